"""AR decoding: ordinary KV-cached next-token decoding, batched with ragged prompts.

The prompt is prefilled left-padded (positions are explicit, so padding only costs compute) and its
last logits give the first token. Each later step forwards one token per row (the previous step's
token, committed to the cache) and chooses the next. Infilling conditions on the prefix only.
"""

from __future__ import annotations

import torch

from ..masks import build_mask, with_key_padding
from .engine import Decoder


class ARDecoder(Decoder):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        B = len(self.reqs)
        capacity = max((len(r.prefix) + r.span for r in self.reqs), default=1)
        self.cache = self.model.new_cache(B, max(capacity, 1))
        self.pend_ids = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        self.pend_pos = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        self.pend_valid = torch.zeros(B, 1, dtype=torch.bool, device=self.device)
        self.next_logits = None

    def prefill(self) -> None:
        ids, pos, valid = self.visible_batch(left_pad=True)
        n = ids.shape[1]
        mask = with_key_padding(build_mask("causal", n, device=self.device), valid)
        self.next_logits = self.logits(ids, pos, mask, cache=self.cache, commit=valid, logits_slice=slice(n - 1, n))

    def step(self, step: int) -> None:
        if step > 1:
            pv = self.pend_valid & (self.pend_pos < self.span_end[:, None])
            self.next_logits = self.logits(self.pend_ids, self.pend_pos, None, cache=self.cache, commit=pv)
        pos = self.todo.int().argmax(1, keepdim=True)
        active = self.todo.gather(1, pos)
        tok, _ = self.choose(self.next_logits)
        self.steps += active[:, 0]
        self.write(pos, tok, active, step)
        self.pend_ids, self.pend_pos, self.pend_valid = tok, pos, active

    def select_rows(self, keep: torch.Tensor) -> None:
        super().select_rows(keep)
        self.pend_ids, self.pend_pos, self.pend_valid = self.pend_ids[keep], self.pend_pos[keep], self.pend_valid[keep]
        self.next_logits = self.next_logits[keep]
        self.cache.reorder(keep)
