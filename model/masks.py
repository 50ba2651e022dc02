"""Static attention masks, built once per (kind, length, block size, device) and cached.

Convention: True means "may attend" (SDPA's boolean convention). Masks never depend on the sampled
generation order: training permutes the data, not the mask (SETDLM.md section 3).

Kinds:
  causal         L x L   token i attends j <= i
  bidirectional  L x L   everything
  set_causal     2L x 2L clean stream [0, L) then query stream [L, 2L), both in generation order:
                         clean r -> clean s <= r; query r -> clean s < r and itself
  block_diffusion 2L x 2L noisy stream x_t [0, L) then clean x_0 [L, 2L), blocks of B:
                         x_t in block b -> x_t in block b, x_0 in blocks < b;
                         x_0 in block b -> x_0 in blocks <= b
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from common.schema import ConfigError

MASK_KINDS = ("causal", "bidirectional", "set_causal", "block_diffusion")  # SW-SetDLM's and BD3-LM's are the last two


class MaskSpec(NamedTuple):
    """A static mask by name: lets the attention pick a structured kernel (flex attention on GPU)."""

    kind: str
    length: int  # L (the two-stream kinds span 2L tokens)
    block_size: int = 0


@functools.lru_cache(maxsize=32)
def _build(kind: str, length: int, block_size: int, device: str) -> torch.Tensor:
    L = length
    idx = torch.arange(L, device=device)
    if kind == "causal":
        return idx[:, None] >= idx[None, :]
    if kind == "bidirectional":
        return torch.ones(L, L, dtype=torch.bool, device=device)
    mask = torch.zeros(2 * L, 2 * L, dtype=torch.bool, device=device)
    if kind == "set_causal":
        causal = idx[:, None] >= idx[None, :]
        mask[:L, :L] = causal  # clean -> clean (inclusive)
        mask[L:, :L] = idx[:, None] > idx[None, :]  # query -> strictly earlier clean
        mask[L:, L:] = torch.eye(L, dtype=torch.bool, device=device)  # query -> itself
        return mask
    if kind == "block_diffusion":
        if block_size < 1 or L % block_size:
            raise ConfigError(f"block-diffusion mask: block size {block_size} must divide length {L}")
        blk = idx // block_size
        mask[:L, :L] = blk[:, None] == blk[None, :]  # x_t -> own block
        mask[:L, L:] = blk[:, None] > blk[None, :]  # x_t -> clean earlier blocks
        mask[L:, L:] = blk[:, None] >= blk[None, :]  # x_0 -> x_0 block-causal
        return mask
    raise ValueError(f"unknown mask kind {kind!r}; valid: {', '.join(MASK_KINDS)}")


def build_mask(kind: str, length: int, block_size: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [T, T] mask (T = length, or 2 * length for the two-stream kinds); cached."""
    return _build(kind, int(length), int(block_size), str(torch.device(device)))


def with_key_padding(mask: torch.Tensor, key_valid: torch.Tensor | None) -> torch.Tensor:
    """Combine a static [T, T] mask with a per-row key validity [B, T] into [B, 1, T, T].

    Rows whose keys are all invalid keep their diagonal so softmax never sees an empty row."""
    if key_valid is None:
        return mask
    full = mask[None, None] & key_valid[:, None, None, :]
    eye = torch.eye(mask.shape[-1], dtype=torch.bool, device=mask.device)
    return full | eye[None, None]
