"""The paper-in-miniature's written result: paper_miniature.json (every figure and verdict), the
markdown page and the frontier PNG, from what benchmarks/paper_miniature.py left on disk."""

from __future__ import annotations

import datetime
import json
import math
import subprocess
from pathlib import Path

from benchmarks import miniature_claims as mc
from benchmarks.miniature_spec import (ABLATED, ABLATION, AR, BD3, FRONTIER, GATES, INFILL, INFILL_CLAIM, LIKELIHOOD,
                                       MD, MODELS, NEW_TOKENS, PILOT_LR, PROBE, PROBE_ROWS, SW, TEST_SETS, VARIANCE,
                                       lr, run_name, seeds, settings)
from benchmarks.study_doc import machine

REPO = Path(__file__).resolve().parent.parent
REVISIONS = [  # what changed in the study after a run, and why (also in paper_miniature.py's docstring)
    "For learnability, before any claim was measured: the first full run (commit 86a0958) let results reach 3 "
    "digits; its first two AR models reached 50.7% and 7.7% (well-formed answers, mostly a units digit wrong where "
    "a 3-digit number met a 2-digit one), under the 50% the best AR model must reach, and no other family had been "
    "evaluated. It was stopped and every number of the task made 2-digit; nothing else changed.",
    "Second version (this one), after an audit of the first's result (commit 8d7bccd): a constant learning rate "
    "from a pilot on seeds no claim uses, a gate on every seed, a test set sharing no operands and operators with "
    "training plus held-out solution steps and reworded questions, Welch's t-test, infilling a number only the "
    "suffix fixes, the gradient variance on the any-order schedule with each estimator on its own run, 3 seeds "
    "of every model (5 of D=4 and B=4 planned, cut to 3 for the budget before any claim was measured); D=8 and B=8 "
    "left out for the budget.",
    "Recorded run, after its first invocation and before any claim was computed: the pilot's 2500 steps left seed "
    "1234 of BD3-LM B=4 at 25% and MDLM at 0.3% on the test problems, under their gates, their training loss still "
    "falling; every model now trains 4000 steps (the constant learning rate lets the saved models go on from 2500). "
    "The evaluations at 2500 were set aside.",
    "Revision 2, after the recorded run's claims were measured (that report: commit c2f1d55). It had AR 93 / 100 / "
    "99%, SW-SetDLM D=4 88 / 99 / 96%, BD3-LM B=4 81 / 75 / 29% (seed 1236 under its 30% gate), MDLM 1 / 0 / 1% "
    "(under its 5% gate) and the any-order SetDLM 7 / 10 / 11%; frontier, infill, cache ablation and likelihood order "
    "were not resolved by the gate, the gradient variance held (1.49x). Diagnostics on BD3-LM's seed 1236 alone "
    "found its loss on a plateau at the learning rate 2e-3 and 98.7% when trained from scratch at 1e-3. BD3-LM "
    "B=4's learning rate was then re-chosen on a second pilot on seeds no claim uses, with its rule fixed before it "
    "ran (its section above); the first pilot's BD3-LM seeds had learned at 2e-3 too, so the reason for the change is the one "
    "failed claim seed, found after the claims. Its three claim seeds were retrained at the chosen rate (none dropped "
    "or added) and every claim computed again; the 2e-3 models were set aside. MDLM was left at 2e-3 (no pilot, "
    "for the budget).",
]
TASK = ("two-step arithmetic word problems in GSM8K format (2-digit operands, + and -, a worked solution and a "
        "'#### n' line; benchmarks/miniature_task.py), exact match of the final answer")
CLAIMS = {
    "frontier": ("At matched tokens per forward, SW-SetDLM's accuracy frontier lies above BD3-LM's", "GSM8K frontier, Fig. 4/5"),
    "infill": ("SW-SetDLM fills a span fixed by both sides better than BD3-LM", "ROCStories infilling, Table 2"),
    "cache_ablation": ("SetDLM with its set-causal mask and KV cache is more accurate and faster than the bidirectional, "
                       "cacheless variant trained on the same order-agnostic schedule", "Table 6"),
    "gradient_variance": ("Token-efficient training has lower gradient variance than naive masked-only training "
                          "(about 3x)", "Table 5"),
    "likelihood_order": ("The bound orders AR < SW-SetDLM (small w) < BD3-LM < MDLM", "likelihood tables"),
}


def git_commit() -> tuple[str, bool]:
    """(HEAD's full SHA, whether tracked files besides the outputs differ from it)."""
    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs/paper_miniature.*")
    except (OSError, subprocess.SubprocessError):
        return "unknown", False
    return head or "unknown", bool(dirty)


