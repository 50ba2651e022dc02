"""Evaluation matrices: checkpoints x tasks x settings, one cell per Slurm array index.

Matrix file (YAML)::

    out: results                      # cell I writes to OUT/<checkpoint>/<task>/<setting>
    checkpoints:                      # name: path (or a list of paths, named by their folder)
      owt-setdlm: runs/owt-setdlm
      owt-bd3lm: runs/owt-bd3lm
    tasks:
      likelihood: {}                  # one cell per checkpoint, setting "default"
      gsm8k:
        args: [--data, data/gsm8k/test.jsonl]     # for every setting (a list, or one string)
        settings:                                 # one cell per setting
          t0.9: [--threshold, "0.9"]
          t1.0: --threshold 1.0

    setdlm eval matrix M.yaml --count        number of cells (for sbatch --array=0-$((n-1)))
    setdlm eval matrix M.yaml --list         index, checkpoint, task, setting, output directory
    setdlm eval matrix M.yaml --index I      run cell I (default: $SLURM_ARRAY_TASK_ID); its ranks
                                             (srun tasks / torchrun workers) split the examples
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import yaml

from common.cli import ArgumentParser as CLIParser

from . import api
from .errors import EvalError
from .tasks import TASKS


def _args(v, where: str) -> list[str]:
    if v is None:
        return []
    if isinstance(v, str):
        return shlex.split(v)
    if isinstance(v, list):
        return [str(x) for x in v]
    raise EvalError(f"matrix: {where}: expected a list of arguments or a string, got {type(v).__name__}")


def load_matrix(path: str) -> list[dict]:
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"matrix: {p}: no such file")
    m = yaml.safe_load(p.read_text()) or {}
    unknown = sorted(set(m) - {"out", "checkpoints", "tasks", "args"})
    if unknown:
        raise EvalError(f"matrix: {p}: unknown key {unknown[0]!r}; valid: out, checkpoints, tasks, args")
    ckpts = m.get("checkpoints")
    if isinstance(ckpts, list):
        ckpts = {Path(c).name: c for c in ckpts}
    if not ckpts or not isinstance(ckpts, dict):
        raise EvalError(f"matrix: {p}: 'checkpoints' must map names to paths (or list paths)")
    tasks = m.get("tasks")
    if not tasks or not isinstance(tasks, dict):
        raise EvalError(f"matrix: {p}: 'tasks' must map task names to their args/settings")
    out = m.get("out", "results")
    common = _args(m.get("args"), "args")
    cells = []
    for cname, cpath in ckpts.items():
        for tname, tspec in tasks.items():
            if tname not in TASKS:
                raise EvalError(f"matrix: {p}: unknown task {tname!r}; valid: {', '.join(TASKS)}")
            tspec = tspec or {}
            bad = sorted(set(tspec) - {"args", "settings"})
            if bad:
                raise EvalError(f"matrix: {p}: tasks.{tname}: unknown key {bad[0]!r}; valid: args, settings")
            targs = _args(tspec.get("args"), f"tasks.{tname}.args")
            settings = tspec.get("settings") or {"default": []}
            for sname, sargs in settings.items():
                cells.append({"index": len(cells), "checkpoint_name": str(cname), "checkpoint": str(cpath),
                              "task": tname, "setting": str(sname),
                              "out": str(Path(out) / str(cname) / tname / str(sname)),
                              "args": common + targs + _args(sargs, f"tasks.{tname}.settings.{sname}")})
    return cells


def cell_argv(cell: dict) -> list[str]:
    return [cell["task"], "--checkpoint", cell["checkpoint"], "--out", cell["out"], *cell["args"]]


def main(argv: list[str]) -> int:
    p = CLIParser(prog="setdlm eval matrix", description="Run one cell of an evaluation matrix.")
    p.add_argument("matrix", help="matrix YAML")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--count", action="store_true", help="print the number of cells")
    g.add_argument("--list", action="store_true", help="list the cells")
    g.add_argument("--index", type=int, help="cell to run (default: $SLURM_ARRAY_TASK_ID)")
    p.add_argument("--dry-run", action="store_true", help="print the cell's command instead of running it")
    args = p.parse_args(argv)
    cells = load_matrix(args.matrix)
    if args.count:
        print(len(cells))
        return 0
    if args.list:
        for c in cells:
            print(f"{c['index']}\t{c['checkpoint_name']}\t{c['task']}\t{c['setting']}\t{c['out']}")
        return 0
    idx = args.index
    if idx is None:
        env = os.environ.get("SLURM_ARRAY_TASK_ID")
        if env is None:
            raise EvalError("matrix: give --index (or run inside a Slurm array job)")
        idx = int(env)
    if not 0 <= idx < len(cells):
        raise EvalError(f"matrix: --index {idx} outside [0, {len(cells)}) ({args.matrix} has {len(cells)} cells)")
    argv = cell_argv(cells[idx])
    if args.dry_run:
        print("setdlm eval " + shlex.join(argv))
        return 0
    print(f"[setdlm eval matrix] cell {idx}/{len(cells)}: setdlm eval {shlex.join(argv)}", file=sys.stderr, flush=True)
    api.run(argv[0], api.from_argv(argv[0], argv[1:]))
    return 0
