"""Distributed environment: who am I, how many are we, where is rank 0.

One function, :func:`detect_env`, reads rank / world size / local rank / master address from
whichever launcher started the process:

1. **torchrun** (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Takes
   precedence, so torchrun workers inside a Slurm step read ``RANK`` before ``SLURM_PROCID``.
2. **mpirun** of Open MPI (``OMPI_COMM_WORLD_*``) when it disagrees with the Slurm variables: an
   ``mpirun`` started inside an ``sbatch`` allocation inherits ``SLURM_PROCID`` of the batch step,
   which is wrong for every rank but one. Under ``srun`` both agree and Slurm is reported.
3. **Slurm** ``srun`` tasks (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``/``SLURM_NTASKS``,
   ``SLURM_LOCALID``; only inside a job step, i.e. with ``SLURM_STEP_ID``: a process started
   directly by the batch script is a single process even when the job has several tasks); the head node is the first of ``scontrol show hostnames $SLURM_JOB_NODELIST``
   (a built-in hostlist parser when ``scontrol`` is absent) and the port is derived from
   ``SLURM_JOB_ID`` so that every task computes the same one without talking to the others.
4. **MPI** launchers: Open MPI (``OMPI_COMM_WORLD_*``), MPICH / Intel MPI (``PMI_RANK``, ``PMI_SIZE``,
   ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``), MVAPICH (``MV2_COMM_WORLD_*``), PMIx (``PMIX_RANK``);
   missing pieces (world size, rank 0's host when ranks span nodes) come from ``mpi4py``.
5. Otherwise a **single** process.

An explicit ``MASTER_ADDR`` / ``MASTER_PORT`` in the environment always wins over derived values
(the Slurm and mpirun templates export them).

:func:`common.dist.init_process_group` turns the result into a ``torch.distributed`` process group
(also for a single process: DeepSpeed and megatron-core need one to train). This module imports nothing heavy (no torch),
so every package can ask "which rank am I" before a group exists (`env_rank`).
"""
from __future__ import annotations

from .errors import Error

import os
import random
import re
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

DEFAULT_MASTER_PORT = 29500
LOCAL_PORT_FLOOR = 20000  # find_free_port draws from here up to the ephemeral range


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "single" | "torchrun" | "slurm" | "mpi"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def node_rank(self) -> int:
        return self.rank // max(self.local_world_size, 1)

    def as_torch_env(self) -> dict[str, str]:
        """The torchrun-style variables that ``init_process_group(init_method="env://")`` reads."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }

    def to_dict(self) -> dict:
        return asdict(self)


class LauncherEnvError(Error):
    """The launcher variables are present but inconsistent (named in the message)."""


# ----------------------------------------------------------------------------- small helpers


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    value = env.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value.strip())
    except ValueError:
        raise LauncherEnvError(f"environment variable {name}={value!r} is not an integer") from None


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = _int(env, name)
        if value is not None:
            return value
    return None


def _check(env: DistEnv, source: str) -> DistEnv:
    if env.world_size < 1:
        raise LauncherEnvError(f"{source}: world size must be >= 1, got {env.world_size}")
    if not 0 <= env.rank < env.world_size:
        raise LauncherEnvError(f"{source}: rank {env.rank} is outside [0, {env.world_size})")
    if env.local_world_size < 1:
        env.local_world_size = 1
    if not 0 <= env.local_rank < env.local_world_size:
        raise LauncherEnvError(
            f"{source}: local rank {env.local_rank} is outside [0, {env.local_world_size})"
        )
    if not 0 < env.master_port < 65536:
        raise LauncherEnvError(f"{source}: master port {env.master_port} is not a valid TCP port")
    return env


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out to any socket bound to port 0 or connecting out (Linux's
    ip_local_port_range; its default elsewhere)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def find_free_port(host: str = "127.0.0.1", *, tries: int = 64) -> int:
    """A TCP port that was free a moment ago (for single-process and local runs), drawn below the
    kernel's ephemeral range where it can: a port from that range can be handed to another process's
    connection or gloo listener in the seconds before the rank-0 store binds it (EADDRINUSE), one
    outside it only to a process that asks for it by number."""
    lo, _ = _ephemeral_range()
    draw = random.Random()  # its own generator: a seeded global `random` would repeat ports across runs
    for _ in range(tries if lo > LOCAL_PORT_FLOOR else 0):
        port = draw.randrange(LOCAL_PORT_FLOOR, lo)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- Slurm


def parse_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist expression (``node[01-03,7],gpu-a[1-2]x``) like ``scontrol show hostnames``."""
    hosts: list[str] = []
    # split on commas that are not inside brackets
    parts, depth, cur = [], 0, ""
    for ch in expr.strip():
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        parts.append(cur)
    for part in parts:
        hosts.extend(_expand_one(part.strip()))
    return [h for h in hosts if h]


