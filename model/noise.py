"""Per-sample random numbers keyed by (seed, stream, global sample index).

Training draws (MDLM/BD3-LM noise levels and masks, SetDLM generation orders) come from a
`SampleNoise` built for each micro-batch from the samples' global positions in the data order
(``batch["sample_index"]``, data_pipeline/order.py). Every number a sample sees is a hash of
(seed, stream, its index, which draw, which element), so it is the same whatever micro-batch, gradient
accumulation or data-parallel rank the sample lands in, and on CPU and GPU alike (integer arithmetic).
Noise levels are stratified ("antithetic") over the whole global batch: sample ``j`` of a global batch
of ``G`` gets ``(u + j / G) mod 1`` with one ``u`` per global batch.

The hash is splitmix64's finaliser on int64 tensors (wrapping multiplication, logical shifts done
with masks), vectorised on the batch's device: a handful of elementwise kernels per draw.

The objectives call `rand`, `randint` and `noise_levels` with whatever ``generator`` they were given:
a `SampleNoise` (training and validation in the trainer), or a ``torch.Generator``/``None`` (sampling,
evaluation and tests that prepare a whole batch at once), which draws exactly as ``torch.rand`` does.
"""

from __future__ import annotations

import math

import torch

TRAIN, VAL = 0, 1  # streams: training steps and validation passes never share draws


def _i64(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_C1 = _i64(0xBF58476D1CE4E5B9)
_C2 = _i64(0x94D049BB133111EB)


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 tensors."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64: a bijective scramble of int64 values (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ _srl(x, 30)) * _C1
    x = (x ^ _srl(x, 27)) * _C2
    return x ^ _srl(x, 31)


def _to_uniform(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Uniform in [0, 1) from hash bits: 53 bits for float64, 24 for narrower types (never rounds to 1)."""
    if dtype == torch.float64:
        return _srl(h, 11).to(torch.float64) * 2.0 ** -53
    return (_srl(h, 40).to(torch.float32) * 2.0 ** -24).to(dtype)


class SampleNoise:
    """Random numbers for the rows of one micro-batch, each row keyed by its global sample index."""

    def __init__(self, seed: int, sample_index: torch.Tensor, global_batch: int, stream: int = TRAIN):
        idx = sample_index.to(torch.int64)
        base = mix(torch.full_like(idx, int(seed) * 4 + int(stream)))
        self.rows = mix(base ^ mix(idx))  # [B] per-sample keys
        self.batch_keys = mix(base ^ mix(-1 - torch.div(idx, global_batch, rounding_mode="floor")))  # [B]
        self.slot = torch.remainder(idx, global_batch)  # place in its global batch
        self.global_batch = int(global_batch)
        self.device = idx.device
        self.calls = 0

    def __len__(self) -> int:
        return self.rows.numel()

    def _bits(self, keys: torch.Tensor, n: int) -> torch.Tensor:
        self.calls += 1
        c = torch.arange(n, device=self.device, dtype=torch.int64) + (self.calls << 40)
        return mix(keys[:, None] ^ mix(c)[None, :])

    def uniform(self, shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        shape = tuple(shape)
        if not shape or shape[0] != len(self):
            raise ValueError(f"SampleNoise: draws are per sample (leading dim {len(self)}), got shape {shape}")
        n = math.prod(shape[1:])
        return _to_uniform(self._bits(self.rows, n), dtype).view(shape)

    def noise_levels(self, n: int, eps: float, antithetic: bool) -> torch.Tensor:
        """`n` = rows x levels per row noise levels in [eps, 1), flat in row-major order; antithetic:
        stratified over the global batch's rows x levels."""
        B = len(self)
        if n % B:
            raise ValueError(f"SampleNoise: {n} noise levels for {B} samples")
        per = n // B
        if antithetic:
            u0 = _to_uniform(self._bits(self.batch_keys, 1), torch.float32)  # one per global batch
            j = self.slot[:, None] * per + torch.arange(per, device=self.device)
            u = (u0 + j.to(torch.float32) / (self.global_batch * per)) % 1.0
        else:
            u = self.uniform((B, per))
        return (eps + (1 - eps) * u).reshape(n)


def rand(shape, generator=None, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.rand(shape) from a SampleNoise or a torch.Generator."""
    if isinstance(generator, SampleNoise):
        return generator.uniform(shape, dtype)
    return torch.rand(tuple(shape), generator=generator, device=device, dtype=dtype)


def randint(high: int, shape, generator=None, device=None) -> torch.Tensor:
    """torch.randint(0, high, shape) from a SampleNoise or a torch.Generator."""
    if isinstance(generator, SampleNoise):
        u = generator.uniform(shape, torch.float64)
        return (u * high).floor().long().clamp_(max=high - 1)
    return torch.randint(0, high, tuple(shape), generator=generator, device=device)


def noise_levels(n: int, eps: float, antithetic: bool, generator=None, device=None) -> torch.Tensor:
    """`n` noise levels t in [eps, 1]; antithetic: evenly spaced from one uniform (over the global batch
    for a SampleNoise, over these `n` otherwise)."""
    if isinstance(generator, SampleNoise):
        return generator.noise_levels(n, eps, antithetic)
    u = torch.rand(n if not antithetic else 1, generator=generator, device=device)
    if antithetic:
        u = (u + torch.arange(n, device=device) / n) % 1.0
    return eps + (1 - eps) * u


__all__ = ["SampleNoise", "rand", "randint", "noise_levels", "mix", "TRAIN", "VAL"]
