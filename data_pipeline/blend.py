"""The mixture schedule: which source each global position of the train split reads (pure arithmetic).

Weights become integers ``m_i`` with ``sum m_i = D`` (`integer_weights`). A schedule starts at a
global position ``s0`` with per-source counts ``c0`` (0 for a fresh run) and cuts the positions from
there into global batches of ``G`` (``train.global_batch``). Batch ``k`` holds

    n_i(k) = floor(m_i G / D) + x_i(k),   x_i(k) in {0, 1},   sum_i n_i(k) = G,

so every global batch holds each source's share ``w_i G`` to within one sample (strictly: floor or
ceiling). Which sources get the ``r = G - sum floor(m_i G / D)`` extra samples of batch ``k`` is
systematic sampling over a period of ``P = D / gcd(D, G)`` batches: the sources' extra quotas per
period, ``a_i = P (m_i G mod D) / D``, are laid end to end on ``[0, r P)``; batch ``k`` takes the
points ``pi(k mod P) + t P`` (``t < r``, ``pi(j) = j q mod P`` with ``q`` coprime to ``P`` near
``P / golden ratio``), one in each of ``r`` different quotas (each ``a_i < P``). Over a period every
point is taken once, so each source gets exactly its ``a_i`` extras: the cumulative counts equal the
targets ``w_i (position - s0)`` at every period's end, and stay close in between.

Inside a batch the positions interleave as Megatron-LM's blended dataset does (each position goes to
the source whose realised count lags its target ``n_i(k) (p + 1) / G`` most; ties to the lower
index), so micro-batches and data-parallel slices are mixed too. A position's index inside its
source is the source's count before it; the source's own order (its seed-derived permutation and
epochs, `order.GlobalOrder`) maps that index to a sample.

So the schedule is a function of (weights, global batch, s0, c0) and the position: the same under any
data-parallel size, micro-batch and worker count. A run resumed with other weights
(``data.allow_reweight``) or another global batch starts a new schedule at the resume position with
the counts consumed so far.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from common.schema import ConfigError

MAX_DENOMINATOR = 1 << 16  # weights are used to 1/65536 of the total (the period table is P x sources)


def integer_weights(weights) -> list[int]:
    """Positive weights -> integers in the same ratio (exact for decimals such as 0.7 / 0.3, else the
    largest-remainder rounding to a total of 65536, every source keeping at least 1)."""
    fr = [Fraction(repr(float(w))) for w in weights]  # the decimal as written: 0.7 -> 7/10
    if not fr or any(f <= 0 for f in fr):
        raise ConfigError(f"data.mixture: weights must be > 0, got {list(weights)}")
    total = sum(fr)
    p = [f / total for f in fr]
    d = math.lcm(*(x.denominator for x in p))
    if d <= MAX_DENOMINATOR:
        return [int(x * d) for x in p]
    exact = [x * MAX_DENOMINATOR for x in p]
    m = [max(1, int(e)) for e in exact]
    order = sorted(range(len(p)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in order[: max(0, MAX_DENOMINATOR - sum(m))]:
        m[i] += 1
    while sum(m) > MAX_DENOMINATOR:  # sources raised to 1: take from the largest
        m[max(range(len(m)), key=lambda i: m[i])] -= 1
    g = math.gcd(*m)
    return [x // g for x in m]


def _stride(period: int) -> int:
    q = max(1, round(period / 1.6180339887498949))
    for step in range(period):
        for c in (q + step, q - step):
            if 1 <= c < period and math.gcd(c, period) == 1:
                return c
    return 1


def _interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(source, index among that source's positions) of each position of a batch with `counts`."""
    n = [int(c) for c in counts]
    G, sources = sum(n), range(len(n))
    taken = [0] * len(n)
    src, rank = [], []
    for p in range(G):
        i = max(sources, key=lambda s: (n[s] * (p + 1) - taken[s] * G, -s))  # lag behind n_s (p + 1) / G, x G
        src.append(i)
        rank.append(taken[i])
        taken[i] += 1
    return np.array(src, dtype=np.int64), np.array(rank, dtype=np.int64)


