"""Logits processors, acceptance rules, seeded sampling and config validation."""

import math

import pytest
import torch

from model import families
from model.sampling import SamplingConfig, generate
from model.sampling.processors import (accept_top1, accept_top_k, choose, presence, repetition_penalty,
                                       top_k_filter, top_p_filter)
from model.sampling.testing import tiny_model

NEG = float("-inf")


def test_top_k_and_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.15, 0.1]]]))
    assert torch.isinf(top_k_filter(logits, 2)[0, 0, 2:]).all() and torch.isfinite(top_k_filter(logits, 2)[0, 0, :2]).all()
    kept = torch.isfinite(top_p_filter(logits, 0.7))[0, 0].tolist()
    assert kept == [True, True, False, False]  # 0.5 < 0.7 <= 0.75
    assert torch.isfinite(top_p_filter(logits, 0.5))[0, 0].tolist() == [True, False, False, False]
    assert torch.isfinite(top_p_filter(logits, 0.01))[0, 0].tolist() == [True, False, False, False]


def test_repetition_penalty_rule():
    logits = torch.tensor([[[2.0, -2.0, 1.0]]])
    present = torch.tensor([[True, True, False]])
    assert repetition_penalty(logits, present, 2.0).tolist() == [[[1.0, -4.0, 1.0]]]
    assert presence(torch.tensor([[0, 2, 5]]), 3).tolist() == [[True, False, True]]  # ids >= vocab ignored


def test_choose_greedy_and_sampled():
    logits = torch.log(torch.tensor([[[0.1, 0.6, 0.3], [0.7, 0.2, 0.1]]]))
    tok, conf = choose(logits, SamplingConfig())
    assert tok.tolist() == [[1, 0]] and torch.allclose(conf, torch.tensor([[0.6, 0.7]]))
    cfg = SamplingConfig(temperature=1.0, top_k=1)
    tok, conf = choose(logits, cfg, torch.Generator().manual_seed(0))
    assert tok.tolist() == [[1, 0]] and torch.allclose(conf, torch.ones(1, 2))
    # sampling frequencies follow the (tempered) distribution
    big = logits[:, :1].expand(1, 20000, 3)
    tok, _ = choose(big, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(0))
    freq = torch.bincount(tok.flatten(), minlength=3) / 20000
    assert torch.allclose(freq, torch.tensor([0.1, 0.6, 0.3]), atol=0.02)


def test_acceptance_rules():
    conf = torch.tensor([[0.2, 0.9, 0.95, 0.1], [0.3, 0.3, 0.3, 0.3]])
    active = torch.tensor([[True, True, False, True], [False, False, False, False]])
    assert accept_top1(conf, active, None).tolist() == [[False, True, False, False], [False] * 4]
    assert accept_top1(conf, active, 1.0).tolist() == [[False, True, False, False], [False] * 4]
    assert accept_top1(conf, active, 0.15).tolist() == [[True, True, False, False], [False] * 4]
    assert accept_top1(conf, active, 0.0).tolist() == [[True, True, False, True], [False] * 4]
    k = torch.tensor([2, 3])
    assert accept_top_k(conf, active, k, None).tolist() == [[True, True, False, False], [False] * 4]
    assert accept_top_k(conf, active, torch.tensor([1, 1]), 0.15).tolist() == [[True, True, False, False], [False] * 4]
    # threshold 0: every active position, whatever the confidences (none need be computed)
    for c in (conf, None):
        assert accept_top1(c, active, 0.0).tolist() == active.tolist()
        assert accept_top_k(c, active, torch.tensor([1, 0]), 0.0).tolist() == active.tolist()


