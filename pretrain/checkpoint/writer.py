"""Saving a format-2 checkpoint from every rank: snapshot, write (in the background), publish.

    saver = Saver(root, rank=rank, background=True, keep_last=3)
    stats = saver.save(engine, ema, step, meta=..., extra=...)   # blocks for the snapshot only
    ...                                                        # training goes on while it is written
    done = saver.poll(step, every=10)                          # at step boundaries: a finished write
    saver.wait()                                               # before exiting, or before the next save

A save: (1) waits for the previous write, if one is still in flight; (2) makes checkpoints/.tmp-step_N;
(3) copies this rank's pieces of the training state (train_state.py) into host buffers, reused from
save to save (`distcp.stage`: the only time the step loop waits, besides the small per-rank files);
(4) writes this rank's extra_rank*.pt (RNG states, data position) and, on rank 0, meta.json;
(5) hands the snapshot to `torch.distributed.checkpoint.async_save`, which plans and writes it in a
background thread over a gloo group of its own (its collectives never meet the training's), one file
per rank plus DCP's `.metadata`, which the coordinator writes after every rank's files are written.
When that has happened, rank 0 publishes the checkpoint in the same thread: COMPLETE, the rename to
step_N, `latest`, pruning (save.py). A kill at any moment before leaves the previous checkpoint the one
that resumes; the next start removes the .tmp- folder.

A write that fails (a full disk on any rank) fails on every rank (DCP gathers each rank's result); the
failure is raised, as one CheckpointError naming the path, the free space and the size a checkpoint
needs, at the next point where the ranks agree on it: `poll` (every `every` steps, one all-reduce while
a write is in flight), the next save, or `wait`; the partial save is removed and the last good
checkpoint kept (save.py `_raise_if_any_failed`). `background=False` writes in the step loop (the same
files; `train.async_save: false`).
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

from common.errors import StorageError
from common.storage import is_write_failure

from . import distcp, rundir, train_state
from .save import TMP_PREFIX, _barrier, _raise_if_any_failed, _remove, prune

STORAGE = "dcp"  # meta.json `storage` of a format-2 checkpoint


@dataclasses.dataclass
class Pending:
    """A write in flight."""

    step: int
    tmp: Path
    final: Path
    started: float
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    failure: BaseException | None = None
    write_s: float | None = None
    hook: object = None
    publishing: bool = False  # rank 0: the files are written, publishing them (a failure removes step_N too)


@dataclasses.dataclass
class Finished:
    """A write that ended (`poll`/`wait`): its step, seconds and, on rank 0, the published folder."""

    step: int
    write_s: float
    path: Path


class Saver:
    def __init__(self, root: Path, *, rank: int, background: bool = True, keep_last: int = 0, need: int | None = None):
        self.root, self.rank, self.background, self.keep_last = Path(root), rank, background, keep_last
        self.need = need  # bytes a checkpoint takes: the full-disk message names it
        self.pending: Pending | None = None
        self.finished: list[Finished] = []  # writes that ended since the caller last took them (`take`)
        self._cache: dict = {}  # staging buffers, reused by every save
        # DCP's collectives of a background write run in its thread: a group of their own (gloo: they
        # move only small plans and results), never the one the training's collectives use; made at the
        # first save (every rank saves). A write in the step loop uses the default group.
        self.group = None

    # -- saving --------------------------------------------------------------------------------------------
    def save(self, engine, ema, step: int, *, meta: dict, extra: dict, block: bool = False,
             publish_hook=None) -> dict:
        """Save checkpoint `step`; returns {"ckpt/blocking_s": seconds the caller waited} (plus
        "ckpt/write_s" when the write ended before returning: `block`, or background off). On rank 0,
        `publish_hook(path, step)` runs once the checkpoint is published (train.keep_best's record)."""
        t0 = time.perf_counter()
        out = {}
        self.wait()
        tag = rundir.tag_for(step)
        tmp, final = self.root / (TMP_PREFIX + tag), self.root / tag
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier()
        state = train_state.save_state(engine, ema)
        staged = distcp.stage(state, self._cache, pin=torch.cuda.is_available())
        meta = {**meta, "storage": STORAGE, "optimizer_step": train_state.optimizer_step(engine)}
        failure = None
        try:
            torch.save(extra, rundir.extra_file(tmp, self.rank))
            if self.rank == 0:
                rundir.write_meta(tmp, meta)
        except (OSError, RuntimeError, StorageError) as e:  # RuntimeError: torch's zip writer on a short write
            if not (isinstance(e, StorageError) or is_write_failure(e)):
                raise
            failure = e.with_traceback(None)
        _raise_if_any_failed(failure, self.root, [tmp], step, self.rank, self.need)
        pending = Pending(step, tmp, final, time.perf_counter(), hook=publish_hook)
        self.pending = pending
        if self.background:
            import torch.distributed.checkpoint as dcp

            if self.group is None and dist.is_initialized():
                self.group = dist.new_group(backend="gloo")
            try:
                future = dcp.async_save(staged, storage_writer=distcp.writer(tmp), planner=distcp.ChunkSavePlanner(),
                                        process_group=self.group, async_stager=_Staged())
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - a failure to start is a failed write
                self._finish(pending, e)
            else:
                future.add_done_callback(lambda f: self._finish(pending, f.exception()))
        else:
            try:
                import torch.distributed.checkpoint as dcp

                dcp.save(staged, storage_writer=distcp.writer(tmp), planner=distcp.ChunkSavePlanner())
            except (Exception, CheckpointException) as e:  # noqa: BLE001 - a failed write, reported by wait()
                self._finish(pending, e)
            else:
                self._finish(pending, None)
        out["ckpt/blocking_s"] = time.perf_counter() - t0
        if block or not self.background:
            done = self.wait()
            self.finished.remove(done)
            out["ckpt/blocking_s"] = time.perf_counter() - t0
            out["ckpt/write_s"] = done.write_s
        return out

    def _finish(self, pending: Pending, error: BaseException | None) -> None:
        """Runs where the write ended (the writer thread): publish on rank 0, or record the failure."""
        try:
            pending.write_s = time.perf_counter() - pending.started
            if error is not None:
                pending.failure = _cause(error)
                return
            if self.rank == 0:
                pending.publishing = True
                try:
                    rundir.mark_complete(pending.tmp)
                    if pending.final.exists() or pending.final.is_symlink():
                        _remove(pending.final)
                    pending.tmp.replace(pending.final)
                    rundir.point_latest(self.root, pending.final.name)
                except (OSError, StorageError) as e:
                    pending.failure = e.with_traceback(None)
                    return
                pending.publishing = False
                prune(self.root, self.keep_last)
                if pending.hook is not None:
                    pending.hook(pending.final, pending.step)
        except BaseException as e:  # noqa: BLE001 - a callback's exception would otherwise be lost
            pending.failure = pending.failure or e
        finally:
            pending.done.set()

    # -- waiting -------------------------------------------------------------------------------------------
    def wait(self) -> Finished | None:
        """Wait for the write in flight (if any); every rank raises the same CheckpointError if it failed
        on any rank. Returns what finished (None: nothing was in flight)."""
        pending = self.pending
        if pending is None:
            return None
        pending.done.wait()
        self.pending = None
        partial = [pending.tmp, pending.final] if pending.publishing else [pending.tmp]
        _raise_if_any_failed(pending.failure, self.root, partial, pending.step, self.rank, self.need)
        done = Finished(pending.step, pending.write_s or 0.0, pending.final)
        self.finished.append(done)
        return done

    def take(self) -> list[Finished]:
        """The writes that ended since the last call (for the metrics rows)."""
        out, self.finished = self.finished, []
        return out

    def poll(self, step: int, every: int = 1) -> Finished | None:
        """At a step boundary: the write in flight if every rank's part of it has ended (checked at steps
        that are multiples of `every`, with one all-reduce across ranks), else None."""
        pending = self.pending
        if pending is None:
            return None
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            return self.wait() if pending.done.is_set() else None
        if step % max(1, every):
            return None
        flag = torch.tensor([1 if pending.done.is_set() else 0], dtype=torch.int32, device=_flag_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return self.wait() if flag.item() else None

    def close(self) -> None:
        """Wait for the write in flight without raising (an exit on another error)."""
        if self.pending is not None:
            self.pending.done.wait()


class _Staged(AsyncStager):
    """DCP's staging step for a snapshot `distcp.stage` already made (in the step loop, before the call)."""

    _synchronize_after_execute = False

    def stage(self, state_dict, **kwargs):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _flag_device():
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _cause(error: BaseException) -> BaseException:
    """The exception a failed DCP write stands for: the first failing rank's own (an OSError of a full
    disk), which DCP's CheckpointException wraps."""
    return distcp._inner(error).with_traceback(None)


def save(engine, root: Path, step: int, *, meta: dict, extra: dict, ema=None, keep_last: int = 0, rank: int = 0,
         need: int | None = None) -> Path:
    """Write checkpoint `step` under `root` from every rank, in the caller (no background write);
    returns its folder."""
    saver = Saver(root, rank=rank, background=False, keep_last=keep_last, need=need)
    saver.save(engine, ema, step, meta=meta, extra=extra)
    return Path(root) / rundir.tag_for(step)
