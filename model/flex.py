"""Flex-attention block masks for the static mask kinds (the GPU fast path).

The same masks as model/masks.py, written as `mask_mod` predicates so flex attention skips every
fully-masked tile: the SetDLM two-stream layout then costs about two causal attentions instead of a
dense 2L x 2L one. Block masks are built once per (kind, length, block size, device) and cached.
Flex attention trains on CUDA; on CPU it runs forward only (used by the tests to check the
predicates against the dense masks).
"""

from __future__ import annotations

import functools

import torch

try:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - torch < 2.5
    BlockMask = create_block_mask = flex_attention = None


def available() -> bool:
    return flex_attention is not None


def mask_mod(kind: str, length: int, block_size: int = 0):
    L = length
    if kind == "causal":
        return lambda b, h, q, kv: kv <= q
    if kind == "bidirectional":
        return lambda b, h, q, kv: kv >= 0
    if kind == "set_causal":
        def set_causal(b, h, q, kv):
            q_query, kv_query = q >= L, kv >= L
            q_rank = torch.where(q_query, q - L, q)
            kv_rank = torch.where(kv_query, kv - L, kv)
            clean_row = ~q_query & ~kv_query & (kv_rank <= q_rank)
            query_row = q_query & ((~kv_query & (kv_rank < q_rank)) | (kv == q))
            return clean_row | query_row
        return set_causal
    if kind == "block_diffusion":
        B = block_size

        def block_diffusion(b, h, q, kv):
            q_clean, kv_clean = q >= L, kv >= L
            qb = torch.where(q_clean, q - L, q) // B
            kb = torch.where(kv_clean, kv - L, kv) // B
            noisy_row = ~q_clean & ((~kv_clean & (qb == kb)) | (kv_clean & (kb < qb)))
            clean_row = q_clean & kv_clean & (kb <= qb)
            return noisy_row | clean_row
        return block_diffusion
    raise ValueError(f"flex attention: unknown mask kind {kind!r}")


@functools.lru_cache(maxsize=32)
def block_mask(kind: str, length: int, block_size: int, device: str):
    T = length if kind in ("causal", "bidirectional") else 2 * length
    return create_block_mask(mask_mod(kind, length, block_size), None, None, T, T, device=device)


_compiled = None


def is_block_mask(mask) -> bool:
    return BlockMask is not None and isinstance(mask, BlockMask)


def attention(q, k, v, kind: str, length: int, block_size: int = 0, enable_gqa: bool = False):
    """flex attention with the cached block mask of a static mask kind (compiled on CUDA, eager elsewhere)."""
    return attend(q, k, v, block_mask(kind, int(length), int(block_size), str(q.device)), enable_gqa)


def attend(q, k, v, bm, enable_gqa: bool = False):
    """flex attention under a built block mask. The model builds it once per forward, outside its
    (possibly compiled) blocks, so a compiled block takes it as an input instead of tracing the cache
    lookup and rebuilding it in every block's graph."""
    global _compiled
    fn = flex_attention
    if q.device.type == "cuda":
        if _compiled is None:
            _compiled = torch.compile(flex_attention, dynamic=False)
        fn = _compiled
    return fn(q, k, v, block_mask=bm, enable_gqa=enable_gqa)
