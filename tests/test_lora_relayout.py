"""A LoRA run continues under another layout: a TP=2 LoRA checkpoint resumes under PP=2 with ZeRO-1
(2 processes, no conversion step), the frozen base read as weights only and the adapters with their
fp32 masters, Adam moments and EMA; the loaded weights' validation equals the TP=2 run's at that step
and the next steps' losses follow it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, cli_env, read_metrics, run_as_of, write_recipe

pytestmark = pytest.mark.slow
LORA = ["train.lora.rank=4", "train.lora.alpha=8", "train.lora.random_base=true", "train.lr=0.01"]
CHARS = REPO / "tests" / "fixtures" / "checkpoint_format1" / "format1" / "tokenizer"  # a small vocabulary
REL = 1e-5


def pretrain(nproc: int, recipe: Path, out: Path, *overrides: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "launch.cli", "pretrain", "--config", str(recipe), "--out", str(out), *overrides]
    r = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    return r.stdout + r.stderr


def close(a, b):
    return abs(a - b) <= REL * max(abs(a), abs(b))


def test_tp2_lora_checkpoint_continues_under_pp2_zero1(tmp_path):
    r = write_recipe(tmp_path / "r.yaml", model={"n_layers": 2, "dropout": 0.0},
                     data={"tokenizer": str(CHARS), "add_mask_token": True},
                     train={"max_steps": 4, "save_every": 2, "eval_every": 2, "eval_batches": 2, "keep_last": 3,
                            "micro_batch": 2, "global_batch": 4, "ema": 0.5})
    out = pretrain(2, r, tmp_path / "runs", "parallel.tp=2", *LORA)
    assert "LoRA: rank 4" in out
    run = tmp_path / "runs" / "tiny"
    cont = run_as_of(run, tmp_path / "tiny", 2)
    out = pretrain(2, r, tmp_path, "parallel.pp=2", "parallel.zero_stage=1", *LORA)
    assert "re-layout" in out
    saved, got = read_metrics(run), read_metrics(cont)
    assert close(got[3]["relayout/val/nll"], saved[2]["val/nll"]), (got[3], saved[2])
    for step in (3, 4):
        assert close(got[step]["train/loss"], saved[step]["train/loss"]), (step, got[step], saved[step])
    assert close(got[4]["val/nll"], saved[4]["val/nll"])
    assert not list(tmp_path.rglob("consolidated.pt"))
