"""The quickstart's closing report: one prompt at one token per step, a strict and a loose threshold."""

import re
from types import SimpleNamespace

import pytest

from model.sampling import SamplingConfig
from model.sampling.report import speed_report, speed_settings
from model.sampling.testing import CharTokenizer, tiny_model


@pytest.fixture(scope="module")
def model(one_thread):
    return tiny_model(seed=0, sharpness=3.0)


def test_report_shows_parallel_decoding(model):
    base = SamplingConfig(family="setdlm", window=4, max_new_tokens=12, threshold=0.9)
    text = speed_report(model, CharTokenizer(), "abc", base, loose=0.0)
    found = re.findall(r"sample, (.+?): (\d+) forwards \(prefill \+ (\d+) steps\), ([\d.]+) tokens/step, (\d+) tokens/s", text)
    assert [f[0] for f in found] == ["one token per step (AR order)", "strict threshold 0.9", "loose threshold 0"]
    steps = [int(f[2]) for f in found]
    assert steps[0] == 12 and steps[2] == 3 and float(found[2][3]) == 4.0  # loose: the whole window per step
    assert all(line.startswith("abc") for line in text.splitlines()[1::2])
    labels = [label for label, _ in speed_settings(base)]  # the default loose threshold adds the whole-window row
    assert labels[-1] == "threshold 0 (the whole window every step)" and len(labels) == 4


def test_ar_reports_one_line():
    assert [label for label, _ in speed_settings(SamplingConfig(family="ar"))] == ["AR, one token per step"]


def test_each_setting_is_timed_after_its_own_warm_up_as_the_median(model, monkeypatch):
    from model.sampling import report

    calls, clock = [], iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # three timed decodes: 1 s, 3 s, 2 s
    real = report.generate
    monkeypatch.setattr(report, "generate", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    monkeypatch.setattr(report, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    cfg = SamplingConfig(family="setdlm", window=4, max_new_tokens=6, threshold=0.5)
    out, secs = report.timed_decode(model, [0, 1, 2], cfg, repeats=3)
    assert secs == 2.0 and len(calls) == 4 and all(c is cfg for c in calls)  # the warm-up decodes the same setting
    assert len(out.tokens) == 6


def test_a_loose_threshold_that_decodes_as_the_strict_one_is_said_so(model):
    base = SamplingConfig(family="setdlm", window=4, max_new_tokens=8, threshold=0.9)
    same = speed_report(model, CharTokenizer(), "abc", base, loose=0.9, repeats=1)
    assert ("(the loose threshold 0.9 decoded exactly as the strict one: no other position reached a confidence of "
            "0.9 in any step)") in same.splitlines()
    differs = speed_report(model, CharTokenizer(), "abc", base, loose=0.0, repeats=1)
    assert "decoded exactly as the strict one" not in differs
