"""The quickstart's closing report: one prompt at one token per step, a strict and a loose threshold."""

import re

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
