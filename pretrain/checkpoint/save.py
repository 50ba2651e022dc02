"""Saving a checkpoint from every rank, atomically, and pruning old ones.

A checkpoint is written under a temporary name (checkpoints/.tmp-step_N) and renamed once every
rank has finished, and `latest` is replaced only after that, so a kill during a save never damages
the last good one. A save that fails (disk full) removes its temporary directory on every rank and
keeps the last good checkpoint. Files of one checkpoint:

    DeepSpeed's model / optimizer shards and LR scheduler (`engine.save_checkpoint`), with this
    rank's shard map (`shard_info`, read by consolidate.py) in the model file's client state
    extra_rank*.pt       per rank: RNG states (rng.py) and data-loader position
    ema_mp_rank_*.pt     EMA weights, once per model-parallel rank
    meta.json, COMPLETE  rundir.py
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..safe_load import CheckpointError
from . import rundir

TMP_PREFIX = ".tmp-"


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def clean_partial(root: Path) -> None:
    """Remove checkpoints whose save was interrupted (rank 0, before training starts)."""
    for p in Path(root).glob(TMP_PREFIX + "*"):
        shutil.rmtree(p, ignore_errors=True)


def shard_info(engine) -> dict:
    """How this rank's model file is cut out of the full model (read by consolidate.py): its
    tensor/pipeline ranks, each parameter's tensor-parallel split dimension (-1: replicated), the
    parameters that are copies of another stage's (a tied embedding on the last stage) and, for a
    client torch optimizer saved in the model file, the parameter names in the optimizer's order."""
    from megatron.core import parallel_state

    module = engine.module
    init = parallel_state.model_parallel_is_initialized()
    names = {id(p): n for n, p in module.named_parameters()}
    order = None
    opt = getattr(engine, "optimizer", None)
    if isinstance(opt, torch.optim.Optimizer):
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        order = [names[i] for i in ids] if all(i in names for i in ids) else None
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size() if init else 1,
        "pp": parallel_state.get_pipeline_model_parallel_world_size() if init else 1,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank() if init else 0,
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank() if init else 0,
        "partition": {n: int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else -1
                      for n, p in module.named_parameters()},
        "copies": [n for n, p in module.named_parameters() if getattr(p, "shared_embedding", False)],
        "optimizer_order": order,
    }


def save(engine, root: Path, step: int, *, meta: dict, extra: dict, ema_state: dict | None,
         keep_last: int, mp_rank: int, dp_rank: int, rank: int) -> Path:
    """Write checkpoint `step` under `root` (RUN/checkpoints) from every rank; returns its folder."""
    root = Path(root)
    tag = rundir.tag_for(step)
    tmp_tag = TMP_PREFIX + tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root / tmp_tag, ignore_errors=True)
    _barrier()
    tmp = root / tmp_tag
    failure = None
    try:
        engine.save_checkpoint(str(root), tag=tmp_tag, client_state={"step": step, "shard": shard_info(engine)},
                               save_latest=False)
        torch.save(extra, rundir.extra_file(tmp, rank))
        if ema_state is not None and dp_rank == 0:
            torch.save(ema_state, rundir.ema_file(tmp, mp_rank))
        if rank == 0:
            rundir.write_meta(tmp, meta)
    except OSError as e:
        failure = e
    _raise_if_any_failed(failure, root, tmp, step, rank)
    final = root / tag
    if rank == 0:
        rundir.mark_complete(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        rundir.point_latest(root, tag)
        prune(root, keep_last)
    _barrier()
    return final


def _raise_if_any_failed(failure: OSError | None, root: Path, tmp: Path, step: int, rank: int) -> None:
    """After every rank has written its files: if any rank failed (disk full, permissions), remove
    the partial save and raise a CheckpointError on every rank; the last good checkpoint stays."""
    failed = torch.tensor([1.0 if failure is not None else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:  # also the barrier before COMPLETE is written
        if dist.get_backend() == "nccl":
            failed = failed.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    kept = rundir.latest_tag(root)
    if failure is None:
        cause = "another rank could not write its files"
    elif failure.errno == errno.ENOSPC:
        cause = f"the disk is full ({failure.filename or root})"
    else:
        cause = f"{failure.strerror or failure} ({failure.filename or root})"
    raise CheckpointError(f"saving checkpoint step {step} failed: {cause}; the partial save was removed and "
                          + (f"the last good checkpoint ({kept}) is kept" if kept else "no earlier checkpoint exists")
                          + "; free space and rerun the same command to resume") from None


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest `keep_last` complete checkpoints (never the ones `latest` and `best`
    name: the best checkpoint of train.keep_best lives outside keep_last)."""
    if keep_last <= 0:
        return
    keep = {rundir.latest_tag(root), rundir.best_tag(root)}
    for p in rundir.complete_checkpoints(root)[:-keep_last]:
        if p.name not in keep:
            shutil.rmtree(p, ignore_errors=True)
