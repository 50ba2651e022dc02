"""This process's rank, world size and local rank from the launcher's environment variables, read
without a process group and without importing launch/ (eval/ and pretrain/ sit below it).

Same precedence as `launch.env.detect_env(use_mpi4py=False)`: torchrun (`RANK`, `WORLD_SIZE`,
`LOCAL_RANK`) first, then Open MPI when it disagrees with Slurm (an mpirun inside an sbatch
allocation), then a Slurm step (`SLURM_PROCID`, only inside an srun step), then the other MPI
launchers (MPICH/Intel MPI `PMI_*`, MVAPICH `MV2_*`, PMIx), else a single process. launch/env.py
adds what only a launcher needs (rendezvous address and port, mpi4py, process-group set-up).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

_MPI = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
        ("PMIX_RANK", "PMI_SIZE", "PMI_LOCAL_RANK"),
        ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK"))


@dataclass(frozen=True)
class Ranks:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # single | torchrun | slurm | mpi


def _get(env: Mapping[str, str], name: str) -> int | None:
    value = (env.get(name) or "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"environment variable {name}={value!r} is not a non-negative integer")
    return int(value)


def _checked(r: Ranks, source: str) -> Ranks:
    if r.world_size < 1 or not 0 <= r.rank < r.world_size:
        raise ValueError(f"{source}: rank {r.rank} is outside [0, {r.world_size})")
    return r


def read_ranks(environ: Mapping[str, str] | None = None) -> Ranks:
    env = os.environ if environ is None else environ
    rank, world = _get(env, "RANK"), _get(env, "WORLD_SIZE")
    if rank is not None and world is not None:
        local = _get(env, "LOCAL_RANK")
        return _checked(Ranks(rank, world, rank if local is None else local, "torchrun"), "torchrun")
    slurm = None
    if _get(env, "SLURM_PROCID") is not None and (env.get("SLURM_STEP_ID") is not None or env.get("SLURM_STEPID") is not None):
        world = next((v for v in (_get(env, n) for n in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
                      if v is not None), None)
        if world is not None:
            slurm = _checked(Ranks(_get(env, "SLURM_PROCID"), world, _get(env, "SLURM_LOCALID") or 0, "slurm"), "Slurm")
    if "OMPI_COMM_WORLD_RANK" in env:
        mpi = _mpi(env, _MPI[:1])
        if mpi is not None and (slurm is None or (slurm.rank, slurm.world_size) != (mpi.rank, mpi.world_size)):
            return mpi
    return slurm or _mpi(env, _MPI) or Ranks(0, 1, 0, "single")


def _mpi(env: Mapping[str, str], launchers) -> Ranks | None:
    for rank_var, size_var, local_var in launchers:
        rank, world = _get(env, rank_var), _get(env, size_var)
        if rank is not None and world is not None:
            return _checked(Ranks(rank, world, _get(env, local_var) or 0, "mpi"), "MPI")
    return None
