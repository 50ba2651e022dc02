"""MDLM decoding: no cache; every step re-runs the whole bidirectional sequence.

Each step predicts every masked position of the span and unmasks k = ceil(masked / steps left) of
them: the most confident (remasking="confidence") or uniformly random ones (remasking="random", the
order of ancestral sampling), plus every position with confidence >= threshold. Rows of different
lengths are padded on the right and their padding is invisible. Infilling sees prefix and suffix.
"""

from __future__ import annotations

import torch

from ..masks import with_key_padding
from .engine import Decoder
from .processors import accept_top_k, accepts_all


class MDLMDecoder(Decoder):
    uses_cache = False
    compilable = False

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.total_steps = torch.zeros(self.S, dtype=torch.long, device=self.device)
        self.positions = torch.arange(self.L, device=self.device)[None]

    def _layout(self) -> None:
        """Per-batch static pieces (recomputed when rows are admitted or dropped)."""
        reqs = [self.reqs[i] for i in self.rows if i >= 0]
        self.lo = min((len(r.prefix) for r in reqs), default=0)
        self.hi = max((len(r.prefix) + r.span for r in reqs), default=0)
        valid = self.positions < self.row_len[:, None]
        full = torch.ones(self.L, self.L, dtype=torch.bool, device=self.device)
        self.mask = with_key_padding(full, valid)
        self.out_pos = torch.arange(self.lo, self.hi, device=self.device)[None].expand(len(self.rows), -1)

    def reset_slots(self, st, reqs) -> None:
        self.total_steps[st] = torch.tensor([self.cfg.steps or r.span for r in reqs], dtype=torch.long, device=self.device)

    def prefill(self, st, slots, reqs) -> None:
        self._layout()

    def device_step(self) -> None:
        lo, hi = self.lo, self.hi
        if hi <= lo:
            return
        ids = self.canvas[:, : self.L]
        active = self.todo[:, lo:hi]
        every = accepts_all(self.cfg.threshold)  # threshold 0: every masked position, no confidence needed
        if self.cpu_head:
            hidden = self.model(ids, self.positions.expand_as(ids), self.mask, head=False)
            tok, conf = self.head_choose(hidden[:, lo:hi], active, not every)
        else:
            tok, conf = self.choose(self.logits(ids, self.positions.expand_as(ids), self.mask, logits_slice=slice(lo, hi)),
                                    not every)
        prio = conf
        if self.cfg.remasking == "random":  # drawn whatever the threshold: the generator's stream stays the same
            prio = torch.rand(active.shape, generator=self.generator, device=self.device)
        if every:
            accept = active.clone()
        else:
            left = (self.total_steps - self.steps).clamp(min=1)
            k = (active.sum(1) + left - 1) // left
            accept = accept_top_k(prio, active, k, None)
            if self.cfg.threshold is not None and self.cfg.threshold < 1.0:
                accept |= active & (conf >= self.cfg.threshold)
        self.steps += active.any(1)
        self.write(self.out_pos, tok, accept)

    def window_bounds(self):
        return self.span_start.clone(), self.span_end.clone()

    def select_rows(self, keep: torch.Tensor) -> None:
        super().select_rows(keep)
        self.total_steps = self.total_steps[keep]
        self._layout()
