"""The paper-in-miniature's claims: figures over seeds and a verdict for each (benchmarks/paper_miniature.py).

Every figure is a mean over independently trained seeds with its standard error (seed standard
deviation / sqrt(seeds)). A comparison "A beats B" is Welch's t-test on the two models' per-seed
values (benchmarks/study_stats.py `welch`: the seeds' degrees of freedom, two-sided); a comparison
of per-seed paired values (the gradient-variance log ratio) is a one-sample t-test against 0. Each
comparison records its ``test``, ``t``, ``df``, ``p``, the difference and its 95% interval.

Verdicts at ALPHA = 0.05: a comparison is **held** when p < its level and the difference is in the
paper's direction, **contradicted** when p < its level the other way, **not resolved** otherwise. A
claim made of k comparisons (the ablation's accuracy and speed, the bound's three orderings) judges
them at Holm's levels (the smallest p at ALPHA / k, the next at ALPHA / (k - 1), ..., stopping at the
first that fails), and is held when all hold, contradicted when any is contradicted.

The gate (`gate`): a model enters a claim only if every one of its seeds reaches the model's floor
(benchmarks/miniature_spec.py GATES) in exact match at the model's best decoding setting (the
setting with the best mean over seeds). A claim with a model that fails the gate keeps its figures
and tests, and its verdict is **not resolved** with the failing seeds named.

The frontier claim ("at matched tokens per forward, SW-SetDLM's frontier lies above BD3-LM's"): per
model and seed, the frontier at x tokens per forward is the best accuracy among that model's
settings (every threshold) that decode at least x tokens per forward. It is read at the grid
FRONTIER_GRID, keeping the points every (model, seed) reaches, and a seed's score is the mean over
those points; the claim compares the scores. Beside it, each threshold is compared on its own
(accuracy and tokens per forward of both models at the same threshold).
"""

from __future__ import annotations

import math
import statistics

from benchmarks.study_stats import one_sample_t, welch

FRONTIER_GRID = (0.9, 1.25, 1.5, 2.0, 2.5, 3.0)  # tokens per forward at which the frontiers are compared
VERDICTS = ("held", "not resolved", "contradicted")
ALPHA = 0.05


def seed_summary(values: list[float]) -> dict:
    """Mean, seed standard deviation and standard error of the mean over seeds, and the values."""
    n = len(values)
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if n > 1 else 0.0
    return {"mean": mean, "sd": sd, "se": sd / math.sqrt(n), "seeds": n, "values": list(values)}


def _verdict(test: dict, level: float) -> str:
    if test["p"] < level:
        return "held" if test["difference"] > 0 else "contradicted"
    return "not resolved"


def compare(better: dict | list, worse: dict | list, what: str, level: float = ALPHA) -> dict:
    """The claim "`better` exceeds `worse`" (seed summaries or per-seed values): Welch's t-test and the verdict."""
    a = better["values"] if isinstance(better, dict) else list(better)
    b = worse["values"] if isinstance(worse, dict) else list(worse)
    test = welch(a, b)
    return {"claim": what, **test, "level": level, "verdict": _verdict(test, level)}


def holm(parts: list[dict], alpha: float = ALPHA) -> list[dict]:
    """Re-judge the comparisons `parts` of one claim at Holm's step-down levels (module docstring)."""
    order = sorted(range(len(parts)), key=lambda i: parts[i]["p"])
    stopped = False
    for rank, i in enumerate(order):
        level = alpha / (len(parts) - rank)
        p = parts[i]
        p["level"] = level
        p["verdict"] = "not resolved" if stopped else _verdict(p, level)
        stopped = stopped or p["verdict"] == "not resolved"
    return parts


def combine(parts: list[str]) -> str:
    """A claim made of several comparisons: held when all hold, contradicted when any is contradicted."""
    if parts and all(p == "held" for p in parts):
        return "held"
    return "contradicted" if "contradicted" in parts else "not resolved"


def gate(per_seed: dict, floor: float) -> dict:
    """`per_seed` = {seed: exact match at the model's best setting}: whether every seed reaches `floor`."""
    failed = {str(s): a for s, a in sorted(per_seed.items()) if a < floor}
    return {"floor": floor, "passed": not failed and bool(per_seed), "failed_seeds": failed,
            "seeds": {str(s): a for s, a in sorted(per_seed.items())}}


