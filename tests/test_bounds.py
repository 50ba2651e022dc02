"""The likelihood bounds are unbiased: on a tiny random model, the Monte-Carlo mean of each family's
bound (prepare(bound=True)) equals the exact value from enumerating every masking pattern (MDLM,
BD3-LM; the continuous-time weight of a pattern integrated over t numerically) or every generation
order (SW-SetDLM; order probabilities integrated numerically from the schedule's definition). Every
family's default case is checked by tests/test_family_contract.py (tests/exact_bounds.py); these are
the further block sizes, windows and the order frequencies."""

import itertools
import math

import pytest
import torch
from exact_bounds import order_probabilities, pattern_weight
from model.config import ModelConfig, ObjectiveConfig
from model.layers import vocab_cross_entropy
from model.masks import build_mask
from model.objectives import build_objective
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


@pytest.mark.parametrize("bs", [2, 3])
@pytest.mark.slow
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