def gather(out: Path, size: dict) -> tuple[dict, dict]:
    res, timed = {}, {}
    for slug in size["models"]:
        for seed in seeds(size, slug):
            name = run_name(slug, seed)
            for store, sub in ((res, "results"), (timed, "timed")):
                p = out / sub / f"{name}.json"
                if p.is_file():
                    store.setdefault(slug, {})[seed] = json.loads(p.read_text())
    return res, timed


def summaries(res: dict, timed: dict, size: dict) -> list[dict]:
    """Per model and decoding setting: accuracy, tokens per forward and timed tokens/s over seeds."""
    rows = []
    for slug in size["models"]:
        for label, ov in settings(slug, size):
            got = {s: r["accuracy"][label] for s, r in res.get(slug, {}).items() if label in r.get("accuracy", {})}
            if not got:
                continue
            tps = {s: t["settings"][label]["tokens_per_s"] for s, t in timed.get(slug, {}).items()
                   if label in t.get("settings", {})}
            rows.append({"model": slug, "label": MODELS[slug]["label"], "family": MODELS[slug]["family"],
                         "setting": label, "overrides": ov, "seeds": sorted(got),
                         "accuracy": mc.seed_summary([g["accuracy"] for g in got.values()]),
                         "tokens_per_forward": mc.seed_summary([g["tokens_per_forward"] or 0.0 for g in got.values()]),
                         "tokens_per_s": mc.seed_summary(list(tps.values())) if tps else None,
                         "format_rate": mc.seed_summary([g["format_rate"] for g in got.values()])})
    return rows


def gates(rows: list[dict]) -> dict:
    """Each gated model's gate (miniature_claims.gate) at its best setting."""
    out = {}
    for slug, floor in GATES.items():
        cands = [r for r in rows if r["model"] == slug]
        if not cands:
            out[slug] = {"floor": floor, "passed": False, "failed_seeds": {}, "seeds": {}, "note": "no results"}
            continue
        best = max(cands, key=lambda r: r["accuracy"]["mean"])
        out[slug] = {**mc.gate(dict(zip(best["seeds"], best["accuracy"]["values"])), floor), "setting": best["setting"]}
    return out


def _enough(*summ) -> bool:
    return all(s is not None and s["seeds"] >= 2 for s in summ)


def frontier(res: dict, rows: list[dict], size: dict) -> dict:
    better, worse = FRONTIER
    points = {}
    for slug in FRONTIER:
        for seed, r in res.get(slug, {}).items():
            points.setdefault(slug, {})[seed] = [(a["tokens_per_forward"], a["accuracy"]) for a in r.get("accuracy", {}).values()]
    if len(points) < 2 or any(len(v) < 2 for v in points.values()):
        return {"verdict": "not resolved", "note": "fewer than 2 seeds of a model"}
    out = mc.frontier_claim(points, better, worse)
    by = {}
    for r in rows:
        by.setdefault(r["model"], {})[r["setting"]] = r
    out["per_threshold"] = mc.per_threshold(by, better, worse)
    out["models"] = {s: MODELS[s]["label"] for s in FRONTIER}
    return out


def infill_claim(res: dict, timed: dict) -> dict:
    rows = {}
    for slug in INFILL:
        got = [r["infill"] for r in res.get(slug, {}).values() if "infill" in r]
        if not got:
            continue
        tps = [t["infill"]["tokens_per_s"] for t in timed.get(slug, {}).values() if "infill" in t]
        rows[slug] = {"label": MODELS[slug]["label"], "sampling": INFILL[slug],
                      "exact_match": mc.seed_summary([g["exact_match"] for g in got]),
                      "token_accuracy": mc.seed_summary([g["token_accuracy"] for g in got]),
                      "tokens_per_forward": mc.seed_summary([g["tokens_per_forward"] for g in got]),
                      "tokens_per_s": mc.seed_summary(tps) if tps else None, "example": got[0]["example"]}
    out = {"task": "the question's last operand masked; prefix: the question up to it; suffix: the rest of the "
                   "question, the worked solution and EOS", "models": rows}
    if "ar" in rows:
        out["floor"] = {"model": "ar", "label": "AR, prefix only", "exact_match": rows["ar"]["exact_match"]}
    a, b = INFILL_CLAIM
    if a not in rows or b not in rows or not _enough(rows[a]["exact_match"], rows[b]["exact_match"]):
        return {**out, "verdict": "not resolved", "note": "fewer than 2 seeds of a model"}
    cmp = mc.compare(rows[a]["exact_match"], rows[b]["exact_match"],
                     f"{MODELS[a]['label']} exact match above {MODELS[b]['label']}")
    return {**out, "comparison": cmp, "verdict": cmp["verdict"]}


