"""Block diffusion (BD3-LM): noisy blocks x_t attend inside their block and to clean earlier blocks.

Input concat(x_t, x_0) of length 2L, one noise level per block. Two maskings (`prepare(bound=...)`):

- training (``bound=False``): ``t ~ U[eps, 1]`` per block and at least one MASK per block (a
  variance reduction); the loss is the mean CE over masked tokens. These draws are not an unbiased
  NELBO (the forced mask with ``1/t`` weights inflates it badly at small ``t``), so ``nll_weight`` is
  zero in this mode.
- bound (``bound=True``: ``val/nll``, ``eval likelihood``): the NELBO is a sum over blocks of MDLM's
  continuous-time bound of the block given the clean earlier blocks; each block is masked with its
  exact discrete form (``k ~ U{1..n}`` of its ``n`` predictable tokens, a uniform ``k``-subset, weight
  ``n / k``; see mdlm.py), which equals plain Bernoulli(``t``) masking with ``t ~ U(0, 1]`` and ``1/t``
  weights in expectation.
"""

from __future__ import annotations

import torch

from .. import noise
from ..masks import MaskSpec
from .base import ModelInputs, Objective
from .mdlm import bound_masking, sample_t


class BlockDiffusionObjective(Objective):

    def prepare(self, batch, generator=None, bound: bool = False) -> ModelInputs:
        x, valid, context = self._batch_masks(batch)
        B, L = x.shape
        bs = self.cfg.block_size
        nb = L // bs
        predictable = valid & ~context
        if bound:
            masked, w = bound_masking(predictable.view(B, nb, bs), generator)
            masked = masked.view(B, L)
            nll_w = masked.float() * w.repeat_interleave(bs, dim=1)
            extra = {"k_weight": w}
        else:
            t = sample_t(B * nb, self.cfg.eps, self.cfg.antithetic, generator, x.device).view(B, nb)
            u = noise.rand((B, nb, bs), generator, x.device)
            masked = u < t[:, :, None]
            forced = noise.randint(bs, (B, nb), generator, x.device)
            none = ~masked.any(-1)
            masked = masked | (none[:, :, None] & (torch.arange(bs, device=x.device) == forced[:, :, None]))
            masked = masked.view(B, L) & predictable
            nll_w = torch.zeros_like(x, dtype=torch.float)  # not a bound (forced mask, t >= eps)
            extra = {"t": t}
        xt = torch.where(masked, torch.full_like(x, self.mask_id), x)
        pos = torch.arange(L, device=x.device).expand(B, L)
        key_valid = torch.cat((valid, valid), 1) if batch.get("valid_mask") is not None else None
        return self.for_rank(ModelInputs(
            input_ids=torch.cat((xt, x), 1), position_ids=torch.cat((pos, pos), 1),
            attn_mask=self.mask(self.mask_kind, L, x.device, key_valid, block_size=bs), logits_slice=slice(0, L),
            targets=x, loss_weight=masked.float(), nll_weight=nll_w, num_tokens=predictable.float().sum(),
            extra=extra, mask_spec=MaskSpec(self.mask_kind, L, bs) if key_valid is None else None))
