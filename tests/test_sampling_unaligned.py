"""Prompts and spans that do not start on a block boundary: BD3-LM caches only whole prompt blocks and
denoises a prompt's partial last block with the span's first positions (the training view, and the
reference implementation's `align_inputs_to_blocks`); SW-SetDLM and MDLM infilling with spans at every
offset. Cached decoders == the recomputing reference (model/sampling/reference.py) for every prompt
length modulo the block size."""

import math

import pytest
import torch

from model.sampling import Infill, SamplingConfig, generate
from model.sampling.processors import accept_top_k, choose
from model.sampling.reference import generate_reference
from model.sampling.testing import tiny_model
from model.transformer import full_logits


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model(seed=1)


def _key(outs):
    return [(o.tokens, o.commit_step, o.steps, o.sequence) for o in outs]


def _prompts(B):
    """Plain prompts of every length modulo B, and one shorter than a block. (Not an empty one: its first block
    is all MASK, whose positions a random model scores equal up to the last bit, a tie that the forward's shape
    decides.)"""
    return [[(7 * i + j) % 48 + 1 for j in range(n)] for i, n in enumerate(list(range(2 * B, 3 * B)) + [B - 1])]


def _infills(B):
    """Prefixes of every length modulo B, spans that end mid-block, suffixes or none."""
    return [Infill([(5 * i + j) % 48 + 1 for j in range(B + i)], 2 * B + 1 - i, [(3 * i + j) % 48 + 1 for j in range(i)])
            for i in range(B)]


@pytest.mark.parametrize("kw", [dict(block_size=4), dict(block_size=4, threshold=0.6),
                                dict(block_size=3, steps_per_block=2), dict(block_size=5, threshold=0.0)])
def test_bd3lm_every_prompt_length_mod_block_matches_recomputed(model, kw):
    B = kw["block_size"]
    cfg = SamplingConfig(family="bd3lm", max_new_tokens=2 * B + 1, **kw)
    for prompts in (_prompts(B), _infills(B)):
        out = generate(model, prompts, cfg)
        assert _key(out) == _key(generate_reference(model, prompts, cfg))
        assert _key(out) == [_key(generate(model, [p], cfg))[0] for p in prompts]  # batch == alone
        for o, p in zip(out, prompts):
            n = p.length if isinstance(p, Infill) else cfg.max_new_tokens
            assert len(o.tokens) == n and 49 not in o.tokens  # exactly the span, whatever the prompt's offset


def _block_causal_logprobs(model, ids, B):
    """log_softmax of one forward over ids [T] under the block-causal mask (bidirectional inside a block)."""
    T = len(ids)
    blk = torch.arange(T) // B
    with torch.inference_mode():
        logits = full_logits(model, model(torch.tensor([ids]), torch.arange(T)[None], (blk[:, None] >= blk[None, :])[None, None]))
    return logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("tail", [1, 2, 3])
def test_bd3lm_partial_prompt_block_is_denoised_with_the_span(model, tail):
    """A prompt ending mid-block: each step of its first block scores the positions as one forward over the
    prompt's whole blocks (block-causal) and the partial block (its prompt tokens, the tokens decoded so far and
    MASKs, bidirectional) does: what training sees. Checked on the log-probability of every committed token."""
    B = 4
    prompt = [(3 * j) % 48 + 1 for j in range(2 * B + tail)]
    n = B - tail
    out = generate(model, [prompt], SamplingConfig(family="bd3lm", block_size=B, max_new_tokens=n, logprobs=5))[0]
    assert sorted(out.commit_step) == list(range(1, n + 1))
    old_rule = 0.0
    for step in range(1, n + 1):
        j = out.commit_step.index(step)
        ids = prompt + [t if c < step else model.cfg.mask_id for t, c in zip(out.tokens, out.commit_step)]
        lp = _block_causal_logprobs(model, ids, B)[len(prompt) + j]
        assert int(lp.argmax()) == out.tokens[j]
        assert max(abs(float(lp[t]) - v) for t, v in out.top_logprobs[j]) < 1e-5
        # the old rule: the prompt tail cached up front, never seeing the block's masks
        T = len(ids)
        blk = torch.arange(T) // B
        mask = blk[:, None] >= blk[None, :]
        mask[: len(prompt), len(prompt):] = False
        with torch.inference_mode():
            old = full_logits(model, model(torch.tensor([ids]), torch.arange(T)[None], mask[None, None]))[0].float()
        old_lp = old.log_softmax(-1)[len(prompt) + j]
        old_rule = max(old_rule, max(abs(float(old_lp[t]) - v) for t, v in out.top_logprobs[j]))
    assert old_rule > 1e-4  # the two rules give different distributions here (at least 7e-4 on this model)


@pytest.mark.parametrize("kw", [dict(window=4), dict(window=4, threshold=0.6), dict(window=8, threshold=0.0),
                                dict(window=3, adaptive_window=True, window_max=6, threshold=0.4)])
def test_setdlm_infill_spans_at_every_offset_match_recomputed(model, kw):
    cfg = SamplingConfig(family="setdlm", **kw)
    w = cfg.window_size
    infills = _infills(w)
    out = generate(model, infills, cfg)
    assert _key(out) == _key(generate_reference(model, infills, cfg))
    assert _key(out) == [_key(generate(model, [p], cfg))[0] for p in infills]
    for o, p in zip(out, infills):
        assert o.sequence == p.prefix + o.tokens + p.suffix


def _mdlm_alone(model, p: Infill, cfg):
    """MDLM infilling from scratch: every step one bidirectional forward over prefix + span + suffix; unmask
    the ceil(masked / steps left) most confident span positions (plus those >= threshold)."""
    n, k0 = p.length, len(p.prefix)
    canvas = list(p.prefix) + [model.cfg.mask_id] * n + list(p.suffix)
    steps = cfg.steps or n
    commit = [0] * n
    T = len(canvas)
    step = 0
    while 0 in commit:
        with torch.inference_mode():
            logits = full_logits(model, model(torch.tensor([canvas]), torch.arange(T)[None], torch.ones(T, T, dtype=torch.bool)[None, None]))
        tok, conf = choose(logits[:, k0:k0 + n].float(), cfg)
        active = torch.tensor([[c == 0 for c in commit]])
        k = math.ceil(int(active.sum()) / max(steps - step, 1))
        acc = accept_top_k(conf, active, torch.tensor([k]), None)
        if cfg.threshold is not None and cfg.threshold < 1.0:
            acc |= active & (conf >= cfg.threshold)
        step += 1
        for j in range(n):
            if acc[0, j]:
                canvas[k0 + j], commit[j] = int(tok[0, j]), step
    return canvas[k0:k0 + n], commit, step


@pytest.mark.parametrize("kw", [dict(), dict(steps=3), dict(threshold=0.5)])
def test_mdlm_infill_spans_at_every_offset(model, kw):
    cfg = SamplingConfig(family="mdlm", **kw)
    infills = _infills(4)
    out = generate(model, infills, cfg)  # a padded batch of different lengths
    for o, p in zip(out, infills):
        assert (o.tokens, o.commit_step, o.steps) == _mdlm_alone(model, p, cfg)
        assert o.sequence == p.prefix + o.tokens + p.suffix
