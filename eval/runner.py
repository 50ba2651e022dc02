"""Sharded, resumable evaluation runs: who does which example, what is already done, and the merge.

An evaluation is a list of *units* (a unit is one batch: one or more examples evaluated together),
fixed by the task and its settings, never by the number of ranks. Unit ``u`` belongs to rank
``u % world``. Each rank appends the records of every unit it finishes to its own JSONL file, in one
write that is flushed and fsynced, so a killed job loses at most the unit in flight. A restarted job
(with the same or another number of ranks) reads every rank's file and skips the units whose records
are all there. The merge reads all files, checks that every unit is complete and computes the final
metrics from the records alone (no model), so it can run anywhere: automatically on rank 0, or with
``setdlm eval merge OUT``.

Output directory::

    OUT/run.json                  task, settings (spec), checkpoint; a restart must match it
    OUT/units.json                the unit list (keys of the records each unit produces)
    OUT/records.rank00000.jsonl   append-only records of rank 0 (one JSON object per example)
    OUT/failed.rank00000.json     written when a rank fails (rank 0 stops waiting for the merge)
    OUT/examples.jsonl            merged records in unit order       (written by the merge)
    OUT/metrics.json              final metrics, spec and provenance  (written by the merge)
    OUT/summary.md                markdown summary                    (written by the merge)

Coordination is through the file system only (shared across nodes on a cluster): ranks never talk
to each other, so a slow rank cannot time out a collective and independent jobs (a Slurm array over
shards) can fill one output directory.
"""

from __future__ import annotations

from common.errors import Error

import datetime
import hashlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common.io import atomic_write_text

FORMAT = "setdlm-eval"
VERSION = 1


class EvalError(Error):
    """Bad input or an inconsistent output directory; the message says what to change."""


class IncompleteError(EvalError):
    """The merge found units without records (ranks still running, or failed)."""


# ------------------------------------------------------------------------------------------ ranks
@dataclass
class Shard:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    launcher: str = "single"  # single | torchrun | slurm | mpi | explicit

    @property
    def explicit(self) -> bool:
        return self.launcher == "explicit"

    def owns(self, unit_index: int) -> bool:
        return unit_index % self.world == self.rank

    def tag(self) -> str:
        return f"rank {self.rank}/{self.world}"


def detect_shard(shard: str | None = None) -> Shard:
    """This process's share. ``shard="I/N"`` (e.g. from a Slurm array) wins; otherwise the launcher
    environment (torchrun, srun, mpirun) is read with `common.env.detect_env`."""
    if shard:
        try:
            i, n = (int(x) for x in str(shard).split("/"))
        except ValueError:
            raise EvalError(f"--shard: expected I/N (e.g. 0/4), got {shard!r}") from None
        if n < 1 or not 0 <= i < n:
            raise EvalError(f"--shard: need 0 <= I < N, got {shard!r}")
        return Shard(i, n, 0, "explicit")
    from common.env import detect_env  # not launch/: eval sits below it

    try:
        env = detect_env(use_mpi4py=False)
    except ValueError as e:
        raise EvalError(str(e)) from None
    return Shard(env.rank, env.world_size, env.local_rank, env.launcher)


def isolate_process_group() -> None:
    """Give this process its own single-rank torch.distributed group (megatron-core needs one).

    Evaluation ranks are independent: they coordinate through files, never through collectives, so
    a rank that finishes early cannot time out waiting for a slow one. A file:// rendezvous needs no
    port (many ranks on one node cannot collide)."""
    import tempfile

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    fd, path = tempfile.mkstemp(prefix="setdlm-eval-pg-")
    os.close(fd)
    os.unlink(path)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        os.environ.pop(k, None)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, init_method=f"file://{path}", rank=0, world_size=1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")


# ------------------------------------------------------------------------------------------ units
@dataclass
class Unit:
    index: int
    keys: list[str]  # record keys this unit produces, in order
    payload: object = None  # task data (examples, batch ids, ...)


