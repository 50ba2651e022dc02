"""SW-SetDLM decoding with a KV cache (SETDLM.md section 5), batched with ragged progress.

The step is window.py's: p `pending` slots (tokens accepted last step, in ascending position order,
or packed left in descending first-hitting time under `cache_order: first_hitting`
(first_hitting.py), causal among themselves, committed to the cache by this forward) followed by w
query slots (MASK at the masked positions of [start, start + w), each seeing the cache, the valid
pending tokens and itself; dropped from the cache). p = w with a threshold below 1, p = 1 without one
(then exactly one token is accepted per step).

Adaptive window (`SamplingConfig.adaptive_window`): each row has its own window w_r in
[window_min, window_max]; the forward always has window_max query slots, those at offsets >= w_r are
inactive. After a step that accepted a tokens, w_r <- clamp(2 a, window_min, window_max): the window
grows while the threshold keeps accepting more than half of it and shrinks when it accepts few.
"""

from __future__ import annotations

import torch

from ..masks import build_mask, with_key_padding
from .first_hitting import for_decode as first_hitting_times
from .processors import accept_top1
from .window import WindowDecoder


class SetDLMDecoder(WindowDecoder):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        dev, S = self.device, self.S
        self.win = torch.full((S,), self.cfg.initial_window, dtype=torch.long, device=dev)
        self.query_mask_ids = torch.full((S, self.w), self.mask_id, dtype=torch.long, device=dev)
        # first-hitting cache order: each slot's times over the canvas (None: position order)
        self.fht_draw = first_hitting_times(self.cfg, self.model, self.generator) if self.p > 1 else None
        self.fht = torch.zeros(S, self.L + 1, dtype=torch.float64, device=dev) if self.fht_draw else None

    # -- the hooks of window.py ----------------------------------------------------------------------
    def slot_count(self) -> int:
        return self.cfg.max_window

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
        if self.cfg.adaptive_window:
            active &= self.offsets[None, :] < self.win[:, None]
        return self.query_mask_ids, posc, pos, active, self.no_commit

    def accept(self, conf: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        accept = accept_top1(conf, active, self.cfg.threshold)
        if self.cfg.adaptive_window:
            cfg = self.cfg
            new = (2 * accept.sum(1)).clamp(min=cfg.window_min, max=cfg.max_window)
            self.win.copy_(torch.where(active.any(1), new, self.win))
        return accept

    def next_pending(self, tok, pos, accept):
        """Tokens to commit next step: the accepted ones in ascending position order (or in descending
        first-hitting time). With p = w slots (a threshold) in position order they stay where the queries
        were: the query slots are in ascending position order already, a rejected one is an invalid
        pending slot (never attended), and the cache packs the committed ones first in slot order, so
        nothing is sorted or gathered, whatever the number of commits."""
        if self.p == 1:  # at most one accepted: the first accepted slot (or an invalid one)
            order = accept.to(torch.int8).argmax(1, keepdim=True)
        elif self.fht is not None:
            key = torch.where(accept, self.fht.gather(1, pos.clamp(max=self.L)), float("-inf"))
            order = torch.sort(key, dim=1, descending=True, stable=True).indices[:, : self.p]
        else:
            return tok, pos, accept
        return tok.gather(1, order), pos.gather(1, order), accept.gather(1, order)

    # -- decoding ---------------------------------------------------------------------------------
    def reset_slots(self, st, reqs) -> None:
        super().reset_slots(st, reqs)
        self.win[st] = self.cfg.initial_window
        if self.fht is not None:
            self.fht[st] = self.first_hitting_rows(reqs)

    def first_hitting_rows(self, reqs) -> torch.Tensor:
        """[n, L + 1] each request's first-hitting times at its span positions (infilling, which the
        reference caches in position order: times falling with position)."""
        rows = torch.zeros(len(reqs), self.L + 1, dtype=torch.float64)
        for b, r in enumerate(reqs):
            k = len(r.prefix)
            if r.infill:
                rows[b] = -torch.arange(self.L + 1, dtype=torch.float64)
            elif r.span:
                rows[b, k : k + r.span] = self.fht_draw.times(r.span).cpu()
        return rows.to(self.device)

    def window_bounds(self):
        start = self.todo.int().argmax(1)
        width = self.win if self.cfg.adaptive_window else self.w
        return start, torch.minimum(start + width, self.span_end)

    def after_write(self, tok, pos, accept, active) -> None:
        ids, pos, valid = self.next_pending(tok, pos, accept)
        self.pend_ids.copy_(ids)
        self.pend_pos.copy_(pos)
        self.pend_valid.copy_(valid)

    def select_rows(self, keep: torch.Tensor) -> None:
        super().select_rows(keep)
        self.query_mask_ids, self.win = self.query_mask_ids[keep], self.win[keep]
        if self.fht is not None:
            self.fht = self.fht[keep]
