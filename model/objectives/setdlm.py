"""SW-SetDLM training with permuted-order causal attention (the two-stream layout, SETDLM.md section 3).

input = concat(x[perm], query) with query = MASK at every predicted position, positions =
concat(perm, perm); one static mask serves every order. Any-order AR is order="any_order"; AR order is
D = 1 or order="left_to_right".
"""

from __future__ import annotations

import torch

from ..schedule import SlidingWindow, sample_order
from ..masks import MaskSpec
from .base import ModelInputs, Objective


class SetDiffusionObjective(Objective):

    def __init__(self, cfg, model_cfg, seq_len, cross_entropy=None):
        super().__init__(cfg, model_cfg, seq_len, cross_entropy)
        self.schedule = SlidingWindow.build(seq_len, cfg.set_size, cfg.s_max, cfg.k)

    def prepare(self, batch, generator=None, bound: bool = False) -> ModelInputs:
        # bound or not, the same draw: one order per sequence, every predicted token (an unbiased
        # estimate of E_order[-log p(x | order)], an upper bound on -log p(x))
        x, valid, context = self._batch_masks(batch)
        B, L = x.shape
        perm = sample_order(B, L, order=self.cfg.order, schedule=self.schedule, context=context, valid=valid,
                            generator=generator, device=x.device)
        clean = torch.gather(x, 1, perm)
        predicted = torch.gather(valid & ~context, 1, perm)
        query = torch.where(predicted, torch.full_like(clean, self.mask_id), clean)
        w = predicted.float()
        return self.for_rank(ModelInputs(
            input_ids=torch.cat((clean, query), 1), position_ids=torch.cat((perm, perm), 1),
            attn_mask=self.mask(self.mask_kind, L, x.device), logits_slice=slice(L, 2 * L), targets=clean,
            loss_weight=w, nll_weight=w, num_tokens=w.sum(), mask_spec=MaskSpec(self.mask_kind, L), extra={"perm": perm}))