def seed_for(base: int, *parts) -> int:
    """A 63-bit seed from a base seed and an example's identity (independent of ranks and batching)."""
    h = hashlib.sha256(("/".join(map(str, (base, *parts)))).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


# ------------------------------------------------------------------------------------------ files
def atomic_write(path: Path, text: str) -> None:
    atomic_write_text(path, text)  # common/io.py: temp file, fsync, rename, fsync of the directory


def write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n")


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def records_path(out: Path, rank: int) -> Path:
    return Path(out) / f"records.rank{rank:05d}.jsonl"


class RecordReader:
    """Reads every rank's records file incrementally (only complete lines; a line cut by a kill is
    ignored until it is completed or truncated by its owner)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.offsets: dict[Path, int] = {}
        self.records: dict[str, dict] = {}

    def refresh(self) -> dict[str, dict]:
        for path in sorted(self.out.glob("records.rank*.jsonl")):
            start = self.offsets.get(path, 0)
            size = path.stat().st_size
            if size < start:  # truncated by its owner after a kill: read again
                start = 0
            if size == start:
                continue
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(size - start)
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn line followed by later writes (kill, then an older writer)
                key = rec.get("key")
                if key is not None and key not in self.records:
                    self.records[key] = rec
            self.offsets[path] = start + end
        return self.records


class RecordWriter:
    """Append-only records file of one rank; cuts a torn last line left by a kill before appending."""

    def __init__(self, out: Path, rank: int):
        self.path = records_path(out, rank)
        if self.path.exists():
            data = self.path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end != len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(end)
        self.f = open(self.path, "a")

    def append(self, records: list[dict]) -> None:
        self.f.write("".join(json.dumps(r, default=_json_default) + "\n" for r in records))
        self.f.flush()
        os.fsync(self.f.fileno())

    def close(self) -> None:
        self.f.close()


def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    return str(o)


# ------------------------------------------------------------------------------------------ the run
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


class EvalRun:
    """One output directory: settings check, unit scheduling, records, markers, merge."""

    def __init__(self, out: str | os.PathLike, task: str, spec: dict, shard: Shard, *, overwrite: bool = False,
                 log: Callable[[str], None] | None = None):
        self.out = Path(out)
        self.task, self.spec, self.shard = task, spec, shard
        self.log = log or (lambda msg: print(f"[eval {task} {shard.tag()}] {msg}", file=sys.stderr, flush=True))
        self.started = time.time()
        self.out.mkdir(parents=True, exist_ok=True)
        run_file = self.out / "run.json"
        if overwrite and shard.rank == 0:
            for p in list(self.out.glob("records.rank*.jsonl")) + list(self.out.glob("failed.rank*.json")) + [
                    self.out / n for n in ("run.json", "units.json", "metrics.json", "examples.jsonl", "summary.md")]:
                if p.exists():
                    p.unlink()
        want = {"format": FORMAT, "version": VERSION, "task": task, "spec": spec}
        if run_file.is_file():
            have = read_json(run_file)
            if have.get("format") != FORMAT:
                raise EvalError(f"--out: {self.out} holds a run.json that is not a setdlm eval run")
            cmp_have = {"task": have.get("task"), "spec": have.get("spec", {})}
            cmp_want = {"task": task, "spec": spec}
            diff = _spec_diff(json.loads(json.dumps(cmp_have, default=str)), json.loads(json.dumps(cmp_want, default=str)))
            if diff:
                raise EvalError(f"--out: {self.out} holds results of a different evaluation, which a restart would mix "
                                f"with these ({'; '.join(diff[:4])}); use another --out or --overwrite")
        else:
            write_json(run_file, {**want, "created": provenance(shard)})

    # -- units -------------------------------------------------------------------------------
    def set_units(self, units: list[Unit]) -> None:
        keys = [u.keys for u in units]
        flat = [k for ks in keys for k in ks]
        if len(set(flat)) != len(flat):
            raise EvalError(f"task {self.task}: duplicate example keys (e.g. ids repeated in the data)")
        path = self.out / "units.json"
        if path.is_file():
            have = read_json(path)
            if have.get("keys") != keys:
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
            write_json(self.out / f"failed.rank{self.shard.rank:05d}.json",
                       {"rank": self.shard.rank, "world": self.shard.world, "error": f"{type(e).__name__}: {e}",
                        "time": time.time()})
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


# ------------------------------------------------------------------------------------------ merge
def load_records(out: Path) -> tuple[dict, list[list[str]], dict[str, dict]]:
    out = Path(out)
    if not (out / "run.json").is_file():
        raise EvalError(f"merge: {out} is not an evaluation output directory (no run.json)")
    run = read_json(out / "run.json")
    if not (out / "units.json").is_file():
        raise IncompleteError(f"merge: {out} has no units.json yet (no rank has started)")
    keys = read_json(out / "units.json")["keys"]
    return run, keys, RecordReader(out).refresh()


def merge(out: str | os.PathLike, *, allow_partial: bool = False, log=None) -> dict:
    """Compute the final metrics of an output directory from its records; writes examples.jsonl,
    metrics.json and summary.md. Raises IncompleteError when examples are missing (unless allowed)."""
    from .tasks import get_task

    out = Path(out)
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
    atomic_write(out / "examples.jsonl", "".join(json.dumps(r, default=_json_default) + "\n" for r in ordered))
    created = run.get("created", {})
    doc = {"task": run["task"], "metrics": metrics, "spec": run["spec"], "created": created,
           "merged": datetime.datetime.now().isoformat(timespec="seconds")}
    write_json(out / "metrics.json", doc)
    from .report import summary_markdown

    atomic_write(out / "summary.md", summary_markdown(run["task"], metrics, run["spec"], created, task))
    if log:
        log(f"merged {len(ordered)} examples -> {out / 'metrics.json'}")
    return metrics