def ablation_claim(rows: list[dict]) -> dict:
    find = {(r["model"], r["setting"]): r for r in rows}
    (a_slug, a_set), (b_slug, b_set) = ABLATION
    a, b = find.get((a_slug, a_set)), find.get((b_slug, b_set))
    if a is None or b is None or not _enough(a["accuracy"], b["accuracy"]):
        return {"verdict": "not resolved", "note": "fewer than 2 seeds of a model"}
    parts = [mc.compare(a["accuracy"], b["accuracy"], "set-causal + cache more accurate")]
    if _enough(a["tokens_per_s"], b["tokens_per_s"]):
        parts.append(mc.compare(a["tokens_per_s"], b["tokens_per_s"], "set-causal + cache faster (tokens/s)"))
    parts = mc.holm(parts)
    if len(parts) < 2:
        parts.append({"claim": "set-causal + cache faster (tokens/s)", "verdict": "not resolved", "note": "not timed"})
    return {"set_causal": a, "bidirectional": b, "comparisons": parts, "verdict": mc.combine([p["verdict"] for p in parts])}


def variance(res: dict, size: dict) -> dict:
    te, nv = VARIANCE["token_efficient"], VARIANCE["naive"]
    per = []
    for seed in sorted(set(res.get(te, {})) & set(res.get(nv, {}))):
        a, b = res[te][seed].get("gradient_variance", {}), res[nv][seed].get("gradient_variance", {})
        steps = [k for k in (f"step_{s}" for s in size["variance_steps"]) if k in a and k in b]
        if steps:
            per.append({"seed": seed, "steps": [{"step": int(k[5:]), "token_efficient": a[k], "naive": b[k],
                                                 "ratio": b[k]["variance"] / a[k]["variance"],
                                                 "relative_ratio": b[k]["relative_variance"] / a[k]["relative_variance"]}
                                                for k in steps]})
    base = {"schedule": "any_order", "models": {"token_efficient": MODELS[te]["label"], "naive": MODELS[nv]["label"]},
            "normalisation": "V relative to the token-efficient estimator at the same step (token-efficient = 1)",
            "matched_steps": list(size["variance_steps"]), "per_seed": per}
    if len(per) < 2:
        return {**base, "verdict": "not resolved", "note": "fewer than 2 seeds with both runs measured"}
    return {**base, **mc.variance_claim(per)}


def likelihood(res: dict) -> dict:
    bounds = {}
    for slug in LIKELIHOOD:
        got = [r["likelihood"] for r in res.get(slug, {}).values() if "likelihood" in r]
        if len(got) < 2:
            return {"verdict": "not resolved", "note": f"fewer than 2 seeds of {slug}"}
        bounds[MODELS[slug]["label"]] = [(g["nll"], g["mc_se"]) for g in got]
    return mc.likelihood_claim(bounds, [MODELS[s]["label"] for s in LIKELIHOOD])


def best_accuracy(rows: list[dict]) -> dict:
    best = {}
    for slug in MODELS:
        cands = [r for r in rows if r["model"] == slug]
        if cands:
            r = max(cands, key=lambda r: r["accuracy"]["mean"])
            best[slug] = {"accuracy": r["accuracy"]["mean"], "se": r["accuracy"]["se"], "model": r["label"],
                          "family": r["family"], "setting": r["setting"], "per_seed": r["accuracy"]["values"]}
    return best


def other_sets(res: dict) -> dict:
    """Per model: exact match on the held-out-steps and reworded sets at its main setting, beside the test set's."""
    out = {}
    for slug, by_seed in res.items():
        for test in TEST_SETS:
            got = [r[test] for r in by_seed.values() if test in r] if test != "test" else []
            if got:
                out.setdefault(slug, {"label": MODELS[slug]["label"], "setting": got[0]["setting"]})[test] = \
                    mc.seed_summary([g["accuracy"] for g in got])
        if slug in out:
            main = out[slug]["setting"]
            out[slug]["test"] = mc.seed_summary([r["accuracy"][main]["accuracy"] for r in by_seed.values()
                                                 if main in r.get("accuracy", {})])
    return out


def probes(res: dict) -> dict:
    """Per model: the teacher-forced accuracy of the solution lines' tens and units digits over seeds."""
    out = {}
    for slug in PROBE:
        got = [r["digit_probe"] for r in res.get(slug, {}).values() if "digit_probe" in r]
        if got:
            out[slug] = {"label": MODELS[slug]["label"], "tens": mc.seed_summary([g["tens"] for g in got]),
                         "units": mc.seed_summary([g["units"] for g in got]), "digits": got[0]["n"]}
    return out


