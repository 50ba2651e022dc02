"""SW-SetDLM adaptive window: bounded by window_max (S_max), equal to the fixed window when its bounds
are equal, exact against the recomputing reference."""

import pytest
import torch

from model.sampling import Infill, SamplingConfig, generate
from model.sampling.reference import generate_reference
from model.sampling.testing import tiny_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], Infill([1, 2, 3], 10, [7, 8, 9]), Infill([4], 12, [])]


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model(seed=0, sharpness=3.0)


def _key(outs):
    return [(o.tokens, o.commit_step, o.steps, o.sequence) for o in outs]


@pytest.mark.parametrize("kw", [dict(window=4, window_max=8, threshold=0.5), dict(window=2, window_max=8, threshold=0.2),
                                dict(window=8, window_min=2, window_max=8, threshold=0.9)])
def test_adaptive_matches_reference_and_stays_within_bounds(model, kw):
    cfg = SamplingConfig(family="setdlm", max_new_tokens=16, adaptive_window=True, **kw)
    out = generate(model, PROMPTS, cfg)
    assert _key(out) == _key(generate_reference(model, PROMPTS, cfg))
    for o in out:  # no step commits more than window_max tokens, nor reaches past window_max positions
        counts = torch.bincount(torch.tensor(o.commit_step))
        assert int(counts.max()) <= cfg.window_max


def test_adaptive_window_grows_and_shrinks(model):
    """Threshold 0: every active position is accepted, so the window doubles up to window_max."""
    cfg = SamplingConfig(family="setdlm", max_new_tokens=15, window=1, window_max=8, adaptive_window=True, threshold=0.0)
    o = generate(model, [[1, 2, 3]], cfg)[0]
    per_step = torch.bincount(torch.tensor(o.commit_step))[1:].tolist()
    assert per_step == [1, 2, 4, 8]
    # no threshold: one token per step, so the window shrinks to 2 (and tokens differ from w = 8)
    strict = SamplingConfig(family="setdlm", max_new_tokens=12, window=8, window_max=8, adaptive_window=True)
    o = generate(model, [[1, 2, 3]], strict)[0]
    assert o.steps == 12
    assert _key([o]) == _key(generate_reference(model, [[1, 2, 3]], strict))


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_equal_bounds_is_the_fixed_window(model, threshold):
    fixed = SamplingConfig(family="setdlm", max_new_tokens=14, window=4, threshold=threshold)
    adaptive = SamplingConfig(family="setdlm", max_new_tokens=14, window=4, window_min=4, window_max=4,
                              adaptive_window=True, threshold=threshold)
    assert _key(generate(model, PROMPTS, adaptive)) == _key(generate(model, PROMPTS, fixed))


def test_bad_bounds():
    with pytest.raises(ValueError, match="sampling.window_max"):
        SamplingConfig(adaptive_window=True, window_min=5, window_max=4).validate()


def test_adaptive_window_is_capped_at_s_max(model):
    """window = S_max (the infill default) used to let window_max = 2 x window open the window to 4D: a
    D = 4 model committed 16 tokens in one step. With the model's S_max known (from_objective sets it)
    the default bound is S_max, and a larger window or window_max is refused."""
    from model.config import ObjectiveConfig

    cfg = SamplingConfig.from_objective(ObjectiveConfig(name="setdlm", set_size=4), window=8, adaptive_window=True,
                                        threshold=0.0, max_new_tokens=40)
    assert cfg.s_max == 8 and cfg.max_window == 8
    per_step = torch.bincount(torch.tensor(generate(model, [[1, 2, 3]], cfg)[0].commit_step))[1:]
    assert int(per_step.max()) == 8
    uncapped = SamplingConfig(window=8, adaptive_window=True, threshold=0.0, max_new_tokens=40)  # S_max unknown
    assert int(torch.bincount(torch.tensor(generate(model, [[1, 2, 3]], uncapped)[0].commit_step)).max()) == 16
    with pytest.raises(ValueError, match="sampling.window_max: at most the model's S_max = 8"):
        SamplingConfig.from_objective(ObjectiveConfig(name="setdlm", set_size=4), adaptive_window=True, window_max=16)
    with pytest.raises(ValueError, match="sampling.window: at most the model's S_max = 8"):
        SamplingConfig.from_objective(ObjectiveConfig(name="setdlm", set_size=4), window=9)
    assert SamplingConfig.from_objective(ObjectiveConfig(name="setdlm", set_size=4, s_max=6)).s_max == 6
