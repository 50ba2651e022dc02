"""The sample order: one global sequence per split, a pure function of (seed, data), sliced per rank.

A split is a list of *units* (shards, or single sequences for builtin sources) with sample counts
(``N`` samples in all). Every sample of the run has a **global position** ``g = 0, 1, 2, ...`` in one
infinite sequence; nothing about it depends on the data-parallel size, the micro-batch or
``data.num_workers`` (OLMo-core's global-index approach).

Train split: epoch ``e = g // N`` covers positions ``[e N, (e + 1) N)``. In epoch ``e`` the units are
permuted with ``rng(seed, e)`` (identity without shuffling) and cut into windows of ``window``
consecutive units; a window's samples follow each other in the order of ``rng(seed, e, window index)``.
So the ``i``-th sample of epoch ``e`` is found by arithmetic on the unit sizes, and a reader needs only
the units of the windows its positions fall in.

Val split (finite, never shuffled): position ``i`` is sample ``i`` in manifest order; a pass covers
``[0, n_eval)`` with ``n_eval`` a multiple of the global batch.

Global batches: optimizer step ``k`` (counted from a start position ``s``) takes positions
``[s + k G, s + (k + 1) G)``. Data-parallel rank ``r`` of ``dp`` takes the contiguous slice of ``G / dp``
positions starting at ``s + k G + r G / dp`` and reads it as ``G / (dp B)`` micro-batches of ``B``
(`rank_positions`). The set of samples in a step, and the position of every sample, are the same under
every layout.
"""
from __future__ import annotations

import numpy as np

from common.schema import ConfigError

_DOMAIN = 0x5E7D1A


def unit_order(n_units: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n_units)
    return np.random.default_rng([_DOMAIN, seed, epoch]).permutation(n_units)


def window_order(n: int, seed: int, epoch: int, window: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([_DOMAIN, seed, epoch, 2, window]).permutation(n)


class GlobalOrder:
    """Maps global positions to (unit, row in unit) for one split (picklable; caches per epoch)."""

    def __init__(self, counts: np.ndarray, seed: int, shuffle: bool, window: int):
        self.counts = np.asarray(counts, dtype=np.int64)
        self.seed, self.shuffle, self.window = int(seed), bool(shuffle), int(window)
        self.n = int(self.counts.sum())
        if self.n <= 0:
            raise ValueError("the split has no samples")
        self._epochs: dict = {}
        self._windows: dict = {}

    def _epoch(self, epoch: int):
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[epoch] = self._epoch_layout(epoch)
        return self._epochs[epoch]

    def _window(self, epoch: int, w: int):
        if (epoch, w) not in self._windows:
            if len(self._windows) >= 8:
                self._windows.pop(next(iter(self._windows)))
            self._windows[epoch, w] = self._window_layout(epoch, w)
        return self._windows[epoch, w]

    def _epoch_layout(self, epoch: int):
        perm = unit_order(len(self.counts), self.seed, epoch, self.shuffle)
        sizes = self.counts[perm]
        unit_end = np.cumsum(sizes)  # end (in epoch positions) of each permuted unit
        w_units = [perm[j:j + self.window] for j in range(0, len(perm), self.window)]
        w_end = unit_end[np.minimum(np.arange(len(w_units)) * self.window + self.window, len(perm)) - 1]
        return w_units, w_end

    def _window_layout(self, epoch: int, w: int):
        units = self._epoch(epoch)[0][w]
        c = self.counts[units]
        return units, np.cumsum(c), window_order(int(c.sum()), self.seed, epoch, w, self.shuffle)

    def window_units(self, epoch: int, w: int) -> np.ndarray:
        return self._epoch(epoch)[0][w]

    def locate(self, positions: np.ndarray):
        """(epoch, window, unit, row) arrays for global positions (int64 array)."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs, within = np.divmod(positions, self.n)
        out_w, out_u, out_r = (np.empty_like(positions) for _ in range(3))
        for e in _groups(epochs):
            sel = slice(None) if e is None else epochs == e
            e = int(epochs[0]) if e is None else int(e)
            w_units, w_end = self._epoch(e)
            i = within[sel]
            w = np.searchsorted(w_end, i, side="right")
            out_w[sel] = w
            u_sel, r_sel = np.empty_like(i), np.empty_like(i)
            for wi in _groups(w):
                s = slice(None) if wi is None else w == wi
                wi = int(w[0]) if wi is None else int(wi)
                units, u_end, perm = self._window(e, wi)
                start = w_end[wi - 1] if wi > 0 else 0
                k = perm[i[s] - start]  # sample index inside the window's concatenated units
                j = np.searchsorted(u_end, k, side="right")
                u_sel[s] = units[j]
                r_sel[s] = k - (u_end[j] - self.counts[units[j]])
            out_u[sel], out_r[sel] = u_sel, r_sel
        return epochs, out_w, out_u, out_r


def _groups(values: np.ndarray):
    """The distinct values to loop over; [None] (meaning: all of them, one value) in the common case."""
    if len(values) and values.min() == values.max():
        return [None]
    return np.unique(values)


def rank_positions(batch: int, start: int, global_batch: int, micro_batch: int, dp_rank: int,
                   dp_size: int) -> np.ndarray:
    """Global positions of micro-batch `batch` (counted from `start`) of data-parallel rank `dp_rank`."""
    accum = global_batch // (micro_batch * dp_size)
    step, m = divmod(batch, accum)
    first = start + step * global_batch + dp_rank * (global_batch // dp_size) + m * micro_batch
    return np.arange(first, first + micro_batch, dtype=np.int64)


def check_layout(global_batch: int, micro_batch: int, dp_size: int) -> None:
    if global_batch % (micro_batch * dp_size):
        raise ConfigError(f"global_batch: {global_batch} is not divisible by micro_batch x dp_size = "
                          f"{micro_batch} x {dp_size}")


def val_samples(n_samples: int, global_batch: int) -> int:
    """Samples of one validation pass: whole global batches of the val split."""
    return n_samples // global_batch * global_batch
