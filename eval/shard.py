"""Which rank does which example: this process's shard (from `--shard I/N` or the launcher's
variables) and its own single-rank process group.

Evaluation ranks are independent: unit ``u`` belongs to rank ``u % world``, and ranks coordinate
through the output directory only (eval/units.py), never through collectives, so a slow rank cannot
time out a collective and independent jobs (a Slurm array over shards) can fill one directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import EvalError


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
            raise EvalError(f"--shard: expected I/N, shard I of N counted from 0 (e.g. 0/4), got {shard!r}") from None
        if n < 1 or not 0 <= i < n:
            raise EvalError(f"--shard {shard}: shard I of N needs N >= 1 and 0 <= I < N (the N shards are 0/{max(n, 1)} "
                            f"... {max(n, 1) - 1}/{max(n, 1)})")
        return Shard(i, n, 0, "explicit")
    from common.env import detect_env  # not launch/: eval sits below it

    try:
        env = detect_env(use_mpi4py=False)
    except ValueError as e:
        raise EvalError(str(e)) from None
    return Shard(env.rank, env.world_size, env.local_rank, env.launcher)


def rank_guard(shard: Shard, prog: str):
    """The rank-failure guard of common/rankguard.py for ranks started by a launcher: when one rank
    fails or is killed, the others stop within seconds with one line naming it (they would otherwise
    go on, or rank 0 would wait for the merge forever). The ranks share a TCPStore made as the
    training's rendezvous makes it (rank 0 or torchrun's agent hosts it); explicit shards
    (``--shard I/N``, independent jobs) and single processes run unguarded."""
    import contextlib

    if shard.world <= 1 or shard.explicit:
        return contextlib.nullcontext()
    from common.dist import rendezvous_store
    from common.env import detect_env
    from common.rankguard import guard

    job = rendezvous_store(detect_env(use_mpi4py=False), timeout_s=300, wait_for_workers=False)
    return guard(prog, job, rank=shard.rank, world=shard.world, stop_on_sigterm=True)


def isolate_process_group() -> None:
    """Give this process its own single-rank torch.distributed group, so that nothing it loads or runs
    (a launcher's RANK/WORLD_SIZE, DeepSpeed's or a library's `dist.is_initialized()` checks) joins the
    other evaluation ranks in a collective.

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


