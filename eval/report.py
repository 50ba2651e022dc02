"""Reports: the markdown summary of a result directory, frontier plots, tables across runs."""

from __future__ import annotations

import json
from pathlib import Path

from common.errors import InputFileError
from common.io import atomic_save, atomic_write_text

PERCENT = {"accuracy", "format_rate", "rouge1", "rouge2", "rougeL", "rougeLsum", "lm_eval/exact_match",
           "lm_eval/exact_match_flexible"}


def fmt(key: str, v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        if key in PERCENT:
            return f"{100 * v:.2f}"
        if abs(v) >= 1000:
            return f"{v:,.1f}"
        return f"{v:.4g}" if abs(v) < 0.01 else f"{v:.4f}".rstrip("0").rstrip(".") if abs(v) < 100 else f"{v:.2f}"
    if isinstance(v, (dict, list)):
        return "`" + json.dumps(v, default=str)[:200] + "`"
    return str(v)


def table(rows: list[dict], cols: list[str]) -> str:
    head = "| " + " | ".join(cols) + " |\n|" + "|".join("---" for _ in cols) + "|\n"
    return head + "".join("| " + " | ".join(fmt(c, r.get(c)) for c in cols) + " |\n" for r in rows)


def summary_markdown(task: str, metrics: dict, spec: dict, created: dict, task_cls=None) -> str:
    ck = spec.get("checkpoint") or {}
    lines = [f"# setdlm eval {task}", ""]
    if ck:
        weights = ("EMA weights" if ck.get("ema") else "raw weights (the checkpoint has no EMA weights)"
                   if ck.get("ema_requested") else "raw weights (--no-ema)")
        lines.append(f"checkpoint `{ck.get('path')}` (step {ck.get('step')}, objective {ck.get('objective')}, {weights})")
    elif spec.get("predictor"):
        lines.append(f"predictor `{spec['predictor']}`")
    lines.append(f"run on {created.get('device', '?')} ({created.get('host', '?')}), {created.get('world', 1)} rank(s), "
                 f"{created.get('time', '')}")
    if metrics.get("partial"):
        lines.append(f"\n**PARTIAL**: {metrics.get('missing_examples')} examples missing")
    over = spec.get("overlong") or {}
    if metrics.get("skipped_overlong"):
        keys = metrics.get("skipped_keys") or over.get("skipped_keys") or []
        limit = over.get("max_seq_len") or ck.get("max_seq_len")
        lines.append(f"\n**SKIPPED**: {metrics['skipped_overlong']} examples do not fit the model's max_seq_len "
                     f"{limit if limit is not None else 'n/a'} with the decoded tokens (--overlong "
                     f"{over.get('policy', 'skip')}); "
                     + (f"the metrics are over the other {metrics['n']}" if "n" in metrics else "they were left out")
                     + (f" (first skipped: {', '.join(map(str, keys[:5]))})" if keys else ""))
    if metrics.get("prompts_cut"):
        what = "contexts were cut" if spec.get("span") else "prompts were cut from the left"
        lines.append(f"\n**TRUNCATED**: {metrics['prompts_cut']} {what} to fit the model's "
                     f"max_seq_len ({metrics.get('prompt_tokens_cut')} tokens in all)")
    if metrics.get("articles_cut"):
        lines.append(f"\n**TRUNCATED**: {metrics['articles_cut']} articles were cut to fit the model's max_seq_len")
    for k, v in metrics.items():
        if k.endswith("_warning") and v:
            lines.append(f"\n**WARNING** ({k}): {v}")
    lines += ["", "## Metrics", ""]
    rows = metrics.get("rows")
    scalars = {k: v for k, v in metrics.items() if k != "rows" and not isinstance(v, (dict, list))}
    head = [k for k in (getattr(task_cls, "headline", ()) or ()) if k in scalars]
    rest = [k for k in scalars if k not in head]
    lines.append("| metric | value |\n|---|---|")
    for k in head + rest:
        unit = " (%)" if k in PERCENT else ""
        lines.append(f"| {k}{unit} | {fmt(k, scalars[k])} |")
    for k, v in metrics.items():
        if isinstance(v, dict) and k != "rows":
            lines.append(f"| {k} | {fmt(k, v)} |")
    if rows:
        cols = [c for c in ("setting", "batch_size", "n", "tokens_per_s", "batch_tokens_per_s", "latency_s",
                            "latency_p90_s", "tokens_per_step", "new_tokens", "gen_ppl", "entropy") if any(c in r for r in rows)]
        lines += ["", "## Speed by setting and batch size", "", table(rows, cols)]
        if metrics.get("frontier"):
            lines += [f"![speed-quality frontier]({Path(metrics['frontier']['png']).name})", ""]
    samp = spec.get("sampling")
    if samp:
        keep = {k: v for k, v in samp.items() if v not in (None, [], 0, 1.0, False) or k in ("threshold", "temperature")}
        lines += ["", "## Decoding", "", "`" + json.dumps(keep, default=str) + "`"]
    lines += ["", "## Settings", "", "```json", json.dumps({k: v for k, v in spec.items() if k != "sampling"},
                                                          indent=1, default=str), "```", ""]
    return "\n".join(lines)


def frontier_plot(points: list[tuple[float, float, str]], path: Path, *, xlabel: str, ylabel: str, title: str = "") -> str:
    """Scatter + line of (x, y, label) points sorted by x; returns the PNG path (or a note without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed: no plot (pip install 'setdlm[eval]')"
    pts = sorted((p for p in points if p[0] is not None and p[1] is not None), key=lambda p: p[0])
    fig, ax = plt.subplots(figsize=(5.5, 4))
    groups: dict = {}
    for x, y, label in pts:
        groups.setdefault(label.split("=")[0] if "=" in label else label, []).append((x, y, label))
    for name, g in groups.items():
        ax.plot([p[0] for p in g], [p[1] for p in g], marker="o", label=name)
        for x, y, label in g:
            ax.annotate(label.split("=")[-1] if "=" in label else label, (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(groups) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    try:  # atomically: a full disk leaves no half-written image (common/io.py)
        atomic_save(path, lambda f: fig.savefig(f, dpi=120, format=path.suffix.lstrip(".") or "png"))
    finally:
        plt.close(fig)
    return str(path)


def _get(d: dict, key: str):
    for part in key.split("."):
        if not isinstance(d, dict):
            return None
        d = d.get(part)
    return d


def collect(dirs: list[str]) -> list[dict]:
    """metrics.json of several result directories, flattened with their settings."""
    out = []
    for d in dirs:
        p = Path(d) / "metrics.json"
        if not p.is_file():
            raise InputFileError(f"{d}: no metrics.json (run the evaluation or `setdlm eval merge {d}` first)")
        doc = json.loads(p.read_text())
        out.append({"dir": str(d), "task": doc["task"], **doc["metrics"], "spec": doc["spec"]})
    return out


def frontier_main(dirs: list[str], *, x: str, y: str, out: str, label: str | None = None) -> str:
    """Frontier across result directories (e.g. gsm8k at several thresholds): PNG + markdown table."""
    rows = collect(dirs)
    pts = []
    for r in rows:
        name = str(_get(r["spec"], label)) if label else Path(r["dir"]).name
        pts.append((_get(r, x), _get(r, y), name))
    out_p = Path(out)
    out_p.parent.mkdir(parents=True, exist_ok=True)
    png = frontier_plot([(a, b, f"run={n}") for a, b, n in pts], out_p, xlabel=x, ylabel=y, title="speed-quality frontier")
    md = "| run | " + x + " | " + y + " |\n|---|---|---|\n" + "".join(
        f"| {n} | {fmt(x, a)} | {fmt(y, b)} |\n" for a, b, n in sorted(pts, key=lambda p: (p[0] is None, p[0])))
    atomic_write_text(out_p.with_suffix(".md"), md)
    return png
