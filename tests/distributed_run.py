"""Run a test's function on N local processes, as torchrun would start them (the tests' multi-process helper).

    ranks = run_distributed(train_layouts, 2, out, ["tp2pp1z0"], timeout=900)
    ranks.results[0]   # what rank 0's call returned;  ranks.logs[1]: everything rank 1 printed

`func` is a module-level function of a test module (the ranks import it by name). Each rank is a fresh
interpreter (torch.multiprocessing, start method "spawn": nothing of the test process's state, its
process group included, leaks in) with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set as torchrun sets them, OMP_NUM_THREADS=1 and no visible CUDA device, plus `env`. The
function creates its process group the way the code under test does (common/dist.py reads those
variables: gloo on the CPU); the helper tears it down after the call.

A rank that raises or dies fails the call with a `RankFailed` holding that rank's traceback and the end
of its output; the other ranks are stopped (they would wait in a collective). A call still running
after `timeout` seconds stops every rank and raises `RankTimeout` naming the ranks still running, so a
hung rank fails its test instead of hanging the suite. Return values travel through `torch.save` and
come back with `torch.load(weights_only=True)`: tensors, numbers, strings, None, and lists, tuples and
dicts of them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_distributed", "Ranks", "RankFailed", "RankTimeout"]

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
TAIL = 4000  # characters of a rank's output quoted in a failure


class RankFailed(AssertionError):
    """A rank raised an exception or exited with a non-zero status (or a signal)."""


class RankTimeout(RankFailed):
    """Some rank was still running when the call's time limit ran out."""


@dataclass
class Ranks:
    results: list[Any]  # per rank: what `func` returned
    logs: list[str]  # per rank: its stdout and stderr


def run_distributed(func: Callable, world_size: int, *args, timeout: float = 600, env: dict | None = None,
                    **kwargs) -> Ranks:
    """Call `func(*args, **kwargs)` on `world_size` new local processes; see the module docstring."""
    import torch
    import torch.multiprocessing as mp

    from common.env import find_free_port

    work = Path(tempfile.mkdtemp(prefix="distributed_run_"))
    port = find_free_port("127.0.0.1")
    spawn_env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    with _environ(spawn_env, drop=LAUNCHER_VARS):  # what the interpreters start with (glibc, OpenMP read it then)
        ctx = mp.start_processes(_rank_main, args=(world_size, port, str(work), func, args, kwargs),
                                 nprocs=world_size, join=False, start_method="spawn")
    try:
        failed = _join(ctx.processes, timeout)
        logs = [_read(work / f"rank{r}.log") for r in range(world_size)]
        if failed is None:
            running = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
            raise RankTimeout(f"rank{'s' if len(running) > 1 else ''} {', '.join(map(str, running))} of "
                              f"{world_size} still running after {timeout:.0f}s (stopped)"
                              + "".join(_tail(r, logs[r]) for r in running))
        if failed:
            raise RankFailed(_failure(work, failed, logs))
        results = [torch.load(work / f"rank{r}.pt", weights_only=True)["result"] for r in range(world_size)]
        return Ranks(results=results, logs=logs)
    finally:
        _stop(ctx.processes)
        shutil.rmtree(work, ignore_errors=True)


def _rank_main(rank: int, world_size: int, port: int, work: str, func: Callable, args: tuple, kwargs: dict) -> None:
    """One rank: torchrun's variables, output to its log file, the call, its result (or error) to a file."""
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    log = open(Path(work) / f"rank{rank}.log", "w", buffering=1)
    for fd in (1, 2):
        os.dup2(log.fileno(), fd)
    try:
        result = func(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - recorded, then re-raised: the rank fails
        # when and why, in plain text: the rank that failed first is the cause, the others followed it
        (Path(work) / f"rank{rank}.error").write_text(f"{time.time()}\n{traceback.format_exc()}")
        if isinstance(e, SystemExit):  # even SystemExit(0): the call did not return
            raise RuntimeError(f"rank {rank}: SystemExit({e.code!r})") from e
        raise
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    torch.save({"result": result}, Path(work) / f"rank{rank}.pt")


def _join(processes, timeout: float, grace: float = 10.0) -> dict[int, tuple[int, float]] | None:
    """Wait for every rank. Returns {} when all exited with status 0; else {rank: (exit code, when)} of
    those that failed (after the first failure the others get `grace` seconds to fail or finish by
    themselves); None at the timeout."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout
    waiting = {p.sentinel: r for r, p in enumerate(processes)}
    failed: dict[int, tuple[int, float]] = {}
    first = 0.0  # when the first failure was seen
    while waiting:
        end = min(deadline, first + grace) if failed else deadline
        ready = wait(list(waiting), timeout=max(0.0, end - time.monotonic()))
        if not ready:
            return failed or None
        for sentinel in ready:
            r = waiting.pop(sentinel)
            processes[r].join()
            if processes[r].exitcode != 0:
                if not failed:
                    first = time.monotonic()
                failed[r] = (processes[r].exitcode, time.time())
    return failed


def _failure(work: Path, failed: dict[int, tuple[int, float]], logs: list[str]) -> str:
    """The rank that failed first (its traceback or exit status, and its output), then one line per rank
    that failed after it."""
    why, when = {}, {}
    for r, (code, noticed) in failed.items():
        text = _read(work / f"rank{r}.error")
        stamp, _, trace = text.partition("\n")
        if trace:
            why[r], when[r] = trace.strip(), float(stamp)
        else:  # os._exit, a signal: nothing recorded
            why[r], when[r] = (f"terminated by signal {signal.Signals(-code).name}" if code < 0
                               else f"exited with status {code}"), noticed
    order = sorted(failed, key=when.get)
    msg = f"rank {order[0]} of {len(logs)} failed" + (" first" if len(order) > 1 else "") + f": {why[order[0]]}"
    msg += _tail(order[0], logs[order[0]])
    for r in order[1:]:
        msg += f"\n--- then rank {r} failed: {why[r].splitlines()[-1]}"
    return msg


def _tail(rank: int, text: str) -> str:
    return f"\n--- rank {rank} output (last {TAIL} characters) ---\n{text[-TAIL:]}" if text.strip() else ""


def _stop(processes, grace: float = 10.0) -> None:
    """SIGTERM every live rank, then SIGKILL what is still alive after `grace` seconds."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    end = time.monotonic() + grace
    for p in alive:
        p.join(max(0.0, end - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


@contextlib.contextmanager
def _environ(values: dict, drop: tuple = ()):
    """os.environ with `values` set and `drop` removed, restored afterwards."""
    saved = dict(os.environ)
    for key in drop:
        os.environ.pop(key, None)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
