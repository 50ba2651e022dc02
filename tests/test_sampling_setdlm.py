"""SW-SetDLM sampler: cached batched decoding == recomputing reference, batching, window rules."""

import pytest

from model.sampling import Infill, SamplingConfig, generate
from model.sampling.reference import generate_reference
from model.sampling.testing import tiny_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]
INFILL = [Infill([1, 2, 3], 6, [7, 8, 9]), Infill([4], 9, [5, 6]), Infill([1, 2, 3, 4, 5], 4, [])]


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model(seed=0)


def _same(a, b):
    assert [o.tokens for o in a] == [o.tokens for o in b]
    assert [o.commit_step for o in a] == [o.commit_step for o in b]
    assert [o.steps for o in a] == [o.steps for o in b]
    assert [o.sequence for o in a] == [o.sequence for o in b]


@pytest.mark.parametrize("threshold", [None, 0.7, 0.0])
@pytest.mark.parametrize("window", [1, 4, 8])
def test_cached_matches_recomputed(model, window, threshold):
    cfg = SamplingConfig(family="setdlm", max_new_tokens=10, window=window, threshold=threshold)
    out = generate(model, PROMPTS, cfg)
    _same(out, generate_reference(model, PROMPTS, cfg))
    if threshold == 0.7 and window > 1:
        assert any(o.tokens_per_step > 1 for o in out)  # the threshold really accepted extra tokens


@pytest.mark.parametrize("threshold", [None, 0.7])
def test_infill_cached_matches_recomputed(model, threshold):
    cfg = SamplingConfig(family="setdlm", window=8, threshold=threshold)
    out = generate(model, INFILL, cfg)
    _same(out, generate_reference(model, INFILL, cfg))
    for o, p in zip(out, INFILL):
        assert len(o.tokens) == p.length and o.stop_reason == "length"


def test_batch_equals_one_by_one(model):
    cfg = SamplingConfig(family="setdlm", max_new_tokens=9, window=4, threshold=0.6)
    prompts = PROMPTS + INFILL
    batch = generate(model, prompts, cfg)
    for p, o in zip(prompts, batch):
        alone = generate(model, [p], cfg)[0]
        assert (o.tokens, o.commit_step, o.steps) == (alone.tokens, alone.commit_step, alone.steps)
    no_compact = generate(model, prompts, cfg, compact=False, check_every=3)
    _same(batch, no_compact)


def test_window_one_is_left_to_right(model):
    out = generate(model, PROMPTS, SamplingConfig(family="setdlm", max_new_tokens=7, window=1, threshold=0.0))
    for o in out:
        assert o.commit_step == list(range(1, 8)) and o.steps == 7 and o.tokens_per_step == 1.0


def test_threshold_one_commits_one_per_step(model):
    out = generate(model, PROMPTS, SamplingConfig(family="setdlm", max_new_tokens=12, window=8, threshold=1.0))
    for o in out:
        assert sorted(o.commit_step) == list(range(1, 13)) and o.steps == 12
    assert any(o.commit_step != sorted(o.commit_step) for o in out)  # not simply left to right


def test_threshold_zero_fills_the_window(model):
    w, n = 4, 10
    out = generate(model, PROMPTS, SamplingConfig(family="setdlm", max_new_tokens=n, window=w, threshold=0.0))
    for o in out:
        assert o.commit_step == [i // w + 1 for i in range(n)] and o.steps == 3


def test_infill_keeps_context(model):
    out = generate(model, INFILL, SamplingConfig(family="setdlm", window=4, threshold=0.5), eos_id=7)
    for o, p in zip(out, INFILL):
        assert len(o.tokens) == p.length and 49 not in o.tokens and o.masks_dropped == 0
        assert o.sequence == p.prefix + o.tokens + p.suffix


def test_prompt_tokens_are_never_changed_and_mask_never_emitted(model):
    cfg = SamplingConfig(family="setdlm", max_new_tokens=16, window=8, threshold=0.3, temperature=1.5, seed=3)
    for o in generate(model, PROMPTS, cfg):
        assert len(o.tokens) == 16 and all(0 <= t < 49 for t in o.tokens)
