"""What every save shares: the temporary name, the full-disk handling, the space check and pruning.

The writer (writer.py) saves a checkpoint under a temporary name (checkpoints/.tmp-step_N) and renamed once every
rank has finished, and `latest` is replaced only after that, so a kill during a save never damages
the last good one. A save that fails (a full disk: OSError, or the RuntimeError torch's zip writer
raises for a short write) removes its temporary directory on every rank, keeps the last good
checkpoint and raises one CheckpointError on every rank naming the path, the free space and the
space a checkpoint needs (`expected_bytes`: the size of the newest complete checkpoint, else an
estimate from the parameter count). `check_space` says the same before a job trains at all.
Pruning renames a step to .tmp-pruned-step_N before deleting it, so a kill mid-prune leaves no
half-deleted step_N (the next start removes the .tmp-* leftovers; `clean_partial`). Files of one
format-2 checkpoint (writer.py):

    __R_0.distcp, .metadata   torch.distributed.checkpoint: each rank's pieces of the global tensors
                              (train_state.py: weights, fp32 masters, Adam moments, EMA) and the index
    extra_rank*.pt            per rank: RNG states (rng.py) and the data-loader position
    meta.json, COMPLETE       rundir.py

(Format-1 checkpoints, DeepSpeed's files, are still read: shards.py, resume.py.)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from common.errors import StorageError
from common.io import remove_temps
from common.storage import free_bytes, human_bytes, is_write_failure, tree_bytes, write_failure

from ..safe_load import CheckpointError
from . import rundir
from .shards import shard_info  # noqa: F401 - its home was here (callers import it from save)

TMP_PREFIX = ".tmp-"
PRUNED = TMP_PREFIX + "pruned-"


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink(missing_ok=True)
    else:
        shutil.rmtree(p, ignore_errors=True)


def clean_partial(root: Path) -> None:
    """Remove what killed runs left (rank 0, before training starts): checkpoints whose save or prune
    was interrupted (.tmp-*), and the temporary files of interrupted atomic writes (`latest`,
    meta.json, config.yaml, metrics.jsonl) in the run directory, checkpoints/ and its steps."""
    root = Path(root)
    for p in root.glob(TMP_PREFIX + "*"):
        _remove(p)
    for d in (root.parent, root, *(p for p in root.glob("step_*") if p.is_dir() and not p.is_symlink())):
        remove_temps(d, all_of_them=True)  # one job per run directory: no writer is running now


# -- space -------------------------------------------------------------------------------------------
def estimate_bytes(n_params: int, *, precision: str, ema: bool) -> int:
    """What a checkpoint of `n_params` parameters holds on disk, over all ranks: the fp32 weights (the
    fp32 masters, whatever `precision` trains in), Adam's two fp32 moments and the fp32 EMA."""
    per_param = 4 + 8 + (4 if ema else 0)
    return int(n_params * per_param)


def expected_bytes(root: Path, estimate: int) -> tuple[int, str]:
    """(bytes the next checkpoint needs, where the figure comes from): the size of the newest complete
    checkpoint under `root`, else `estimate`."""
    done = rundir.complete_checkpoints(root) if Path(root).is_dir() else []
    if done:
        return tree_bytes(done[-1]), f"the size of {done[-1].name}"
    return estimate, "estimated from the parameter count"


def check_space(root: Path, need: int, source: str) -> None:
    """Refuse to start a job whose next checkpoint (`need` bytes) does not fit on the disk of `root`
    (a requeued job on a still-full disk stops here, before any work)."""
    free = free_bytes(root)
    if free is not None and free < need:
        raise StorageError(f"checkpoint: {root}: No space left on device for the next checkpoint (the disk is full: "
                           f"{human_bytes(free)} free, a checkpoint needs about {human_bytes(need)}, {source}); "
                           "nothing was trained: free space (older step_* folders can go) and rerun the same command")


def _raise_if_any_failed(failure: BaseException | None, root: Path, partial: list[Path], step: int, rank: int,
                         need: int | None) -> None:
    """After every rank has written its files: if any rank failed (disk full, permissions), remove
    the partial save and raise a CheckpointError on every rank; the last good checkpoint stays."""
    failed = torch.tensor([1.0 if failure is not None else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:  # also the barrier before COMPLETE is written
        if dist.get_backend() == "nccl":
            failed = failed.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return
    free = None
    if rank == 0:
        # torch's zip writer can keep a failed file open (the space returns when the process exits):
        # the free space to report is what there is once the partial save is gone
        before, held = free_bytes(root), sum(tree_bytes(p) for p in partial)
        for p in partial:
            _remove(p)
        after = free_bytes(root)
        free = None if before is None or after is None else max(after, before + held)
    _barrier()
    kept = rundir.latest_tag(root)
    if failure is None:
        cause = "another rank could not write its files"
    else:
        storage = write_failure(failure, root, need, "a checkpoint", free=free)
        cause = str(storage) if storage is not None else f"{type(failure).__name__}: {failure} ({root})"
        if need and "needs" not in cause:
            cause += f" (a checkpoint needs about {human_bytes(need)})"
    raise CheckpointError(f"saving checkpoint step {step} failed: {cause}; the partial save was removed and "
                          + (f"the last good checkpoint ({kept}) is kept" if kept else "no earlier checkpoint exists")
                          + "; free space and rerun the same command to resume") from None


def prune(root: Path, keep_last: int) -> None:
    """Remove all but the newest `keep_last` complete checkpoints (never the ones `latest` and `best`
    name: the best checkpoint of train.keep_best lives outside keep_last), and
    the steps older than the newest complete one that are not complete (a prune a kill interrupted
    in an older setdlm, or a damaged copy). Each goes by a rename to .tmp-pruned-step_N first."""
    if keep_last <= 0:
        return
    root = Path(root)
    keep = {rundir.latest_tag(root), rundir.best_tag(root)}
    done = rundir.complete_checkpoints(root)
    doomed = list(done[:-keep_last])
    if done:
        newest = rundir.step_of(done[-1])
        doomed += [p for p in root.glob("step_*") if p.is_dir() and not p.is_symlink() and p not in done
                   and (rundir.step_of(p) or 0) < newest]
    for p in doomed:
        if p.name in keep:
            continue
        gone = root / (PRUNED + p.name)
        try:
            if os.path.lexists(gone):
                _remove(gone)
            os.replace(p, gone)  # atomic: step_N is whole or absent, never half deleted
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)
