"""A LoRA run continues under another layout: a TP=2 LoRA checkpoint, consolidated, resumes under
PP=2 with ZeRO-1 (2 processes), the frozen base loaded as weights only and the adapters with their
fp32 masters, Adam moments and EMA; the loaded weights' validation equals the TP=2 run's at that step
and the next steps' losses follow it (tests/test_checkpoint_parallel.py's re-layout check)."""

from __future__ import annotations

import pytest

from test_checkpoint_parallel import NO_DROPOUT, _check_continuation, _from_step_2, pretrain, recipe

pytestmark = pytest.mark.slow
LORA = ["train.lora.rank=4", "train.lora.alpha=8", "train.lora.random_base=true", "train.lr=0.01"]


def test_tp2_lora_checkpoint_continues_under_pp2_zero1(tmp_path):
    r = recipe(tmp_path)
    out = pretrain(2, r, tmp_path / "runs", "parallel.tp=2", *NO_DROPOUT, *LORA)
    assert "LoRA: rank 4" in out
    run = tmp_path / "runs" / "tiny"
    cont = _from_step_2(run, tmp_path / "tiny")
    out = pretrain(2, r, tmp_path, "parallel.pp=2", "parallel.zero_stage=1", *NO_DROPOUT, *LORA)
    assert "re-layout" in out
    _check_continuation(run, cont)
