"""The sample order: a pure function of (seed, epoch, rank layout), with cheap seeking.

A split is a list of *units* (shards, or single sequences for builtin sources) with sample counts.
Readers are the ``dp_size * max(1, num_workers)`` (rank, worker) pairs; reader ``s`` is
``dp_rank * max(1, num_workers) + worker``.

Train split (infinite): in epoch ``e`` the units are permuted with ``rng(seed, e)`` (identity when
not shuffling) and reader ``s`` takes units ``perm[s::S]``, so every unit is read by exactly one
reader per epoch. A reader reads its units in windows of ``window`` units and, when shuffling,
emits each window's samples in the order of ``rng(seed, e, s, window index)``. A reader position is
``(epoch, p)``: ``p`` counts the manifest samples of that epoch already passed (samples of skipped
bad shards count too), so positions never depend on what failed.

Val split (finite, never shuffled): the split's samples in manifest order; with ``nb = N // (B * dp)``
batches per rank, rank ``r`` reads samples ``[r * nb * B, (r + 1) * nb * B)``, its batches are
divided into contiguous runs, one per worker, and the last ``N - nb * B * dp`` samples are dropped
so that every rank evaluates the same number of full batches.
"""
from __future__ import annotations

import numpy as np

_DOMAIN = 0x5E7D1A


def unit_order(n_units: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n_units)
    return np.random.default_rng([_DOMAIN, seed, epoch]).permutation(n_units)


def reader_units(n_units: int, seed: int, epoch: int, shuffle: bool, reader: int, n_readers: int):
    return unit_order(n_units, seed, epoch, shuffle)[reader::n_readers]


def window_order(n: int, seed: int, epoch: int, reader: int, window: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([_DOMAIN, seed, epoch, 1 + reader, window]).permutation(n)


def epoch_length(counts: np.ndarray, seed: int, epoch: int, shuffle: bool, reader: int, n_readers: int) -> int:
    return int(counts[reader_units(len(counts), seed, epoch, shuffle, reader, n_readers)].sum())


def advance(counts: np.ndarray, seed: int, shuffle: bool, reader: int, n_readers: int,
            epoch: int, pos: int, n_samples: int) -> tuple[int, int]:
    """Position after passing `n_samples` more samples from (epoch, pos) (no holes assumed)."""
    pos += n_samples
    while True:
        n = epoch_length(counts, seed, epoch, shuffle, reader, n_readers)
        if n <= 0:
            raise ValueError(f"reader {reader} of {n_readers} has no samples in epoch {epoch}")
        if pos < n:
            return epoch, pos
        pos -= n
        epoch += 1


def val_batches_per_rank(n_samples: int, micro_batch: int, dp_size: int) -> int:
    return n_samples // (micro_batch * dp_size)


def val_worker_range(n_samples: int, micro_batch: int, dp_rank: int, dp_size: int, worker: int,
                     n_workers: int) -> tuple[int, int]:
    """Sample range [start, stop) of the val split read by (dp_rank, worker)."""
    nb = val_batches_per_rank(n_samples, micro_batch, dp_size)
    base, extra = divmod(nb, n_workers)
    first = worker * base + min(worker, extra)
    count = base + (1 if worker < extra else 0)
    start = (dp_rank * nb + first) * micro_batch
    return start, start + count * micro_batch
