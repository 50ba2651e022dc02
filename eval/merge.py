"""The merge: final metrics of an output directory from its records alone (no model), written to
examples.jsonl, metrics.json and summary.md; on rank 0 at the end of a run, or `setdlm eval merge`."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from common.storage import check_output_dir

from .errors import EvalError, IncompleteError
from .overlong import scored
from .records import RecordReader, atomic_write, json_default, read_json, write_json
from .report import summary_markdown
from .tasks import get_task


def _read_checked(path: Path, need: dict[str, type], what: str) -> dict:
    """A JSON object with keys `need` of the given types; EvalError naming the file otherwise."""
    try:
        obj = read_json(path)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise EvalError(f"merge: {path}: unreadable or truncated ({type(e).__name__}); {what}") from None
    bad = [k for k, t in need.items() if not isinstance(obj, dict) or not isinstance(obj.get(k), t)]
    if bad:
        raise EvalError(f"merge: {path}: not a setdlm evaluation file (needs " + ", ".join(
            f"`{k}` ({need[k].__name__})" for k in bad) + f"); {what}")
    return obj


REDO = "rerun the evaluation command into a new --out"


def read_run(out: Path) -> dict:
    """run.json of output directory `out`, checked (task, spec)."""
    out = Path(out)
    if not (out / "run.json").is_file():
        raise EvalError(f"merge: {out} is not an evaluation output directory (no run.json)")
    run = _read_checked(out / "run.json", {"task": str, "spec": dict}, REDO)
    get_task(run["task"])  # an unknown task: named
    return run


def load_records(out: Path) -> tuple[dict, list[list[str]], dict[str, dict]]:
    out = Path(out)
    run = read_run(out)
    redo = REDO
    if not (out / "units.json").is_file():
        raise IncompleteError(f"merge: {out} has no units.json yet (no rank has started)")
    keys = _read_checked(out / "units.json", {"keys": list}, redo)["keys"]
    if not all(isinstance(ks, list) and all(isinstance(k, str) for k in ks) for ks in keys):
        raise EvalError(f"merge: {out / 'units.json'}: `keys` must be lists of example keys; {redo}")
    return run, keys, RecordReader(out).refresh()


def merge(out: str | os.PathLike, *, allow_partial: bool = False, log=None) -> dict:
    """Compute the final metrics of an output directory from its records; writes examples.jsonl,
    metrics.json and summary.md. Raises IncompleteError when examples are missing (unless allowed)."""
    out = Path(out)
    check_output_dir(out, "merge")  # its outputs go next to the records
    run, unit_keys, recs = load_records(out)
    task = get_task(run["task"])
    expected = [k for ks in unit_keys for k in ks]
    missing = [k for k in expected if k not in recs]
    if missing and not allow_partial:
        raise IncompleteError(f"merge: {len(missing)} of {len(expected)} examples have no records yet in {out} "
                              f"(first missing: {missing[:3]}); finish them by rerunning the evaluation command, "
                              f"or merge anyway with --allow-partial")
    ordered = [recs[k] for k in expected if k in recs]
    metrics = task.aggregate(ordered, run["spec"], out=out)
    metrics.setdefault("examples", len(ordered))
    if missing:
        metrics["partial"] = True
        metrics["missing_examples"] = len(missing)
    # one row per example that ran, in every task, backend and prompt format (docs/eval.md)
    atomic_write(out / "examples.jsonl", "".join(json.dumps(r, default=json_default) + "\n" for r in scored(ordered)))
    created = run.get("created", {})
    doc = {"task": run["task"], "metrics": metrics, "spec": run["spec"], "created": created,
           "merged": datetime.datetime.now().isoformat(timespec="seconds")}
    write_json(out / "metrics.json", doc)
    atomic_write(out / "summary.md", summary_markdown(run["task"], metrics, run["spec"], created, task))
    if log:
        log(f"merged {len(ordered)} examples -> {out / 'metrics.json'}")
    return metrics
