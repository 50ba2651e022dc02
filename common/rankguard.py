"""When one rank fails, every rank knows it, says one line naming that rank, and exits.

torch.distributed gives the pieces and this module joins them (docs/cluster.md, "When a rank fails"):

- the launcher stops the other processes when one exits (torchrun's elastic agent, `setdlm launch
  local`, ``srun --kill-on-bad-exit``), and no collective waits forever
  (``init_process_group(timeout=parallel.collective_timeout_s)``);
- the job's TCPStore carries a failure notice (common/rankfail.py): a rank that fails posts its rank,
  exit status and one-line reason before it exits;
- a watchdog thread in every rank beats a heartbeat, reads the notice, and watches the next rank
  that has not finished: on the same host its process (a ``kill -9`` is seen within a second), else its
  heartbeat (``parallel.heartbeat_timeout_s``). When the next rank is gone it posts the notice for it;
  when the store itself stops answering, its host (rank 0, or torchrun's agent) is gone.

`guard(prog)` wraps the distributed part of a command. An exception inside it is classified: a
consequence of another rank's failure (the collective that broke when that rank left) becomes one
line, ``PROG: error: rank R of N failed: REASON``, and the process exits at once with that failure's
status, without a traceback; this rank's own user error is posted, then reported as usual (exit
status 2); its own bug is posted and keeps its traceback (1); a broken collective nobody explains is
posted as this rank having lost contact (75). When the main thread does not come out by itself
(blocked in an NCCL collective; evaluation, which has no collectives, is woken by a SIGTERM), the
watchdog prints the line and ends the process `grace_s` seconds after the notice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback

from .cli import debug_enabled, is_user_error, one_line, report
from .rankfail import BUG, RANK_LOST, USER_ERROR, Board, process_alive, process_info, write_status

__all__ = ["Watchdog", "guard", "is_comm_error"]

EXIT_S = 5.0  # after its line, a rank has this long to exit by itself before the watchdog ends it

_COMM = ("gloo", "nccl", "connection closed", "connection reset", "broken pipe", "timed out", "socket", "c10d",
         "peer")


def is_comm_error(error: BaseException) -> bool:
    """An error of a collective or of the store (a peer gone, a timeout), not of this rank's own work."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _COMM)


def status_of(error: BaseException) -> int:
    """The exit status a rank that raised `error` leaves: 2 (or the error's own) for a user's mistake, 1 for a bug."""
    return int(getattr(error, "exit_status", USER_ERROR)) if is_user_error(error) else BUG


def _gone(info: dict) -> str:
    return f"its process (pid {info['pid']} on {info['host']}) ended without a word (killed, or crashed)"


def _ignore_sigterm() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class _Stopped(BaseException):
    """SIGTERM in a command without its own handler (evaluation): unwinds the main thread."""


