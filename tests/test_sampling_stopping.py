"""Stopping: EOS / stop token ids (device side), stop strings and regexes (host side), variable length."""

import re

import pytest
import torch

from model.sampling import Infill, SamplingConfig, generate
from model.sampling.reference import generate_reference
from model.sampling.testing import CharTokenizer, tiny_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model(seed=2)


def _frequent_token(outs):
    counts = torch.bincount(torch.tensor([t for o in outs for t in o.tokens[1:]]), minlength=50)
    return int(counts.argmax())


@pytest.mark.parametrize("family,kw", [("setdlm", dict(window=4, threshold=0.6)), ("setdlm", dict(window=8)),
                                        ("bd3lm", dict(block_size=4, threshold=0.6)), ("ar", {})])
def test_eos_stops_and_matches_reference(model, family, kw):
    cfg = SamplingConfig(family=family, max_new_tokens=16, **kw)
    free = generate(model, PROMPTS, cfg)
    eos = _frequent_token(free)
    out = generate(model, PROMPTS, cfg, eos_id=eos)
    ref = generate_reference(model, PROMPTS, cfg, eos_id=eos)
    assert [(o.tokens, o.steps, o.stop_reason, o.masks_dropped) for o in out] == \
        [(o.tokens, o.steps, o.stop_reason, o.masks_dropped) for o in ref]
    stopped = [o for o in out if o.stopped_early]
    assert stopped, "the test EOS never fired"
    for p, o in zip(PROMPTS, out):
        assert eos not in o.tokens and o.sequence == p + o.tokens
        if o.stopped_early:
            assert o.stop_reason == "eos" and len(o.tokens) < 16
            if family == "ar":
                assert o.masks_dropped == 16 - len(o.tokens) - 1
        else:
            assert o.stop_reason == "length" and len(o.tokens) == 16
    # stop_token_ids is the same mechanism, and stop_on_eos=False turns EOS off
    same = generate(model, PROMPTS, cfg, stop_token_ids=[eos])
    assert [o.tokens for o in same] == [o.tokens for o in out]
    assert [o.tokens for o in generate(model, PROMPTS, cfg, eos_id=eos, stop_on_eos=False)] == [o.tokens for o in free]


def test_mdlm_eos_truncates(model):
    cfg = SamplingConfig(family="mdlm", max_new_tokens=12, steps=6)
    eos = _frequent_token(generate(model, PROMPTS, cfg))
    for o in generate(model, PROMPTS, cfg, eos_id=eos):
        assert eos not in o.tokens and (o.stopped_early or len(o.tokens) == 12)


@pytest.mark.parametrize("family,kw", [("setdlm", dict(window=4, threshold=0.5)), ("bd3lm", dict(block_size=4)),
                                        ("ar", {}), ("mdlm", dict(steps=8))])
@pytest.mark.parametrize("check_every", [1, 3])
def test_stop_string_and_regex_cut_where_documented(model, family, kw, check_every):
    tok = CharTokenizer()
    cfg = SamplingConfig(family=family, max_new_tokens=16, check_every=check_every, **kw)
    free = generate(model, PROMPTS, cfg, tokenizer=tok)
    text = free[1].text
    stop = text[5:7]  # a string that certainly occurs in row 1
    out = generate(model, PROMPTS, cfg, tokenizer=tok, stop=[stop])
    for f, o in zip(free, out):
        i = f.text.find(stop)
        if i < 0 and family != "mdlm":
            assert o.tokens == f.tokens and o.stop_reason == "length"
        elif i >= 0:
            assert o.text == f.text[:i] and o.stop_reason == "stop_string" and o.stopped_early
            assert o.tokens == f.tokens[: i + len(stop)]  # tokens keep the stop string's tokens
    pattern = re.escape(text[3]) + "." + re.escape(text[5])
    out = generate(model, PROMPTS, cfg, tokenizer=tok, stop_regex=pattern)
    for f, o in zip(free, out):
        m = re.search(pattern, f.text)
        if m is not None:
            assert o.text == f.text[: m.end()] and o.stop_reason == "regex" and o.tokens == f.tokens[: m.end()]
        elif family != "mdlm":
            assert o.text == f.text


def test_stop_string_matches_reference(model):
    tok = CharTokenizer()
    cfg = SamplingConfig(family="setdlm", max_new_tokens=16, window=8, threshold=0.5)
    stop = generate(model, PROMPTS[:1], cfg, tokenizer=tok)[0].text[6:8]
    a = generate(model, PROMPTS, cfg, tokenizer=tok, stop=[stop, "zz"])
    b = generate_reference(model, PROMPTS, cfg, tokenizer=tok, stop=[stop, "zz"])
    assert [(o.tokens, o.text, o.stop_reason) for o in a] == [(o.tokens, o.text, o.stop_reason) for o in b]


def test_infill_ignores_stops(model):
    tok = CharTokenizer()
    cfg = SamplingConfig(family="setdlm", window=4)
    p = [Infill([1, 2, 3], 10, [4, 5])]
    free = generate(model, p, cfg, tokenizer=tok)[0]
    out = generate(model, p, cfg, tokenizer=tok, eos_id=free.tokens[0], stop=[free.text[2:4]])[0]
    assert out.tokens == free.tokens and out.stop_reason == "length"


def test_stop_strings_need_a_tokenizer(model):
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model, PROMPTS, SamplingConfig(stop=["x"]))
