"""BD3-LM, AR and MDLM samplers: cached == recomputed, batch == one by one, infilling."""

import pytest
import torch

from model import families
from model.sampling import Infill, SamplingConfig, generate
from model.sampling.reference import generate_reference
from model.sampling.testing import tiny_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]
INFILL = [Infill([1, 2, 3], 6, [7, 8, 9]), Infill([4], 9, [5, 6]), Infill([1, 2, 3, 4, 5, 6], 7, [])]


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model(seed=1)


def _key(outs):
    return [(o.tokens, o.commit_step, o.steps, o.sequence) for o in outs]


BD3 = [dict(block_size=4), dict(block_size=4, threshold=0.7), dict(block_size=8, steps_per_block=3),
       dict(block_size=8, steps_per_block=3, threshold=0.6), dict(block_size=2, threshold=0.0)]


@pytest.mark.parametrize("kw", BD3)
def test_bd3lm_cached_matches_recomputed(model, kw):
    cfg = SamplingConfig(family="bd3lm", max_new_tokens=11, **kw)
    for prompts in (PROMPTS, INFILL):
        out = generate(model, prompts, cfg)
        assert _key(out) == _key(generate_reference(model, prompts, cfg))
    if kw.get("threshold") == 0.0:
        assert all(o.tokens_per_step > 1 for o in out)


def test_bd3lm_block_structure(model):
    """Blocks are decoded left to right: every position of block k is committed before block k+1."""
    out = generate(model, [[1, 2, 3, 4]], SamplingConfig(family="bd3lm", max_new_tokens=12, block_size=4))[0]
    blocks = [out.commit_step[i:i + 4] for i in range(0, 12, 4)]
    assert all(max(a) < min(b) for a, b in zip(blocks, blocks[1:]))
    assert out.steps == 12  # default: block_size steps per block, one token each


@pytest.mark.parametrize("kw", [dict(), dict(repetition_penalty=1.3)])
def test_ar_cached_matches_recomputed(model, kw):
    cfg = SamplingConfig(family="ar", max_new_tokens=9, **kw)
    for prompts in (PROMPTS, INFILL):
        out = generate(model, prompts, cfg)
        assert _key(out) == _key(generate_reference(model, prompts, cfg))
        assert all(o.commit_step == list(range(1, len(o.tokens) + 1)) for o in out)


def test_ar_needs_a_prompt_token(model):
    with pytest.raises(ValueError, match="prompts\\[0\\].*AR"):
        generate(model, [[]], SamplingConfig(family="ar"))


@pytest.mark.parametrize("family,kw", [("bd3lm", dict(block_size=4, threshold=0.6)), ("ar", {}),
                                        ("mdlm", dict(steps=5)), ("mdlm", dict(threshold=0.6))])
def test_batch_equals_one_by_one(model, family, kw):
    cfg = SamplingConfig(family=family, max_new_tokens=10, **kw)
    prompts = PROMPTS + INFILL
    batch = generate(model, prompts, cfg)
    assert _key(batch) == [_key(generate(model, [p], cfg))[0] for p in prompts]


def test_mdlm_steps_and_threshold(model):
    out = generate(model, PROMPTS, SamplingConfig(family="mdlm", max_new_tokens=12, steps=4))
    assert all(o.steps == 4 and sorted(set(o.commit_step)) == [1, 2, 3, 4] for o in out)
    out = generate(model, PROMPTS, SamplingConfig(family="mdlm", max_new_tokens=12, threshold=0.0))
    assert all(o.steps == 1 for o in out)
    out = generate(model, PROMPTS, SamplingConfig(family="mdlm", max_new_tokens=12))
    assert all(o.steps == 12 and sorted(o.commit_step) == list(range(1, 13)) for o in out)


@pytest.mark.parametrize("family", families.names())
def test_infill_never_changes_context_and_fills_the_span(model, family):
    cfg = SamplingConfig(family=family, window=8, block_size=4, threshold=0.5, temperature=0.8, seed=0)
    out = generate(model, INFILL, cfg, eos_id=7)  # EOS never stops an infill
    for o, p in zip(out, INFILL):
        assert len(o.tokens) == p.length and o.stop_reason == "length" and o.masks_dropped == 0
        assert all(0 <= t < 49 for t in o.tokens)
        if family == "ar":  # conditions on the prefix only
            assert o.sequence == p.prefix + o.tokens
        else:
            assert o.sequence == p.prefix + o.tokens + p.suffix


@pytest.mark.parametrize("family", ["setdlm", "bd3lm"])
def test_infill_sees_the_suffix(model, family):
    """The suffix is in the context: changing it changes the fill (greedy, same prefix)."""
    cfg = SamplingConfig(family=family, window=8, block_size=4)
    a = generate(model, [Infill([1, 2], 8, [3, 4, 5, 6])], cfg)[0].tokens
    b = generate(model, [Infill([1, 2], 8, [40, 41, 42, 43])], cfg)[0].tokens
    assert a != b


@pytest.mark.parametrize("family,kw", [(name, dict(window=4, block_size=4, threshold=0.5)) for name in families.names()] + [
    (families.SETDLM.name, dict(window=4)),
    (families.SETDLM.name, dict(window=2, adaptive_window=True, window_max=8, threshold=0.3))])
def test_fixed_shape_head_equals_the_active_slot_head(model, family, kw):
    """A GPU runs the head on every query slot in the step (fixed shapes, no host read); a CPU on the
    active slots only, packed (Decoder.head_choose). Both decide alike."""
    from model.sampling.api import decoder_class
    from model.sampling.engine import to_requests

    cfg = SamplingConfig(family=family, max_new_tokens=10, **kw)
    outs = []
    for cpu_head in (True, False):
        reqs = to_requests(PROMPTS + INFILL, cfg, model.cfg.mask_id, model.cfg.vocab_size)
        dec = decoder_class(family)(model, reqs, cfg, mask_id=model.cfg.mask_id, eos_id=None)
        dec.cpu_head = cpu_head
        with torch.inference_mode():
            outs.append(_key(dec.run()))
    assert outs[0] == outs[1]