@pytest.mark.parametrize("family", families.names())
def test_seeded_sampling_is_reproducible(one_thread, family):
    model = tiny_model(seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cfg = SamplingConfig(family=family, max_new_tokens=12, window=4, threshold=0.8, temperature=1.2, top_k=20,
                         top_p=0.95, repetition_penalty=1.2, seed=123)
    a, b = generate(model, prompts, cfg), generate(model, prompts, cfg)
    assert [o.tokens for o in a] == [o.tokens for o in b]
    c = generate(model, prompts, cfg, seed=124)
    assert [o.tokens for o in a] != [o.tokens for o in c]
    g = torch.Generator().manual_seed(123)
    assert [o.tokens for o in generate(model, prompts, cfg, generator=g, seed=None)] == [o.tokens for o in a]
    greedy = [o.tokens for o in generate(model, prompts, cfg, temperature=0.0)]
    assert [o.tokens for o in a] != greedy


@pytest.mark.parametrize("field,value,match", [
    ("family", "gpt", "sampling.family"), ("window", 0, "sampling.window"), ("threshold", -0.1, "sampling.threshold"),
    ("top_p", 0.0, "sampling.top_p"), ("temperature", -1.0, "sampling.temperature"),
    ("stop", "abc", "sampling.stop"), ("stop_regex", "(", "sampling.stop_regex"),
    ("remasking", "low", "sampling.remasking"), ("max_new_tokens", -1, "sampling.max_new_tokens")])
def test_bad_config_names_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**{field: value}).validate()


def test_from_objective():
    from model.config import ObjectiveConfig

    cfg = SamplingConfig.from_objective(ObjectiveConfig(name="setdlm", set_size=8), threshold=0.9)
    assert (cfg.family, cfg.window, cfg.threshold) == ("setdlm", 8, 0.9)
    assert SamplingConfig.from_objective({"name": "bd3lm", "block_size": 16}).block_size == 16


def test_prompts_must_be_a_list_of_prompts():
    model = tiny_model()
    with pytest.raises(TypeError, match="list of prompts"):
        generate(model, [1, 2, 3])
    with pytest.raises(ValueError, match="prompts\\[0\\]: token id 49"):
        generate(model, [[1, 49]])
    assert generate(model, []) == []
    out = generate(model, [[1, 2]], max_new_tokens=0)[0]
    assert out.tokens == [] and out.steps == 0 and not math.isnan(out.tokens_per_step)


def test_a_temperature_below_the_floor_is_greedy_and_penalties_stay_finite(one_thread):
    """temperature 1e-300 decodes greedily (float32 logits divided by it are inf and NaN, which failed
    the sampler); a repetition penalty outside REPETITION_PENALTY_RANGE is refused naming the field, and
    at either end of the range, with a temperature at the floor, logits of 1e4 still give a distribution."""
    from model.sampling.config import REPETITION_PENALTY_RANGE, TEMPERATURE_FLOOR
    from model.sampling.processors import adjust

    model = tiny_model(seed=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    cfg = SamplingConfig(max_new_tokens=10, window=4, threshold=0.8)
    greedy = [o.tokens for o in generate(model, prompts, cfg)]
    assert [o.tokens for o in generate(model, prompts, cfg, temperature=1e-300, seed=1)] == greedy
    assert SamplingConfig(temperature=TEMPERATURE_FLOOR / 2).greedy
    assert not SamplingConfig(temperature=TEMPERATURE_FLOOR).greedy
    for bad in (1e-300, REPETITION_PENALTY_RANGE[0] / 2, REPETITION_PENALTY_RANGE[1] * 2):
        with pytest.raises(ValueError, match="sampling.repetition_penalty"):
            SamplingConfig(repetition_penalty=bad)
    logits = torch.tensor([[[1e4, -1e4, 3.0, NEG]]])
    for p in REPETITION_PENALTY_RANGE:
        c = SamplingConfig(temperature=TEMPERATURE_FLOOR, repetition_penalty=p)
        adjusted = adjust(logits, c, torch.tensor([[True, True, False, False]]))
        assert torch.isfinite((adjusted / c.temperature).softmax(-1)).all()
        tok, conf = choose(adjusted, c, torch.Generator().manual_seed(0))
        assert tok.item() in (0, 2) and torch.isfinite(conf).all()
        out = generate(model, prompts, cfg, temperature=TEMPERATURE_FLOOR, repetition_penalty=p, seed=1)
        assert len(out[0].tokens) == 10
