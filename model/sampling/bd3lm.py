"""BD3-LM (block diffusion) decoding with a KV cache, batched with ragged progress.

Blocks are the absolute positions [kB, (k+1)B) (as in training). Each step forwards, per row, the
slots of the current block (bidirectional among themselves, seeing the cache) after B pending slots:
the previous block's tokens when it has just been completed (bidirectional among themselves,
committed to the cache by this forward). A block's slots are its span positions (decoded tokens and
MASKs) and, in the block where the span starts, the prompt tokens before it: a prompt (prefix) that
ends mid-block is cached in whole blocks only, and its last partial block is denoised with the span's
first positions, seeing their masks, and committed with them once the block is complete (as training
and the reference implementation see it). Inside a block each step unmasks the k = ceil(masked /
steps left) most confident positions plus every position with confidence >= threshold. The rest of
the visible context (the prompt's whole blocks; and the suffix for infilling) is prefilled into the
cache with block-causal attention (tokens see their own and earlier blocks).
"""

from __future__ import annotations

import torch

from .engine import Request
from .processors import accept_top_k
from .window import WindowDecoder


def uncached_tail(r: Request, block_size: int) -> int:
    """Prompt (prefix) tokens in the block where the span starts: left out of the prefill, denoised
    with that block and committed with it (0 when the prefix ends on a block boundary or nothing is
    generated)."""
    return len(r.prefix) % block_size if r.span else 0


class BD3LMDecoder(WindowDecoder):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.steps_per_block = self.cfg.steps_per_block or self.cfg.block_size
        self.cur_block = torch.full((self.S,), -1, dtype=torch.long, device=self.device)
        self.block_steps = torch.zeros(self.S, dtype=torch.long, device=self.device)

    def slot_count(self) -> int:
        return self.cfg.block_size

    def pending_count(self) -> int:
        return self.cfg.block_size

    def step_template(self) -> torch.Tensor:
        w = self.w
        t = torch.ones(2 * w, 2 * w, dtype=torch.bool)
        t[:w, w:] = False  # committed tokens never see the noisy block
        return t

    def prefill_mask(self, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        blk = pos // self.cfg.block_size
        mask = (blk[:, None, :] <= blk[:, :, None]) & valid[:, None, :]
        eye = torch.eye(pos.shape[1], dtype=torch.bool, device=pos.device)
        return (mask | eye)[:, None]

    def prefilled(self, r: Request) -> tuple[list[int], list[int]]:
        tail = uncached_tail(r, self.cfg.block_size)
        if not tail:
            return r.visible, r.visible_positions
        k = len(r.prefix) - tail
        return r.prefix[:k] + r.suffix, r.visible_positions[:k] + r.visible_positions[len(r.prefix):]

    def queries(self):
        Bs = self.cfg.block_size
        start = self.todo.int().argmax(1)
        blk = start // Bs
        pos = (blk * Bs)[:, None] + self.offsets
        posc = pos.clamp(max=self.L)
        # the block's span positions, and the uncached prompt tail before the span in its first block
        lo = self.span_start - self.span_start % Bs
        in_block = (pos >= lo[:, None]) & (pos < self.span_end[:, None])
        active = in_block & self.todo.gather(1, posc)
        self.block_steps.masked_fill_(blk != self.cur_block, 0)
        self.cur_block.copy_(blk)
        self._posc, self._in_block = posc, in_block
        return self.canvas.gather(1, posc), posc, pos, active, in_block

    def window_bounds(self):
        Bs = self.cfg.block_size
        blk = self.todo.int().argmax(1) // Bs
        return torch.maximum(blk * Bs, self.span_start), torch.minimum(blk * Bs + Bs, self.span_end)

    def context_tokens(self, active: torch.Tensor, q_keys: torch.Tensor) -> torch.Tensor:
        return q_keys  # the block's span slots, decoded or masked

    def accept(self, conf: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        left = (self.steps_per_block - self.block_steps).clamp(min=1)
        n = active.sum(1)
        k = (n + left - 1) // left
        self.block_steps += active.any(1)
        return accept_top_k(conf, active, k, self.cfg.threshold)

    def after_write(self, tok, pos, accept, active) -> None:
        posc = self._posc
        complete = active.any(1) & ~self.todo.gather(1, posc).any(1)
        self.pend_ids.copy_(self.canvas.gather(1, posc))
        self.pend_pos.copy_(posc)
        self.pend_valid.copy_(self._in_block & complete[:, None] & (pos < self.span_end[:, None]))

    def reset_slots(self, st, reqs) -> None:
        super().reset_slots(st, reqs)
        self.cur_block[st] = -1
        self.block_steps[st] = 0

    def select_rows(self, keep: torch.Tensor) -> None:
        super().select_rows(keep)
        self.cur_block, self.block_steps = self.cur_block[keep], self.block_steps[keep]
