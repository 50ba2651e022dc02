"""Log-probabilities, OpenAI's penalties and logit bias in the sampler engine, against recomputation.

`SamplingConfig.logprobs = k` records, per output token, its log-probability under the step that
committed it and that step's k most likely tokens at its position. The recomputing reference
(model/sampling/reference.py: no cache, every step re-runs the model over what the cached decoder's
step sees) gives the same distributions; here it is extended (in the test only) to record them."""

import math

import pytest
import torch

from model.sampling import SamplingConfig, generate
from model.sampling.engine import to_requests
from model.sampling.reference import Reference
from model.sampling.testing import tiny_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]
K = 3


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model(seed=3)


class RecordingReference(Reference):
    """The reference decoder, recording log_softmax of each step's logits at the positions it commits."""

    def choose(self, row, logits, confidence=True):
        tok, conf = super().choose(row, logits, confidence)
        self._step = (logits[0].float().log_softmax(-1), tok[0])
        return tok, conf

    def write(self, row, pos, tok, acc, step):
        lp, _ = self._step
        rec = row.__dict__.setdefault("lp", {})
        for j, (p, a) in enumerate(zip(pos, acc)):
            if a:
                top = lp[j].topk(K)
                rec[p] = (float(lp[j, tok[j]]), top.indices.tolist(), top.values.tolist())
        super().write(row, pos, tok, acc, step)

    def output(self, row, seconds):
        out = super().output(row, seconds)
        recs = [row.lp[p] for p in range(row.start, row.end)]
        out.logprobs = [r[0] for r in recs]
        out.top_logprobs = [list(zip(r[1], r[2])) for r in recs]
        return out


def reference_logprobs(model, prompts, cfg):
    mask_id = model.cfg.mask_id
    ref = RecordingReference(model, cfg, mask_id=mask_id, eos_id=None, tokenizer=None, generator=None)
    with torch.inference_mode():
        return [ref.run(r) for r in to_requests(prompts, cfg, mask_id, model.cfg.vocab_size)]


@pytest.mark.parametrize("family,kw", [("setdlm", dict(window=4)), ("setdlm", dict(window=4, threshold=0.3)),
                                        ("bd3lm", dict(block_size=4, threshold=0.6)), ("ar", {})])
@pytest.mark.parametrize("max_batch", [None, 2])
def test_logprobs_equal_recomputation(model, family, kw, max_batch):
    cfg = SamplingConfig(family=family, max_new_tokens=10, logprobs=K, **kw)
    out = generate(model, PROMPTS, cfg, max_batch=max_batch)
    ref = reference_logprobs(model, PROMPTS, cfg)
    for o, r in zip(out, ref):
        assert o.tokens == r.tokens and len(o.logprobs) == len(o.tokens) == len(o.top_logprobs)
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4)
        for got, want in zip(o.top_logprobs, r.top_logprobs):
            assert [t for t, _ in got] == [t for t, _ in want]
            assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-4)
    # greedy: the committed token is its step's most likely one, and its probability the confidence
    for o in out:
        for lp, top in zip(o.logprobs, o.top_logprobs):
            assert top[0][1] == pytest.approx(lp, abs=1e-6) and [v for _, v in top] == sorted(
                [v for _, v in top], reverse=True) and lp <= 0
    # the tokens are those of a run without logprobs
    plain = generate(model, PROMPTS, SamplingConfig(family=family, max_new_tokens=10, **kw), max_batch=max_batch)
    assert [o.tokens for o in plain] == [o.tokens for o in out] and plain[0].logprobs is None


def test_set_decoding_logprob_is_that_of_the_committing_step(model):
    """SW-SetDLM with a threshold commits several tokens per step; a token committed at a later step
    is predicted with more context, so its log-probability differs from what the first step that saw
    its position gave it (the record is the committing step's)."""
    cfg = SamplingConfig(family="setdlm", window=4, threshold=0.3, max_new_tokens=10, logprobs=0)
    [o] = generate(model, PROMPTS[:1], cfg)
    assert o.steps < len(o.tokens)  # several tokens per step
    [r] = reference_logprobs(model, PROMPTS[:1], cfg)
    assert o.logprobs == pytest.approx(r.logprobs, abs=1e-4) and o.top_logprobs == [[] for _ in o.tokens]


def test_mdlm_logprobs_are_those_of_the_step_distribution(model):
    cfg = SamplingConfig(family="mdlm", max_new_tokens=8, steps=4, logprobs=2)
    out = generate(model, PROMPTS, cfg)
    for o in out:
        assert len(o.logprobs) == len(o.tokens) == 8
        for t, lp, top in zip(o.tokens, o.logprobs, o.top_logprobs):
            assert top[0] == (t, pytest.approx(lp, abs=1e-6))  # greedy: the argmax of its step


