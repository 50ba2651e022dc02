"""Sharded, resumable evaluation runs: units of examples, what is already done, and the output directory.

An evaluation is a list of *units* (a unit is one batch: one or more examples evaluated together),
fixed by the task and its settings, never by the number of ranks. Unit ``u`` belongs to rank
``u % world`` (eval/shard.py). Each rank appends the records of every unit it finishes to its own
file (eval/records.py). A restarted job (with the same or another number of ranks) reads every
rank's file and skips the units whose records are all there. The merge (eval/merge.py) reads all
files, checks that every unit is complete and computes the final metrics from the records alone (no
model), so it can run anywhere: automatically on rank 0, or with ``setdlm eval merge OUT``.

Output directory::

    OUT/run.json                  task, settings (spec), checkpoint; a restart must match it
    OUT/units.json                the unit list (keys of the records each unit produces)
    OUT/records.rank00000.jsonl   append-only records of rank 0 (one JSON object per example)
    OUT/failed.rank00000.json     written when a rank fails (rank 0 stops waiting for the merge)
    OUT/examples.jsonl            merged records in unit order       (written by the merge)
    OUT/metrics.json              final metrics, spec and provenance  (written by the merge)
    OUT/summary.md                markdown summary                    (written by the merge)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common.errors import StorageError
from common.io import remove_temps

from .errors import EvalError
from .records import RecordReader, RecordWriter, read_json, write_json
from .shard import Shard

FORMAT = "setdlm-eval"
VERSION = 1


@dataclass
class Unit:
    index: int
    keys: list[str]  # record keys this unit produces, in order
    payload: object = None  # task data (examples, batch ids, ...)


def seed_for(base: int, *parts) -> int:
    """A 63-bit seed from a base seed and an example's identity (independent of ranks and batching)."""
    h = hashlib.sha256(("/".join(map(str, (base, *parts)))).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _spec_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _spec_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} (saved) vs {vb!r} (now)")
    return out


def provenance(shard: Shard) -> dict:
    import torch

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"host": socket.gethostname(), "device": dev, "torch": torch.__version__, "world": shard.world,
            "launcher": shard.launcher, "time": datetime.datetime.now().isoformat(timespec="seconds")}


def _read_saved(path: Path):
    """A JSON file an earlier attempt wrote into --out (EvalError naming it when it is damaged)."""
    try:
        return read_json(path)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise EvalError(f"--out: {path}: unreadable or truncated ({type(e).__name__}); use another --out "
                        "or --overwrite") from None


