"""The paper-in-miniature's claims: figures over seeds and a verdict for each (benchmarks/paper_miniature.py).

Every figure is a mean over independently trained seeds with its standard error (seed standard
deviation / sqrt(seeds); for the bound and the gradient variance combined with the Monte-Carlo error as
benchmarks/study_stats.py does). A claim "A beats B" compares the difference of the means with
sigma = sqrt(se_A^2 + se_B^2): **held** when it exceeds Z = 2 sigma in the paper's direction,
**contradicted** when it exceeds 2 sigma the other way, **not resolved** otherwise.

The frontier claim ("at matched tokens per forward, SW-SetDLM's frontier lies above BD3-LM's"): per
family and seed, the frontier at x tokens per forward is the best accuracy among that family's
settings (every trained size, every threshold) that decode at least x tokens per forward. It is read
at the grid FRONTIER_GRID, keeping the points every (family, seed) reaches, and the family's score for
a seed is the mean over those points. The claim compares the scores' means over seeds.
"""

from __future__ import annotations

import math
import statistics

from benchmarks.study_stats import Z, difference, family_summary, ordering

FRONTIER_GRID = (0.9, 1.25, 1.5, 2.0, 2.5, 3.0)  # tokens per forward at which the frontiers are compared
VERDICTS = ("held", "not resolved", "contradicted")


def seed_summary(values: list[float]) -> dict:
    """Mean, seed standard deviation and standard error of the mean over seeds."""
    n = len(values)
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if n > 1 else 0.0
    return {"mean": mean, "sd": sd, "se": sd / math.sqrt(n), "seeds": n, "values": list(values)}


def compare(better: dict, worse: dict, what: str) -> dict:
    """The claim "`better` exceeds `worse`" from two seed summaries: difference, sigma, z, verdict."""
    return difference(better, worse, what, against="contradicted")


def combine(parts: list[str]) -> str:
    """A claim made of several comparisons: held when all hold, contradicted when any is contradicted."""
    if parts and all(p == "held" for p in parts):
        return "held"
    return "contradicted" if "contradicted" in parts else "not resolved"


def envelope(points: list[tuple[float, float]], x: float) -> float | None:
    """Best accuracy among (tokens per forward, accuracy) points at >= x tokens per forward (None: none)."""
    accs = [a for t, a in points if t is not None and t >= x - 1e-9]
    return max(accs) if accs else None


def frontier_claim(points: dict, better: str, worse: str, grid=FRONTIER_GRID) -> dict:
    """`points[family][seed]` = [(tokens per forward, accuracy), ...]; module docstring."""
    seeds = {f: sorted(points[f]) for f in (better, worse)}
    kept = [x for x in grid if all(envelope(points[f][s], x) is not None for f in seeds for s in seeds[f])]
    out = {"grid": list(grid), "grid_used": kept}
    if not kept:
        out.update(verdict="not resolved", note="no tokens-per-forward value of the grid is reached by every model")
        return out
    scores = {f: seed_summary([statistics.fmean(envelope(points[f][s], x) for x in kept) for s in seeds[f]])
              for f in seeds}
    per_x = {f: {str(x): seed_summary([envelope(points[f][s], x) for s in seeds[f]]) for x in kept} for f in seeds}
    cmp = compare(scores[better], scores[worse], f"{better} frontier above {worse} frontier")
    out.update(scores=scores, per_x=per_x, comparison=cmp, verdict=cmp["verdict"])
    return out


def likelihood_claim(bounds: dict, chain: list[str]) -> dict:
    """`bounds[family]` = [(bound, Monte-Carlo s.e.) per seed]; the claim: chain[0] < chain[1] < ...,
    each ordering judged at the combined error of benchmarks/study_stats.py."""
    fams = {f: family_summary([b for b, _ in bounds[f]], [e for _, e in bounds[f]]) for f in chain}
    orders = [ordering(a, b, fams) for a, b in zip(chain, chain[1:])]
    verdict = combine([{"reversed": "contradicted"}.get(o["verdict"], o["verdict"]) for o in orders])
    return {"families": fams, "orderings": orders, "verdict": verdict}


def variance_claim(per_seed: list[dict], mode: str = "fresh") -> dict:
    """Token-efficient vs naive gradient variance: per seed log(V_naive / V_token_efficient), its mean
    over seeds with the seed s.e. combined with the Monte-Carlo s.e. of each log V (sqrt(2 / (K - 1))
    for K draws, two of them per ratio); held when the log ratio exceeds 2 s.e. above 0."""
    logs = [math.log(r[mode]["naive"]["variance"] / r[mode]["token_efficient"]["variance"]) for r in per_seed]
    mc = [math.sqrt(4.0 / (r["draws"] - 1)) for r in per_seed]
    s = family_summary(logs, mc)
    zero = {"mean": 0.0, "se": 0.0}
    cmp = compare(s, zero, "naive variance above token-efficient variance (log ratio > 0)")
    return {"mode": mode, "log_ratio": s, "ratio": math.exp(s["mean"]),
            "ratio_2se": [math.exp(s["mean"] - Z * s["se"]), math.exp(s["mean"] + Z * s["se"])],
            "comparison": cmp, "verdict": cmp["verdict"]}


__all__ = ["FRONTIER_GRID", "VERDICTS", "seed_summary", "compare", "combine", "envelope", "frontier_claim",
           "likelihood_claim", "variance_claim"]
