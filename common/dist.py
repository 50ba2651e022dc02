"""The one ``torch.distributed`` process-group initialiser (used by training, evaluation and tests).

`init_process_group` reads the launcher (common/env.py: torchrun, Slurm, MPI, or a single process on
a free local port), exports the torchrun-style variables so libraries that read them agree, selects
the CUDA device of the local rank, and creates the default group (NCCL with CUDA, else gloo).
Idempotent: with a group already initialised it only reports the environment.
"""
from __future__ import annotations

import datetime
import os

from .env import DistEnv, detect_env, find_free_port

__all__ = ["init_process_group", "ensure_process_group", "destroy_process_group"]


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
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return env


def destroy_process_group() -> None:
    """Tear down the default process group if there is one (safe to call twice)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def ensure_process_group() -> None:
    """`init_process_group()` for callers that only need a group to exist (pretrain.parallel re-exports it)."""
    init_process_group()