class EvalRun:
    """One output directory: settings check, unit scheduling, records, markers, merge."""

    def __init__(self, out: str | os.PathLike, task: str, spec: dict, shard: Shard, *, overwrite: bool = False,
                 log: Callable[[str], None] | None = None):
        self.out = Path(out)
        self.task, self.spec, self.shard = task, spec, shard
        self.log = log or (lambda msg: print(f"[eval {task} {shard.tag()}] {msg}", file=sys.stderr, flush=True))
        self.started = time.time()
        created = not self.out.exists()
        self.out.mkdir(parents=True, exist_ok=True)
        remove_temps(self.out)  # what killed writers left (a live writer's file stays: common/io.py)
        run_file = self.out / "run.json"
        if overwrite and shard.rank == 0:
            for p in list(self.out.glob("records.rank*.jsonl")) + list(self.out.glob("failed.rank*.json")) + [
                    self.out / n for n in ("run.json", "units.json", "metrics.json", "examples.jsonl", "summary.md")]:
                if p.exists():
                    p.unlink()
        want = {"format": FORMAT, "version": VERSION, "task": task, "spec": spec}
        if run_file.is_file():
            have = _read_saved(run_file)
            if not isinstance(have, dict) or have.get("format") != FORMAT:
                raise EvalError(f"--out: {self.out} holds a run.json that is not a setdlm eval run")
            cmp_have = {"task": have.get("task"), "spec": have.get("spec", {})}
            cmp_want = {"task": task, "spec": spec}
            diff = _spec_diff(json.loads(json.dumps(cmp_have, default=str)), json.loads(json.dumps(cmp_want, default=str)))
            if diff:
                raise EvalError(f"--out: {self.out} holds results of a different evaluation, which a restart would mix "
                                f"with these ({'; '.join(diff[:4])}); use another --out or --overwrite")
        else:
            try:
                write_json(run_file, {**want, "created": provenance(shard)})
            except StorageError:  # a full disk: the directory this run made goes again
                if created:
                    shutil.rmtree(self.out, ignore_errors=True)
                raise

    # -- units -------------------------------------------------------------------------------
    def set_units(self, units: list[Unit]) -> None:
        keys = [u.keys for u in units]
        flat = [k for ks in keys for k in ks]
        if len(set(flat)) != len(flat):
            raise EvalError(f"task {self.task}: duplicate example keys (e.g. ids repeated in the data)")
        path = self.out / "units.json"
        if path.is_file():
            have = _read_saved(path)
            if not isinstance(have, dict) or have.get("keys") != keys:
                raise EvalError(f"--out: {self.out}/units.json lists other examples than this run has (the data or "
                                f"settings changed since the first attempt); use another --out or --overwrite")
        else:
            write_json(path, {"n_units": len(units), "n_examples": len(flat), "keys": keys})
        self.units = units

    def execute(self, units: list[Unit], fn: Callable[[Unit], list[dict]], *,
                after_unit: Callable[[Unit, list[dict]], None] | None = None) -> dict:
        """Run `fn` on this rank's unfinished units; returns counts."""
        self.set_units(units)
        reader = RecordReader(self.out)
        done = reader.refresh()
        mine = [u for u in units if self.shard.owns(u.index)]
        todo = [u for u in mine if not all(k in done for k in u.keys)]
        self.log(f"{len(units)} units ({sum(len(u.keys) for u in units)} examples); this rank: {len(mine)} units, "
                 f"{len(mine) - len(todo)} already done, {len(todo)} to run")
        writer = RecordWriter(self.out, self.shard.rank)
        t0, last = time.time(), time.time()
        try:
            for i, unit in enumerate(todo):
                recs = fn(unit)
                got = [r.get("key") for r in recs]
                if got != unit.keys:
                    raise RuntimeError(f"task {self.task}: unit {unit.index} produced keys {got[:3]}..., "
                                       f"expected {unit.keys[:3]}...")
                for r in recs:
                    r.setdefault("unit", unit.index)
                writer.append(recs)
                if after_unit is not None:
                    after_unit(unit, recs)
                if time.time() - last > 30 or i + 1 == len(todo):
                    last = time.time()
                    self.log(f"{i + 1}/{len(todo)} units done ({time.time() - t0:.1f}s)")
        except BaseException as e:
            try:  # best effort: on a full disk the marker fails too, and the error to report is `e`
                write_json(self.out / f"failed.rank{self.shard.rank:05d}.json",
                           {"rank": self.shard.rank, "world": self.shard.world, "error": f"{type(e).__name__}: {e}",
                            "time": time.time()})
            except StorageError:
                pass
            raise
        finally:
            writer.close()
        stale = self.out / f"failed.rank{self.shard.rank:05d}.json"
        if stale.exists():
            stale.unlink()
        return {"units": len(mine), "ran": len(todo), "skipped": len(mine) - len(todo)}

    def complete(self, reader: RecordReader | None = None) -> tuple[bool, int]:
        reader = reader or RecordReader(self.out)
        recs = reader.refresh()
        missing = sum(1 for u in self.units for k in u.keys if k not in recs)
        return missing == 0, missing

    def wait_for_all(self, timeout_s: float = 0.0, poll_s: float = 5.0) -> bool:
        """Rank 0 under a launcher: wait until every unit has records; False if a rank failed."""
        reader = RecordReader(self.out)
        deadline = time.time() + timeout_s if timeout_s > 0 else None
        announced = False
        while True:
            ok, missing = self.complete(reader)
            if ok:
                return True
            for p in self.out.glob("failed.rank*.json"):
                try:
                    info = read_json(p)
                except (OSError, json.JSONDecodeError):
                    continue
                if info.get("time", 0) >= self.started - 5:
                    self.log(f"rank {info.get('rank')} failed ({info.get('error')}); not merging. Rerun the "
                             f"same command to finish the missing examples, then it merges")
                    return False
            if deadline is not None and time.time() > deadline:
                self.log(f"gave up waiting for {missing} examples of other ranks; run `setdlm eval merge {self.out}` "
                         f"once they are written")
                return False
            if not announced:
                self.log(f"waiting for other ranks ({missing} examples left) to merge")
                announced = True
            time.sleep(poll_s)


