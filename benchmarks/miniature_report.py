"""The paper-in-miniature's written result: paper_miniature.json (every figure and verdict), the
markdown page and the frontier PNG, from what benchmarks/paper_miniature.py left on disk."""

from __future__ import annotations

import datetime
import json
import math
import subprocess
from pathlib import Path

from benchmarks import miniature_claims as mc
from benchmarks.paper_miniature import (ABLATED, ABLATION, AR, BD3, INFILL, LIKELIHOOD, MD, MODELS, NEW_TOKENS, SW,
                                        VARIANCE_MODEL, run_name, seeds, settings)
from benchmarks.study_doc import machine

REPO = Path(__file__).resolve().parent.parent
REVISIONS = [  # what changed in the study after a run, and why (also in paper_miniature.py's docstring)
    "For learnability, before any claim was measured: the first full run (commit 86a0958) let results reach 3 "
    "digits; its first two AR models reached 50.7% and 7.7% (well-formed answers, mostly a units digit wrong where "
    "a 3-digit number met a 2-digit one), under the 50% the best AR model must reach, and no other family had been "
    "evaluated. It was stopped and every number of the task made 2-digit; nothing else changed.",
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
        for seed in seeds(size):
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
            got = [r["accuracy"][label] for r in res.get(slug, {}).values() if label in r.get("accuracy", {})]
            if not got:
                continue
            tps = [t["settings"][label]["tokens_per_s"] for t in timed.get(slug, {}).values()
                   if label in t.get("settings", {})]
            rows.append({"model": slug, "label": MODELS[slug]["label"], "family": MODELS[slug]["family"],
                         "setting": label, "overrides": ov,
                         "accuracy": mc.seed_summary([g["accuracy"] for g in got]),
                         "tokens_per_forward": mc.seed_summary([g["tokens_per_forward"] or 0.0 for g in got]),
                         "tokens_per_s": mc.seed_summary(tps) if tps else None,
                         "format_rate": mc.seed_summary([g["format_rate"] for g in got])})
    return rows


def frontier(res: dict, size: dict) -> dict:
    points = {}
    for fam in (SW, BD3):
        for slug in size["models"]:
            if MODELS[slug]["family"] != fam:
                continue
            for seed, r in res.get(slug, {}).items():
                points.setdefault(fam, {}).setdefault(seed, []).extend(
                    (a["tokens_per_forward"], a["accuracy"]) for a in r.get("accuracy", {}).values())
    if len(points) < 2:
        return {"verdict": "not resolved", "note": "missing results"}
    return mc.frontier_claim(points, SW, BD3)


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
    if "setdlm-d4" not in rows or "bd3lm-b4" not in rows:
        return {"verdict": "not resolved", "note": "missing results", "models": rows}
    cmp = mc.compare(rows["setdlm-d4"]["exact_match"], rows["bd3lm-b4"]["exact_match"],
                     "SW-SetDLM D=4 exact match above BD3-LM B=4")
    return {"models": rows, "comparison": cmp, "verdict": cmp["verdict"]}


def ablation_claim(rows: list[dict]) -> dict:
    find = {(r["model"], r["setting"]): r for r in rows}
    (a_slug, a_set), (b_slug, b_set) = ABLATION
    a, b = find.get((a_slug, a_set)), find.get((b_slug, b_set))
    if a is None or b is None:
        return {"verdict": "not resolved", "note": "missing results"}
    parts = [mc.compare(a["accuracy"], b["accuracy"], "set-causal + cache more accurate")]
    if a["tokens_per_s"] and b["tokens_per_s"]:
        parts.append(mc.compare(a["tokens_per_s"], b["tokens_per_s"], "set-causal + cache faster (tokens/s)"))
    else:
        parts.append({"claim": "set-causal + cache faster (tokens/s)", "verdict": "not resolved", "note": "not timed"})
    return {"set_causal": a, "bidirectional": b, "comparisons": parts, "verdict": mc.combine([p["verdict"] for p in parts])}


def variance(res: dict) -> dict:
    per = [r["gradient_variance"] for r in res.get(VARIANCE_MODEL, {}).values() if "gradient_variance" in r]
    if not per:
        return {"verdict": "not resolved", "note": "missing results"}
    out = mc.variance_claim(per, "fresh")
    out["fixed_batch"] = mc.variance_claim(per, "fixed")
    out["per_seed"] = per
    out["model"] = MODELS[VARIANCE_MODEL]["label"]
    return out


def likelihood(res: dict) -> dict:
    bounds = {}
    for slug in LIKELIHOOD:
        got = [r["likelihood"] for r in res.get(slug, {}).values() if "likelihood" in r]
        if not got:
            return {"verdict": "not resolved", "note": f"missing results of {slug}"}
        bounds[MODELS[slug]["label"]] = [(g["nll"], g["mc_se"]) for g in got]
    return mc.likelihood_claim(bounds, [MODELS[s]["label"] for s in LIKELIHOOD])


def best_accuracy(rows: list[dict]) -> dict:
    best = {}
    for fam in (AR, SW, BD3, MD):
        cands = [r for r in rows if r["family"] == fam]
        if cands:
            r = max(cands, key=lambda r: r["accuracy"]["mean"])
            best[fam] = {"accuracy": r["accuracy"]["mean"], "se": r["accuracy"]["se"], "model": r["label"],
                         "setting": r["setting"]}
    return best


def build(out: Path, size: dict, smoke: bool, phases: list) -> dict:
    res, timed = gather(out, size)
    rows = summaries(res, timed, size)
    claims = {"frontier": frontier(res, size), "infill": infill_claim(res, timed), "cache_ablation": ablation_claim(rows),
              "gradient_variance": variance(res), "likelihood_order": likelihood(res)}
    best = best_accuracy(rows)
    ran = [p for p in phases if "train_and_eval_seconds" in p] or phases  # the invocations that trained
    sha, dirty = (ran[0]["commit"], ran[0]["uncommitted_changes"]) if ran and "commit" in ran[0] else git_commit()
    train = [r["train_seconds"] for m in res.values() for r in m.values() if "train_seconds" in r]
    return {
        "commit": sha,
        "claims": [{"id": k, "verdict": v["verdict"], "claim": CLAIMS[k][0], "paper": CLAIMS[k][1], **v}
                   for k, v in claims.items()],
        "reasoning": {"task": TASK, "accuracy": {f: b["accuracy"] for f, b in best.items()}, "best": best},
        "settings": rows,
        "run": {"smoke": smoke, "size": size, "uncommitted_changes": dirty, "machine": machine(),
                "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "invocations": phases, "seconds": sum(p.get("seconds", 0.0) for p in phases),
                "train_seconds_total": sum(train), "models_trained": len(train), "new_tokens": NEW_TOKENS},
    }


# -- outputs -------------------------------------------------------------------------------------------
def fmt(s: dict | None, pct: bool = False, digits: int = 2) -> str:
    if not s:
        return "-"
    k = 100.0 if pct else 1.0
    return f"{s['mean'] * k:.{1 if pct else digits}f} ± {s['se'] * k:.{1 if pct else digits}f}"


def per_seed(s: dict) -> str:
    return " / ".join(f"{100 * v:.0f}" for v in s["values"])


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {AR: "black", SW: "tab:blue", BD3: "tab:orange", MD: "tab:green", ABLATED: "tab:purple"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, xlabel in ((axes[0], "tokens_per_forward", "tokens per forward (machine-independent)"),
                            (axes[1], "tokens_per_s", "tokens/s at batch 1 (median pass, mean over seeds; CPU)")):
        for slug in dict.fromkeys(r["model"] for r in data["settings"]):
            pts = [r for r in data["settings"] if r["model"] == slug and r[key]]
            if not pts:
                continue
            pts.sort(key=lambda r: r[key]["mean"])
            fam = pts[0]["family"]
            style = "--" if slug.endswith(("d8", "b8")) else "-"
            ax.errorbar([r[key]["mean"] for r in pts], [100 * r["accuracy"]["mean"] for r in pts],
                        xerr=[r[key]["se"] for r in pts], yerr=[100 * r["accuracy"]["se"] for r in pts],
                        marker="o", ms=4, capsize=2, ls=style, color=colors[fam], label=pts[0]["label"])
            for r in pts:
                tag = r["setting"].replace("threshold ", "").replace(" steps", "").replace("off", "1")
                ax.annotate(tag, (r[key]["mean"], 100 * r["accuracy"]["mean"]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("exact match on held-out problems (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[0].set_title("accuracy vs parallelism (labels: threshold, MDLM steps)", fontsize=9)
    axes[1].set_title("accuracy vs speed", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load_text(phases: list) -> str:
    def la(v):
        return "/".join(f"{x:.1f}" for x in v)

    return "; ".join(f"{p['started']}: start {la(p['load_start'])}, end {la(p['load_end'])}" for p in phases)


def markdown(data: dict, png: str) -> str:
    run = data["run"]
    size = run["size"]
    claims = {c["id"]: c for c in data["claims"]}
    cmd = "python benchmarks/paper_miniature.py" + (" --smoke --out DIR" if run["smoke"] else "")
    lines = [
        "# The paper in miniature" + (" (smoke run)" if run["smoke"] else ""),
        "",
        "Each headline claim of the set-diffusion paper, tested by small models trained from scratch on a CPU with this "
        "stack's trainer, samplers and evaluation. Verdicts: **held** (the difference exceeds 2 standard errors in the "
        "paper's direction), **not resolved**, **contradicted** (2 s.e. the other way); error bars are standard errors "
        f"over {size['seeds']} seeds. Regenerate with `{cmd}` (the timed pass alone: `--timed-only`).",
        "",
        f"- trained and evaluated at commit `{data['commit']}`"
        f"{' (with uncommitted changes)' if run['uncommitted_changes'] else ''}; report written {run['date']}"
        + "".join(f"; `{' '.join(p['argv']) or '(no options)'}` at `{p.get('commit', '?')[:12]}`"
                  for p in run["invocations"][1:]),
        f"- machine: {run['machine']}; {run['models_trained']} models trained in {run['train_seconds_total'] / 60:.0f} "
        f"process-minutes, {run['seconds'] / 60:.0f} minutes wall over the {len(run['invocations'])} invocation(s) "
        "that ran to their end (one killed before its end records no wall time; every trained model's own time is counted)",
        f"- load average (1/5/15 min) per invocation: {load_text(run['invocations'])}",
        "",
        "| claim | paper | result here | verdict |",
        "|---|---|---|---|",
    ]
    for cid, c in claims.items():
        lines.append(f"| `{cid}`: {c['claim']} | {c['paper']} | {headline(cid, c)} | **{c['verdict']}** |")
    r = data["reasoning"]
    lines += ["", "## The reasoning task", "", f"{r['task']}. Best accuracy per family (mean over seeds, best setting):", "",
              "| family | model, setting | exact match |", "|---|---|---|"]
    for fam, b in r["best"].items():
        lines.append(f"| {fam} | {b['model']}, {b['setting']} | {100 * b['accuracy']:.1f} ± {100 * b['se']:.1f}% |")
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
                      f"{k} {fmt(v, True)}%" for k, v in f["scores"].items()) + f"; z = {f['comparison']['z']:.2f}."]
    lines += ["", "## Infilling", "", "The second solution step masked between the question with the first step and the "
              "`#### n` line; exact match of the span.", "",
              "| model | sampling | exact match (%) | per seed (%) | token accuracy (%) | tokens/forward | tokens/s |",
              "|---|---|---|---|---|---|---|"]
    for m in claims["infill"].get("models", {}).values():
        lines.append(f"| {m['label']} | {m['sampling'] or 'greedy, prefix only'} | {fmt(m['exact_match'], True)} | "
                     f"{per_seed(m['exact_match'])} | "
                     f"{fmt(m['token_accuracy'], True)} | {fmt(m['tokens_per_forward'])} | {fmt(m['tokens_per_s'], digits=0)} |")
    a = claims["cache_ablation"]
    lines += ["", "## Cache ablation", ""]
    if "set_causal" in a:
        lines += ["| model | setting | exact match (%) | tokens/forward | tokens/s |", "|---|---|---|---|---|"]
        for k in ("set_causal", "bidirectional"):
            s = a[k]
            lines.append(f"| {s['label']} | {s['setting']} | {fmt(s['accuracy'], True)} | {fmt(s['tokens_per_forward'])} | "
                         f"{fmt(s['tokens_per_s'], digits=0)} |")
        lines += [""] + [f"- {p['claim']}: {p['verdict']}" + (f" (z = {p['z']:.2f})" if "z" in p else "")
                         for p in a["comparisons"]]
    g = claims["gradient_variance"]
    lines += ["", "## Gradient variance", ""]
    if "per_seed" in g:
        lines += [f"{g['model']} at its trained weights, {g['per_seed'][0]['draws']} draws of {g['per_seed'][0]['batch']} "
                  "rows, V = sum_k ||g_k - mean||^2 / (K - 1) over the non-embedding parameters "
                  "(benchmarks/miniature_measure.py).", "",
                  "| draws | V token-efficient | V naive | ratio naive / token-efficient (2 s.e. range) | verdict |",
                  "|---|---|---|---|---|"]
        for mode, c in (("fresh batches (verdict)", g), ("fixed batch", g["fixed_batch"])):
            key = c["mode"]
            te = sum(p[key]["token_efficient"]["variance"] for p in g["per_seed"]) / len(g["per_seed"])
            nv = sum(p[key]["naive"]["variance"] for p in g["per_seed"]) / len(g["per_seed"])
            lines.append(f"| {mode} | {te:.4g} | {nv:.4g} | {c['ratio']:.2f} ({c['ratio_2se'][0]:.2f}-"
                         f"{c['ratio_2se'][1]:.2f}) | {c['verdict']} |")
    lk = claims["likelihood_order"]
    lines += ["", "## Likelihood bound", ""]
    if "families" in lk:
        lines += ["Validation rows (answer tokens), nats/token; error: seeds and Monte-Carlo draws combined "
                  "(benchmarks/study_stats.py).", "", "| model | bound | s.e. |", "|---|---|---|"]
        lines += [f"| {k} | {v['mean']:.4f} | {v['se']:.4f} |" for k, v in lk["families"].items()]
        lines += [""] + [f"- {o['claim']}: {o['verdict']} (z = {o['z']:.2f})" for o in lk["orderings"]]
    lines += ["", "## Revisions", "", *[f"- {r}" for r in REVISIONS]]
    lines += ["", "## How it was run", "",
              f"Sizes: {json.dumps({k: v for k, v in size.items() if k != 'models'})}; models: "
              f"{', '.join(MODELS[m]['label'] for m in size['models'])}. The choices and their reasons are in the "
              "docstring of benchmarks/paper_miniature.py, written before any result was seen.", ""]
    return "\n".join(lines) + "\n"


def headline(cid: str, c: dict) -> str:
    if "note" in c and "comparison" not in c and "comparisons" not in c and "orderings" not in c:
        return c["note"]
    if cid == "frontier":
        return ", ".join(f"{k} {fmt(v, True)}%" for k, v in c["scores"].items())
    if cid == "infill":
        return ", ".join(f"{m['label']} {fmt(m['exact_match'], True)}%" for m in c["models"].values())
    if cid == "cache_ablation":
        s, b = c["set_causal"], c["bidirectional"]
        return (f"{fmt(s['accuracy'], True)}% vs {fmt(b['accuracy'], True)}%; {fmt(s['tokens_per_s'], digits=0)} vs "
                f"{fmt(b['tokens_per_s'], digits=0)} tok/s")
    if cid == "gradient_variance":
        return f"naive / token-efficient = {c['ratio']:.2f} ({c['ratio_2se'][0]:.2f}-{c['ratio_2se'][1]:.2f})"
    if cid == "likelihood_order":
        return " < ".join(f"{k} {v['mean']:.3f}" for k, v in c["families"].items())
    return ""


def write_report(out: Path, docs: Path, size: dict, *, smoke: bool, phases: list) -> Path:
    data = build(out, size, smoke, phases)
    docs.mkdir(parents=True, exist_ok=True)
    png = docs / "paper_miniature.png"
    plot(data, png)
    (docs / "paper_miniature.json").write_text(json.dumps(_finite(data), indent=1) + "\n")
    (docs / "paper_miniature.md").write_text(markdown(data, png.name))
    return docs / "paper_miniature.json"


def _finite(o):
    """`o` with non-finite floats (a z of a zero sigma) as strings, so the file is strict JSON."""
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o
