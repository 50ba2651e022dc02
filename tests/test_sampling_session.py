"""A Session (prompts joining a running decode, step events, cancellation) == `generate` alone."""

import dataclasses

import pytest

from model import families
from model.sampling import Infill, SamplingConfig, generate
from model.sampling.session import Session
from model.sampling.testing import CharTokenizer, tiny_model

PROMPTS = [[1, 2, 3], Infill([4, 5], 6, [7, 8, 9]), [11], [12, 13, 14, 15, 16, 17, 18, 19], Infill([20], 9, []),
           [21, 22], [23, 24, 25, 26], Infill([27, 28, 29, 30, 31], 4, [32]), [33, 34, 35, 36, 37, 38], [40]]
SPANS = [12, None, 5, 9, None, 14, 3, None, 10, 7]
# Every family with the settings its sampler reads (window, block size, a threshold; each ignores the
# others'), and SW-SetDLM's own variants: one token per step, an adaptive window.
FAMILIES = [(name, dict(window=4, block_size=4, threshold=0.6)) for name in families.names()] + [
    (families.SETDLM.name, dict(window=4)),
    (families.SETDLM.name, dict(window=4, threshold=0.6, adaptive_window=True, window_max=8))]


@pytest.fixture(scope="module")
def model(model_parallel, one_thread):
    return tiny_model(seed=3)


def _alone(model, cfg, i, stop=None, eos=None):
    c = dataclasses.replace(cfg, max_new_tokens=SPANS[i] or 0, stop=stop or [])
    return generate(model, [PROMPTS[i]], c, tokenizer=CharTokenizer(), eos_id=eos)[0]


def _stops(model, cfg):
    """An EOS token (the first of row 0's tokens from its fourth on that works) and a stop string for row 8
    under which some rows stop at EOS, row 8 at its stop string and others at full length."""
    free = [_alone(model, cfg, i) for i in range(len(PROMPTS))]
    for eos, s in ((e, s) for e in dict.fromkeys(free[0].tokens[3:]) for s in range(0, 6)):
        stop = free[8].text[s:s + 2]
        alone = [_alone(model, cfg, i, [stop] if i == 8 else None, eos) for i in range(len(PROMPTS))]
        if {"length", "eos", "stop_string"} <= {o.stop_reason for o in alone}:
            return eos, stop, alone
    raise AssertionError("no EOS / stop string mix for this family")


def _key(o):
    return (o.tokens, o.text, o.commit_step, o.steps, o.stop_reason, o.sequence)


def _run(sess, arrivals, stop):
    """Submit prompt i at step arrivals[i] (row 8 with its stop string); returns {prompt index:
    output}, {prompt index: events}."""
    rows, outs, events, step = {}, {}, {}, 0
    while len(outs) < len(arrivals):
        for i, at in enumerate(arrivals):
            if at == step:
                rows[sess.submit(PROMPTS[i], max_new_tokens=SPANS[i], stop=[stop] if i == 8 else None, watch=True)] = i
        evs, fin = sess.step()
        for e in evs:
            events.setdefault(rows[e.row], []).append(e)
        outs.update({rows[r]: o for r, o in fin})
        step += 1
        assert step < 500
    return outs, events


@pytest.mark.parametrize("family,kw", FAMILIES)
def test_prompts_arriving_while_others_decode_equal_one_by_one(model, family, kw):
    cfg = SamplingConfig(family=family, **kw)
    eos, stop, alone = _stops(model, cfg)
    sess = Session(model, cfg, slots=3, max_len=40, mask_id=49, eos_id=eos, tokenizer=CharTokenizer())
    arrivals = [0, 0, 1, 1, 2, 5, 5, 6, 9, 30]
    outs, events = _run(sess, arrivals, stop)
    for i in range(len(PROMPTS)):
        assert _key(outs[i]) == _key(alone[i]), i
    assert sess.live == 0 and not sess.busy and len(sess.dec.rows) == 1  # shrunk back when idle
    # the events rebuild every output: each committed token, at its step, inside that step's window
    for i, evs in events.items():
        o, got, start = outs[i], {}, evs[-1].span[0]
        for e in evs:
            assert e.window is not None and all(e.window[0] <= p < e.window[1] for p in e.positions)
            got.update({p: (t, e.step) for p, t in zip(e.positions, e.tokens)})
        end = evs[-1].span[1]
        kept = [got[p] for p in range(start, end)]
        assert [t for t, _ in kept] == o.tokens and [s for _, s in kept] == o.commit_step
        assert [e.step for e in evs] == list(range(1, o.steps + 1))


