"""Context parallelism (CP): one sequence split over `size` ranks, and the K/V exchange attention needs.

Every rank of a CP group holds the same weights and reads the same samples. The sequence of L
positions is cut into 2 * size chunks of c = L / (2 * size) positions, and rank r holds chunks r and
2 * size - 1 - r ("head-tail": every rank gets an early and a late chunk, so under a causal or
set-causal mask every rank has the same number of allowed query-key pairs). The two-stream families
(SW-SetDLM, BD3-LM) hold those positions of BOTH streams: rank r's tokens are its 2c positions of
stream 0 followed by the same 2c positions of stream 1 (positions in the stream's own order: the
generation order for SW-SetDLM).

Which K/V cross ranks (model/masks.py's masks decide it):

- ``set_causal`` (SW-SetDLM, clean stream first): a clean row attends clean keys up to itself, a
  query row clean keys before it and only itself in the query stream. So only the clean stream's K/V
  are exchanged (all-gathered: every rank gets all L clean positions); query K/V stay on their rank.
- ``block_diffusion`` (BD3-LM, noisy stream first): a noisy row attends noisy keys of its own block
  (on its own rank when a chunk is a whole number of blocks) and clean keys of earlier blocks: the
  clean stream (the second) is exchanged, the noisy one stays local.
- ``bidirectional`` (MDLM) and ``causal`` (AR), one stream: all K/V are gathered.

So a two-stream layer moves L tokens of K/V per rank, not the 2L the sequence has. The exchange is
an all-gather in the forward and a reduce-scatter of dK/dV in the backward (`ContextParallel.all_gather`;
pretrain/context_parallel.py does it over the CP process group). The gathered stream is put back in
stream order, so a rank's keys are: the streams before the exchanged one (local), the exchanged stream
whole, the streams after it (local). The rank-local mask is the static mask's rows at this rank's
tokens and columns at its keys (`RankLayout.mask`): the same boolean values the one-process mask has
there, through SDPA, or as a flex block mask on GPU (`RankLayout.block_mask`).

`ContextParallel` is the seam the model talks to (as `model.layers.TensorParallel` is for TP): the
class here is one process (size 1, nothing to exchange); the multi-rank implementation lives in
pretrain/, so model/ imports no process group.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from common.schema import ConfigError

from .masks import build_mask

# mask kind -> (streams through the model, the stream whose K/V are exchanged)
STREAMS = {"causal": (1, 0), "bidirectional": (1, 0), "set_causal": (2, 0), "block_diffusion": (2, 1)}


class ContextParallel:
    """One process: the whole sequence on this rank. Subclasses split it over `size` ranks."""

    size = 1
    rank = 0

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[*shape] on every rank -> [size, *shape], rank q's tensor at index q; the backward sums the
        gradients of each rank's tensor over the ranks (a reduce-scatter) and hands each its own."""
        return x[None]


def check_layout(kind: str, length: int, size: int, block_size: int = 0) -> None:
    """The sequence splits into 2 * size equal chunks (and, for the block-diffusion mask, each chunk is
    a whole number of blocks): a ConfigError naming the keys otherwise."""
    if size < 1 or length % (2 * size):
        raise ConfigError(f"parallel.cp: data.seq_len={length} is not divisible by 2 * cp = {2 * size} (each rank "
                          "holds two of 2 * cp equal chunks of the sequence)")
    if kind == "block_diffusion" and block_size > 0 and (length // (2 * size)) % block_size:
        raise ConfigError(f"parallel.cp: a chunk of data.seq_len / (2 * cp) = {length // (2 * size)} tokens is not a "
                          f"multiple of objective.block_size={block_size} (noisy K/V stay on their rank only when a "
                          "chunk holds whole blocks)")


def chunk_positions(length: int, size: int, rank: int) -> torch.Tensor:
    """The 2c positions of rank `rank` (chunks `rank` and 2 * size - 1 - rank), ascending."""
    c = length // (2 * size)
    a = torch.arange(rank * c, (rank + 1) * c)
    b = torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c)
    return torch.cat((a, b))


def to_stream_order(gathered: torch.Tensor) -> torch.Tensor:
    """[size, ..., 2c, D] (each rank's chunks, as `all_gather` returns them) -> [..., L, D] in stream
    order: chunks 0 .. size-1 are the ranks' first chunks, chunks size .. 2 size-1 their second ones in
    reverse rank order."""
    size, c = gathered.shape[0], gathered.shape[-2] // 2
    first = gathered[..., :c, :].movedim(0, -3)  # [..., size, c, D]
    second = gathered.flip(0)[..., c:, :].movedim(0, -3)
    shape = (*first.shape[:-3], size * c, first.shape[-1])
    return torch.cat((first.reshape(shape), second.reshape(shape)), dim=-2)


