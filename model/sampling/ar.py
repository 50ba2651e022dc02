"""AR decoding: ordinary KV-cached next-token decoding, batched with ragged prompts.

The prompt except its last token is prefilled left-padded (positions are explicit, so padding only
costs compute); the last prompt token is the first step's pending token. Each step forwards one token
per row (the previous step's token, or the prompt's last one, committed to the cache by that forward)
and chooses the next, so a row admitted into a running batch needs no special first step. Infilling
conditions on the prefix only.
"""

from __future__ import annotations

import torch

from ..masks import build_mask, with_key_padding
from .engine import Decoder, Request


class ARDecoder(Decoder):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        S, dev = self.S, self.device
        self.cache = self.new_slot_cache(1)
        self.pend_ids = torch.zeros(S, 1, dtype=torch.long, device=dev)
        self.pend_pos = torch.zeros(S, 1, dtype=torch.long, device=dev)
        self.pend_valid = torch.zeros(S, 1, dtype=torch.bool, device=dev)

    def cache_need(self, r: Request) -> int:
        return len(r.prefix) + r.span

    def reset_slots(self, st, reqs) -> None:
        dev = self.device
        self.pend_ids[st] = torch.tensor([[r.prefix[-1]] for r in reqs], dtype=torch.long, device=dev)
        self.pend_pos[st] = torch.tensor([[len(r.prefix) - 1] for r in reqs], dtype=torch.long, device=dev)
        self.pend_valid[st] = True

    def prefilled(self, r: Request) -> tuple[list[int], list[int]]:
        return r.visible[:-1], r.visible_positions[:-1]  # the last prompt token is the first step's pending one

    def prefill(self, st, slots, reqs) -> None:
        ids, pos, valid = self.visible_batch(reqs, left_pad=True)
        mask = with_key_padding(build_mask("causal", ids.shape[1], device=self.device), valid)
        self.prefill_cache(st, slots, ids, pos, mask, valid)
        self.set_cached(slots, [len(r.prefix) - 1 for r in reqs])

    def device_step(self) -> None:
        pv = self.pend_valid & (self.pend_pos < self.span_end[:, None])
        if self.drops:
            self.fit_context(pv.sum(1))
        if self.cpu_head:
            hidden = self.model(self.pend_ids, self.pend_pos, None, cache=self.cache, commit=pv, head=False)
            tok, _ = self.head_choose(hidden, confidence=False)
        else:
            tok, _ = self.choose(self.logits(self.pend_ids, self.pend_pos, None, cache=self.cache, commit=pv),
                                 confidence=False)
        pos = self.todo.int().argmax(1, keepdim=True)
        active = self.todo.gather(1, pos)
        self.steps += active[:, 0]
        self.write(pos, tok, active)
        self.pend_ids.copy_(tok)
        self.pend_pos.copy_(pos)
        self.pend_valid.copy_(active)

    def after_step(self) -> None:
        self.grow_bound(1)

    def select_rows(self, keep: torch.Tensor) -> None:
        super().select_rows(keep)
        self.pend_ids, self.pend_pos, self.pend_valid = self.pend_ids[keep], self.pend_pos[keep], self.pend_valid[keep]
        self.cache.reorder(keep)
