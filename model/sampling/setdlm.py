"""SW-SetDLM decoding with a KV cache (SETDLM.md section 5), batched with ragged progress.

One forward per step over p + w tokens per row: p `pending` slots (tokens accepted last step, packed
left in ascending position order, causal among themselves, committed to the cache by this forward)
followed by w query slots (MASK at the masked positions of [start, start + w), each seeing the cache,
the valid pending tokens and itself; dropped from the cache). p = w with a threshold below 1, p = 1
without one (then exactly one token is accepted per step). Everything is computed on the device; the
step has fixed shapes [B, p + w] (only the cache's attended prefix grows).
"""

from __future__ import annotations

import torch

from ..masks import build_mask, with_key_padding
from .engine import Decoder
from .processors import accept_top1


class SetDLMDecoder(Decoder):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.w = self.slot_count()
        self.p = self.pending_count()
        w, p, dev = self.w, self.p, self.device
        B = len(self.reqs)
        self.offsets = torch.arange(w, device=dev)
        self.pend_ids = torch.full((B, p), self.mask_id, dtype=torch.long, device=dev)
        self.pend_pos = torch.zeros(B, p, dtype=torch.long, device=dev)
        self.pend_valid = torch.zeros(B, p, dtype=torch.bool, device=dev)
        self.template = self.step_template().to(dev)
        self.eye = torch.eye(p + w, dtype=torch.bool, device=dev)
        self.query_mask_ids = torch.full((B, w), self.mask_id, dtype=torch.long, device=dev)
        self.no_commit = torch.zeros(B, w, dtype=torch.bool, device=dev)
        capacity = max((len(r.visible) + r.span for r in self.reqs), default=0)
        self.cache = self.model.new_cache(B, max(capacity, 1))
        self.bound = 0

    # -- policy hooks (BD3-LM overrides them) ----------------------------------------------------
    def slot_count(self) -> int:
        return self.cfg.window_size

    def pending_count(self) -> int:
        """Most tokens one step can accept (host-known, so shapes stay static)."""
        thr = self.cfg.threshold
        return self.w if thr is not None and thr < 1.0 else 1

    def step_template(self) -> torch.Tensor:
        """[p + w, p + w] attention among (pending, query) slots before key validity: pending causal,
        queries see every pending slot; the diagonal is added separately."""
        p, w = self.p, self.w
        t = torch.zeros(p + w, p + w, dtype=torch.bool)
        t[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
        t[p:, :p] = True
        return t

    def prefill_mask(self, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        return with_key_padding(build_mask("causal", pos.shape[1], device=self.device), valid)

    def queries(self):
        """(ids, positions (clamped into the canvas), true positions, active, key_valid) [B, w]."""
        start = self.todo.int().argmax(1)
        pos = start[:, None] + self.offsets
        posc = pos.clamp(max=self.L)
        active = self.todo.gather(1, posc) & (pos < self.span_end[:, None])
        return self.query_mask_ids, posc, pos, active, self.no_commit

    def accept(self, conf: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        return accept_top1(conf, active, self.cfg.threshold)

    def next_pending(self, tok, pos, accept):
        """Tokens to commit next step: the accepted ones, packed left in ascending position order."""
        if self.p == 1:  # at most one accepted: the first accepted slot (or an invalid one)
            order = accept.to(torch.int8).argmax(1, keepdim=True)
        else:
            order = torch.sort((~accept).to(torch.int8), dim=1, stable=True).indices[:, : self.p]
        return tok.gather(1, order), pos.gather(1, order), accept.gather(1, order)

    # -- decoding ---------------------------------------------------------------------------------
    def prefill(self) -> None:
        ids, pos, valid = self.visible_batch(left_pad=True)
        if ids.shape[1] == 0:
            return
        self.model(ids, pos, self.prefill_mask(pos, valid), cache=self.cache, commit=valid, logits_slice=slice(0, 0))
        self.bound = min(self.cache.capacity, ids.shape[1])
        self.cache.bound = self.bound

    def step(self, step: int) -> None:
        p, w = self.p, self.w
        q_ids, q_pos, pos, active, q_keys = self.queries()
        pv = self.pend_valid & (self.pend_pos < self.span_end[:, None])
        ids = torch.cat((self.pend_ids, q_ids), 1)
        positions = torch.cat((self.pend_pos, q_pos), 1)
        keys = torch.cat((pv, q_keys), 1)
        mask = ((self.template[None] & keys[:, None, :]) | self.eye[None])[:, None]
        logits = self.logits(ids, positions, mask, cache=self.cache, commit=torch.cat((pv, self.no_commit), 1),
                             logits_slice=slice(p, p + w))
        # At most p entries were appended: keep the attended prefix tight (the forward assumed p + w).
        self.bound = min(self.cache.capacity, self.bound + p)
        self.cache.bound = self.bound
        tok, conf = self.choose(logits)
        accept = self.accept(conf, active)
        self.steps += active.any(1)
        self.write(pos, tok, accept, step)
        self.after_write(tok, pos, accept, active)

    def after_write(self, tok, pos, accept, active) -> None:
        self.pend_ids, self.pend_pos, self.pend_valid = self.next_pending(tok, pos, accept)

    def select_rows(self, keep: torch.Tensor) -> None:
        super().select_rows(keep)
        self.pend_ids, self.pend_pos, self.pend_valid = self.pend_ids[keep], self.pend_pos[keep], self.pend_valid[keep]
        self.query_mask_ids, self.no_commit = self.query_mask_ids[keep], self.no_commit[keep]
        self.cache.reorder(keep)
