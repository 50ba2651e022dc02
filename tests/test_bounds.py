"""The likelihood bounds are unbiased: on a tiny random model, the Monte-Carlo mean of each family's
bound (prepare(bound=True)) equals the exact value from enumerating every masking pattern (MDLM,
BD3-LM; the continuous-time weight of a pattern integrated over t numerically) or every generation
order (SW-SetDLM; order probabilities integrated numerically from the schedule's definition)."""

import itertools
import math

import numpy as np
import pytest
import torch
from model.config import ModelConfig, ObjectiveConfig
from model.layers import vocab_cross_entropy
from model.masks import build_mask
from model.objectives import build_objective
from model.schedule import SlidingWindow
from model.transformer import Transformer

V = 24
MASK = V - 1


def tiny(seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(n_layers=2, hidden=32, n_heads=4, ffn_hidden=64, vocab_size=V, mask_id=MASK, dropout=0.0,
                      max_seq_len=64, init_std=0.5)
    return Transformer(cfg).eval()


def ce(logits, targets):
    return vocab_cross_entropy(logits.float().clone(), targets)


def pattern_weight(k: int, n: int) -> float:
    """int_0^1 (1/t) t^k (1-t)^(n-k) dt by Gauss-Legendre quadrature (exact for this polynomial)."""
    xs, ws = np.polynomial.legendre.leggauss(32)
    t = (xs + 1) / 2
    return float(np.sum(ws / 2 * t ** (k - 1) * (1 - t) ** (n - k)))


def mc_bound(model, obj, batch, draws: int, seed: int = 0):
    """Per-draw bound values (summed weighted CE of one sequence) from prepare(bound=True)."""
    g = torch.Generator().manual_seed(seed)
    rep = {k: v.expand(draws, -1).clone() for k, v in batch.items()}
    inp = obj.prepare(rep, g, bound=True)
    with torch.no_grad():
        logits = model(inp.input_ids, inp.position_ids, inp.attn_mask, logits_slice=inp.logits_slice)
    vals = (ce(logits, inp.targets) * inp.nll_weight).sum(-1).double()
    return vals.mean().item(), vals.std().item() / math.sqrt(draws)


def masked_ce(model, ids, positions, mask, out_slice, targets):
    with torch.no_grad():
        logits = model(ids, positions, mask, logits_slice=out_slice)
    return ce(logits, targets)


def test_mdlm_bound_matches_enumeration():
    L = 6
    model = tiny(1)
    obj = build_objective(ObjectiveConfig(name="mdlm"), model.cfg, L)
    x = torch.randint(0, V - 1, (1, L), generator=torch.Generator().manual_seed(3))
    context = torch.zeros(1, L, dtype=torch.bool)
    context[0, 0] = True  # position 0 is a prompt: never masked, never scored
    free = list(range(1, L))
    n = len(free)
    pats = [S for k in range(1, n + 1) for S in itertools.combinations(free, k)]
    ids = x.expand(len(pats), L).clone()
    for r, S in enumerate(pats):
        ids[r, list(S)] = MASK
    c = masked_ce(model, ids, torch.arange(L).expand(len(pats), L), build_mask("bidirectional", L), slice(0, L),
                  x.expand(len(pats), L))
    exact = sum(pattern_weight(len(S), n) * float(c[r, list(S)].sum()) for r, S in enumerate(pats))
    mean, se = mc_bound(model, obj, {"input_ids": x, "context_mask": context}, 20000)
    assert abs(mean - exact) < 4 * se + 1e-6, (mean, se, exact)
    assert se < 0.02 * exact  # enough draws for the check to have teeth


@pytest.mark.parametrize("bs", [2, 3])
def test_bd3lm_bound_matches_enumeration(bs):
    L = 6
    model = tiny(2)
    obj = build_objective(ObjectiveConfig(name="bd3lm", block_size=bs), model.cfg, L)
    x = torch.randint(0, V - 1, (1, L), generator=torch.Generator().manual_seed(4))
    mask = build_mask("block_diffusion", L, bs)
    exact = 0.0
    for b0 in range(0, L, bs):  # each block's bound given clean earlier blocks; other blocks' noise is invisible
        block = list(range(b0, b0 + bs))
        pats = [S for k in range(1, bs + 1) for S in itertools.combinations(block, k)]
        xt = x.expand(len(pats), L).clone()
        for r, S in enumerate(pats):
            xt[r, list(S)] = MASK
        ids = torch.cat((xt, x.expand(len(pats), L)), 1)
        pos = torch.arange(L).repeat(2).expand(len(pats), 2 * L)
        c = masked_ce(model, ids, pos, mask, slice(0, L), x.expand(len(pats), L))
        exact += sum(pattern_weight(len(S), bs) * float(c[r, list(S)].sum()) for r, S in enumerate(pats))
    mean, se = mc_bound(model, obj, {"input_ids": x}, 20000)
    assert abs(mean - exact) < 4 * se + 1e-6, (mean, se, exact)
    assert se < 0.02 * exact


def test_training_draw_is_not_the_bound():
    """The training draws (forced mask, t >= eps) carry no NLL weight: nothing of them can leak into val/nll."""
    model = tiny(0)
    for cfg in (ObjectiveConfig(name="mdlm"), ObjectiveConfig(name="bd3lm", block_size=2)):
        obj = build_objective(cfg, model.cfg, 8)
        inp = obj.prepare({"input_ids": torch.randint(0, V - 1, (4, 8))}, torch.Generator().manual_seed(0))
        assert inp.loss_weight.sum() > 0 and inp.nll_weight.abs().sum() == 0


def order_probabilities(sched: SlidingWindow, grid: int = 200000) -> dict:
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


@pytest.mark.parametrize("set_size,s_max", [(2, None), (2, 3)])
def test_setdlm_bound_matches_enumeration(set_size, s_max):
    L = 4
    model = tiny(3)
    obj = build_objective(ObjectiveConfig(name="setdlm", set_size=set_size, s_max=s_max), model.cfg, L)
    probs = order_probabilities(obj.schedule)
    assert sum(probs.values()) == pytest.approx(1.0, abs=1e-4)
    x = torch.randint(0, V - 1, (1, L), generator=torch.Generator().manual_seed(5))
    perms = torch.tensor(list(probs))
    clean = x[0][perms]
    ids = torch.cat((clean, torch.full_like(clean, MASK)), 1)
    c = masked_ce(model, ids, torch.cat((perms, perms), 1), build_mask("set_causal", L), slice(L, 2 * L), clean)
    exact = sum(p * float(c[r].sum()) for r, p in enumerate(probs.values()))
    draws = 20000
    mean, se = mc_bound(model, obj, {"input_ids": x}, draws)
    assert abs(mean - exact) < 4 * se + 2e-4 * exact, (mean, se, exact)
    # and the sampler's order frequencies are the schedule's probabilities
    inp = obj.prepare({"input_ids": x.expand(draws, L).clone()}, torch.Generator().manual_seed(9), bound=True)
    got = {}
    for row in inp.extra["perm"].tolist():
        got[tuple(row)] = got.get(tuple(row), 0) + 1
    for perm, p in probs.items():
        assert abs(got.get(perm, 0) / draws - p) < 4 * math.sqrt(p * (1 - p) / draws) + 1e-3, (perm, p)
