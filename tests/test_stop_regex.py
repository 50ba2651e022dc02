"""Stop regexes are RE2 (model/sampling/stopping.py): linear-time matching, bounded compilation, the
interpreter lock released while matching, and a matching-time budget per output."""

import threading
import time

import pytest

from model.sampling import SamplingConfig, generate
from model.sampling import stopping
from model.sampling.stop_regex import StopRegexError, compile_stop_regex
from model.sampling.stopping import StopChecker
from model.sampling.testing import CharTokenizer, tiny_model


@pytest.mark.parametrize("pattern,why", [("(?=x)", "invalid perl operator"), (r"(a)\1", "invalid escape"),
                                         ("(?:a{1000}){1000}", "invalid repetition size"), ("(", "missing )"),
                                         ("x" * 600, "at most 512 characters")])
def test_patterns_re2_refuses_say_why(pattern, why):
    t0 = time.perf_counter()
    with pytest.raises(StopRegexError, match=why.replace("(", r"\(").replace(")", r"\)")):
        compile_stop_regex(pattern)
    assert time.perf_counter() - t0 < 1.0


def test_catastrophic_backtracking_pattern_is_linear_and_releases_the_lock():
    pattern = compile_stop_regex(r"(\s+)+x")
    t0 = time.perf_counter()
    assert pattern.search(" " * 200_000) is None  # Python's re takes exponential time here
    assert time.perf_counter() - t0 < 1.0
    slow = compile_stop_regex(r"(?:[\s\S]?){300}[\s\S]{300}x")  # linear, but a large program: a slow search
    ticks, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    th = threading.Thread(target=ticker)
    th.start()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        slow.search("a b " * 20_000)
    done.set()
    th.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:])]
    assert len(ticks) > 20 and max(gaps) < 0.25  # another thread ran while RE2 matched


def test_an_output_over_its_matching_time_ends_at_its_decoded_prefix(monkeypatch, one_thread):
    model = tiny_model(seed=2)
    tok = CharTokenizer()
    prompts = [[1, 2, 3], [4, 5]]
    cfg = SamplingConfig(family="setdlm", window=4, max_new_tokens=12, stop_regex="zzzzzz")
    free = generate(model, prompts, cfg, tokenizer=tok)
    assert all(o.stop_reason == "length" for o in free)
    monkeypatch.setattr(stopping, "REGEX_SECONDS", 0.0)  # the first search uses up the budget
    out = generate(model, prompts, cfg, tokenizer=tok)
    for f, o in zip(free, out):
        assert o.stop_reason == "regex_timeout" and o.stopped_early and 0 < len(o.tokens) < 12
        assert o.tokens == f.tokens[: len(o.tokens)] and o.text == tok.decode(o.tokens)


def test_checker_budget_is_per_output():
    tok = CharTokenizer()
    checker = StopChecker(tok, [], "q+r", budget=0.0)
    assert checker.check([0, 1], 0, row=1) is None  # the first search of row 1
    with pytest.raises(stopping.StopRegexTimeout, match="^sampling.stop_regex: "):
        checker.check([0, 1, 2], 2, row=1)
    assert checker.check([0], 0, row=2) is None  # row 2 has its own
    checker.forget(1)
    assert checker.check([0, 1, 2], 2, row=1) is None
