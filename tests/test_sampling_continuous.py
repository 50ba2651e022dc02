"""Continuous batching: slots refilled as rows finish == decoding each prompt alone (greedy)."""

import pytest
import torch

from model.sampling import Infill, SamplingConfig, generate
from model.sampling.reference import generate_reference
from model.sampling.testing import CharTokenizer, tiny_model

PROMPTS = [[1, 2, 3], Infill([4, 5], 6, [7, 8, 9]), [11], [12, 13, 14, 15, 16, 17, 18, 19], Infill([20], 9, []),
           [21, 22], [23, 24, 25, 26], Infill([27, 28, 29, 30, 31], 4, [32]), [33, 34, 35, 36, 37, 38], [40]]


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model(seed=3)


FAMILIES = [("setdlm", dict(window=4, threshold=0.6)), ("setdlm", dict(window=8)),
            ("setdlm", dict(window=4, threshold=0.6, adaptive_window=True, window_max=8)),
            ("bd3lm", dict(block_size=4, threshold=0.6)), ("ar", {})]


def _key(o):
    return (o.tokens, o.commit_step, o.steps, o.stop_reason, o.sequence, o.masks_dropped)


@pytest.mark.parametrize("family,kw", FAMILIES)
def test_three_slots_over_ten_prompts_equal_one_by_one(model, family, kw):
    tok = CharTokenizer()
    base = SamplingConfig(family=family, max_new_tokens=12, **kw)
    free = generate(model, PROMPTS, base, tokenizer=tok)
    # stop conditions that fire for some rows and not others: EOS = a token one row produces early,
    # a stop string = two characters another row produces
    plain = [o for p, o in zip(PROMPTS, free) if not isinstance(p, Infill)]
    # the first EOS (a token the first row produces, from its 4th on) and two-character stop string (of
    # another row, not after that row's EOS) that leave rows stopping for each of the three reasons: the
    # test needs all three mixed in one batch
    reasons = set()
    for eos, j, start in ((e, j, s) for e in dict.fromkeys(plain[0].tokens[3:]) for j in range(1, len(plain))
                          for s in range(2, 9)):
        if eos in plain[j].tokens[:start + 2]:
            continue
        cfg = SamplingConfig(family=family, max_new_tokens=12, stop=[plain[j].text[start:start + 2]], **kw)
        alone = [generate(model, [p], cfg, eos_id=eos, tokenizer=tok)[0] for p in PROMPTS]
        reasons = {o.stop_reason for o in alone}
        if {"length", "eos", "stop_string"} <= reasons:
            break
    assert {"length", "eos", "stop_string"} <= reasons, reasons
    cont = generate(model, PROMPTS, cfg, max_batch=3, eos_id=eos, tokenizer=tok)
    assert [_key(o) for o in cont] == [_key(o) for o in alone]
    assert [o.text for o in cont] == [o.text for o in alone]
    # checking every 3 steps: a stop string is seen a little later (more steps), same text
    lazy = generate(model, PROMPTS, cfg, max_batch=3, eos_id=eos, tokenizer=tok, check_every=3)
    assert [(o.tokens, o.text, o.stop_reason) for o in lazy] == [(o.tokens, o.text, o.stop_reason) for o in alone]
    ref = generate_reference(model, PROMPTS, cfg, eos_id=eos, tokenizer=tok)
    assert [_key(o) for o in cont] == [_key(o) for o in ref]


def test_mdlm_continuous_batching(model):
    cfg = SamplingConfig(family="mdlm", max_new_tokens=10, steps=5)
    alone = [generate(model, [p], cfg)[0] for p in PROMPTS]
    cont = generate(model, PROMPTS, cfg, max_batch=3)
    assert [_key(o) for o in cont] == [_key(o) for o in alone]


def test_slots_bound_the_cache(model):
    """The KV cache has max_batch rows however many prompts the job has."""
    from model.sampling.api import decoder_class
    from model.sampling.engine import to_requests

    cfg = SamplingConfig(family="setdlm", max_new_tokens=6, window=4, max_batch=2)
    reqs = to_requests(PROMPTS, cfg, 49, 50)
    dec = decoder_class("setdlm")(model, reqs, cfg, mask_id=49, eos_id=None)
    assert dec.cache.batch == 2 and dec.canvas.shape[0] == 2
    with torch.inference_mode():
        outs = dec.run()
    assert len(outs) == len(PROMPTS) and all(o is not None for o in outs)


def test_max_batch_must_be_positive(model):
    with pytest.raises(ValueError, match="sampling.max_batch"):
        generate(model, PROMPTS, SamplingConfig(max_batch=0))
