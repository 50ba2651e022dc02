"""Rotary position embeddings at arbitrary per-token positions.

Set-diffusion layouts permute tokens, so the rotary phase comes from each token's original position
(`position_ids`), never from its index in the input."""

from __future__ import annotations

import torch


class Rotary(torch.nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        # integer arange, then float64: a float factory in a build that casts floating-point factories
        # to the parameters' dtype (bf16) would come back in it; this buffer stays float32 in any build
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2).double() / head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [B, T] -> (cos, sin), each [B, 1, T, head_dim // 2] in float32."""
        freqs = position_ids.float()[..., None] * self.inv_freq
        return freqs.cos()[:, None], freqs.sin()[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] rotated pairwise (first half, second half) by the given phases."""
    dtype = x.dtype
    x1, x2 = (x if dtype == torch.float32 else x.float()).chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out if dtype == torch.float32 else out.to(dtype)