def test_generate_reports_the_same_events(model):
    cfg = SamplingConfig(family="setdlm", window=4, threshold=0.6)
    seen = []
    outs = generate(model, [PROMPTS[0], PROMPTS[1]], cfg, max_new_tokens=12, tokenizer=CharTokenizer(),
                    on_step=seen.append)
    assert [o.tokens for o in outs] == [o.tokens for o in generate(model, [PROMPTS[0], PROMPTS[1]], cfg,
                                                                      max_new_tokens=12, tokenizer=CharTokenizer())]
    sess = Session(model, cfg, slots=2, max_len=40, mask_id=49, tokenizer=CharTokenizer())
    sess.submit(PROMPTS[0], max_new_tokens=12, watch=True)
    evs = []
    while sess.busy:
        e, _ = sess.step()
        evs += e
    strip = lambda es: [(e.step, e.positions, e.tokens, e.window, e.span, e.decoded) for e in es]  # noqa: E731
    assert strip([e for e in seen if e.row == 0]) == strip(evs)
    assert {e.row for e in seen} == {0, 1} and sum(len(e.positions) for e in seen if e.row == 1) >= 6


def test_cancel_frees_the_slot_and_leaves_the_others_alone(model):
    cfg = SamplingConfig(family="setdlm", window=4)
    sess = Session(model, cfg, slots=2, max_len=40, mask_id=49, tokenizer=CharTokenizer())
    a = sess.submit(PROMPTS[0], max_new_tokens=12)
    b = sess.submit(PROMPTS[5], max_new_tokens=14)
    c = sess.submit(PROMPTS[8], max_new_tokens=10)
    d = sess.submit(PROMPTS[9], max_new_tokens=7)
    sess.step()
    assert sess.live == 2 and sess.waiting == 2
    sess.cancel(d)  # waiting: leaves the queue
    sess.cancel(a)  # running: its slot goes to the next waiting prompt at once
    assert sess.live == 2 and sess.waiting == 0 and c in sess.dec.rows
    outs = {}
    while sess.busy:
        outs.update(dict(sess.step()[1]))
    assert outs[a].stop_reason == "cancelled" and len(outs[a].tokens) <= 1
    assert outs[d].stop_reason == "cancelled" and outs[d].tokens == []
    assert outs[b].tokens == _alone(model, cfg, 5).tokens and outs[c].tokens == _alone(model, cfg, 8).tokens


def test_a_prompt_longer_than_the_session_is_refused(model):
    sess = Session(model, SamplingConfig(window=4), slots=1, max_len=8, mask_id=49)
    with pytest.raises(ValueError, match="exceed the session's 8 positions"):
        sess.submit([1, 2, 3], max_new_tokens=6)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_whose_logits_are_not_finite_fails_alone(model, temperature):
    """NaN logits in one row (its final hidden states poisoned from its third step): that row ends with
    stop_reason "error" and no tokens; the step does not fail (sampled, torch.multinomial refuses NaN
    for the whole batch), and its batch-mates decode exactly as when that row is cancelled at the same
    point instead (greedy: as each decoded alone)."""
    cfg = SamplingConfig(family="setdlm", window=4, threshold=0.6, temperature=temperature, seed=5)

    def run(poison: bool):
        sess = Session(model, cfg, slots=3, max_len=40, mask_id=49, tokenizer=CharTokenizer())
        rows = [sess.submit(PROMPTS[i], max_new_tokens=SPANS[i]) for i in (0, 5, 8)]
        bad, steps = rows[1], [0]

        def hook(module, inputs, out):
            if poison and steps[0] >= 2 and out.shape[0] == len(sess.dec.rows):
                for b, r in enumerate(sess.dec.rows):
                    if r == bad:
                        out[b] = float("nan")
            return out

        handle = model.final_norm.register_forward_hook(hook)
        outs = {}
        try:
            while sess.busy:
                fin = sess.step()[1]
                steps[0] += 1
                outs.update(dict(fin))
                if not poison and steps[0] == 3 and bad not in outs:
                    sess.cancel(bad)  # the same point: after the step that fails it when poisoned
        finally:
            handle.remove()
        return [outs[r] for r in rows]

    a, bad, c = run(poison=True)
    assert bad.stop_reason == "error" and bad.tokens == [] and bad.stopped_early
    ref = run(poison=False)
    assert ref[1].stop_reason == "cancelled"
    assert _key(a) == _key(ref[0]) and _key(c) == _key(ref[2])
    if temperature == 0.0:
        assert a.tokens == _alone(model, cfg, 0).tokens and c.tokens == _alone(model, cfg, 8).tokens
