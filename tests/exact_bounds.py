"""Exact values of the likelihood bounds on tiny cases, by enumeration, chosen by a family's traits
(never by its name), so that every registered family is checked (tests/test_family_contract.py) and a
family whose bound has none of these forms fails there naming what is missing:

- `exact_likelihood`: the chain rule under causal attention (the bound is the NLL itself);
- `bound_masks_subset`: every masking pattern of each group (the whole sequence, or each block of
  `block_size` where the mask has blocks) weighted by its continuous-time NELBO weight, the noisy
  tokens laid out as the family trains (two-stream: noisy then clean copy);
- `order_mixture`: every generation order weighted by its probability under the objective's schedule.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from model.layers import vocab_cross_entropy
from model.masks import build_mask


def ce(logits, targets):
    return vocab_cross_entropy(logits.float().clone(), targets)


def pattern_weight(k: int, n: int) -> float:
    """int_0^1 (1/t) t^k (1-t)^(n-k) dt by Gauss-Legendre quadrature (exact for this polynomial)."""
    xs, ws = np.polynomial.legendre.leggauss(32)
    t = (xs + 1) / 2
    return float(np.sum(ws / 2 * t ** (k - 1) * (1 - t) ** (n - k)))


def order_probabilities(sched, grid: int = 200000) -> dict:
    """P(order) for the sliding-window schedule: positions revealed by descending masking time T_i,
    T_i independent on [loc_i, loc_i + b] with CDF 1 - (1 - s)^k, s = (T - loc_i) / b (SETDLM.md 2).
    P(T_p1 > ... > T_pL) by nested Stieltjes sums on a grid of t."""
    L, b, k = sched.length, sched.b, sched.k
    loc = sched.locations().numpy()
    t = np.linspace(0.0, 1.0, grid + 1)
    cdf = [1 - (1 - np.clip((t - loc[i]) / b, 0, 1)) ** k for i in range(L)]
    probs = {}
    for perm in itertools.permutations(range(L)):
        F = cdf[perm[-1]]  # P(T_last < t)
        for p in reversed(perm[:-1]):  # P(T_p < t and T_p > the rest in order)
            mid = (F[1:] + F[:-1]) / 2
            F = np.concatenate(([0.0], np.cumsum(mid * np.diff(cdf[p]))))
        probs[perm] = float(F[-1])
    return probs


def _ce_of(model, ids, pos, mask, out: slice, targets):
    with torch.no_grad():
        return ce(model(ids, pos, mask, logits_slice=out), targets)


def _chain_rule(spec, model, x) -> float:
    L = x.shape[1]
    c = _ce_of(model, x, torch.arange(L)[None], build_mask("causal", L), slice(0, L - 1), x[:, 1:])
    return float(c.sum())


def _masked_subsets(spec, model, x, mask_id: int, block_size: int) -> float:
    L = x.shape[1]
    size = block_size if spec.blocked_mask else L
    mask = build_mask(spec.mask_kind, L, block_size)
    exact = 0.0
    for g0 in range(0, L, size):  # each group's bound given the clean rest (other groups' noise is invisible or absent)
        group = list(range(g0, min(g0 + size, L)))
        pats = [S for k in range(1, len(group) + 1) for S in itertools.combinations(group, k)]
        xt = x.expand(len(pats), L).clone()
        for r, S in enumerate(pats):
            xt[r, list(S)] = mask_id
        if spec.two_stream:
            ids, pos = torch.cat((xt, x.expand(len(pats), L)), 1), torch.arange(L).repeat(2).expand(len(pats), 2 * L)
        else:
            ids, pos = xt, torch.arange(L).expand(len(pats), L)
        c = _ce_of(model, ids, pos, mask, slice(0, L), x.expand(len(pats), L))
        exact += sum(pattern_weight(len(S), len(group)) * float(c[r, list(S)].sum()) for r, S in enumerate(pats))
    return exact


def _orders(spec, model, x, mask_id: int, schedule) -> float:
    L = x.shape[1]
    probs = order_probabilities(schedule, grid=50000)
    assert abs(sum(probs.values()) - 1.0) < 1e-4
    perms = torch.tensor(list(probs))
    clean = x[0][perms]
    ids = torch.cat((clean, torch.full_like(clean, mask_id)), 1)
    c = _ce_of(model, ids, torch.cat((perms, perms), 1), build_mask(spec.mask_kind, L), slice(L, 2 * L), clean)
    return sum(p * float(c[r].sum()) for r, p in enumerate(probs.values()))


def exact_bound(spec, objective, model, x) -> float | None:
    """The exact expected value of one draw of `objective`'s bound (prepare(bound=True)) on the one
    sequence `x` [1, L], or None when no enumeration here fits the family's traits."""
    mask_id = model.cfg.mask_id
    if spec.exact_likelihood and spec.mask_kind == "causal" and spec.shifted:
        return _chain_rule(spec, model, x)
    if spec.bound_masks_subset:
        return _masked_subsets(spec, model, x, mask_id, int(getattr(objective.cfg, "block_size", 0) or 0))
    if spec.order_mixture and hasattr(objective, "schedule"):
        return _orders(spec, model, x, mask_id, objective.schedule)
    return None


def mc_bound(model, obj, x, draws: int, seed: int = 0):
    """Per-draw bound values (summed weighted CE of one sequence) from prepare(bound=True): (mean, its
    standard error, every value)."""
    g = torch.Generator().manual_seed(seed)
    inp = obj.prepare({"input_ids": x.expand(draws, -1).clone()}, g, bound=True)
    with torch.no_grad():
        logits = model(inp.input_ids, inp.position_ids, inp.attn_mask, logits_slice=inp.logits_slice)
    vals = (ce(logits, inp.targets) * inp.nll_weight).sum(-1).double()
    return vals.mean().item(), vals.std().item() / draws ** 0.5, vals