@dataclass(frozen=True)
class RankLayout:
    """Rank `rank`'s part of a sequence of `length` positions per stream under a mask `kind` over
    `size` CP ranks; index maps, the exchanged slice and the rank-local mask."""

    kind: str
    length: int  # L (positions per stream)
    size: int
    rank: int
    block_size: int = 0

    @property
    def streams(self) -> int:
        return STREAMS[self.kind][0]

    @property
    def exchanged(self) -> int:
        """The stream whose K/V are gathered from every rank."""
        return STREAMS[self.kind][1]

    @property
    def local(self) -> int:
        """Positions per stream on this rank (2c)."""
        return self.length // self.size

    def positions(self) -> torch.Tensor:
        return chunk_positions(self.length, self.size, self.rank)

    def token_index(self) -> torch.Tensor:
        """Indices into the full [streams * L] sequence of this rank's tokens, in local order."""
        pos = self.positions()
        return torch.cat([s * self.length + pos for s in range(self.streams)])

    def key_index(self) -> torch.Tensor:
        """Indices into the full sequence of this rank's keys: its local streams, the exchanged one whole."""
        pos, L = self.positions(), self.length
        return torch.cat([s * L + (torch.arange(L) if s == self.exchanged else pos) for s in range(self.streams)])

    def exchanged_tokens(self) -> slice:
        """Where the exchanged stream's local tokens sit among this rank's tokens (and its gathered
        keys start among its keys)."""
        return slice(self.exchanged * self.local, (self.exchanged + 1) * self.local)

    def mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The rank-local boolean mask [tokens, keys] (True = may attend): the static mask's rows and
        columns at this rank's index maps; cached."""
        return _local_mask(self, str(torch.device(device)))

    def slice_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A full mask [..., T, T] (a per-row padded one) cut to this rank's rows and keys."""
        rows, cols = self.token_index().to(mask.device), self.key_index().to(mask.device)
        return mask.index_select(-2, rows).index_select(-1, cols)

    def block_mask(self, device: torch.device | str):
        """The rank-local mask as a flex-attention block mask (the GPU path); cached."""
        return _local_block_mask(self, str(torch.device(device)))

    def pairs(self) -> int:
        """Query-key pairs this rank's mask allows (its attention work)."""
        return int(self.mask().sum())


@functools.lru_cache(maxsize=64)
def _local_mask(layout: RankLayout, device: str) -> torch.Tensor:
    full = build_mask(layout.kind, layout.length, layout.block_size, device)
    return layout.slice_mask(full)


@functools.lru_cache(maxsize=64)
def _local_block_mask(layout: RankLayout, device: str):
    from . import flex  # here: flex attention imports torch._dynamo (about a second per process otherwise)

    rows, cols = layout.token_index().to(device), layout.key_index().to(device)
    base = flex.mask_mod(layout.kind, layout.length, layout.block_size)

    def local(b, h, q, kv):
        return base(b, h, rows[q], cols[kv])

    return flex.create_block_mask(local, None, None, rows.numel(), cols.numel(), device=device)


def exchange_kv(cp: ContextParallel, layout: RankLayout, k: torch.Tensor, v: torch.Tensor):
    """k, v [B, H, tokens, D] of this rank's tokens -> [B, H, keys, D]: the exchanged stream's K/V
    gathered from every rank (one all-gather of K and V together; reduce-scatter of dK/dV backward)
    and put in stream order, the other streams' K/V as they are."""
    xs = layout.exchanged_tokens()
    gathered = to_stream_order(cp.all_gather(torch.stack((k[:, :, xs], v[:, :, xs]))))  # [2, B, H, L, D]
    k = torch.cat((k[:, :, :xs.start], gathered[0], k[:, :, xs.stop:]), dim=2)
    v = torch.cat((v[:, :, :xs.start], gathered[1], v[:, :, xs.stop:]), dim=2)
    return k, v


def exchanged_bytes(layout: RankLayout, batch: int, kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """Bytes of one attention layer's all-gathered K/V on each rank (the forward's output; the backward's
    reduce-scatter input has the same size): one stream of L positions, K and V."""
    return 2 * batch * kv_heads * layout.length * head_dim * bytes_per_value


__all__ = ["ContextParallel", "RankLayout", "STREAMS", "check_layout", "chunk_positions", "exchange_kv",
           "exchanged_bytes", "to_stream_order"]