class Blend:
    """The schedule of one mixture from position `start` (with `start_counts` consumed before it)."""

    def __init__(self, weights: list[int], global_batch: int, start: int = 0, start_counts=None):
        self.m = np.asarray(weights, dtype=np.int64)
        self.n_sources = len(self.m)
        self.D, self.G, self.start = int(self.m.sum()), int(global_batch), int(start)
        self.start_counts = np.zeros(self.n_sources, np.int64) if start_counts is None else \
            np.asarray(start_counts, dtype=np.int64)
        mg = self.m * self.G
        self.base = mg // self.D
        self.P = self.D // math.gcd(self.D, self.G)
        quota = (mg % self.D) * self.P // self.D  # extra samples per period, each < P
        r = int(quota.sum()) // self.P
        extras = np.zeros((self.P, self.n_sources), dtype=np.int8)
        if r:
            points = (np.arange(self.P)[:, None] * _stride(self.P)) % self.P + np.arange(r)[None, :] * self.P
            owner = np.searchsorted(np.cumsum(quota), points, side="right")
            np.put_along_axis(extras, owner, 1, axis=1)
        self.extras = extras
        self.cum = np.vstack([np.zeros((1, self.n_sources), np.int64), np.cumsum(extras, axis=0, dtype=np.int64)])
        self.per_period = self.base * self.P + quota
        self._patterns: dict = {}

    def batch_counts(self, k: int) -> np.ndarray:
        """Samples of each source in batch `k` of this schedule."""
        return self.base + self.extras[k % self.P]

    def counts_before(self, k: int) -> np.ndarray:
        """Samples of each source consumed before batch `k` of this schedule (start_counts included)."""
        q, j = divmod(int(k), self.P)
        return self.start_counts + q * self.per_period + j * self.base + self.cum[j]

    def counts_at(self, position: int) -> np.ndarray:
        """Samples of each source at global positions before `position` (a batch boundary of this schedule)."""
        k, rest = divmod(int(position) - self.start, self.G)
        if k < 0 or rest:
            raise ValueError(f"position {position} is not a global-batch boundary of the schedule from {self.start}")
        return self.counts_before(k)

    def _pattern(self, k: int):
        key = self.extras[k % self.P].tobytes()
        if key not in self._patterns:
            if len(self._patterns) >= 64:
                self._patterns.pop(next(iter(self._patterns)))
            self._patterns[key] = _interleave(self.batch_counts(k))
        return self._patterns[key]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index in that source's own order) of each global position (>= start)."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(positions) and int(positions.min()) < self.start:
            raise ValueError(f"position {int(positions.min())} precedes the schedule's start {self.start}")
        k_all, p_all = np.divmod(positions - self.start, self.G)
        if len(k_all) and k_all[0] == k_all[-1] == k_all.min():  # one batch (a micro-batch): the common case
            s, rank = self._pattern(int(k_all[0]))
            src = s[p_all]
            return src, self.counts_before(int(k_all[0]))[src] + rank[p_all]
        src, idx = np.empty_like(positions), np.empty_like(positions)
        for k in np.unique(k_all):
            sel = k_all == k
            s, rank = self._pattern(int(k))
            src[sel] = s[p_all[sel]]
            idx[sel] = self.counts_before(int(k))[src[sel]] + rank[p_all[sel]]
        return src, idx

    def first_batch_exceeding(self, limits: np.ndarray, from_batch: int = 0) -> tuple[int, int]:
        """(k, source) of the first batch k >= from_batch in which some source i reads its sample number
        limits[i] (0-based; i.e. after batch k more than limits[i] were consumed)."""
        limits = np.asarray(limits, dtype=np.int64)
        best = (None, -1)
        for i in range(self.n_sources):
            if self.counts_before(from_batch)[i] > limits[i]:
                return from_batch, i
            if self.per_period[i] == 0:
                continue
            lo, hi = from_batch, from_batch + 1  # invariant: counts_before(lo) <= limit
            while self.counts_before(hi)[i] <= limits[i]:
                lo, hi = hi, from_batch + 2 * (hi - from_batch)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if self.counts_before(mid)[i] <= limits[i] else (lo, mid)
            k = hi - 1  # the batch after which the count first exceeds the limit
            if best[0] is None or k < best[0]:
                best = (k, i)
        return best