def costs(res: dict) -> dict:
    """Wall and CPU seconds of every model's training and measurements, summed."""
    tw = tc = ew = ec = 0.0
    for by_seed in res.values():
        for r in by_seed.values():
            for t in r.get("trained", {}).values():
                tw, tc = tw + t["wall_s"], tc + t["cpu_s"]
            parts = list(r.get("accuracy", {}).values()) + [r[k] for k in ("test_heldout", "test_reworded", "infill",
                                                                          "likelihood") if k in r]
            parts += list(r.get("gradient_variance", {}).values()) + ([r["digit_probe"]] if "digit_probe" in r else [])
            for p in parts:
                ew, ec = ew + p.get("wall_s", 0.0), ec + p.get("cpu_s", 0.0)
    return {"train_wall_s": tw, "train_cpu_s": tc, "measure_wall_s": ew, "measure_cpu_s": ec,
            "models_trained": sum(1 for by_seed in res.values() for r in by_seed.values() if r.get("trained"))}


def build(out: Path, size: dict, smoke: bool, phases: list, pilot: dict | None = None,
          pilot_lr: dict | None = None) -> dict:
    res, timed = gather(out, size)
    rows = summaries(res, timed, size)
    g = gates(rows)
    claims = {
        "frontier": mc.gated(frontier(res, rows, size), {m: g[m] for m in FRONTIER}),
        "infill": mc.gated(infill_claim(res, timed), {m: g[m] for m in INFILL_CLAIM}),
        "cache_ablation": mc.gated(ablation_claim(rows), {m: g[m] for m, _ in ABLATION}),
        "gradient_variance": variance(res, size),
        "likelihood_order": mc.gated(likelihood(res), {m: g[m] for m in LIKELIHOOD}),
    }
    ran = [p for p in phases if p.get("finished", True) and "train_and_eval_seconds" in p] or phases
    # the commit of the invocation that finished training (the code every model's last part ran with)
    sha, dirty = (ran[-1]["commit"], ran[-1]["uncommitted_changes"]) if ran and "commit" in ran[-1] else git_commit()
    return {
        "commit": sha,
        "claims": [{"id": k, "verdict": v["verdict"], "claim": CLAIMS[k][0], "paper": CLAIMS[k][1], **v}
                   for k, v in claims.items()],
        "reasoning": {"task": TASK, "accuracy": {s: b["accuracy"] for s, b in best_accuracy(rows).items()},
                      "best": best_accuracy(rows), "gates": g, "other_sets": other_sets(res), "digit_probe": probes(res),
                      "test_sets": dict(TEST_SETS)},
        "settings": rows,
        "pilot": pilot,
        "pilot_lr": pilot_lr,
        "run": {"smoke": smoke, "size": size, "uncommitted_changes": dirty, "machine": machine(),
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "invocations": [_clean(p) for p in phases], "seconds": sum(p.get("seconds", 0.0) for p in phases),
                **costs(res), "new_tokens": NEW_TOKENS, "learning_rates": {m: lr(m, size) for m in size["models"]}},
    }


def _clean(phase: dict) -> dict:
    """An invocation's record with the values of path options left out (no machine paths in the docs)."""
    argv, out, skip = phase.get("argv", []), [], False
    for a in argv:
        out.append("DIR" if skip else a)
        skip = a in ("--out", "--docs")
    return {**phase, "argv": out}


# -- outputs -------------------------------------------------------------------------------------------
def fmt(s: dict | None, pct: bool = False, digits: int = 2) -> str:
    if not s:
        return "-"
    k = 100.0 if pct else 1.0
    return f"{s['mean'] * k:.{1 if pct else digits}f} ± {s['se'] * k:.{1 if pct else digits}f}"


def per_seed(s: dict | None) -> str:
    return " / ".join(f"{100 * v:.0f}" for v in s["values"]) if s else "-"


def ptest(c: dict) -> str:
    """A comparison as "difference, test p" (or its note)."""
    if "p" not in c:
        return c.get("note", "-")
    df = f", {c['df']:.1f} df" if isinstance(c.get("df"), float) else (f", {c['df']} df" if c.get("df") else "")
    return f"difference {c['difference']:+.3g} (95% CI {c['ci95'][0]:+.3g} to {c['ci95'][1]:+.3g}), t = {c['t']:.2f}{df}, p = {c['p']:.3g}"


MARKERS = {"threshold off": "o", "threshold 0.9": "s", "threshold 0.7": "^", "threshold 0.5": "D", "greedy": "o"}


