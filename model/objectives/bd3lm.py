"""Block diffusion (BD3-LM): noisy blocks x_t attend inside their block and to clean earlier blocks.

Input concat(x_t, x_0) of length 2L, one noise level per block, at least one MASK per block."""

from __future__ import annotations

import torch

from .. import noise
from ..masks import MaskSpec
from .base import ModelInputs, Objective
from .mdlm import sample_t


class BlockDiffusionObjective(Objective):
    name = "bd3lm"
    mask_kind = "bd3lm"

    def prepare(self, batch, generator=None) -> ModelInputs:
        x, valid, context = self._batch_masks(batch)
        B, L = x.shape
        bs = self.cfg.block_size
        nb = L // bs
        t = sample_t(B * nb, self.cfg.eps, self.cfg.antithetic, generator, x.device).view(B, nb)
        u = noise.rand((B, nb, bs), generator, x.device)
        masked = u < t[:, :, None]
        forced = noise.randint(bs, (B, nb), generator, x.device)
        none = ~masked.any(-1)
        masked = masked | (none[:, :, None] & (torch.arange(bs, device=x.device) == forced[:, :, None]))
        masked = masked.view(B, L) & valid & ~context
        xt = torch.where(masked, torch.full_like(x, self.mask_id), x)
        pos = torch.arange(L, device=x.device).expand(B, L)
        lw = masked.float()
        t_tok = t.repeat_interleave(bs, dim=1)
        key_valid = torch.cat((valid, valid), 1) if batch.get("valid_mask") is not None else None
        return ModelInputs(
            input_ids=torch.cat((xt, x), 1), position_ids=torch.cat((pos, pos), 1),
            attn_mask=self.mask("bd3lm", L, x.device, key_valid, block_size=bs), logits_slice=slice(0, L),
            targets=x, loss_weight=lw, nll_weight=lw / t_tok, num_tokens=(valid & ~context).float().sum(),
            extra={"t": t}, mask_spec=MaskSpec("bd3lm", L, bs) if key_valid is None else None)
