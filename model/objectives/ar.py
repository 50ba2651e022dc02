"""Autoregression: causal attention, next-token cross-entropy."""

from __future__ import annotations

import torch

from ..masks import MaskSpec
from .base import ModelInputs, Objective


class AutoregressiveObjective(Objective):

    def prepare(self, batch, generator=None, bound: bool = False) -> ModelInputs:  # exact NLL either way
        x, valid, context = self._batch_masks(batch)
        B, L = x.shape
        pos = torch.arange(L, device=x.device).expand(B, L)
        w = (valid[:, 1:] & ~context[:, 1:]).float()
        return self.for_rank(ModelInputs(
            input_ids=x, position_ids=pos, attn_mask=self.mask("causal", L, x.device),
            logits_slice=slice(0, L - 1), targets=x[:, 1:], loss_weight=w, nll_weight=w, num_tokens=w.sum(), mask_spec=MaskSpec("causal", L)))
