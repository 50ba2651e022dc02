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

A paper matrix (eval/templates/paper_matrix.yaml) lists its cells as `rows` instead of `tasks`, each with
the paper's own number, and may name released checkpoints of the reference implementation, imported once
into `IMPORTS/<name>` (`imports:`, default runs/released; `--import`: a hub id is read from the local
Hugging Face cache, nothing is downloaded) before the array job runs::

    out: results/paper
    imports: runs/released
    checkpoints:
      setdlm-gsm8k-smax8: {release: kuleshov-group/setdlm-gsm8k-smax8, base_model: Qwen/Qwen3-1.7B-Base}
      mine: runs/my-setdlm
    rows:
      - {table: GSM8K, checkpoint: setdlm-gsm8k-smax8, task: gsm8k, setting: w4-t0.9,
         args: --protocol paper --window 4 --threshold 0.9,
         paper: {metric: accuracy, value: 0.657, source: "where the number is from"}}

    setdlm eval matrix M.yaml --import       import the released checkpoints (setdlm convert from-reference)
    setdlm eval matrix M.yaml --summary      OUT/summary.md: each row's number beside the paper's
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import yaml

from common.cli import ArgumentParser as CLIParser
from common.errors import Error

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


RELEASE_KEYS = ("release", "base_model", "args")  # a released checkpoint: what `setdlm convert from-reference` takes


def _read(path: str) -> tuple[Path, dict]:
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"matrix: {p}: no such file")
    try:
        m = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise EvalError(f"matrix: {p}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(m, dict):
        raise EvalError(f"matrix: {p}: expected a mapping at the top level")
    return p, m


def _checkpoints(p: Path, m: dict) -> dict[str, dict]:
    """name -> {"path": run directory to evaluate, "release": hub id or directory (released ones), ...}."""
    ckpts = m.get("checkpoints")
    if isinstance(ckpts, list):
        ckpts = {Path(c).name: c for c in ckpts}
    if not ckpts or not isinstance(ckpts, dict):
        raise EvalError(f"matrix: {p}: 'checkpoints' must map names to paths (or list paths)")
    imports = Path(str(m.get("imports", "runs/released")))
    out = {}
    for name, spec in ckpts.items():
        if isinstance(spec, dict):
            bad = sorted(set(spec) - set(RELEASE_KEYS))
            if bad or "release" not in spec:
                raise EvalError(f"matrix: {p}: checkpoints.{name}: a released checkpoint is {{release: HUB_ID_OR_DIR"
                                f"[, base_model: ..., args: ...]}}" + (f"; unknown key {bad[0]!r}" if bad else ""))
            out[str(name)] = {"path": str(imports / str(name)), **{k: spec.get(k) for k in RELEASE_KEYS}}
        else:
            out[str(name)] = {"path": str(spec), "release": None}
    return out


def _rows(p: Path, m: dict, ckpts: dict, out: str, common: list[str]) -> list[dict]:
    cells = []
    for i, row in enumerate(m.get("rows") or []):
        where = f"rows[{i}]"
        if not isinstance(row, dict):
            raise EvalError(f"matrix: {p}: {where}: expected a mapping")
        bad = sorted(set(row) - {"table", "checkpoint", "task", "setting", "args", "paper"})
        if bad:
            raise EvalError(f"matrix: {p}: {where}: unknown key {bad[0]!r}; valid: table, checkpoint, task, setting, "
                            "args, paper")
        cname, tname = str(row.get("checkpoint")), str(row.get("task"))
        if cname not in ckpts:
            raise EvalError(f"matrix: {p}: {where}.checkpoint: {cname!r} is not one of checkpoints")
        if tname not in TASKS:
            raise EvalError(f"matrix: {p}: {where}.task: unknown task {tname!r}; valid: {', '.join(TASKS)}")
        paper = row.get("paper") or {}
        if not isinstance(paper, dict) or "metric" not in paper or "source" not in paper:
            raise EvalError(f"matrix: {p}: {where}.paper: expected {{metric: NAME, value: NUMBER or null, "
                            "source: TEXT}")
        sname = str(row.get("setting", "default"))
        cells.append({"index": len(cells), "checkpoint_name": cname, "checkpoint": ckpts[cname]["path"],
                      "release": ckpts[cname].get("release"), "task": tname, "setting": sname,
                      "table": str(row.get("table", "")), "paper": paper,
                      "out": str(Path(out) / cname / tname / sname),
                      "args": common + _args(row.get("args"), f"{where}.args")})
    if not cells:
        raise EvalError(f"matrix: {p}: 'rows' is empty")
    return cells


def load_matrix(path: str) -> list[dict]:
    p, m = _read(path)
    unknown = sorted(set(m) - {"out", "checkpoints", "tasks", "args", "rows", "imports"})
    if unknown:
        raise EvalError(f"matrix: {p}: unknown key {unknown[0]!r}; valid: out, checkpoints, tasks, args, rows, imports")
    released = _checkpoints(p, m)
    out = m.get("out", "results")
    common = _args(m.get("args"), "args")
    if "rows" in m:
        if "tasks" in m:
            raise EvalError(f"matrix: {p}: give 'tasks' (checkpoints x tasks x settings) or 'rows' (a paper matrix), "
                            "not both")
        return _rows(p, m, released, out, common)
    ckpts = {name: c["path"] for name, c in released.items()}
    tasks = m.get("tasks")
    if not tasks or not isinstance(tasks, dict):
        raise EvalError(f"matrix: {p}: 'tasks' must map task names to their args/settings")
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
                              "release": released[str(cname)].get("release"), "task": tname, "setting": str(sname),
                              "out": str(Path(out) / str(cname) / tname / str(sname)),
                              "args": common + targs + _args(sargs, f"tasks.{tname}.settings.{sname}")})
    return cells