def _ar_recompute(model, prompt, n, bias=None, presence=0.0, frequency=0.0):
    """Greedy AR with OpenAI's adjustments, recomputed from scratch: a causal forward over the whole
    sequence each step, then logits + bias - frequency * count - presence * (count > 0), counting only
    the generated tokens. Returns (tokens, log-probabilities of the adjusted distribution)."""
    from model.masks import build_mask
    from model.transformer import full_logits

    V = model.cfg.vocab_size
    seq, out, lps = list(prompt), [], []
    for _ in range(n):
        ids = torch.tensor([seq])
        pos = torch.arange(len(seq))[None]
        with torch.no_grad():
            logits = full_logits(model, model(ids, pos, build_mask("causal", len(seq))))[0, -1].float()
        if bias:
            for t, v in bias.items():
                logits[t] += v
        count = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=V).float()
        logits = logits - frequency * count - presence * (count > 0).float()
        t = int(logits.argmax())
        lps.append(float(logits.log_softmax(-1)[t]))
        out.append(t)
        seq.append(t)
    return out, lps


@pytest.mark.parametrize("adjust", [dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
                                    dict(frequency_penalty=-1.0, presence_penalty=2.0),
                                    dict(logit_bias={7: 3.0, 9: -100.0})])
def test_penalties_and_logit_bias_equal_recomputation(model, adjust):
    n = 12
    cfg = SamplingConfig(family="ar", max_new_tokens=n, logprobs=1, **adjust)
    out = generate(model, PROMPTS, cfg, max_batch=2)
    for p, o in zip(PROMPTS, out):
        toks, lps = _ar_recompute(model, p, n, adjust.get("logit_bias"), adjust.get("presence_penalty", 0.0),
                                  adjust.get("frequency_penalty", 0.0))
        assert o.tokens == toks
        assert o.logprobs == pytest.approx(lps, abs=1e-4)
    plain = generate(model, PROMPTS, SamplingConfig(family="ar", max_new_tokens=n), max_batch=2)
    assert [o.tokens for o in plain] != [o.tokens for o in out]  # each setting changes what is decoded


def test_penalties_change_set_decoding_and_bias_forces_a_token(model):
    base = SamplingConfig(family="setdlm", window=4, max_new_tokens=16)
    plain = generate(model, PROMPTS, base)
    repeats = lambda outs: sum(len(o.tokens) - len(set(o.tokens)) for o in outs)  # noqa: E731
    penalised = generate(model, PROMPTS, SamplingConfig(family="setdlm", window=4, max_new_tokens=16,
                                                        frequency_penalty=2.0, presence_penalty=2.0))
    assert repeats(penalised) < repeats(plain)
    forced = generate(model, PROMPTS, SamplingConfig(family="setdlm", window=4, max_new_tokens=16, logit_bias={5: 100}))
    assert all(o.tokens == [5] * 16 for o in forced)
    sampled = generate(model, PROMPTS, SamplingConfig(family="setdlm", window=4, max_new_tokens=8, temperature=1.0,
                                                      seed=1, logprobs=2, logit_bias={5: 100}))
    assert all(o.tokens == [5] * 8 and all(math.isclose(lp, 0.0, abs_tol=1e-3) for lp in o.logprobs) for o in sampled)


def test_bad_values_name_the_field():
    from common.schema import ConfigError

    for kw, field in [(dict(logprobs=21), "logprobs"), (dict(presence_penalty=3.0), "presence_penalty"),
                      (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
                      (dict(logprobs=1, compile=True), "logprobs"), (dict(stop_regex="(?=x)"), "stop_regex")]:
        with pytest.raises(ConfigError, match=f"^sampling.{field}: "):
            SamplingConfig(**kw)


@pytest.mark.parametrize("family,kw", [("setdlm", dict(window=4, threshold=0.3)), ("bd3lm", dict(block_size=4)),
                                       ("mdlm", dict(steps=5)), ("ar", {})])
def test_fixed_shape_head_records_the_same_logprobs(model, family, kw):
    """A GPU chooses over every query slot in the step, a CPU over the active ones packed
    (Decoder.head_choose, whose logprobs are scattered back): both record the same."""
    from model.sampling.api import decoder_class

    cfg = SamplingConfig(family=family, max_new_tokens=8, logprobs=2, **kw)
    outs = []
    for cpu_head in (True, False):
        reqs = to_requests(PROMPTS, cfg, model.cfg.mask_id, model.cfg.vocab_size)
        dec = decoder_class(family)(model, reqs, cfg, mask_id=model.cfg.mask_id, eos_id=None)
        dec.cpu_head = cpu_head
        with torch.inference_mode():
            outs.append(dec.run())
    for a, b in zip(*outs):
        assert a.tokens == b.tokens and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert [[t for t, _ in top] for top in a.top_logprobs] == [[t for t, _ in top] for top in b.top_logprobs]
