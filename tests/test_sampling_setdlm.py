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


@pytest.mark.parametrize("threshold", [0.7, 0.0])
@pytest.mark.parametrize("window", [4, 8])
def test_first_hitting_cache_order_matches_recomputed(model, window, threshold):
    """cache_order first_hitting: a step's commits enter the cache in descending first-hitting time (the
    reference implementation's setdlm_fht_cache_order); the cached engine equals the recomputing reference,
    batched and alone, and the order changes the decoded tokens of this model somewhere."""
    cfg = SamplingConfig(family="setdlm", max_new_tokens=12, window=window, threshold=threshold,
                         cache_order="first_hitting", seed=5)
    out = generate(model, PROMPTS, cfg)
    _same(out, generate_reference(model, PROMPTS, cfg))
    for p, o in zip(PROMPTS, out):
        assert generate(model, [p], cfg)[0].tokens == o.tokens  # every prompt draws its times from the same state


def test_first_hitting_cache_order_changes_what_is_decoded(model):
    differ = 0
    for window, threshold in ((4, 0.0), (8, 0.0), (8, 0.3)):
        cfg = SamplingConfig(family="setdlm", max_new_tokens=24, window=window, threshold=threshold, seed=5)
        fht = generate(model, PROMPTS, cfg, cache_order="first_hitting")
        pos = generate(model, PROMPTS, cfg, cache_order="position")
        differ += sum(a.tokens != b.tokens for a, b in zip(fht, pos))
    assert differ


def test_first_hitting_draws_follow_torch_global_generator(model):
    """No seed and no generator: the times come from torch's global generator, as the reference draws them."""
    cfg = SamplingConfig(family="setdlm", max_new_tokens=12, window=4, threshold=0.0, cache_order="first_hitting")
    import torch

    torch.manual_seed(7)
    a = generate(model, PROMPTS[:1], cfg)[0].tokens
    torch.manual_seed(7)
    assert generate_reference(model, PROMPTS[:1], cfg)[0].tokens == a
    torch.manual_seed(7)
    assert generate(model, PROMPTS[:1], cfg)[0].tokens == a


def test_first_hitting_times_are_the_reference_schedule():
    """b and k of the reference's evaluation-time schedule, and times drawn as it draws them."""
    import torch

    from model.sampling.first_hitting import FirstHitting, schedule

    b, k = schedule(1024, 4, 8)
    assert abs(b - 8 / 1031) < 1e-15 and abs(k - (4 / 2048) / (b - 4 / 2048)) < 1e-12
    assert schedule(64, 4, 4) == (4 / 64, 1.0)  # D = S_max
    fh = FirstHitting(length=64, set_size=4, window=4, k=None, device="cpu", generator=torch.Generator().manual_seed(3))
    t = fh.times(10)
    e = torch.empty(1, 10, dtype=torch.float64).exponential_(generator=torch.Generator().manual_seed(3))[0]
    loc = torch.linspace(0.0, 1.0 - fh.b, 64, dtype=torch.float64).flip(0)[-10:]
    assert torch.equal(t, loc + fh.b * -torch.expm1(-e / fh.k))
    assert torch.equal(fh.times(10), t)  # every span draws from the same starting state
    long = fh.times(70)  # past L: locations continue at the same spacing
    assert long.shape == (70,) and torch.isfinite(long).all()


def test_cache_order_only_for_setdlm():
    from common.schema import ConfigError

    with pytest.raises(ConfigError, match="sampling.cache_order"):
        SamplingConfig(family="bd3lm", cache_order="first_hitting")


def test_from_objective_carries_the_recorded_cache_order():
    from model.config import ObjectiveConfig

    obj = ObjectiveConfig(name="setdlm", set_size=4, cache_order="first_hitting")
    assert SamplingConfig.from_objective(obj).cache_order == "first_hitting"
    assert SamplingConfig.from_objective(obj, family="bd3lm").cache_order is None  # another sampler: not its mode
    assert SamplingConfig.from_objective(ObjectiveConfig(name="setdlm")).cache_order is None