class Watchdog(threading.Thread):
    """One rank's heartbeat, notice reader and neighbour watcher (see the module docstring)."""

    def __init__(self, prog: str, board: Board, rank: int, world: int, *, address: str, host_rank: int | None,
                 heartbeat_timeout_s: float = 60.0, interval_s: float = 1.0, grace_s: float = 5.0, on_notice=None):
        super().__init__(name="setdlm-rank-watchdog", daemon=True)
        self.prog, self.board, self.rank, self.world = prog, board, rank, world
        self.address, self.host_rank = address, host_rank  # host_rank: who hosts the store (None: torchrun's agent)
        self.heartbeat_timeout_s, self.interval_s, self.grace_s = heartbeat_timeout_s, interval_s, grace_s
        self.on_notice = on_notice  # called once in this thread when a failure becomes known
        self.here = process_info()
        self.procs: dict[int, dict] = {}
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (heartbeat count, when it last changed)
        self.gone: set[int] = set()  # ranks that finished normally
        self.known: dict | None = None  # the job's failure notice, once read
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._reported = False
        self._held = False  # hold_store ran
        self.board.register(rank, self.here)

    # -- reporting ------------------------------------------------------------------------------
    def line(self, notice: dict) -> str:
        r, by, why, status = notice["rank"], notice["by"], notice["reason"], notice["status"]
        requeue = f"; exit status {RANK_LOST} (the job may be requeued)"
        if r == self.rank and by == self.rank:
            return why + (requeue if status == RANK_LOST else "")
        if r == self.rank:
            return f"rank {by} found this rank unresponsive ({why}){requeue}"
        if status == RANK_LOST:
            return f"rank {r} of {self.world} was lost: {why}{requeue}"
        return f"rank {r} of {self.world} failed: {why}"

    def report_once(self, notice: dict) -> bool:
        """Print this rank's one line for `notice` unless it was printed; True when this call printed it."""
        with self._lock:
            if self._reported:
                return False
            self._reported = True
        report(self.prog, self.line(notice))
        write_status(self.rank, notice["status"], self.line(notice))
        return True

    def learn(self, notice: dict) -> None:
        """A failure is known: remember it, tell the board this rank has read it, stop watching."""
        with self._lock:
            if self.known is not None:
                return
            self.known = notice
        self._halt.set()
        with contextlib.suppress(Exception):
            self.board.ack()

    # -- the thread -------------------------------------------------------------------------------
    def run(self) -> None:
        try:
            while not self._halt.wait(self.interval_s):
                self.tick()
        except Exception:  # noqa: BLE001 - the watchdog must never print a traceback of its own
            return
        notice = self.known
        if notice is None or notice["rank"] == self.rank and notice["by"] == self.rank:
            return  # stopped normally, or this rank's own failure (the main thread reports it)
        if self.on_notice is not None:
            with contextlib.suppress(Exception):
                self.on_notice()
        end = time.monotonic() + self.grace_s
        while time.monotonic() < end and not self._reported:
            time.sleep(0.1)
        if not self.report_once(notice):  # reported by the main thread: it has a few seconds to exit
            time.sleep(EXIT_S)
        self.hold_store()
        for stream in (sys.stdout, sys.stderr):  # still here: blocked in a collective, or a hung exit
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(notice["status"])

    def tick(self) -> None:
        try:
            self.board.beat(self.rank)
            notice = self.board.notice()
            if notice is None:
                notice = self.watch_next()
        except Exception:  # noqa: BLE001 - the store does not answer
            if self._halt.is_set():
                return
            notice = self.store_lost()
        if notice is not None:
            self.learn(notice)

    def store_lost(self) -> dict:
        where = (f"the rendezvous store it hosted at {self.address} stopped answering" if self.host_rank is not None
                 else f"torchrun's agent store at {self.address} stopped answering (node 0 lost)")
        return {"rank": 0 if self.host_rank is None else self.host_rank, "status": RANK_LOST, "reason": where,
                "by": self.rank}

    def watch_next(self) -> dict | None:
        """Check the next rank (cyclically) that has not finished; post a notice when it is gone."""
        for step in range(1, self.world):
            r = (self.rank + step) % self.world
            if r in self.gone:
                continue
            if self.board.has_left(r):
                self.gone.add(r)
                continue
            return self._check(r)
        return None

    def _check(self, r: int) -> dict | None:
        info = self.procs.get(r) or self.board.proc(r)
        if info is None:
            return None  # not registered yet (still starting)
        self.procs[r] = info
        alive = process_alive(info, self.here)
        why = None
        if alive is False:
            why = _gone(info)
        elif alive is None and self.heartbeat_timeout_s > 0:
            count, now = self.board.beat(r, 0), time.monotonic()
            last = self.seen.get(r)
            if last is None or count != last[0]:
                self.seen[r] = (count, now)
            elif now - last[1] > self.heartbeat_timeout_s:
                why = f"no heartbeat from {info['host']} for {now - last[1]:.0f} s (its node was lost, or it hung)"
        if why is None or self.board.has_left(r):
            return None
        return self.board.publish(r, RANK_LOST, why, by=self.rank)

    # -- the main thread's side ---------------------------------------------------------------------
    def stop(self) -> None:
        """Stop watching; waits for the thread unless a failure is known (then it ends the process)."""
        self._halt.set()
        if self.known is None and self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=self.interval_s + 5)

    def explain(self, wait_s: float) -> dict | None:
        """The failure that explains a broken collective: the notice, a dead process on this host, or a
        notice that appears within `wait_s` seconds (a watcher on another host)."""
        end = time.monotonic() + wait_s
        while True:
            if self.known is not None:
                return self.known
            try:
                notice = self.board.notice()
                if notice is None:
                    notice = self._dead_here()
            except Exception:  # noqa: BLE001
                notice = self.store_lost()
            if notice is not None:
                self.learn(notice)
                return notice
            if time.monotonic() > end:
                return None
            time.sleep(0.2)

    def _dead_here(self) -> dict | None:
        for r in range(self.world):
            if r == self.rank or r in self.gone:
                continue
            info = self.procs.get(r) or self.board.proc(r)
            if info is not None:
                self.procs[r] = info
                if process_alive(info, self.here) is False and not self.board.has_left(r):
                    why = _gone(info)
                    return self.board.publish(r, RANK_LOST, why, by=self.rank)
        return None

    def post_own(self, status: int, reason: str) -> None:
        """Post this rank's own failure; the rank hosting the store then waits (a few seconds at most)
        until the others have read it, so that they can name it."""
        try:
            notice = self.board.publish(self.rank, status, reason, by=self.rank)
        except Exception:  # noqa: BLE001 - the store is gone: nobody to tell
            return
        self.learn(notice)
        self.hold_store()

    def hold_store(self) -> None:
        """On the rank hosting the store, before it exits after a failure: wait (a few seconds at most)
        until every other rank still there has read the notice, so that they can name the failed rank
        (not this one, whose store would be gone)."""
        notice = self.known
        if self.host_rank != self.rank or notice is None or self._held:
            return
        self._held = True
        dead = 1 if notice["status"] == RANK_LOST and notice["rank"] != notice["by"] else 0  # it cannot read
        end = time.monotonic() + max(5.0, 3 * self.interval_s)
        with contextlib.suppress(Exception):
            while self.board.acks() < self.world - self.board.left() - dead and time.monotonic() < end:
                time.sleep(0.05)

    def leave(self) -> None:
        """Normal end: stop watching and say so; the rank hosting the store waits for the others."""
        self.stop()
        with contextlib.suppress(Exception):
            self.board.leave(self.rank)
            if self.host_rank == self.rank:
                end = time.monotonic() + 30
                while self.board.left() < self.world and time.monotonic() < end:
                    time.sleep(0.1)

    def outcome(self, error: BaseException) -> tuple[int, bool] | None:
        """What becomes of `error` in the main thread: None to let it pass (SystemExit), else (exit status,
        own): `own` for this rank's own failure (posted; the caller reports it), otherwise this rank's
        line naming another rank's failure, or a broken collective nobody explains, is printed."""
        if isinstance(error, SystemExit) and self.known is None:
            return None
        if isinstance(error, KeyboardInterrupt):  # Ctrl-C reaches every rank: each says "interrupted"
            self.post_own(130, "interrupted")
            return 130, True
        stopped = isinstance(error, _Stopped)
        if not stopped and not is_comm_error(error):  # this rank's own error, unless another's came first
            notice = self.known
            if notice is None or notice["rank"] == self.rank:
                status = status_of(error)
                reason = one_line(error) if status != BUG else f"{type(error).__name__}: {one_line(error)}"
                self.post_own(status, reason)
                write_status(self.rank, status, reason)
                return status, True
        else:
            notice = self.explain(2 * self.interval_s if stopped else self.heartbeat_timeout_s + 2 * self.interval_s)
        if notice is None and stopped:
            notice = {"rank": self.rank, "status": 128 + signal.SIGTERM, "reason": "stopped by SIGTERM",
                      "by": self.rank}
        elif notice is None:
            reason = f"lost contact with the other ranks ({one_line(error)[:200]})"
            self.post_own(RANK_LOST, reason)
            notice = self.known or {"rank": self.rank, "status": RANK_LOST, "reason": reason, "by": self.rank}
        self.report_once(notice)
        return notice["status"], False


