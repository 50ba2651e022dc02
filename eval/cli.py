"""`setdlm eval`: likelihood and sampling benchmarks from checkpoints, sharded and resumable.

    setdlm eval TASK --checkpoint RUN_OR_CKPT --out DIR [options]    TASK: likelihood gsm8k infill summarize uncond throughput
    setdlm eval merge DIR [--allow-partial]                          final metrics from the records of all ranks
    setdlm eval frontier DIR... --x KEY --y KEY --out PLOT.png        speed-quality frontier across result dirs
    setdlm eval matrix MATRIX.yaml (--count | --list | --index I)     checkpoints x tasks x settings (Slurm arrays)

Under torchrun / srun / mpirun (or with --shard I/N) the examples are split across ranks; every rank
appends its records to DIR; rank 0 (or the last shard) merges. Run `setdlm eval TASK --help` for the
options of a task; docs/eval.md describes the outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from common.cli import ArgumentParser as CLIParser

from .runner import EvalError, EvalRun, IncompleteError, detect_shard, isolate_process_group, merge
from .tasks import TASKS, get_task


def task_parser(name: str) -> argparse.ArgumentParser:
    cls = get_task(name)
    p = CLIParser(prog=f"setdlm eval {name}", description=(cls.__doc__ or cls.help).strip().split("\n")[0])
    g = p.add_argument_group("run")
    g.add_argument("--checkpoint", help="run directory (newest checkpoint) or a checkpoints/step_* folder")
    g.add_argument("--out", required=True, help="output directory (per-rank records, metrics.json, summary.md)")
    g.add_argument("--seed", type=int, default=None, help="base seed (per-example seeds derive from it; likelihood: "
                                                           "default the recipe's run.seed, others 0)")
    g.add_argument("--limit", type=int, default=0, help="evaluate only the first N examples (0: all)")
    g.add_argument("--shard", help="I/N: this process is shard I of N (e.g. from a Slurm array); default: the "
                                   "launcher's rank and world size")
    g.add_argument("--overwrite", action="store_true", help="delete earlier results in --out first")
    g.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA weights")
    g.add_argument("--device", help="torch device (default: cuda:LOCAL_RANK when available, else cpu)")
    g.add_argument("--no-merge", action="store_true", help="do not merge at the end (run `setdlm eval merge` later)")
    g.add_argument("--merge-timeout", type=float, default=0.0,
                   help="rank 0: seconds to wait for the other ranks before merging (0: until they finish)")
    cls.add_args(p)
    return p


def _log(msg: str) -> None:
    print(f"[setdlm eval] {msg}", file=sys.stderr, flush=True)


def _select_device(shard, device: str | None) -> None:
    """One GPU per local rank: make it the current device before anything allocates (megatron-core
    builds layers on the current device), so ranks on one node do not all start on GPU 0."""
    import torch

    if not torch.cuda.is_available() or (device and not device.startswith("cuda")):
        return
    from .models import pick_device

    torch.cuda.set_device(pick_device(shard.local_rank, device))


def run_task(name: str, argv: list[str], *, predictor=None, after_unit=None) -> dict:
    """Parse `argv` into the task's typed options (eval.api) and run it (see `execute`)."""
    from .api import from_argv

    return execute(name, from_argv(name, argv), predictor=predictor, after_unit=after_unit)


