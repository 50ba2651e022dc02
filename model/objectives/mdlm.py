"""Masked diffusion (MDLM): bidirectional attention, linear schedule alpha_t = 1 - t."""

from __future__ import annotations

import torch

from .. import noise
from ..masks import MaskSpec
from .base import ModelInputs, Objective


def sample_t(n: int, eps: float, antithetic: bool, generator, device) -> torch.Tensor:
    return noise.noise_levels(n, eps, antithetic, generator, device)


class MaskedDiffusionObjective(Objective):
    name = "mdlm"
    mask_kind = "bidirectional"

    def prepare(self, batch, generator=None) -> ModelInputs:
        x, valid, context = self._batch_masks(batch)
        B, L = x.shape
        t = sample_t(B, self.cfg.eps, self.cfg.antithetic, generator, x.device)[:, None].expand(B, L)
        u = noise.rand((B, L), generator, x.device)
        masked = (u < t) & valid & ~context
        xt = torch.where(masked, torch.full_like(x, self.mask_id), x)
        pos = torch.arange(L, device=x.device).expand(B, L)
        lw = masked.float()
        key_valid = valid if batch.get("valid_mask") is not None else None  # no host sync
        return ModelInputs(
            input_ids=xt, position_ids=pos, attn_mask=self.mask("bidirectional", L, x.device, key_valid),
            logits_slice=slice(0, L), targets=x, loss_weight=lw, nll_weight=lw / t,
            num_tokens=(valid & ~context).float().sum(), extra={"t": t[:, 0]},
            mask_spec=MaskSpec("bidirectional", L) if key_valid is None else None)
