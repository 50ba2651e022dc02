"""The failure notice board of a multi-rank job: who failed, why, with which exit status.

It lives in the job's TCPStore (the one the process group rendezvoused through, common/dist.py; or,
for evaluation, one made the same way) under ``setdlm/rf/<attempt>/``:

    notice         JSON {rank, status, reason, by}: the first failure of the job (compare-and-set:
                   later ones never replace it)
    seen           how many ranks have read the notice (the rank hosting the store waits for them
                   before it exits, so that they can still read it)
    proc/<r>       JSON {host, pidns, pid, start}: where rank r's process runs
    beat/<r>       rank r's heartbeat counter (+1 a second)
    left/<r>, left rank r finished normally (it is no longer watched); how many have

Exit statuses of a rank (and of `setdlm launch local`, and what the Slurm template acts on):

    0   success
    1   a bug: the failing rank prints its traceback; the others one line naming it
    2   USER_ERROR: a recipe, file or option to fix (one line); never requeued
    75  RANK_LOST (EX_TEMPFAIL): a rank or node was lost (killed, crashed, unreachable); requeued

A rank that leaves a status sets the file ``$SETDLM_STATUS_DIR/rank<r>.status`` (``STATUS MESSAGE``)
when that variable is set: torchrun reports 1 for any failed worker, so the Slurm template reads the
ranks' own statuses there.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

__all__ = ["USER_ERROR", "RANK_LOST", "BUG", "Board", "process_info", "process_alive", "write_status"]

BUG = 1
USER_ERROR = 2
RANK_LOST = 75


def write_status(rank: int | None, status: int, message: str) -> None:
    """``$SETDLM_STATUS_DIR/rank<r>.status`` = ``STATUS MESSAGE`` (nothing without the variable; rank
    None: this process's rank from the launcher variables)."""
    where = os.environ.get("SETDLM_STATUS_DIR")
    if not where:
        return
    if rank is None:
        from .env import env_rank

        rank = env_rank()
    try:
        Path(where).mkdir(parents=True, exist_ok=True)
        (Path(where) / f"rank{rank:05d}.status").write_text(f"{status} {message}\n")
    except OSError:
        pass  # the status file helps the batch script decide; the exit status stays the same


# -- processes on this host ------------------------------------------------------------------------
def _start_time(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):  # a zombie (exited, not yet reaped) or dead
        return None
    return fields[19]  # starttime: tells a reused pid apart


def process_info() -> dict:
    """This process: host, pid namespace, pid and start time (what `process_alive` compares)."""
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pidns = None
    return {"host": socket.gethostname(), "pidns": pidns, "pid": os.getpid(), "start": _start_time(os.getpid())}


def process_alive(info: dict, here: dict) -> bool | None:
    """Whether the process `info` describes still runs; None when it is not visible from here (another
    host or pid namespace, or no /proc): then only its heartbeat tells."""
    if (info.get("host"), info.get("pidns")) != (here.get("host"), here.get("pidns")) or info.get("start") is None:
        return None
    return _start_time(int(info["pid"])) == info["start"]


# -- the store ------------------------------------------------------------------------------------------
class Board:
    """The keys above in `store` (a torch.distributed Store). Methods raise the store's errors
    (DistError) when it cannot be reached; callers decide what that means."""

    def __init__(self, store, attempt: str = "0"):
        self.store = store
        self.prefix = f"setdlm/rf/{attempt}/"

    def _k(self, name: str) -> str:
        return self.prefix + name

    def _get(self, name: str) -> str | None:
        key = self._k(name)
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    # notice
    def publish(self, rank: int, status: int, reason: str, by: int) -> dict:
        """Post the job's failure notice unless one is there; returns the notice that holds."""
        mine = json.dumps({"rank": rank, "status": status, "reason": reason, "by": by, "time": time.time()})
        held = self.store.compare_set(self._k("notice"), "", mine)
        return json.loads(held.decode() if isinstance(held, bytes) else held)

    def notice(self) -> dict | None:
        text = self._get("notice")
        return json.loads(text) if text else None

    def ack(self) -> int:
        return self.store.add(self._k("seen"), 1)

    def acks(self) -> int:
        return self.store.add(self._k("seen"), 0)

    # processes and heartbeats
    def register(self, rank: int, info: dict) -> None:
        self.store.set(self._k(f"proc/{rank}"), json.dumps(info))

    def proc(self, rank: int) -> dict | None:
        text = self._get(f"proc/{rank}")
        return json.loads(text) if text else None

    def beat(self, rank: int, by: int = 1) -> int:
        return self.store.add(self._k(f"beat/{rank}"), by)

    # leaving
    def leave(self, rank: int) -> int:
        self.store.set(self._k(f"left/{rank}"), "1")
        return self.store.add(self._k("left"), 1)

    def has_left(self, rank: int) -> bool:
        return self.store.check([self._k(f"left/{rank}")])

    def left(self) -> int:
        return self.store.add(self._k("left"), 0)
