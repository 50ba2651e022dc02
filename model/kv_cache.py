"""Preallocated, slot-indexed key/value cache for set decoding with ragged progress per row.

Each batch row is a *slot*: row b holds exactly `length[b]` committed entries, packed at
[0, length[b]) (rotary already applied, so their order does not matter). A forward over T new tokens
writes all of them in place at [length, length + T) (the committed ones first, in input order), attends
to the packed prefix plus the new tokens, and then advances `length` by the committed count only: the
uncommitted ones (MASK queries) are overwritten by the next forward. So there is no concatenation of
the cache per layer, key validity is simply `index < length`, and a slot is recycled for a new prompt
by setting its length to 0 (`reset_rows`) or by copying another cache's rows in (`load_rows`).

Storage per row is `capacity + extra` entries: `capacity` committed tokens (the longest visible context
plus span) and `extra` scratch entries for the widest forward's uncommitted tokens. Memory is bounded
by slots x (capacity + extra), independent of how many prompts a job decodes.

Nothing here reads a value back to the host. `bound` is a host-side upper bound on every row's length
(the decoders keep it tight); the attended key range of a forward is [0, bound + T). `static = True`
attends to the whole storage instead (fixed shapes for torch.compile / CUDA graphs).

Context overflow (`positions=True`): each entry also records its token position (`pos`, -1 for none),
and `drop_oldest(limit, incoming)` drops, per row, the lowest-position live entries so that the live
entries plus the next forward's tokens fit in `limit` (the model's max_seq_len), as the reference
implementation's decoding does when cache + window would exceed its context. A dropped entry keeps its
storage (pos = -1: never attended again), so storage still bounds the entries a row ever commits.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layer_ids, batch: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", extra: int = 0,
                 positions: bool = False):
        self.capacity = int(capacity)
        self.storage = self.capacity + max(int(extra), 1)
        self.kv_heads, self.head_dim = int(kv_heads), int(head_dim)
        shape = (batch, kv_heads, self.storage, head_dim)
        self.k = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {int(i): torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.arange(self.storage, device=device)
        self.pos = torch.full((batch, self.storage), -1, dtype=torch.long, device=device) if positions else None
        self.bound = 0
        self.static = False
        self._dest: torch.Tensor | None = None
        self._kv_idx: torch.Tensor | None = None

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    def key_count(self, t_new: int) -> int:
        return self.storage if self.static else min(self.storage, self.bound + t_new)

    def begin(self, commit: torch.Tensor, new_mask: torch.Tensor | None = None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
        """Start a forward over T new tokens; commit [B, T] bool marks those appended afterwards.

        new_mask: attention among the new tokens, [T, T] or [B, 1, T, T] (True = attend; None: all);
        positions [B, T]: their token positions (recorded with `positions=True`).
        Returns the forward's full mask [B, 1, T, K] over the attended keys [0, K)."""
        commit = commit if commit.dtype == torch.bool else commit.bool()
        B, T = commit.shape
        c = commit.long()
        count = c.sum(1, keepdim=True)
        before = c.cumsum(1) - c  # committed tokens before each one
        # committed tokens first (in input order), then the others: [length, length + T)
        dest = torch.where(commit, before, self.positions[:T] + count - before)
        self._dest = dest.add_(self.length[:, None]).clamp_(max=self.storage - 1)
        self._count = count[:, 0]
        self._t_new = T
        K = self.key_count(T)
        self._keys = K
        self._kv_idx = self._dest.view(B, 1, T, 1).expand(B, self.kv_heads, T, self.head_dim)  # where each layer writes
        if self.pos is not None:
            self.pos.scatter_(1, self._dest, positions)
        mask = self.live(K).view(B, 1, 1, K).expand(B, 1, T, K).clone()
        if new_mask is None:
            new_mask = torch.ones(T, T, dtype=torch.bool, device=c.device)
        new_mask = new_mask.expand(B, 1, T, T) if new_mask.dim() == 2 else new_mask
        idx = self._dest.clamp(max=K - 1).view(B, 1, 1, T).expand(B, 1, T, T)
        return mask.scatter_(3, idx, new_mask)

    def live(self, K: int) -> torch.Tensor:
        """[B, K] bool: the committed, not dropped entries among the first K."""
        old = self.positions[None, :K] < self.length[:, None]
        return old if self.pos is None else old & (self.pos[:, :K] >= 0)

    def drop_oldest(self, limit: int, incoming: torch.Tensor) -> None:
        """Context overflow: drop each row's lowest-position live entries so that its live entries plus
        the `incoming` [B] tokens of the next forward fit in `limit` (needs `positions=True`)."""
        K = self.storage if self.static else min(self.storage, max(self.bound, 1))
        pos = self.pos[:, :K]
        live = self.live(K)
        over = live.sum(1) + incoming - limit  # entries to drop, per row
        key = torch.where(live, pos, torch.full_like(pos, torch.iinfo(pos.dtype).max))
        kth = key.sort(1).values.gather(1, (over - 1).clamp(0, K - 1)[:, None])
        pos.masked_fill_(live & (pos <= kth) & (over > 0)[:, None], -1)

    def attend_kv(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor):
        """Write the new keys/values in place; return the attended keys/values [B, H, K, D] (views)."""
        k, v = self.k[layer], self.v[layer]
        k.scatter_(2, self._kv_idx, k_new if k_new.dtype == k.dtype else k_new.to(k.dtype))
        v.scatter_(2, self._kv_idx, v_new if v_new.dtype == v.dtype else v_new.to(v.dtype))
        return k[:, :, : self._keys], v[:, :, : self._keys]

    def end(self) -> None:
        self.length += self._count
        if not self.static:  # (a static forward reads no host value: nothing for torch.compile to guard on)
            self.bound = min(self.capacity, self.bound + self._t_new)
        self._dest = self._kv_idx = None

    # -- slots ------------------------------------------------------------------------------------
    def reorder(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (e.g. finished rows removed)."""
        for d in (self.k, self.v):
            for i in d:
                d[i] = d[i][rows]
        self.length = self.length[rows]
        if self.pos is not None:
            self.pos = self.pos[rows]

    def reset_rows(self, rows: torch.Tensor) -> None:
        """Empty the given slots (their storage is reused by the next prompt)."""
        self.length.index_fill_(0, rows, 0)

    def load_rows(self, rows: torch.Tensor, other: "KVCache") -> None:
        """Copy `other`'s rows (a cache of len(rows) rows, e.g. a prefill's) into the given slots."""
        n = min(other.storage, self.storage)
        for i in self.k:
            self.k[i][rows, :, :n] = other.k[i][:, :, :n].to(self.k[i].dtype)
            self.v[i][rows, :, :n] = other.v[i][:, :, :n].to(self.v[i].dtype)
        self.length[rows] = other.length
        if self.pos is not None:
            self.pos[rows, :n] = other.pos[:, :n]
