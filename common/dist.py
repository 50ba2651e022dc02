"""The one ``torch.distributed`` process-group initialiser (used by training, evaluation and tests).

`init_process_group` reads the launcher (common/env.py: torchrun, Slurm, MPI, or a single process on
a free local port), exports the torchrun-style variables so libraries that read them agree, selects
the CUDA device of the local rank, and creates the default group (NCCL with CUDA, else gloo).
Idempotent: with a group already initialised it only reports the environment.

The group rendezvouses through a TCPStore this module creates (`rendezvous_store`: torchrun's agent
store when torchrun started the process, else one hosted by rank 0 at MASTER_ADDR:MASTER_PORT, as
torch's ``env://`` does) and keeps (`job_store`), so that common/rankguard.py can tell every rank when
one of them fails. Collectives time out after ``timeout_s`` (the recipe's
``parallel.collective_timeout_s``).
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

from .env import DistEnv, detect_env, find_free_port

__all__ = [
    "JobStore",
    "destroy_process_group",
    "ensure_process_group",
    "init_process_group",
    "job_store",
    "rendezvous_store",
]


@dataclass
class JobStore:
    """The key-value store every rank of this job shares, and where it lives (for messages)."""
    store: object  # torch.distributed.TCPStore
    address: str  # host:port
    agent: bool  # hosted by torchrun's agent (survives rank 0), else by rank 0's process


_JOB_STORE: JobStore | None = None


def rendezvous_store(env: DistEnv, timeout_s: float = 600, wait_for_workers: bool = True) -> JobStore:
    """The TCPStore of this job, as torch's ``env://`` rendezvous creates it: a client of torchrun's agent
    store when torchrun started this process (``TORCHELASTIC_USE_AGENT_STORE=True``), else hosted by rank 0
    at ``MASTER_ADDR:MASTER_PORT`` with every other rank a client."""
    import torch.distributed as dist

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, env.rank == 0 and not agent,
                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=wait_for_workers,
                          multi_tenant=True)
    return JobStore(store, f"{env.master_addr}:{env.master_port}", agent)


def job_store() -> JobStore | None:
    """The store `init_process_group` created (None before, or when another library made the group)."""
    return _JOB_STORE


def init_process_group(backend: str | None = None, timeout_s: float = 600) -> DistEnv:
    """Create the default ``torch.distributed`` process group from the detected launcher.

    Exports ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
    (so libraries that read them agree), sets the CUDA device to ``local_rank`` and initialises the
    group with NCCL when CUDA is available, else gloo -- also for a single process, on a free port.
    Idempotent: when a group exists, returns the environment it describes.
    """
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            env = detect_env(use_mpi4py=False)
        except ValueError:
            env = DistEnv(0, 1, 0, 1, "127.0.0.1", 0, "single")
        env.rank, env.world_size = dist.get_rank(), dist.get_world_size()
        return env
    env = detect_env()
    if env.launcher == "single" and not env.master_port:
        env.master_port = find_free_port("127.0.0.1")
    os.environ.update(env.as_torch_env())
    global _JOB_STORE
    _JOB_STORE = rendezvous_store(env, timeout_s)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend=backend,
        store=_JOB_STORE.store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return env


def destroy_process_group() -> None:
    """Tear down the default process group if there is one (safe to call twice)."""
    import torch.distributed as dist

    global _JOB_STORE
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _JOB_STORE = None


def ensure_process_group() -> None:
    """`init_process_group()` for callers that only need a group to exist (pretrain.parallel re-exports it)."""
    init_process_group()