def _exit_now(status: int) -> None:
    """Leave at once after this rank's line: Python's exit handlers run, but not the interpreter's
    teardown, where a process group with a dead peer can hang for many seconds."""
    import atexit

    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


@contextlib.contextmanager
def guard(prog: str, job=None, *, rank: int | None = None, world: int | None = None,
          heartbeat_timeout_s: float = 60.0, grace_s: float = 5.0, stop_on_sigterm: bool = False):
    """Run the block under the rank-failure rules of the module docstring. `job` is a
    common.dist.JobStore (default: the one `init_process_group` made); nothing happens for one rank or
    without a store. `stop_on_sigterm`: a SIGTERM unwinds the main thread (commands without a
    preemption handler of their own), and the watchdog sends one when another rank fails."""
    from .dist import job_store

    job = job or job_store()
    if rank is None or world is None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    if job is None or not world or world <= 1:
        yield None
        return
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    unwinding = threading.Event()

    def wake() -> None:  # the watchdog learned of a failure: unwind the main thread (evaluation)
        if not unwinding.is_set():
            os.kill(os.getpid(), signal.SIGTERM)

    watch = Watchdog(prog, Board(job.store, attempt), rank, world, address=job.address,
                     host_rank=None if job.agent else 0, heartbeat_timeout_s=heartbeat_timeout_s, grace_s=grace_s,
                     on_notice=wake if stop_on_sigterm else None)
    previous = None
    if stop_on_sigterm and threading.current_thread() is threading.main_thread():
        def _raise(signum, frame):
            if not unwinding.is_set():
                unwinding.set()
                raise _Stopped()

        previous = signal.signal(signal.SIGTERM, _raise)
    watch.start()
    try:
        yield watch
    except BaseException as error:  # classified, then re-raised or ended with one line
        unwinding.set()
        if isinstance(error, SystemExit) and not error.code and watch.known is None:
            watch.leave()  # sys.exit(0) inside the block: a normal end
            raise
        verdict = watch.outcome(error)
        watch.stop()
        if verdict is None or verdict[1] and debug_enabled():  # SETDLM_DEBUG: this rank's own error as usual
            raise
        status, own = verdict
        if own:  # reported here: the exit must not wait for the interpreter's teardown (see _exit_now)
            if isinstance(error, KeyboardInterrupt):
                report(prog, "interrupted")
            elif status == BUG:
                traceback.print_exception(error)
            else:
                report(prog, error)
        _ignore_sigterm()  # the launcher's SIGTERM (it saw the failed rank too) must not replace this status
        watch.hold_store()
        _exit_now(status)
    else:
        unwinding.set()
        watch.leave()
    finally:
        if previous is not None and signal.getsignal(signal.SIGTERM) is _raise:  # not when now ignored
            signal.signal(signal.SIGTERM, previous)