def plot(data: dict, path: Path) -> None:
    """Accuracy against tokens per forward and against tokens/s: the mean over seeds per setting joined by a
    line, every seed's point beside it (small, pale); marker shapes name the setting, so no point is labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colors = {AR: "black", SW: "tab:blue", BD3: "tab:orange", MD: "tab:green", ABLATED: "tab:purple"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    res = data["_per_seed"]
    for ax, key, xlabel in ((axes[0], "tokens_per_forward", "tokens per forward (machine-independent)"),
                            (axes[1], "tokens_per_s", "tokens/s at batch 1 (median pass; CPU)")):
        for slug in dict.fromkeys(r["model"] for r in data["settings"]):
            pts = [r for r in data["settings"] if r["model"] == slug and r[key]]
            if not pts:
                continue
            pts.sort(key=lambda r: r[key]["mean"])
            c = colors[pts[0]["family"]]
            ax.plot([r[key]["mean"] for r in pts], [100 * r["accuracy"]["mean"] for r in pts], "-", color=c, lw=1.2,
                    label=pts[0]["label"])
            for r in pts:
                mk = MARKERS.get(r["setting"], "v")
                ax.plot(r[key]["mean"], 100 * r["accuracy"]["mean"], mk, color=c, ms=6, mec="white", mew=0.6)
                xs = res.get((slug, r["setting"], key), [])
                if xs:
                    ax.scatter([x for x, _ in xs], [100 * y for _, y in xs], marker=mk, s=12, color=c, alpha=0.35,
                               linewidths=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("exact match on the test problems (%)")
        ax.grid(alpha=0.3)
    present = {r["setting"] for r in data["settings"]}
    handles = [Line2D([], [], color="gray", marker=m, ls="", label=s) for s, m in MARKERS.items()
               if s != "greedy" and s in present]
    handles.append(Line2D([], [], color="gray", marker="v", ls="", label="MDLM steps / other"))
    axes[0].legend(fontsize=7, loc="best")
    axes[1].legend(handles=handles, fontsize=7, loc="best", title="setting (large: mean; small: seeds)",
                   title_fontsize=7)
    axes[0].set_title("accuracy vs parallelism", fontsize=9)
    axes[1].set_title("accuracy vs speed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def per_seed_points(out: Path, size: dict) -> dict:
    """(model, setting, axis) -> [(x, accuracy) per seed] for the plot."""
    res, timed = gather(out, size)
    pts: dict = {}
    for slug, by_seed in res.items():
        for seed, r in by_seed.items():
            for label, a in r.get("accuracy", {}).items():
                pts.setdefault((slug, label, "tokens_per_forward"), []).append((a["tokens_per_forward"], a["accuracy"]))
                t = timed.get(slug, {}).get(seed, {}).get("settings", {}).get(label)
                if t:
                    pts.setdefault((slug, label, "tokens_per_s"), []).append((t["tokens_per_s"], a["accuracy"]))
    return pts


def load_text(phases: list) -> str:
    def la(v):
        return "/".join(f"{x:.1f}" for x in v)

    return "; ".join(f"{p['started']}: start {la(p['load_start']) if p.get('load_start') else '-'}, "
                     f"end {la(p['load_end']) if p.get('load_end') else '-'}" for p in phases)


def invocation_text(p: dict) -> str:
    """One invocation: its options, commit, start and whether it ran to its end."""
    end = "" if p.get("finished", True) else ", stopped before its end"
    end += f" ({p['note']})" if p.get("note") else ""
    return f"`{' '.join(p['argv']) or '(no options)'}` at `{p.get('commit', '?')[:12]}` from {p['started']}{end}"


def jobs_text(phases: list) -> str:
    """How many models trained at once, per invocation that trained."""
    jobs = sorted({p.get("jobs", 1) for p in phases if "train_and_eval_seconds" in p or not p.get("finished", True)}
                  or {1})
    return " or ".join(map(str, jobs)) + (" model at a time" if jobs == [1] else " models at a time")


def markdown(data: dict, png: str) -> str:
    run = data["run"]
    size = run["size"]
    claims = {c["id"]: c for c in data["claims"]}
    cmd = "python benchmarks/paper_miniature.py" + (" --smoke --out DIR" if run["smoke"] else "")
    n_seeds = ", ".join(f"{MODELS[m]['label']} {n}" for m, n in size["seeds"].items())
    lines = [
        "# The paper in miniature" + (" (smoke run)" if run["smoke"] else ""),
        "",
        "Each headline claim of the set-diffusion paper, tested by small models trained from scratch on a CPU with this "
        "stack's trainer, samplers and evaluation. Each comparison is Welch's t-test over independently trained seeds "
        "(two-sided, at 0.05; Holm's levels within a claim of several comparisons). Verdicts: **held** (significant in "
        "the paper's direction), **not resolved**, **contradicted** (significant the other way); a claim whose model "
        "has a seed under its gate floor is not resolved. Error bars are standard errors over seeds "
        f"({n_seeds}). Regenerate with `{cmd}` (the timed pass alone: `--timed-only`).",
        "",
        f"- trained and evaluated at commit `{data['commit']}`"
        f"{' (with uncommitted changes)' if run['uncommitted_changes'] else ''}; report written {run['date']}"
        + "; invocations: " + "; ".join(invocation_text(p) for p in run["invocations"]),
        f"- machine: {run['machine']}; {run['models_trained']} models trained: {run['train_wall_s'] / 3600:.1f} hours "
        f"wall ({run['train_cpu_s'] / 3600:.1f} CPU hours) of training and {run['measure_wall_s'] / 3600:.1f} hours "
        f"({run['measure_cpu_s'] / 3600:.1f} CPU hours) of measurements, summed over models, "
        f"{jobs_text(run['invocations'])}; "
        f"{run['seconds'] / 3600:.1f} hours wall over the "
        f"{sum(p.get('finished', True) for p in run['invocations'])} invocation(s) that ran to their end (one "
        "stopped before its end records no wall time of its own; every model's own time is counted above)",
        f"- load average (1/5/15 min) per invocation: {load_text(run['invocations'])}",
        "",
        "| claim | paper | result here | test | verdict |",
        "|---|---|---|---|---|",
    ]
    for cid, c in claims.items():
        lines.append(f"| `{cid}`: {c['claim']} | {c['paper']} | {headline(cid, c)} | {test_cell(c)} | **{c['verdict']}** |")
    r = data["reasoning"]
    lines += ["", "## The reasoning task", "", f"{r['task']}. Best accuracy per model (mean over seeds, best setting) "
              "and its gate (every seed must reach the floor):", "",
              "| model | setting | exact match | per seed (%) | gate floor | gate |", "|---|---|---|---|---|---|"]
    for slug, b in r["best"].items():
        gt = r["gates"].get(slug)
        gate_txt = "-" if not gt else ("passed" if gt["passed"] else "failed: seeds " + ", ".join(
            f"{s} ({100 * a:.0f}%)" for s, a in gt["failed_seeds"].items()))
        lines.append(f"| {b['model']} | {b['setting']} | {100 * b['accuracy']:.1f} ± {100 * b['se']:.1f}% | "
                     f"{' / '.join(f'{100 * v:.0f}' for v in b['per_seed'])} | "
                     f"{'-' if not gt else format(100 * gt['floor'], '.0f') + '%'} | {gate_txt} |")
    if r["other_sets"]:
        lines += ["", "Findings beside the claims (each model at its main setting): the test set (no problem shares its "
                  "operands and operators with training), problems built on solution steps that never occur in "
                  "training (composition), and the questions reworded (the question sentence first).", "",
                  "| model | setting | test (%) | held-out steps (%) | reworded (%) |", "|---|---|---|---|---|"]
        for o in r["other_sets"].values():
            lines.append(f"| {o['label']} | {o['setting']} | {fmt(o.get('test'), True)} | "
                         f"{fmt(o.get('test_heldout'), True)} | {fmt(o.get('test_reworded'), True)} |")
    if r.get("digit_probe"):
        lines += ["", f"Teacher-forced result digits: each tens and units digit of the two solution lines of the first "
                  f"{PROBE_ROWS} test problems predicted with the rest of the problem clean, in the model's training "
                  "layout (benchmarks/miniature_measure.py `digit_probe`; chance is about 10% for a units digit).", "",
                  "| model | tens (%) | per seed | units (%) | per seed |", "|---|---|---|---|---|"]
        for o in r["digit_probe"].values():
            lines.append(f"| {o['label']} | {fmt(o['tens'], True)} | {per_seed(o['tens'])} | {fmt(o['units'], True)} | "
                         f"{per_seed(o['units'])} |")
    lines += ["", "## Frontier", "", f"![frontier]({png})", "",
              f"Decoding: greedy, {NEW_TOKENS} new tokens at most, stop at EOS or `Question:`; SW-SetDLM window w = D; "
              "tokens per forward from the accuracy evaluation (new tokens / decoding steps), tokens/s from the timed "
              f"pass ({size['timed_prompts']} prompts at batch 1, {size['timed_warmup']} warm-up decodes, median of "
              f"{size['timed_repeats']} passes, per seed).", "",
              "| model | setting | exact match (%) | per seed (%) | tokens/forward | tokens/s |", "|---|---|---|---|---|---|"]
    for s in data["settings"]:
        lines.append(f"| {s['label']} | {s['setting']} | {fmt(s['accuracy'], True)} | {per_seed(s['accuracy'])} | "
                     f"{fmt(s['tokens_per_forward'])} | {fmt(s['tokens_per_s'], digits=0)} |")
    f = claims["frontier"]
    if "scores" in f:
        lines += ["", f"Frontier score (mean over tokens-per-forward points {f['grid_used']} of the best accuracy at "
                  "least that parallel, benchmarks/miniature_claims.py): " + ", ".join(
                      f"{f['models'][k]} {fmt(v, True)}%" for k, v in f["scores"].items()) + f"; {ptest(f['comparison'])}.",
                  "", "Each threshold on its own:", "",
                  "| setting | exact match D=4 (%) | exact match B=4 (%) | tokens/forward D=4 | tokens/forward B=4 | test |",
                  "|---|---|---|---|---|---|"]
        a, b = FRONTIER
        for t in f["per_threshold"]:
            lines.append(f"| {t['setting']} | {fmt(t['accuracy'][a], True)} | {fmt(t['accuracy'][b], True)} | "
                         f"{fmt(t['tokens_per_forward'][a])} | {fmt(t['tokens_per_forward'][b])} | {ptest(t['comparison'])} |")
    inf = claims["infill"]
    lines += ["", "## Infilling", "", f"{inf.get('task', '')}; exact match of the span. AR sees the prefix only: "
              "its figure is the floor (what the prefix alone gives).", "",
              "| model | sampling | exact match (%) | per seed (%) | token accuracy (%) | tokens/forward | tokens/s |",
              "|---|---|---|---|---|---|---|"]
    for m in inf.get("models", {}).values():
        lines.append(f"| {m['label']} | {m['sampling'] or 'greedy, prefix only'} | {fmt(m['exact_match'], True)} | "
                     f"{per_seed(m['exact_match'])} | "
                     f"{fmt(m['token_accuracy'], True)} | {fmt(m['tokens_per_forward'])} | {fmt(m['tokens_per_s'], digits=0)} |")
    a = claims["cache_ablation"]
    lines += ["", "## Cache ablation", ""]
    if "set_causal" in a:
        lines += ["| model | setting | exact match (%) | per seed (%) | tokens/forward | tokens/s |", "|---|---|---|---|---|---|"]
        for k in ("set_causal", "bidirectional"):
            s = a[k]
            lines.append(f"| {s['label']} | {s['setting']} | {fmt(s['accuracy'], True)} | {per_seed(s['accuracy'])} | "
                         f"{fmt(s['tokens_per_forward'])} | {fmt(s['tokens_per_s'], digits=0)} |")
        lines += [""] + [f"- {p['claim']}: {p['verdict']} ({ptest(p)})" for p in a["comparisons"]]
    g = claims["gradient_variance"]
    lines += ["", "## Gradient variance", "",
              f"On the any-order schedule: {g['models']['token_efficient']} and {g['models']['naive']}, each trained "
              f"on its own run and measured at its own weights at the matched steps {g['matched_steps']}, "
              f"{size['grad_draws']} fresh batches of {size['batch']} rows each, V = sum_k ||g_k - mean||^2 / (K - 1) "
              "over the non-embedding parameters (benchmarks/miniature_measure.py). Normalised to the token-efficient "
              "estimator at the same step (= 1); V relative to the squared mean gradient beside it.", ""]
    if g["per_seed"]:
        lines += ["| step | V token-efficient | V naive | naive / token-efficient | relative V: naive / token-efficient |",
                  "|---|---|---|---|---|"]
        for step in g["matched_steps"]:
            at = [s for p in g["per_seed"] for s in p["steps"] if s["step"] == step]
            if at:
                gm = lambda xs: math.exp(sum(math.log(x) for x in xs) / len(xs))  # noqa: E731
                lines.append(f"| {step} | {gm([s['token_efficient']['variance'] for s in at]):.4g} | "
                             f"{gm([s['naive']['variance'] for s in at]):.4g} | {gm([s['ratio'] for s in at]):.2f} | "
                             f"{gm([s['relative_ratio'] for s in at]):.2f} |")
        lines += ["", "(geometric means over seeds)"]
        if "comparison" in g:
            lines += ["", f"Mean log ratio over steps and seeds: ratio {g['ratio']:.2f} (95% CI {g['ratio_ci95'][0]:.2f}-"
                      f"{g['ratio_ci95'][1]:.2f}); {ptest(g['comparison'])}."]
    lk = claims["likelihood_order"]
    lines += ["", "## Likelihood bound", ""]
    if "families" in lk:
        lines += ["Validation rows (answer tokens), nats/token, mean over seeds ± s.e.", "",
                  "| model | bound | s.e. | per seed |", "|---|---|---|---|"]
        lines += [f"| {k} | {v['mean']:.4f} | {v['se']:.4f} | {' / '.join(f'{x:.3f}' for x in v['values'])} |"
                  for k, v in lk["families"].items()]
        lines += [""] + [f"- {o['claim']}: {o['verdict']} ({ptest(o)})" for o in lk["orderings"]]
    pilot = data.get("pilot")
    if pilot:
        lines += ["", "## The schedule's pilot", "", "SW-SetDLM D=4 and BD3-LM B=4 on seeds no claim uses, constant "
                  "learning rate, exact match on the validation problems at threshold 0.9 after each number of steps "
                  f"(`--pilot`): it chose {pilot.get('chosen_steps')} steps; the recorded run trains {size['steps']} (see Revisions).", "", "| run | exact match (%) |", "|---|---|"]
        lines += [f"| {k} | {100 * v['accuracy']:.1f} |" for k, v in pilot.items() if isinstance(v, dict)]
    second = data.get("pilot_lr")
    if second:
        lines += ["", "## The second pilot: BD3-LM B=4's learning rate", "",
                  f"{', '.join(MODELS[m]['label'] for m in PILOT_LR['models'])} at a constant {second['lr']:g} on seeds "
                  f"no claim uses, {second['steps']} steps, exact match on the validation problems at threshold 0.9 "
                  "(`--pilot-lr`). The rule, fixed before it ran: if every pilot seed passes the gate, the claim seeds "
                  f"train at this rate; else the recorded run stands. Every seed passed: "
                  f"{'yes' if second['passed'] else 'no'}.", "", "| run | exact match (%) |", "|---|---|"]
        lines += [f"| {k} | {100 * v['accuracy']:.1f} |" for k, v in second.items() if isinstance(v, dict)]
    lines += ["", "## Revisions", "", *[f"- {r}" for r in REVISIONS]]
    rates = ", ".join(f"{MODELS[m]['label']} {v:g}" for m, v in run.get("learning_rates", {}).items())
    lines += ["", "## How it was run", "",
              f"Sizes: {json.dumps({k: v for k, v in size.items() if k not in ('models', 'seeds')})}; models: "
              f"{', '.join(MODELS[m]['label'] for m in size['models'])}; learning rates: "
              f"{rates}. The choices and their reasons are in the "
              "docstring of benchmarks/paper_miniature.py, written before any claim was measured.", ""]
    return "\n".join(lines) + "\n"


def test_cell(c: dict) -> str:
    """The claim's tests: each comparison's p, and which test."""
    parts = [c["comparison"]] if "comparison" in c else c.get("comparisons", [])
    if not parts:
        return c.get("note", "-")
    kind = "Welch" if any("Welch" in p.get("test", "") for p in parts) else "one-sample t"
    ps = "; ".join(f"p = {p['p']:.3g}" if "p" in p else p.get("note", "-") for p in parts)
    return f"{ps} ({kind}{', Holm' if len(parts) > 1 else ''})"


def headline(cid: str, c: dict) -> str:
    if cid == "frontier" and "scores" in c:
        return ", ".join(f"{c['models'][k]} {fmt(v, True)}%" for k, v in c["scores"].items())
    if cid == "infill" and c.get("models"):
        return ", ".join(f"{m['label']} {fmt(m['exact_match'], True)}%" for m in c["models"].values())
    if cid == "cache_ablation" and "set_causal" in c:
        s, b = c["set_causal"], c["bidirectional"]
        return (f"{fmt(s['accuracy'], True)}% vs {fmt(b['accuracy'], True)}%; {fmt(s['tokens_per_s'], digits=0)} vs "
                f"{fmt(b['tokens_per_s'], digits=0)} tok/s")
    if cid == "gradient_variance" and "ratio" in c:
        return (f"any-order schedule: naive / token-efficient = {c['ratio']:.2f} "
                f"({c['ratio_ci95'][0]:.2f}-{c['ratio_ci95'][1]:.2f})")
    if cid == "likelihood_order" and "families" in c:
        return " < ".join(f"{k} {v['mean']:.3f}" for k, v in c["families"].items())
    return c.get("note", "-")


def write_report(out: Path, docs: Path, size: dict, *, smoke: bool, phases: list, pilot: dict | None = None,
                 pilot_lr: dict | None = None) -> Path:
    data = build(out, size, smoke, phases, pilot, pilot_lr)
    docs.mkdir(parents=True, exist_ok=True)
    png = docs / "paper_miniature.png"
    plot({**data, "_per_seed": per_seed_points(out, size)}, png)
    (docs / "paper_miniature.json").write_text(json.dumps(_finite(data), indent=1) + "\n")
    (docs / "paper_miniature.md").write_text(markdown(data, png.name))
    return docs / "paper_miniature.json"


def _finite(o):
    """`o` with non-finite floats (a t of a zero spread) as strings, so the file is strict JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o
