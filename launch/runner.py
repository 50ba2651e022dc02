"""Local multi-process runner: ``setdlm launch local -n N -- CMD ...``.

(``setdlm launch slurm`` and ``setdlm launch mpirun`` print the path and usage of the batch templates
in ``launch/templates/``.)

Starts N copies of a command on this machine with the torchrun-style environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so that
``common.dist.init_process_group`` builds a gloo (CPU) or NCCL (one GPU per process) group. It is a
small, dependency-free stand-in for ``torchrun --standalone`` used by tests and laptops:

- ``CMD`` ending in ``.py`` runs under the current interpreter; ``-m module`` too;
- the first process that fails stops the others, as torchrun's elastic agent does (one line naming
  it, then SIGTERM, then SIGKILL after ``--grace``); the ranks themselves tell each other first
  (common/rankguard.py), so each survivor says which rank failed and why;
- SIGINT / SIGTERM / SIGUSR1 sent to the runner are forwarded to every process (preemption
  tests and Ctrl-C); processes die with the runner (``PR_SET_PDEATHSIG``);
- ``--log-dir`` writes ``rank{r}.log`` per process instead of sharing the terminal;
- exit status: 0 when all succeed, else the first status a rank chose itself (a user error's 2, or
  75 from the survivors of a killed rank: common/rankfail.py), else 128+signal of the first rank
  killed by one; 124 on ``--timeout``.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from common.cli import ArgumentParser as CLIParser
from common.cli import run_command
from common.env import find_free_port
from common.errors import UsageError

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def build_command(cmd: Sequence[str]) -> list[str]:
    cmd = list(cmd)
    if not cmd:
        raise UsageError("no command given: use `setdlm launch local -n N -- CMD [ARGS...]`")
    if cmd[0] == "-m" or cmd[0].endswith(".py"):
        return [sys.executable, *cmd]
    return cmd


def rank_env(rank: int, nproc: int, master_addr: str, master_port: int,
             base: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(
        RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0", MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
    )
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N processes share the cores
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # as torchrun: NCCL aborts on a failed peer
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _exit_status(rc: int) -> int:
    return 128 - rc if rc < 0 else rc


def describe_status(status: int) -> str:
    """`exited with status 2`, `was killed by SIGKILL`."""
    if status > 128:
        try:
            return f"was killed by {signal.Signals(status - 128).name}"
        except ValueError:
            pass
    return f"exited with status {status}"


def run_local(
    cmd: Sequence[str],
    nproc: int,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    env: Mapping[str, str] | None = None,
    log_dir: str | os.PathLike | None = None,
    timeout: float | None = None,
    grace: float = 30.0,
    forward_signals: bool = True,
) -> list[int]:
    """Run ``nproc`` copies of ``cmd``; returns each process's exit status (signal n -> 128+n,
    never started or killed on timeout -> 124)."""
    if nproc < 1:
        raise UsageError(f"nproc must be >= 1, got {nproc}")
    argv = build_command(cmd)
    port = master_port or find_free_port(master_addr)
    logs = []
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    previous = {}

    def forward(signum, frame):  # noqa: ARG001
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass

    if forward_signals:
        try:
            for sig in FORWARDED:
                previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: no forwarding
            previous.clear()
    try:
        for rank in range(nproc):
            out = None
            if log_dir is not None:
                out = open(Path(log_dir) / f"rank{rank}.log", "w")  # noqa: SIM115
                logs.append(out)
            procs.append(subprocess.Popen(
                argv, env=rank_env(rank, nproc, master_addr, port, env),
                stdout=out, stderr=subprocess.STDOUT if out else None,
                preexec_fn=_die_with_parent,
            ))
        return _wait(procs, timeout, grace)
    finally:
        for p in procs:  # nothing survives the runner
            if p.poll() is None:
                p.kill()
                p.wait()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for f in logs:
            f.close()


def _wait(procs: list[subprocess.Popen], timeout: float | None, grace: float) -> list[int]:
    deadline = None if timeout is None else time.monotonic() + timeout
    status: list[int | None] = [None] * len(procs)
    failed_at = None
    while any(s is None for s in status):
        for i, p in enumerate(procs):
            if status[i] is None and p.poll() is not None:
                status[i] = _exit_status(p.returncode)
                if status[i] != 0 and failed_at is None:
                    failed_at = time.monotonic()
                    others = sum(1 for q in procs if q.poll() is None)
                    print(f"setdlm launch: rank {i} {describe_status(status[i])}"
                          + (f"; stopping the other {others}" if others else ""), file=sys.stderr, flush=True)
                    _stop_all(procs, signal.SIGTERM)
        now = time.monotonic()
        if failed_at is not None and now - failed_at > grace:
            _stop_all(procs, signal.SIGKILL)
        if deadline is not None and now > deadline:
            print(f"[runner] timeout after {timeout:.0f}s: stopping all processes", file=sys.stderr)
            _stop_all(procs, signal.SIGTERM)
            t0 = time.monotonic()
            while any(p.poll() is None for p in procs) and time.monotonic() - t0 < min(grace, 10):
                time.sleep(0.05)
            _stop_all(procs, signal.SIGKILL)
            return [124 if s is None else s for s in status]
        time.sleep(0.05)
    return [int(s) for s in status]


def _stop_all(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def overall_status(statuses: Sequence[int]) -> int:
    """The job's status: the first status a rank chose itself (2 for a user error, 75 from the survivors of
    a lost rank, ...), else the first death by a signal (128+n), else 0."""
    chosen = [s for s in statuses if 0 < s <= 128]
    return chosen[0] if chosen else next((s for s in statuses if s), 0)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or CLIParser(
        prog="setdlm launch local",
        description="Run N local processes with the torchrun-style environment (gloo on CPU).",
    )
    p.add_argument("-n", "--nproc", "--nproc-per-node", type=int, default=2, help="processes (default 2)")
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=None, help="default: a free port")
    p.add_argument("--log-dir", default=None, help="write rank{r}.log files here")
    p.add_argument("--timeout", type=float, default=None, help="seconds before all are stopped (exit 124)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD [ARGS...] (a .py file or -m MODULE runs under python)")
    return p


TEMPLATES = Path(__file__).resolve().parent / "templates"
_TEMPLATE_HELP = {
    "slurm": ("slurm_train.sbatch",
              "sbatch --nodes=N --job-name=RUN_NAME {path} --config RECIPE.yaml [section.key=value ...]"),
    "mpirun": ("mpirun_train.sh",
               "NP=16 GPUS_PER_NODE=8 HOSTFILE=hosts RUN_NAME=NAME bash {path} --config RECIPE.yaml [...]"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """``setdlm launch local -n N -- CMD`` (the word ``local`` is optional); ``setdlm launch slurm`` /
    ``setdlm launch mpirun`` print where the batch templates are and how to submit them."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _TEMPLATE_HELP:
        name, usage = _TEMPLATE_HELP[argv[0]]
        path = TEMPLATES / name
        print(f"template: {path}\nusage:    {usage.format(path=path)}\nsee docs/cluster.md for the settings")
        return 0
    if argv and argv[0] == "local":
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        build_parser().error("no command: setdlm launch local -n N -- CMD [ARGS...]")
    if args.nproc < 1:
        build_parser().error(f"--nproc must be >= 1, got {args.nproc}")
    statuses = run_local(cmd, args.nproc, master_addr=args.master_addr, master_port=args.master_port,
                         log_dir=args.log_dir, timeout=args.timeout, grace=args.grace)
    rc = overall_status(statuses)
    if rc:
        print(f"[runner] exit statuses per rank: {statuses}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(run_command("setdlm launch", main, sys.argv[1:]))
