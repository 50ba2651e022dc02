"""Masked diffusion (MDLM): bidirectional attention, linear schedule alpha_t = 1 - t.

Two maskings, chosen by `prepare(..., bound=...)`:

- training (``bound=False``): per sequence ``t ~ U[eps, 1]`` (antithetic across the batch), every
  predictable token masked with probability ``t``; the loss is the mean CE over masked tokens.
  Restricting ``t`` to ``[eps, 1]`` is a variance reduction, so the ``1/t``-weighted sum of these
  draws is *not* the NELBO (it leaves out ``t < eps``): ``nll_weight`` is zero in this mode.
- bound (``bound=True``, what ``val/nll`` and ``eval likelihood`` report): an unbiased estimate of
  the continuous-time NELBO ``int_0^1 (1/t) E_{x_t ~ Bernoulli(t)}[sum_masked -log p(x_i | x_t)] dt``.
  Integrating ``t`` out per masking pattern gives its exact discrete form: a pattern with ``k`` of the
  ``n`` predictable tokens masked has weight ``int_0^1 t^(k-1) (1-t)^(n-k) dt = 1 / (k C(n, k))``, so the
  NELBO equals ``E_{k ~ U{1..n}} E_{S uniform of size k} [(n / k) sum_{i in S} -log p(x_i | x_{-S})]``.
  We draw exactly that (``k`` uniform, then a uniform ``k``-subset; weight ``n / k``): the same
  expectation as ``t ~ U(0, 1]`` with ``1/t`` weights, but with finite variance (``t ~ U(0, 1]`` with
  ``1/t`` weights has a logarithmically divergent second moment, so its standard errors mislead).
"""

from __future__ import annotations

import torch

from .. import noise
from ..masks import MaskSpec
from .base import ModelInputs, Objective


def sample_t(n: int, eps: float, antithetic: bool, generator, device) -> torch.Tensor:
    return noise.noise_levels(n, eps, antithetic, generator, device)


def bound_masking(predictable: torch.Tensor, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """NELBO masking over the last dim of `predictable` [..., n] (True = may be masked).

    Per group: k ~ U{1..n} (n = its predictable count), then a uniformly random k-subset of its
    predictable positions. Returns (masked [..., n] bool, per-group weight n / k [...]; 0 where n = 0)."""
    n = predictable.sum(-1)
    u = noise.rand(predictable.shape, generator, predictable.device)
    u = torch.where(predictable, u, torch.full_like(u, 2.0))  # non-predictable positions rank last
    rank = u.argsort(-1).argsort(-1)
    v = noise.rand(n.shape, generator, predictable.device)
    k = (v * n).floor().long() + 1  # uniform on {1..n}
    masked = (rank < k[..., None]) & predictable
    return masked, n.float() / k.float() * (n > 0)


class MaskedDiffusionObjective(Objective):

    def prepare(self, batch, generator=None, bound: bool = False) -> ModelInputs:
        x, valid, context = self._batch_masks(batch)
        B, L = x.shape
        predictable = valid & ~context
        if bound:
            masked, w = bound_masking(predictable, generator)
            nll_w = masked.float() * w[:, None]
            extra = {"k_weight": w}
        else:
            t = sample_t(B, self.cfg.eps, self.cfg.antithetic, generator, x.device)[:, None].expand(B, L)
            u = noise.rand((B, L), generator, x.device)
            masked = (u < t) & predictable
            nll_w = torch.zeros_like(x, dtype=torch.float)  # not a bound: t is restricted to [eps, 1]
            extra = {"t": t[:, 0]}
        xt = torch.where(masked, torch.full_like(x, self.mask_id), x)
        pos = torch.arange(L, device=x.device).expand(B, L)
        key_valid = valid if batch.get("valid_mask") is not None else None  # no host sync
        return self.for_rank(ModelInputs(
            input_ids=xt, position_ids=pos, attn_mask=self.mask("bidirectional", L, x.device, key_valid),
            logits_slice=slice(0, L), targets=x, loss_weight=masked.float(), nll_weight=nll_w,
            num_tokens=predictable.float().sum(), extra=extra,
            mask_spec=MaskSpec("bidirectional", L) if key_valid is None else None))