def _expand_one(part: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", part)
    if not m:
        return [part]
    prefix, suffix = part[: m.start()], part[m.end() :]
    out = []
    for rng in m.group(1).split(","):
        if "-" in rng:
            lo, hi = rng.split("-", 1)
            width = len(lo)
            for i in range(int(lo), int(hi) + 1):
                out.extend(_expand_one(f"{prefix}{i:0{width}d}{suffix}"))
        else:
            out.extend(_expand_one(f"{prefix}{rng}{suffix}"))
    return out


def slurm_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames NODELIST``; falls back to :func:`parse_hostlist` without scontrol."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True, text=True, timeout=30, check=True,
            ).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    return parse_hostlist(nodelist)


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) into one count per node."""
    counts: list[int] = []
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item)
        if not m:
            raise LauncherEnvError(f"cannot parse Slurm tasks-per-node value {spec!r}")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def slurm_master_port(job_id: int | str) -> int:
    """Port shared by all tasks of a Slurm job, derived from its id (12000-31999: below the
    Linux ephemeral range, so it does not collide with outgoing connections)."""
    digits = re.sub(r"\D", "", str(job_id)) or "0"
    return 12000 + int(digits) % 20000


def _slurm_env(env: Mapping[str, str]) -> DistEnv | None:
    rank = _int(env, "SLURM_PROCID")
    if rank is None:
        return None
    if env.get("SLURM_STEP_ID") is None and env.get("SLURM_STEPID") is None:
        # the batch script itself (or an salloc shell): SLURM_PROCID=0 and SLURM_NTASKS=<job's tasks>
        # are set, but this is one process; only srun-launched tasks belong to a step.
        return None
    world = _first_int(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    if world is None:
        return None
    local_rank = _int(env, "SLURM_LOCALID", 0)
    node_id = _int(env, "SLURM_NODEID", 0)
    local_world = None
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = parse_tasks_per_node(env[name])
            if counts:
                local_world = counts[node_id] if node_id < len(counts) else counts[-1]
                break
    if local_world is None:
        local_world = _int(env, "SLURM_NTASKS_PER_NODE", world)
    local_world = max(local_world, local_rank + 1)

    master_addr = env.get("MASTER_ADDR")
    if not master_addr:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        hosts = slurm_hostnames(nodelist) if nodelist else []
        master_addr = hosts[0] if hosts else "127.0.0.1"
    port = _int(env, "MASTER_PORT")
    if port is None:
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        port = slurm_master_port(job_id) if job_id else DEFAULT_MASTER_PORT
    return _check(DistEnv(rank, world, local_rank, local_world, master_addr, port, "slurm"), "Slurm")


# ----------------------------------------------------------------------------- MPI

_MPI_RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "OMPI_UNIVERSE_SIZE")
_MPI_LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK")
_MPI_LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE", "PMI_LOCAL_SIZE")


def _mpi4py_comm():
    try:
        from mpi4py import MPI  # noqa: PLC0415  (optional dependency, initialises MPI)
    except Exception:  # ImportError, or no MPI library at import time
        return None
    return MPI.COMM_WORLD


def _mpi_env(env: Mapping[str, str], use_mpi4py: bool = True) -> DistEnv | None:
    rank = _first_int(env, _MPI_RANK)
    if rank is None:
        return None
    world = _first_int(env, _MPI_SIZE)
    local_rank = _first_int(env, _MPI_LOCAL_RANK)
    local_world = _first_int(env, _MPI_LOCAL_SIZE)
    comm = None
    if world is None or (local_rank is None and use_mpi4py):
        comm = _mpi4py_comm() if use_mpi4py else None
        if comm is not None:
            world = comm.Get_size() if world is None else world
            if local_rank is None:
                from mpi4py import MPI  # noqa: PLC0415

                node = comm.Split_type(MPI.COMM_TYPE_SHARED)
                local_rank, local_world = node.Get_rank(), node.Get_size()
    if world is None:
        raise LauncherEnvError(
            "MPI rank variable found (one of " + ", ".join(_MPI_RANK) + ") but no world size "
            "(" + ", ".join(_MPI_SIZE) + ") and mpi4py is not importable; install mpi4py or set WORLD_SIZE"
        )
    if local_rank is None:
        local_rank, local_world = 0, 1
    if local_world is None:
        local_world = local_rank + 1

    master_addr = env.get("MASTER_ADDR")
    port = _int(env, "MASTER_PORT")
    if not master_addr or port is None:
        if world == local_world:  # every rank on this node
            master_addr = master_addr or "127.0.0.1"
        elif not master_addr:
            comm = comm or (_mpi4py_comm() if use_mpi4py else None)
            if comm is None:
                raise LauncherEnvError(
                    "mpirun across nodes: set MASTER_ADDR (rank 0's host) or install mpi4py so "
                    "rank 0 can broadcast its address"
                )
            master_addr = comm.bcast(socket.gethostname() if rank == 0 else None, root=0)
        if port is None:
            jobid = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMI_JOBID") or env.get("PMIX_NAMESPACE")
            port = slurm_master_port(jobid) if jobid else DEFAULT_MASTER_PORT
    return _check(DistEnv(rank, world, local_rank, local_world, master_addr, port, "mpi"), "MPI")


# ----------------------------------------------------------------------------- torchrun


def _torchrun_env(env: Mapping[str, str]) -> DistEnv | None:
    rank = _int(env, "RANK")
    world = _int(env, "WORLD_SIZE")
    if rank is None or world is None:
        return None
    local_rank = _int(env, "LOCAL_RANK", 0 if world == 1 else None)
    if local_rank is None:
        local_rank = rank  # single node by default
    local_world = _int(env, "LOCAL_WORLD_SIZE", world if local_rank == rank else local_rank + 1)
    return _check(
        DistEnv(
            rank, world, local_rank, local_world,
            env.get("MASTER_ADDR") or "127.0.0.1",
            _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
            "torchrun",
        ),
        "torchrun",
    )


# ----------------------------------------------------------------------------- public API


def detect_env(environ: Mapping[str, str] | None = None, *, use_mpi4py: bool = True) -> DistEnv:
    """Rank, world size, local rank and rendezvous address for this process (see module doc)."""
    env = os.environ if environ is None else environ
    found = _torchrun_env(env)
    if found is not None:
        return found
    slurm = _slurm_env(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        mpi = _mpi_env(env, use_mpi4py)
        if slurm is None or (slurm.rank, slurm.world_size) != (mpi.rank, mpi.world_size):
            return mpi
    if slurm is not None:
        return slurm
    mpi = _mpi_env(env, use_mpi4py)
    if mpi is not None:
        return mpi
    port = _int(env, "MASTER_PORT", 0) or 0  # 0: init_process_group picks a free local port
    addr = (env.get("MASTER_ADDR") or "127.0.0.1") if port else "127.0.0.1"
    return DistEnv(0, 1, 0, 1, addr, port, "single")


def env_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's global rank from the launcher variables (0 when they are absent or unreadable);
    never starts MPI, never raises."""
    try:
        return detect_env(environ, use_mpi4py=False).rank
    except (LauncherEnvError, ValueError):
        return 0


__all__ = [
    "DistEnv",
    "LauncherEnvError",
    "detect_env",
    "env_rank",
    "find_free_port",
    "parse_hostlist",
    "parse_tasks_per_node",
    "slurm_hostnames",
    "slurm_master_port",
]
