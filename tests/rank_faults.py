"""A fault in one rank of a local multi-process job, and what the other ranks did about it.

    out = run_with_rank_fault(["-m", "launch.cli", "pretrain", "--config", R], 4, log_dir=tmp / "logs",
                              kill_rank=2, when=lambda: step_logged(run, 5))
    out.statuses        # exit status per rank, e.g. [75, 75, 137, 75]
    out.exit_s          # per rank: seconds from the fault to its exit (the killed rank: 0)
    out.error_lines     # per rank: its lines holding "error:"
    out.tracebacks      # ranks whose output holds a Python traceback

The job runs under the real `setdlm launch local -n N` (launch/runner.py) with one log file per rank.
With `kill_rank`, that rank's process gets SIGKILL as soon as `when()` holds (polled every 20 ms);
without it the fault is already planted (a damaged file) and the fault's time is the first rank's
exit. The tests of tests/test_rank_failures.py, the fault matrix's multi-rank rows and
benchmarks/bench_rank_faults.py all go through this function.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

__all__ = ["Outcome", "checkpoint_intact", "records_written", "run_with_rank_fault", "saving", "step_logged"]


@dataclass
class Outcome:
    statuses: list[int]
    exit_s: list[float | None]  # seconds from the fault to each rank's exit (None: it never exited)
    logs: list[str]
    runner_err: str
    triggered: bool = False  # the kill was sent (False: `when` never held, or the job ended first)
    error_lines: list[list[str]] = field(default_factory=list)
    tracebacks: list[int] = field(default_factory=list)

    def survivors(self, faulty: int) -> list[int]:
        return [r for r in range(len(self.statuses)) if r != faulty]


def _env(extra: dict | None) -> dict:
    env = dict(os.environ)
    path = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=path)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
              "SETDLM_DEBUG"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _rank_of(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def run_with_rank_fault(cmd: list[str], nproc: int, *, log_dir: Path, kill_rank: int | None = None,
                        when: Callable[[], bool] | None = None, timeout: float = 600, grace: float = 30,
                        env: dict | None = None) -> Outcome:
    """Run `cmd` (arguments of `setdlm launch local -n N --`) on `nproc` ranks; see the module docstring."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "launch.cli", "launch", "local", "-n", str(nproc), "--log-dir", str(log_dir),
            "--timeout", str(timeout), "--grace", str(grace), "--", *cmd]
    rc, ended, fault_at, triggered = watch_job(argv, nproc, log=log_dir / "runner.err", kill_rank=kill_rank,
                                               when=when, timeout=timeout + grace + 60, env=env)
    runner_err = (log_dir / "runner.err").read_text(errors="replace")
    m = re.search(r"exit statuses per rank: \[([\d, ]*)\]", runner_err)
    statuses = [int(x) for x in m.group(1).split(",")] if m else [rc] * nproc
    logs = [_read(log_dir / f"rank{r}.log") for r in range(nproc)]
    return Outcome(statuses=statuses, exit_s=[max(0.0, ended[r] - fault_at) for r in range(nproc)], logs=logs,
                   runner_err=runner_err, triggered=triggered,
                   error_lines=[[x for x in log.splitlines() if "error:" in x] for log in logs],
                   tracebacks=[r for r, log in enumerate(logs) if "Traceback (most recent call last)" in log])