def execute(name: str, args, *, predictor=None, after_unit=None) -> dict:
    """Run this rank's share of task `name` with typed options `args` (eval.api), merge when this
    process should.

    Returns {"metrics": ... or None, "stats": ..., "merged": bool, "out": DIR}. `predictor` replaces
    the checkpoint's sampler (tests, or scoring another system); `after_unit(unit, records)` is
    called after each unit is written (tests use it to simulate a kill). Every option check, the
    task's included, runs before --out is created."""
    if args.limit < 0:
        raise EvalError(f"--limit: must be >= 0, got {args.limit}")
    shard = detect_shard(args.shard)
    if args.overwrite and shard.world > 1:
        raise EvalError("--overwrite: with several ranks the deletion would race with their writes; delete --out first")
    _select_device(shard, args.device)
    isolate_process_group()
    cls = get_task(name)
    task = cls(args, shard, predictor)
    if hasattr(task, "check_fits"):
        task.check_fits()
    spec = task.spec()
    run = EvalRun(args.out, name, spec, shard, overwrite=args.overwrite)
    stats = task.execute(run, after_unit)
    result = {"metrics": None, "stats": stats, "merged": False, "out": args.out}
    if args.no_merge:
        return result
    if shard.world == 1:
        do = True
    elif shard.explicit:
        do, missing = run.complete()
        if not do:
            run.log(f"done; {missing} examples of other shards remain (the last shard to finish merges, or run "
                    f"`setdlm eval merge {args.out}`)")
    elif shard.rank == 0:
        do = run.wait_for_all(args.merge_timeout)
    else:
        do = False
    if do:
        result["metrics"] = merge(args.out, log=run.log)
        result["merged"] = True
        _print_headline(name, result["metrics"], cls)
    return result


def _print_headline(name, metrics, cls) -> None:
    from .report import PERCENT, fmt

    keys = [k for k in getattr(cls, "headline", ()) if k in metrics] or list(metrics)[:4]
    print(f"{name}: " + ", ".join(f"{k} {fmt(k, metrics[k])}{'%' if k in PERCENT else ''}" for k in keys), flush=True)


def merge_main(argv: list[str]) -> int:
    p = CLIParser(prog="setdlm eval merge", description="Final metrics from the records of all ranks.")
    p.add_argument("out", nargs="+", help="output directories")
    p.add_argument("--allow-partial", action="store_true", help="merge even when examples are missing (marked partial)")
    args = p.parse_args(argv)
    code = 0
    for d in args.out:
        try:
            m = merge(d, allow_partial=args.allow_partial, log=_log)
            run = json.loads(open(os.path.join(d, "run.json")).read())
            _print_headline(run["task"], m, get_task(run["task"]))
        except (EvalError, FileNotFoundError) as e:
            print(f"setdlm eval merge: error: {e}", file=sys.stderr)
            code = 2 if not isinstance(e, IncompleteError) else 3
    return code


def frontier_cli(argv: list[str]) -> int:
    from .report import frontier_main

    p = CLIParser(prog="setdlm eval frontier", description="Speed-quality frontier across result directories.")
    p.add_argument("dirs", nargs="+")
    p.add_argument("--x", default="speed/tokens_per_s", help="metric on the x axis (default speed/tokens_per_s)")
    p.add_argument("--y", required=True, help="metric on the y axis, e.g. accuracy, rouge1, gen_ppl")
    p.add_argument("--label", help="spec key naming each point (e.g. sampling.threshold); default: the directory name")
    p.add_argument("--out", required=True, help="PNG path (a .md table is written next to it)")
    args = p.parse_args(argv)
    try:
        png = frontier_main(args.dirs, x=args.x, y=args.y, out=args.out, label=args.label)
    except FileNotFoundError as e:
        print(f"setdlm eval frontier: error: {e}", file=sys.stderr)
        return 2
    print(png)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\ntasks:")
        for n in TASKS:
            print(f"  {n:<11} {get_task(n).help}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "merge":
        return merge_main(rest)
    if cmd == "frontier":
        return frontier_cli(rest)
    if cmd == "matrix":
        from .matrix import main as matrix_main

        return matrix_main(rest)
    if cmd not in TASKS:
        print(f"setdlm eval: unknown task {cmd!r}; valid: {', '.join(TASKS)}, merge, frontier, matrix", file=sys.stderr)
        return 2
    try:
        run_task(cmd, rest)
    except (EvalError, ImportError) as e:
        print(f"setdlm eval {cmd}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
