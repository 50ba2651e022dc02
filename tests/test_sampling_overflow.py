"""Decoding past the model's context (prompt + new tokens > max_seq_len): before each forward the KV
cache drops its lowest-position entries so that cache + step fit, as the reference implementation's
SetDLM.generate does. The cached, batched decoders equal the recomputing reference (which states the
same rule) exactly, for SetDLM (fixed and adaptive window), BD3-LM and AR."""

import pytest
import torch

from model.kv_cache import KVCache
from model.sampling import Infill, SamplingConfig, generate
from model.sampling.config import SamplingError
from model.sampling.reference import generate_reference
from model.sampling.testing import tiny_model

L = 16
# a prompt longer than L - window, prompts whose prompt + max_new_tokens exceed L, an exact fit, infills
PROMPTS = [list(range(1, 15)), [4, 5, 6], [7], list(range(20, 36)), Infill([1, 2, 3, 4, 5, 6], 14, [7, 8]),
           Infill([9], 20, [])]
FAMILIES = [("setdlm", dict(window=4)), ("setdlm", dict(window=4, threshold=0.6)), ("setdlm", dict(window=4, threshold=0.0)),
            ("setdlm", dict(window=2, adaptive_window=True, window_max=4, threshold=0.3)),
            ("bd3lm", dict(block_size=4)), ("bd3lm", dict(block_size=2, threshold=0.5)), ("ar", {})]


@pytest.fixture(scope="module")
def models(one_thread):
    return tiny_model(seed=0, max_seq_len=L), tiny_model(seed=0)  # same weights, contexts 16 and 256


def _key(outs):
    return [(o.tokens, o.commit_step, o.steps, o.stop_reason, o.sequence) for o in outs]


@pytest.mark.parametrize("family,kw", FAMILIES)
def test_overflow_equals_the_reference(models, family, kw):
    short, long = models
    cfg = SamplingConfig(family=family, max_new_tokens=24, **kw)
    out = generate(short, PROMPTS, cfg)
    assert _key(out) == _key(generate_reference(short, PROMPTS, cfg))
    for o, p in zip(out, PROMPTS):
        assert len(o.tokens) == (p.length if isinstance(p, Infill) else 24)
    # the context really was cut: the same weights with room for everything decode differently
    assert _key(out) != _key(generate(long, PROMPTS, cfg))


@pytest.mark.parametrize("family,kw", [FAMILIES[1], FAMILIES[3], FAMILIES[4], FAMILIES[6]])
def test_overflow_under_continuous_batching(models, family, kw):
    short, _ = models
    cfg = SamplingConfig(family=family, max_new_tokens=20, **kw)
    prompts = PROMPTS * 2
    alone = [generate(short, [p], cfg)[0] for p in prompts]
    assert _key(generate(short, prompts, cfg, max_batch=3)) == _key(alone)
    assert _key(generate(short, prompts, cfg, max_batch=2, check_every=3, compact=False)) == _key(alone)


def test_overflow_with_eos(models):
    short, _ = models
    cfg = SamplingConfig(family="setdlm", max_new_tokens=30, window=4, threshold=0.5)
    plain = generate(short, PROMPTS[:4], cfg)
    eos = next(t for o in plain for t in o.tokens[12:])  # a token emitted past the context
    out = generate(short, PROMPTS[:4], cfg, eos_id=eos)
    assert _key(out) == _key(generate_reference(short, PROMPTS[:4], cfg, eos_id=eos))
    assert any(o.stop_reason == "eos" for o in out)


def test_without_overflow_nothing_is_tracked(models):
    """Requests that fit keep the plain cache (no positions, no per-step drop)."""
    from model.sampling.api import decoder_class
    from model.sampling.engine import to_requests

    short, _ = models
    cfg = SamplingConfig(family="setdlm", max_new_tokens=8, window=4)
    dec = decoder_class("setdlm")(short, to_requests([[1, 2, 3]], cfg, short.cfg.mask_id, short.cfg.vocab_size), cfg,
                                  mask_id=short.cfg.mask_id, eos_id=None)
    assert not dec.drops and dec.cache.pos is None
    dec = decoder_class("setdlm")(short, to_requests([[1, 2, 3, 4, 5]], cfg, short.cfg.mask_id, short.cfg.vocab_size), cfg,
                                  mask_id=short.cfg.mask_id, eos_id=None)
    assert dec.drops and dec.cache.pos is not None  # 5 + 8 committed + 5 in one step > 16


def test_cache_drops_lowest_positions():
    cache = KVCache([0], batch=2, kv_heads=1, head_dim=2, capacity=8, extra=2, positions=True)
    k = torch.zeros(2, 1, 6, 2)
    cache.bound = 0
    pos = torch.tensor([[5, 1, 7, 3, 0, 9], [2, 4, 6, 8, 10, 12]])
    commit = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    cache.begin(commit, None, pos)
    cache.attend_kv(0, k, k)
    cache.end()
    cache.drop_oldest(limit=6, incoming=torch.tensor([3, 3]))  # rows of 6 and 4 live entries
    assert cache.pos[0, :6].tolist() == [5, -1, 7, -1, -1, 9] and cache.pos[1, :4].tolist() == [-1, 4, 6, 8]
    assert cache.live(cache.storage).sum(1).tolist() == [3, 3]


def test_what_must_fit(models):
    short, _ = models
    with pytest.raises(SamplingError, match="17 prompt tokens exceed the model's max_seq_len 16"):
        generate(short, [list(range(1, 18))], SamplingConfig(family="setdlm", max_new_tokens=4))
    with pytest.raises(SamplingError, match="MDLM re-reads the whole sequence"):
        generate(short, [[1, 2, 3, 4]], SamplingConfig(family="mdlm", max_new_tokens=13))
    with pytest.raises(SamplingError, match="leaves no room for context"):
        generate(short, [[1, 2, 3]], SamplingConfig(family="setdlm", max_new_tokens=20, window=8, threshold=0.5))
    assert len(generate(short, [[1, 2, 3, 4]], SamplingConfig(family="mdlm", max_new_tokens=12))[0].tokens) == 12
