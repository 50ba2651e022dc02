"""`build_loader` and `TokenLoader`: deterministic, resumable micro-batches of token ids.

The order is defined in `order.py`. Each reader (rank, worker) turns its sample stream into
micro-batches; with workers, torch's `DataLoader` hands batches out round-robin over the workers,
so batch ``j`` of a rank comes from worker ``j % num_workers``. The loader remembers, per worker,
the position of its next sample; `state_dict` holds those positions and the batch count, and a
loader restored from it yields exactly the batches an uninterrupted loader would have yielded next.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from . import order
from .config import DataConfig
from .sources import BuiltinSource, ShardError, check_split

log = logging.getLogger("setdlm.data")
STATE_VERSION = 1


@dataclass
class _Plan:
    """Everything a reader needs (picklable, sent to worker processes)."""
    source: object
    split: str
    micro_batch: int
    dp_rank: int
    dp_size: int
    n_workers: int  # >= 1 (0 workers means one reader in the main process)
    seed: int
    shuffle: bool
    window: int
    skip_bad: bool
    with_ids: bool


@dataclass
class _Stats:
    shards: int = 0
    samples: int = 0
    names: list = field(default_factory=list)


def _read_window(plan: _Plan, units, counts, first, stats: _Stats):
    """Rows of `units` concatenated, `src` mapping window positions to rows (-1 = skipped)."""
    n = int(counts[units].sum())
    src = np.full(n, -1, dtype=np.int64)
    parts, ids, off, good = [], [], 0, 0
    for u in units:
        c = int(counts[u])
        try:
            rows = plan.source.read_unit(plan.split, int(u))
            if len(rows) != c:
                raise ShardError(f"{plan.source.unit_name(plan.split, int(u))}: holds {len(rows)} samples, "
                                 f"the manifest says {c}")
        except ShardError as e:
            if not plan.skip_bad:
                raise
            stats.shards += 1
            stats.samples += c
            stats.names.append(plan.source.unit_name(plan.split, int(u)))
            log.warning("skipping bad shard (data.skip_bad_shards=true; %d shards, %d samples skipped so far "
                        "by this reader): %s", stats.shards, stats.samples, e)
            off += c
            continue
        parts.append(rows)
        ids.append(first[u] + np.arange(c))
        src[off:off + c] = np.arange(good, good + c)
        off += c
        good += c
    if not parts:
        return None, src, None
    return np.concatenate(parts), src, np.concatenate(ids)


def _train_samples(plan: _Plan, reader: int, epoch: int, pos: int, stats: _Stats):
    """Infinite stream of (epoch, position after, sample id, row) for one reader."""
    counts = plan.source.counts(plan.split)
    first = plan.source.first_ids(plan.split)
    n_readers = plan.dp_size * plan.n_workers
    while True:
        units = order.reader_units(len(counts), plan.seed, epoch, plan.shuffle, reader, n_readers)
        acc, produced, whole_epoch = 0, 0, pos == 0
        for j in range(0, len(units), plan.window):
            w = units[j:j + plan.window]
            n = int(counts[w].sum())
            if acc + n <= pos:
                acc += n
                continue
            rows, src, ids = _read_window(plan, w, counts, first, stats)
            perm = order.window_order(n, plan.seed, epoch, reader, j // plan.window, plan.shuffle)
            for q in range(pos - acc, n):
                k = src[perm[q]]
                if k >= 0:
                    produced += 1
                    yield epoch, acc + q + 1, ids[k], rows[k]
            acc += n
            pos = acc
        if produced == 0 and whole_epoch:
            raise ShardError(f"every shard of reader {reader} in epoch {epoch} of split {plan.split!r} was bad")
        epoch, pos = epoch + 1, 0


def _val_samples(plan: _Plan, worker: int, pos: int, stats: _Stats):
    counts = plan.source.counts(plan.split)
    first = plan.source.first_ids(plan.split)
    start, stop = order.val_worker_range(int(counts.sum()), plan.micro_batch, plan.dp_rank, plan.dp_size,
                                         worker, plan.n_workers)
    lo = start + pos
    for u in range(len(counts)):
        f, c = int(first[u]), int(counts[u])
        if f + c <= lo or f >= stop:
            continue
        rows, src, ids = _read_window(plan, np.array([u]), counts, first, stats)
        if rows is None:
            continue
        for i in range(max(lo, f), min(stop, f + c)):
            yield 0, i - start + 1, int(first[u] + (i - f)), rows[src[i - f]]


def _batches(plan: _Plan, worker: int, epoch: int, pos: int):
    """Micro-batches (tensors, meta) of one reader from position (epoch, pos)."""
    stats = _Stats()
    if plan.split == "train":
        samples = _train_samples(plan, plan.dp_rank * plan.n_workers + worker, epoch, pos, stats)
    else:
        samples = _val_samples(plan, worker, pos, stats)
    rows, ids, epochs = [], [], []
    last = (epoch, pos)
    for e, p, sid, row in samples:
        rows.append(row)
        ids.append(sid)
        epochs.append(e)
        last = (e, p)
        if len(rows) == plan.micro_batch:
            yield _pack(plan, rows, ids, epochs, worker, last, stats)
            rows, ids, epochs = [], [], []
    if rows:  # only after skipped shards in the val split: a short final batch
        yield _pack(plan, rows, ids, epochs, worker, last, stats)


def _pack(plan, rows, ids, epochs, worker, last, stats):
    stacked = np.stack(rows)
    if stacked.ndim == 3:  # prompt/answer shards: (ids, context mask, valid mask) per row
        batch = {"input_ids": torch.from_numpy(stacked[:, 0].astype(np.int64)),
                 "context_mask": torch.from_numpy(stacked[:, 1] != 0), "valid_mask": torch.from_numpy(stacked[:, 2] != 0)}
    else:
        batch = {"input_ids": torch.from_numpy(stacked.astype(np.int64))}
    if plan.with_ids:
        batch["sample_id"] = torch.tensor(ids, dtype=torch.long)
        batch["epoch"] = torch.tensor(epochs, dtype=torch.long)
    meta = {"worker": worker, "epoch": int(epochs[-1]), "pos": [int(last[0]), int(last[1])],
            "skipped": [stats.shards, stats.samples]}
    return batch, meta


class _WorkerStreams(torch.utils.data.IterableDataset):
    """DataLoader dataset: DataLoader worker i serves logical worker (i + offset) % n_workers."""

    def __init__(self, plan: _Plan, positions, offset: int):
        self.plan, self.positions, self.offset = plan, positions, offset

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        i = 0 if info is None else info.id
        w = (i + self.offset) % self.plan.n_workers
        e, p = self.positions[w]
        return _batches(self.plan, w, e, p)


def _clean_worker_errors(it):
    """Re-raise a worker's ShardError with its own message (not torch's traceback dump)."""
    try:
        yield from it
    except ShardError as e:
        msg = str(e)
        if "Original Traceback" in msg:
            msg = msg.rstrip().splitlines()[-1].split("ShardError: ", 1)[-1]
        raise ShardError(msg) from None


class TokenLoader:
    """Iterable of ``{"input_ids": LongTensor[micro_batch, seq_len]}`` for one data-parallel rank.

    ``split="train"`` loops over epochs forever; ``split="val"`` is one pass in the same order every
    time, ``len(loader)`` batches, all full: the last ``num_samples % (micro_batch * dp_size)`` val
    samples are dropped (``loader.dropped_samples``), so every rank evaluates the same number of
    batches. ``epoch`` is the epoch of the latest sample delivered. Bad shards skipped under
    ``skip_bad_shards`` are counted in ``skipped_shards`` / ``skipped_samples`` and logged.
    """

    def __init__(self, source, cfg: DataConfig, *, split: str, micro_batch: int, dp_rank: int,
                 dp_size: int, seed: int):
        self.source, self.cfg, self.split = source, cfg, split
        self.micro_batch, self.dp_rank, self.dp_size, self.seed = micro_batch, dp_rank, dp_size, seed
        self.seq_len = source.seq_len
        self.num_workers = cfg.num_workers
        self._plan = _Plan(source, split, micro_batch, dp_rank, dp_size, max(1, cfg.num_workers), seed,
                           cfg.shuffle and split == "train", cfg.shuffle_window, cfg.skip_bad_shards,
                           cfg.with_sample_ids)
        counts = source.counts(split)
        self.num_samples = int(counts.sum())
        n_readers = dp_size * self._plan.n_workers
        if split == "train" and len(counts) < n_readers:
            raise ValueError(
                f"data.num_workers: the train split of {source.description} has {len(counts)} shards, fewer "
                f"than the {n_readers} readers (dp_size {dp_size} x max(1, num_workers) "
                f"{self._plan.n_workers}); use fewer workers or prepare smaller shards (--samples-per-shard)")
        if split == "val":
            nb = order.val_batches_per_rank(self.num_samples, micro_batch, dp_size)
            if nb == 0:
                raise ValueError(f"micro_batch: the val split of {source.description} has {self.num_samples} "
                                 f"sequences, fewer than micro_batch x dp_size = {micro_batch * dp_size}; "
                                 f"lower the micro-batch or use a larger validation split")
            self._num_batches = nb
            self.dropped_samples = self.num_samples - nb * micro_batch * dp_size
        self._positions = [[0, 0] for _ in range(self._plan.n_workers)]
        self._batches = 0
        self.epoch = 0
        self.skipped_shards = 0
        self.skipped_samples = 0
        self._resume_pending = False

    def __len__(self) -> int:
        if self.split != "val":
            raise TypeError("the train split is infinite; len() is defined for split='val' only")
        return self._num_batches

    def __iter__(self):
        if self.split == "val" and not self._resume_pending:  # every pass starts from the beginning
            self._positions = [[0, 0] for _ in range(self._plan.n_workers)]
            self._batches = 0
        self._resume_pending = False
        positions = [list(p) for p in self._positions]
        offset = self._batches % self._plan.n_workers
        if self.cfg.num_workers == 0:
            it = _batches(self._plan, 0, *positions[0])
        else:
            it = iter(torch.utils.data.DataLoader(
                _WorkerStreams(self._plan, positions, offset), batch_size=None,
                num_workers=self.cfg.num_workers, prefetch_factor=self.cfg.prefetch_factor,
                persistent_workers=False))
        per_worker_skips = {}
        base = (self.skipped_shards, self.skipped_samples)
        for batch, meta in _clean_worker_errors(it):
            w = meta["worker"]
            self._positions[w] = meta["pos"]
            self._batches += 1
            self.epoch = meta["epoch"]
            if meta["skipped"] != per_worker_skips.get(w, [0, 0]):
                per_worker_skips[w] = meta["skipped"]
                self.skipped_shards = base[0] + sum(s[0] for s in per_worker_skips.values())
                self.skipped_samples = base[1] + sum(s[1] for s in per_worker_skips.values())
                log.warning("data loader (rank %d, split %s): %d bad shards / %d samples skipped so far",
                            self.dp_rank, self.split, self.skipped_shards, self.skipped_samples)
            yield batch

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "split": self.split, "source": self.source.fingerprint,
                "seq_len": self.seq_len, "seed": self.seed, "shuffle": self._plan.shuffle,
                "shuffle_window": self._plan.window, "dp_size": self.dp_size,
                "num_workers": self.num_workers, "micro_batch": self.micro_batch, "rank": self.dp_rank,
                "batches": self._batches, "epoch": self.epoch, "positions": [list(p) for p in self._positions],
                "skipped_shards": self.skipped_shards, "skipped_samples": self.skipped_samples}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (call before iterating). The reader layout (dp_size, num_workers),
        seed, shuffling and data must match the saved run; a state saved by another rank of the same
        run is accepted (positions are recomputed from its batch count)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"data loader state: not a version-{STATE_VERSION} TokenLoader state")

        def refuse(what, saved, now, hint=""):
            raise ValueError(f"data loader state was saved with {what}={saved!r}, this loader has {what}={now!r}; "
                             f"resuming would repeat or skip data{hint}")

        for key, now in (("split", self.split), ("source", self.source.fingerprint), ("seq_len", self.seq_len),
                         ("seed", self.seed), ("shuffle", self._plan.shuffle),
                         ("shuffle_window", self._plan.window)):
            if state.get(key) != now:
                refuse(key, state.get(key), now)
        for key, now in (("dp_size", self.dp_size), ("num_workers", self.num_workers)):
            if state.get(key) != now:
                refuse(key, state.get(key), now,
                       f". The sample order depends on the reader layout (dp_size x num_workers): resume with "
                       f"dp_size={state.get('dp_size')} and data.num_workers={state.get('num_workers')}, or "
                       f"start without loading the data loader state (the data order then restarts)")
        self._batches = int(state["batches"])
        self._resume_pending = True
        self.skipped_shards = int(state.get("skipped_shards", 0))
        self.skipped_samples = int(state.get("skipped_samples", 0))
        if state.get("rank") == self.dp_rank:
            self._positions = [list(map(int, p)) for p in state["positions"]]
            self.epoch = int(state.get("epoch", 0))
            return
        if self.split != "train":
            raise ValueError(f"data loader state of rank {state.get('rank')} cannot be used by rank {self.dp_rank} "
                             f"for split {self.split!r}")
        if self.skipped_samples:
            log.warning("restoring the data state of rank %s on rank %d after skipped shards: positions are "
                        "recomputed assuming no skips", state.get("rank"), self.dp_rank)
        counts = self.source.counts("train")
        w_n = self._plan.n_workers
        old_b = int(state["micro_batch"])
        self._positions = []
        for w in range(w_n):
            b_w = (self._batches - w + w_n - 1) // w_n if self._batches > w else 0
            e, p = order.advance(counts, self.seed, self._plan.shuffle, self.dp_rank * w_n + w, self.dp_size * w_n,
                                 0, 0, b_w * old_b)
            self._positions.append([e, p])
        self.epoch = int(state.get("epoch", 0))


def build_loader(cfg: DataConfig, *, split: str, tokenizer, micro_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0) -> TokenLoader:
    """The loader of `split` ("train" or "val") for data-parallel rank `dp_rank` of `dp_size`."""
    cfg.validate()
    check_split(split)
    for name, v, lo in (("micro_batch", micro_batch, 1), ("dp_size", dp_size, 1), ("dp_rank", dp_rank, 0),
                        ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}: must be an integer >= {lo}, got {v!r}")
    if dp_rank >= dp_size:
        raise ValueError(f"dp_rank: {dp_rank} is not below dp_size {dp_size}")
    if cfg.is_builtin:
        from .config import EXAMPLE_PACKINGS

        if cfg.packing in EXAMPLE_PACKINGS:
            raise ValueError(f"data.packing: {cfg.packing!r} rows come from prompt/answer shards (setdlm data prepare "
                             "--format prompt_answer); builtin corpora are packed 'wrapped' or 'wrapped_bos_eos'")
        source = BuiltinSource(cfg.source[len("builtin:"):], tokenizer, cfg.seq_len, cfg.packing,
                               float(cfg.val_fraction))
    else:
        from .shards import ShardSource

        source = ShardSource.open(cfg, tokenizer)
    return TokenLoader(source, cfg, split=split, micro_batch=micro_batch, dp_rank=dp_rank, dp_size=dp_size,
                       seed=seed)
