"""Preallocated key/value cache for set decoding with ragged progress per row.

Entries are the keys/values of *committed* tokens (rotary already applied, so their order in the
cache does not matter). A forward over new tokens attends to the cache plus the new tokens and then
appends those marked `commit` in place; the others (MASK queries) are dropped. Nothing here reads a
value back to the host: write offsets are computed on the device, and the attended prefix length
`bound` is a host-side upper bound that grows by the number of new tokens per forward.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layer_ids, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        self.capacity = int(capacity)
        slots = self.capacity + 1  # the last slot absorbs writes of uncommitted tokens
        shape = (batch, kv_heads, slots, head_dim)
        self.k = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.valid = torch.zeros(batch, slots, dtype=torch.bool, device=device)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.bound = 0
        self._dest: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    def begin(self, commit: torch.Tensor) -> None:
        """commit [B, T_new] bool: which new tokens are appended after this forward."""
        commit = commit.bool()
        offset = torch.cumsum(commit.long(), dim=1) - 1
        dest = torch.where(commit, self.length[:, None] + offset, torch.full_like(offset, self.capacity))
        self._dest = dest.clamp_(max=self.capacity)
        self._count = commit.long().sum(1)
        self._t_new = commit.shape[1]

    def prefix_mask(self) -> torch.Tensor:
        """[B, bound] validity of the cached entries that new tokens may attend to."""
        return self.valid[:, : self.bound]

    def attend_kv(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Keys/values to attend to: cached prefix followed by the new tokens; then append committed ones."""
        k_all = torch.cat((self.k[layer][:, :, : self.bound], k_new), dim=2)
        v_all = torch.cat((self.v[layer][:, :, : self.bound], v_new), dim=2)
        idx = self._dest[:, None, :, None].expand(-1, k_new.shape[1], -1, k_new.shape[3])
        self.k[layer].scatter_(2, idx, k_new.to(self.k[layer].dtype))
        self.v[layer].scatter_(2, idx, v_new.to(self.v[layer].dtype))
        return k_all, v_all

    def end(self) -> None:
        self.valid.scatter_(1, self._dest, True)
        self.valid[:, self.capacity] = False
        self.length += self._count
        self.bound = min(self.capacity, self.bound + self._t_new)
        self._dest = None

    def reorder(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (e.g. finished rows removed)."""
        for d in (self.k, self.v):
            for i in d:
                d[i] = d[i][rows]
        self.valid, self.length = self.valid[rows], self.length[rows]
