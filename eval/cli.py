"""`setdlm eval`: likelihood and sampling benchmarks from checkpoints, sharded and resumable.

    setdlm eval TASK --checkpoint RUN_OR_CKPT --out DIR [options]    TASK: likelihood gsm8k infill summarize uncond throughput
    setdlm eval TASK --describe                                      every option: type, valid values, default
    setdlm eval merge DIR [--allow-partial]                          final metrics from the records of all ranks
    setdlm eval frontier DIR... --x KEY --y KEY --out PLOT.png        speed-quality frontier across result dirs
    setdlm eval matrix MATRIX.yaml (--count | --list | --index I)     checkpoints x tasks x settings (Slurm arrays)

Under torchrun / srun / mpirun (or with --shard I/N) the examples are split across ranks; every rank
appends its records to DIR; rank 0 (or the last shard) merges. Run `setdlm eval TASK --help` for the
options of a task; docs/eval.md describes the outputs.
"""

from __future__ import annotations

import sys

from common.cli import ArgumentParser, run_command
from common.errors import UsageError
from common.options import from_namespace
from common.storage import check_output_file

from . import api
from .execute import print_headline
from .matrix import main as matrix_main
from .merge import merge, read_run
from .tasks import TASKS, get_task

__all__ = ["main", "run_task"]


def run_task(name: str, argv: list[str], *, predictor=None, after_unit=None) -> dict:
    """Parse `argv` into the task's typed options and run it (eval.api.run); for scripts holding argv lists."""
    return api.run(name, api.from_argv(name, argv), predictor=predictor, after_unit=after_unit)


def _log(msg: str) -> None:
    print(f"[setdlm eval] {msg}", file=sys.stderr, flush=True)


VALUE_FLAGS = ("--shard",)  # options whose value may start with '-' (argparse would read `-1/2` as a flag)


def _attach_values(argv: list[str]) -> list[str]:
    """`--shard -1/2` -> `--shard=-1/2`, so the value is checked and named rather than taken for a flag."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in VALUE_FLAGS and i + 1 < len(argv) and argv[i + 1][:1] == "-" and argv[i + 1][1:2].isdigit():
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def task_main(name: str, argv: list[str]) -> int:
    ns = api.task_parser(name).parse_args(_attach_values(argv))
    if ns.describe:
        print(api.describe(name))
        return 0
    api.run(name, from_namespace(api.options_class(name), ns))
    return 0


def merge_main(argv: list[str]) -> int:
    p = ArgumentParser(prog="setdlm eval merge", description="Final metrics from the records of all ranks.")
    p.add_argument("out", nargs="+", help="output directories")
    p.add_argument("--allow-partial", action="store_true", help="merge even when examples are missing (marked partial)")
    args = p.parse_args(argv)

    def merge_one(d: str) -> int:
        m = merge(d, allow_partial=args.allow_partial, log=_log)
        task = read_run(d)["task"]
        print_headline(task, m, get_task(task))
        return 0

    # every directory is merged (or reported on one line); the exit status is the worst (3: incomplete)
    return max(run_command("setdlm eval merge", merge_one, d) for d in args.out)


def frontier_main(argv: list[str]) -> int:
    from .report import frontier_main as plot

    p = ArgumentParser(prog="setdlm eval frontier", description="Speed-quality frontier across result directories.")
    p.add_argument("dirs", nargs="+")
    p.add_argument("--x", default="speed/tokens_per_s", help="metric on the x axis (default speed/tokens_per_s)")
    p.add_argument("--y", required=True, help="metric on the y axis, e.g. accuracy, rouge1, gen_ppl")
    p.add_argument("--label", help="spec key naming each point (e.g. sampling.threshold); default: the directory name")
    p.add_argument("--out", required=True, help="PNG path (a .md table is written next to it)")
    args = p.parse_args(argv)
    check_output_file(args.out, "--out")  # a directory, a read-only mount: refused before the directories are read
    print(plot(args.dirs, x=args.x, y=args.y, out=args.out, label=args.label))
    return 0


COMMANDS = {"merge": merge_main, "frontier": frontier_main, "matrix": matrix_main}


def _usage() -> str:
    return __doc__.strip() + "\n\ntasks:\n" + "\n".join(f"  {n:<11} {get_task(n).help}" for n in TASKS)


def _unknown(cmd: str):
    def fail(argv):
        raise UsageError(f"unknown task {cmd!r}; valid: {', '.join(TASKS)}, {', '.join(COMMANDS)}")

    return fail


def main(argv: list[str] | None = None) -> int:
    """`setdlm eval ...`: a mistake is one line `setdlm eval CMD: error: ...` and exit status 2 (common/cli.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd in COMMANDS:
        return run_command(f"setdlm eval {cmd}", COMMANDS[cmd], rest)
    if cmd in TASKS:
        return run_command(f"setdlm eval {cmd}", lambda a: task_main(cmd, a), rest)
    return run_command("setdlm eval", _unknown(cmd), rest)


if __name__ == "__main__":
    sys.exit(main())
