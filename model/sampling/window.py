"""The step both windowed diffusion samplers share (SW-SetDLM: setdlm.py; BD3-LM: bd3lm.py): one forward
per step over p + w tokens per row, p `pending` slots (tokens accepted last step, committed to the KV
cache by this forward, causal among themselves) followed by w query slots (the positions this step
predicts, each seeing the cache, the valid pending tokens and the template's share of the other
queries; dropped from the cache). The step has fixed shapes [B, p + w], is computed on the device and
updates the decoder's state tensors in place. Subclasses say which positions are queried and which
predictions are accepted (the hooks below); this class runs the step.
"""

from __future__ import annotations

import torch

from .engine import Decoder
from .processors import accepts_all


class WindowDecoder(Decoder):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.w = self.slot_count()
        self.p = self.pending_count()
        w, p, dev, S = self.w, self.p, self.device, self.S
        self.offsets = torch.arange(w, device=dev)
        self.pend_ids = torch.full((S, p), self.mask_id, dtype=torch.long, device=dev)
        self.pend_pos = torch.zeros(S, p, dtype=torch.long, device=dev)
        self.pend_valid = torch.zeros(S, p, dtype=torch.bool, device=dev)
        self.template = self.step_template().to(dev)
        self.eye = torch.eye(p + w, dtype=torch.bool, device=dev)
        self.no_commit = torch.zeros(S, w, dtype=torch.bool, device=dev)
        self.cache = self.new_slot_cache(p + w)

    # -- the family's hooks ------------------------------------------------------------------------
    def slot_count(self) -> int:
        """w: query slots per step (host-known, so shapes stay static)."""
        raise NotImplementedError

    def pending_count(self) -> int:
        """p: most tokens one step commits to the cache (host-known)."""
        raise NotImplementedError

    def step_template(self) -> torch.Tensor:
        """[p + w, p + w] attention among (pending, query) slots before key validity (the diagonal is
        added separately)."""
        raise NotImplementedError

    def prefill_mask(self, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The attention mask of the visible context's prefill."""
        raise NotImplementedError

    def queries(self):
        """(ids, positions (clamped into the canvas), true positions, active, key_valid) [B, w]."""
        raise NotImplementedError

    def accept(self, conf: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """[B, w] which predictions of the active slots this step commits."""
        raise NotImplementedError

    def context_tokens(self, active: torch.Tensor, q_keys: torch.Tensor) -> torch.Tensor:
        """[B, w] the query slots that count towards the context (the reference forwards only these)."""
        return active

    def after_write(self, tok, pos, accept, active) -> None:
        """Set the pending slots of the next step (pend_ids, pend_pos, pend_valid)."""
        raise NotImplementedError

    # -- decoding ---------------------------------------------------------------------------------
    def reset_slots(self, st, reqs) -> None:
        self.pend_valid[st] = False

    def prefill(self, st, slots, reqs) -> None:
        ids, pos, valid = self.visible_batch(reqs, left_pad=True)
        self.prefill_cache(st, slots, ids, pos, self.prefill_mask(pos, valid), valid)
        self.set_cached(slots, [len(self.prefilled(r)[0]) for r in reqs])

    def device_step(self) -> None:
        p, w = self.p, self.w
        q_ids, q_pos, pos, active, q_keys = self.queries()
        pv = self.pend_valid & (self.pend_pos < self.span_end[:, None])
        if self.drops:
            self.fit_context(pv.sum(1) + self.context_tokens(active, q_keys).sum(1))
        ids = torch.cat((self.pend_ids, q_ids), 1)
        positions = torch.cat((self.pend_pos, q_pos), 1)
        keys = torch.cat((pv, q_keys), 1)
        mask = ((self.template & keys[:, None, :]) | self.eye)[:, None]
        commit = torch.cat((pv, self.no_commit), 1)
        need = not accepts_all(self.cfg.threshold)  # threshold 0 accepts every active slot: no confidence
        if self.cpu_head:
            hidden = self.model(ids, positions, mask, cache=self.cache, commit=commit, head=False)
            tok, conf = self.head_choose(hidden[:, p:], active, need)
        else:
            tok, conf = self.choose(self.logits(ids, positions, mask, cache=self.cache, commit=commit,
                                                logits_slice=slice(p, p + w)), need)
        accept = self.accept(conf, active)
        self.steps += active.any(1)
        self.write(pos, tok, accept)
        self.after_write(tok, pos, accept, active)

    def after_step(self) -> None:
        self.grow_bound(self.p)  # at most p entries were appended per row

    def select_rows(self, keep: torch.Tensor) -> None:
        super().select_rows(keep)
        self.pend_ids, self.pend_pos, self.pend_valid = self.pend_ids[keep], self.pend_pos[keep], self.pend_valid[keep]
        self.no_commit = self.no_commit[keep]
        self.cache.reorder(keep)