def cell_argv(cell: dict) -> list[str]:
    return [cell["task"], "--checkpoint", cell["checkpoint"], "--out", cell["out"], *cell["args"]]


def as_matrix_keys(message: str) -> str:
    """An error of `setdlm convert from-reference` as the matrix's user fixes it: the two flags the matrix
    fills are its keys (`--model X` is `release: X`, `--base-model X` is `base_model: X`); the others are
    the entry's `args:`, as written."""
    for flag, key in (("--base-model", "base_model:"), ("--model", "release:")):
        message = re.sub(rf"\bpass {flag}(?![\w-])", f"set {key}", message)
        message = re.sub(rf"{flag}(?![\w-])", key, message)
    return message


def import_releases(path: str, log=print) -> list[str]:
    """`--import`: each released checkpoint of the matrix into its run directory (skipped when there)."""
    from pretrain.convert.from_reference import import_reference

    p, m = _read(path)
    done = []
    for name, c in _checkpoints(p, m).items():
        if not c.get("release"):
            continue
        run = Path(c["path"])
        if (run / "checkpoints").is_dir():
            log(f"[setdlm eval matrix] {name}: already imported in {run}")
            continue
        overrides = _args(c.get("args"), f"checkpoints.{name}.args")
        try:
            import_reference(str(c["release"]), run, base_model=c.get("base_model"), overrides=overrides, log=log)
        except Error as e:
            raise EvalError(f"matrix: {p}: checkpoints.{name}: {as_matrix_keys(str(e))}") from None
        done.append(name)
    return done


def _metric(cell: dict):
    f = Path(cell["out"]) / "metrics.json"
    if not f.is_file():
        return None
    try:
        import json

        return (json.loads(f.read_text()).get("metrics") or {}).get(cell["paper"]["metric"])
    except (OSError, ValueError):
        return None


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_summary(path: str) -> Path:
    """`--summary`: OUT/summary.md, each row's metric beside the paper's number and where that is from."""
    from common.io import atomic_write_text

    cells = load_matrix(path)
    if not all("paper" in c for c in cells):
        raise EvalError(f"matrix: {path}: --summary needs a paper matrix (rows with the paper's numbers)")
    _, m = _read(path)
    lines = [f"# {Path(path).name}: our numbers beside the paper's", "",
             "| table | checkpoint | task | setting | metric | paper | ours | paper's number from |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        ours = _metric(c)
        lines.append(f"| {c['table']} | {c['checkpoint_name']} | {c['task']} | {c['setting']} | "
                     f"{c['paper']['metric']} | {_fmt(c['paper'].get('value'))} | {_fmt(ours) if ours is not None else 'not run'} | "
                     f"{c['paper']['source']} |")
    lines += ["", "`-` in the paper column: the number is not transcribed (see the source); `not run`: the cell has no "
              "metrics.json yet (`setdlm eval matrix M --index I`)."]
    out = Path(str(m.get("out", "results"))) / "summary.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, "\n".join(lines) + "\n")
    return out


def _check_imported(cell: dict) -> None:
    if cell.get("release") and not (Path(cell["checkpoint"]) / "checkpoints").is_dir():
        raise EvalError(f"matrix: cell {cell['index']}: the released checkpoint {cell['release']} is not imported yet "
                        f"({cell['checkpoint']}); run `setdlm eval matrix MATRIX --import` once before the array job")


def main(argv: list[str]) -> int:
    p = CLIParser(prog="setdlm eval matrix", description="Run one cell of an evaluation matrix.")
    p.add_argument("matrix", help="matrix YAML")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--count", action="store_true", help="print the number of cells")
    g.add_argument("--list", action="store_true", help="list the cells")
    g.add_argument("--index", type=int, help="cell to run (default: $SLURM_ARRAY_TASK_ID)")
    g.add_argument("--import", dest="do_import", action="store_true",
                   help="import the matrix's released checkpoints (once, before the array job)")
    g.add_argument("--summary", action="store_true",
                   help="a paper matrix: write OUT/summary.md (ours beside the paper's)")
    p.add_argument("--dry-run", action="store_true", help="print the cell's command instead of running it")
    args = p.parse_args(argv)
    if args.do_import:
        import_releases(args.matrix)
        return 0
    if args.summary:
        print(write_summary(args.matrix))
        return 0
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
    if not args.dry_run:
        _check_imported(cells[idx])
    if args.dry_run:
        print("setdlm eval " + shlex.join(argv))
        return 0
    print(f"[setdlm eval matrix] cell {idx}/{len(cells)}: setdlm eval {shlex.join(argv)}", file=sys.stderr, flush=True)
    api.run(argv[0], api.from_argv(argv[0], argv[1:]))
    return 0