def watch_job(argv: list[str], nproc: int, *, log: Path, kill_rank: int | None = None,
              when: Callable[[], bool] | None = None, timeout: float = 600, env: dict | None = None):
    """Run `argv` (a launcher: `setdlm launch local`, torchrun, a batch script) with its output in `log`;
    its ranks are the processes below it with RANK set. Returns (its exit status, when each rank ended,
    when the fault happened (a kill, else the first rank's end), whether the kill was sent); times
    are time.monotonic()."""
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=_env(env), stdout=out, stderr=subprocess.STDOUT)
        pids: dict[int, int] = {}  # rank -> pid
        ended: dict[int, float] = {}  # rank -> when its process ended
        fault_at, triggered = None, False
        try:
            while proc.poll() is None:
                if len(pids) < nproc:
                    pids = _ranks_below(proc.pid, pids)
                now = time.monotonic()
                for rank, pid in pids.items():
                    if rank not in ended and not _running(pid):
                        ended[rank] = now
                if kill_rank is not None and not triggered and kill_rank in pids and kill_rank not in ended \
                        and when is not None and when():
                    os.kill(pids[kill_rank], signal.SIGKILL)
                    fault_at, triggered = time.monotonic(), True
                if now - t0 > timeout:
                    raise TimeoutError(f"{argv[:4]}... did not exit after {timeout:.0f}s")
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    now = time.monotonic()
    for rank in range(nproc):
        ended.setdefault(rank, now)  # ended between the last poll and the launcher's exit
    return proc.returncode, ended, fault_at if fault_at is not None else min(ended.values()), triggered


def _ranks_below(root: int, known: dict[int, int]) -> dict[int, int]:
    """rank -> pid of the highest process below `root` with RANK in its environment."""
    found = dict(known)
    todo = _children(root)
    while todo:
        pid = todo.pop(0)
        rank = _rank_of(pid)
        if rank is not None:
            found.setdefault(rank, pid)
        else:
            todo += _children(pid)
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


# -- triggers --------------------------------------------------------------------------------------
def step_logged(run: Path, step: int) -> bool:
    """metrics.jsonl of run directory `run` has a row for `step` (or later)."""
    import json

    path = Path(run) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return False
    for line in reversed(lines):
        try:
            if json.loads(line)["step"] >= step:
                return True
        except (ValueError, KeyError):
            continue
    return False


def saving(run: Path, after_step: int = 0, since: float = 0.0) -> bool:
    """A save of a step after `after_step` is being written (its .tmp-step_* folder exists, made after
    time `since`: not one a killed run left behind)."""
    root = Path(run) / "checkpoints"
    try:
        return any(int(p.name.rsplit("_", 1)[1]) > after_step and p.stat().st_mtime >= since
                   for p in root.glob(".tmp-step_*"))
    except (OSError, ValueError):
        return False


def records_written(out: Path, rank: int, n: int = 1) -> bool:
    """Evaluation rank `rank` has appended at least `n` records to its file in `out`."""
    try:
        return (Path(out) / f"records.rank{rank:05d}.jsonl").read_bytes().count(b"\n") >= n
    except OSError:
        return False


# -- what a fault must leave alone -------------------------------------------------------------------
def checkpoint_intact(ckpt: Path, world: int) -> list[str]:
    """What is wrong with checkpoint folder `ckpt` of a `world`-rank run (empty: complete and undamaged):
    its COMPLETE marker and meta.json, every rank's extra file, the DCP index and every data file it
    names (whole, and every tensor readable), and every .pt file a zip archive whose members all pass
    their CRC check."""
    from pretrain.checkpoint import distcp, rundir
    from pretrain.safe_load import CheckpointError

    ckpt = Path(ckpt)
    problems = []
    if not rundir.is_complete(ckpt):
        problems.append(f"{ckpt}: not complete")
    for r in range(world):
        if not rundir.extra_file(ckpt, r).is_file():
            problems.append(f"{rundir.extra_file(ckpt, r)}: missing")
    try:
        distcp.whole_state(ckpt, optimizer=True)  # the index, every rank's data file, every tensor read
    except CheckpointError as e:
        problems.append(str(e))
    for f in sorted(ckpt.glob("*.pt")):
        try:
            with zipfile.ZipFile(f) as z:
                bad = z.testzip()
            if bad is not None:
                problems.append(f"{f}: member {bad} fails its CRC")
        except (OSError, zipfile.BadZipFile) as e:
            problems.append(f"{f}: {e}")
    return problems
