"""The family study's written result: markdown (header with the command, commit, machine, date) and
JSON with every number (benchmarks/study_families.py calls it)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
from pathlib import Path

from benchmarks.study_stats import Z

REPO = Path(__file__).resolve().parent.parent
OUTPUTS = ("docs/study_families.md", "docs/study_families.json")
SPEED_POINTER = ("Speed against quality is measured in docs/paper_miniature.md (benchmarks/paper_miniature.py): accuracy "
                 "against tokens per forward and tokens/s, over seeds, on a task small models learn. Models this small "
                 "trained on pydoc text repeat themselves when decoding, so their speed-quality points here measured "
                 "the machine's load and the repetition, not the families.")


def command_line(args, parser) -> str:
    """The command with every option spelled out (defaults too), so the header alone reproduces it."""
    parts = ["python benchmarks/study_families.py"]
    for action in parser._actions:
        if action.dest in ("help", "train_only") or not action.option_strings:
            continue
        value = getattr(args, action.dest)
        if action.nargs == 0:  # a flag
            if value:
                parts.append(action.option_strings[0])
        else:
            parts.append(f"{action.option_strings[0]} {value}")
    return " ".join(parts)


def commit() -> str:
    """HEAD of the checkout the study ran from, marked when tracked files (besides its outputs) differ."""
    def git(*a):
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":!{o}" for o in OUTPUTS))
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return (head or "unknown") + (" with uncommitted changes" if dirty else "")


def machine() -> str:
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()} CPU ({model or 'unknown model'}), {os.cpu_count()} cores, no GPU"


def write_doc(doc: Path, result: dict, args, parser, total: float, loads) -> None:
    doc.parent.mkdir(parents=True, exist_ok=True)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd, rev, mach = command_line(args, parser), commit(), machine()
    fams, per_seed = result["families"], result["per_seed"]
    first = per_seed[0]
    seeds = sorted({r["seed"] for r in per_seed})
    secs = result.get("train_seconds") or []
    known = [t for t in secs if t is not None]
    trained = (f"training {sum(known) / 60:.1f} minutes summed over the {len(known)} runs, {args.jobs} at a time"
               if len(known) == len(secs) and secs else
               f"the {len(secs) - len(known)} runs trained by an earlier invocation of the same command were reused "
               f"and their training time is not in it")
    lines = [
        f"# Family ordering study ({when})", "",
        f"Regenerate with `{cmd}` (this file and the JSON next to it). Ran at commit {rev} on {mach}: "
        f"{total / 60:.1f} minutes wall for the whole command ({trained}); load average {loads[0][0]:.1f} at the start "
        f"and {loads[1][0]:.1f} at the end (the machine was shared with other jobs).", "",
        f"Every family: the same 2 x {args.hidden} model (tied GPT-2 embeddings), {args.steps} steps of 8 x 64 tokens of "
        f"the pydoc corpus (GPT-2 tokenizer), trained once per seed ({', '.join(map(str, seeds))}: initialisation, data "
        f"order and training noise). Bounds on the same {first['rows']} validation rows ({first['tokens']} scored tokens "
        f"for the diffusion families; AR scores all but the first token of a row), "
        f"{args.orders} Monte-Carlo draws per row (AR: exact).", "",
        "| family | bound (nats/token), mean over seeds | seed std | MC s.e. | combined s.e. | perplexity bound | seeds | draws |",
        "|---|---|---|---|---|---|---|---|"]
    for name, f in fams.items():
        draws = next(r["orders"] for r in per_seed if r["family"] == name)
        lines.append(f"| {name} | {f['mean']:.4f} | {f['seed_sd']:.4f} | {f['mc_se']:.4f} | {f['se']:.4f} | "
                     f"{math.exp(min(f['mean'], 50.0)):.1f} | {f['seeds']} | {draws} |")
    lines += ["", "Combined s.e. of a family's mean = sqrt(seed std^2 / seeds + MC s.e.^2), with MC s.e. = "
              "sqrt(sum over seeds of (std over draws / sqrt(draws))^2) / seeds: the seed spread already holds the "
              "Monte-Carlo noise, so this counts it twice and is conservative (benchmarks/study_stats.py).", "",
              f"## Orderings at the combined error (held: the difference exceeds {Z:g} combined s.e.)", "",
              "| ordering | difference (nats/token) | combined s.e. of the difference | difference / s.e. | verdict |",
              "|---|---|---|---|---|"]
    for o in result["orderings"]:
        lines.append(f"| {o['claim']} | {o['difference']:+.4f} | {o['sigma']:.4f} | {o['z']:+.1f} | {o['verdict']} |")
    lines += ["", "The combined s.e. of a difference is sqrt(s.e._A^2 + s.e._B^2) (families trained independently). "
              "The first three rows are the paper's orderings; the last compares SetDLM(D=4) with BD3-LM(B=4), which "
              "the paper finds about equal (so there \"not resolved\" would agree with it, \"held\" would not).", ""]
    bd = next((f for f in fams.values() if "forced_mask" in f), None)
    if bd:
        fm = bd["forced_mask"]
        lines += [f"BD3-LM with the old estimator (forced MASK per block, t ~ U[eps, 1], 1/t weights): {fm['mean']:.4f} "
                  f"+- {fm['se']:.4f} nats/token (mean over seeds, combined s.e.), against the NELBO {bd['mean']:.4f} "
                  f"+- {bd['se']:.4f}.", ""]
    lines += ["## Per seed", "", "| family | seed | bound (nats/token) | MC s.e. | perplexity bound |", "|---|---|---|---|---|"]
    for r in per_seed:
        lines.append(f"| {r['family']} | {r['seed']} | {r['nll']:.4f} | {r['mc_se']:.4f} | {r['ppl']:.1f} |")
    lines += ["", "## Speed and quality", "", SPEED_POINTER, ""]
    doc.write_text("\n".join(lines))
    doc.with_suffix(".json").write_text(json.dumps(
        {**result, "when": when, "machine": mach, "commit": rev, "command": cmd, "minutes": total / 60,
         "load_average": [loads[0][0], loads[1][0]]}, indent=1))