def gated(claim: dict, gates: dict) -> dict:
    """`claim` with its models' gates; a failed gate turns its verdict to not resolved (module docstring)."""
    claim["gates"] = gates
    bad = {m: g["failed_seeds"] or "no results" for m, g in gates.items() if not g["passed"]}
    if bad:
        claim["verdict_before_gate"] = claim.get("verdict")
        claim["verdict"] = "not resolved"
        claim["note"] = "gate failed: " + "; ".join(
            f"{m} seeds {', '.join(f'{s} ({100 * a:.0f}%)' for s, a in f.items())}" if isinstance(f, dict)
            else f"{m}: {f}" for m, f in bad.items())
    return claim


def envelope(points: list[tuple[float, float]], x: float) -> float | None:
    """Best accuracy among (tokens per forward, accuracy) points at >= x tokens per forward (None: none)."""
    accs = [a for t, a in points if t is not None and t >= x - 1e-9]
    return max(accs) if accs else None


def frontier_claim(points: dict, better: str, worse: str, grid=FRONTIER_GRID) -> dict:
    """`points[model][seed]` = [(tokens per forward, accuracy), ...]; module docstring."""
    seeds = {f: sorted(points[f]) for f in (better, worse)}
    kept = [x for x in grid if all(envelope(points[f][s], x) is not None for f in seeds for s in seeds[f])]
    out = {"grid": list(grid), "grid_used": kept}
    if not kept:
        out.update(verdict="not resolved", note="no tokens-per-forward value of the grid is reached by every model")
        return out
    scores = {f: seed_summary([statistics.fmean(envelope(points[f][s], x) for x in kept) for s in seeds[f]])
              for f in seeds}
    per_x = {f: {str(x): seed_summary([envelope(points[f][s], x) for s in seeds[f]]) for x in kept} for f in seeds}
    cmp = compare(scores[better], scores[worse], f"{better} frontier score above {worse} frontier score")
    out.update(scores=scores, per_x=per_x, comparison=cmp, verdict=cmp["verdict"])
    return out


def per_threshold(rows: dict, better: str, worse: str) -> list[dict]:
    """`rows[model][setting]` = {"accuracy": seed summary, "tokens_per_forward": seed summary}: each setting
    both models were decoded at, compared on its own (accuracy: Welch's t-test; tokens per forward shown)."""
    out = []
    for setting in rows.get(better, {}):
        if setting not in rows.get(worse, {}):
            continue
        a, b = rows[better][setting], rows[worse][setting]
        out.append({"setting": setting, "accuracy": {better: a["accuracy"], worse: b["accuracy"]},
                    "tokens_per_forward": {better: a["tokens_per_forward"], worse: b["tokens_per_forward"]},
                    "comparison": compare(a["accuracy"], b["accuracy"], f"{better} more accurate than {worse} at {setting}")})
    return out


def likelihood_claim(bounds: dict, chain: list[str]) -> dict:
    """`bounds[model]` = [(bound, Monte-Carlo s.e.) per seed]; the claim: chain[0] < chain[1] < ..., each
    ordering Welch's t-test on the per-seed bounds, judged at Holm's levels."""
    fams = {f: dict(seed_summary([b for b, _ in bounds[f]]), mc_se=[e for _, e in bounds[f]]) for f in chain}
    orders = holm([compare(fams[b], fams[a], f"{a} < {b}") for a, b in zip(chain, chain[1:])])
    return {"families": fams, "orderings": orders, "comparisons": orders,
            "verdict": combine([o["verdict"] for o in orders])}


def variance_claim(per_seed: list[dict]) -> dict:
    """Naive vs token-efficient gradient variance on the any-order schedule, each estimator on its own
    training run: per seed the mean over the matched steps of log(V_naive / V_token_efficient), tested
    against 0 over seeds (one-sample t-test); the ratio is exp of the mean (token-efficient = 1)."""
    logs = [statistics.fmean(math.log(s["naive"]["variance"] / s["token_efficient"]["variance"]) for s in r["steps"])
            for r in per_seed]
    test = one_sample_t(logs)
    cmp = {"claim": "naive variance above token-efficient variance (mean log ratio > 0)", **test, "level": ALPHA,
           "verdict": _verdict(test, ALPHA)}
    return {"log_ratio": seed_summary(logs), "ratio": math.exp(test["difference"]),
            "ratio_ci95": [math.exp(test["ci95"][0]), math.exp(test["ci95"][1])], "comparison": cmp,
            "verdict": cmp["verdict"]}


__all__ = ["FRONTIER_GRID", "VERDICTS", "ALPHA", "seed_summary", "compare", "holm", "combine", "gate", "gated",
           "envelope", "frontier_claim", "per_threshold", "likelihood_claim", "variance_claim"]
