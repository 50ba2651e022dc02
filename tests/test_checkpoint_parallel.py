"""Checkpoints under parallel layouts, through the real trainer on several processes (CPU, gloo).

- Resume parity: PP=2 with ZeRO-1 (per-stage model files, ZeRO optimizer files) trained 4 steps
  straight vs 2 steps + save + fresh processes + 2 steps: identical losses, gradient norms, validation.
- Re-layout: a TP=2 checkpoint, consolidated, continues under TP=1 (in this process) and under PP=2
  with ZeRO-1 (moments written into DeepSpeed's flat partitions):
  the validation NLL of the loaded weights equals the TP=2 run's at that step, and the next steps'
  losses match the TP=2 run (weights, Adam moments, LR schedule, data position and RNG carried over).
All runs keep an EMA (validation uses the EMA weights), so EMA shards are saved, resumed and
consolidated too.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, cli_env, read_metrics, run_as_of, write_recipe
from pretrain.checkpoint import rundir
from pretrain.config import load_config
from pretrain.checkpoint.consolidate import main as consolidate_main
from pretrain.trainer import Trainer

pytestmark = pytest.mark.slow

REL = 1e-5
# Dropout masks are drawn per pipeline stage, so only a dropout-free run continues identically under PP.
NO_DROPOUT = ["model.dropout=0.0"]


def recipe(tmp_path: Path, **train) -> Path:
    return write_recipe(tmp_path / "r.yaml", model={"n_layers": 2, "dropout": 0.1},
                        train={"max_steps": 4, "save_every": 2, "eval_every": 2, "eval_batches": 2, "keep_last": 3,
                               "micro_batch": 2, "global_batch": 4, "ema": 0.5, **train})


def pretrain(nproc: int, recipe_path: Path, out: Path, *overrides: str) -> str:
    args = ["-m", "launch.cli", "pretrain", "--config", str(recipe_path), "--out", str(out), *overrides]
    cmd = [sys.executable, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    r = subprocess.run(cmd, cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    return r.stdout + r.stderr


def close(a, b, rel=REL):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def test_pipeline_zero1_resume_matches_uninterrupted_run(tmp_path):
    r = recipe(tmp_path)
    layout = ["parallel.pp=2", "parallel.zero_stage=1"]
    pretrain(2, r, tmp_path / "straight", *layout)
    pretrain(2, r, tmp_path / "resumed", *layout, "train.max_steps=2", "train.keep_last=1")
    out = pretrain(2, r, tmp_path / "resumed", *layout, "train.keep_last=1")
    assert "resumed at step 2" in out
    a, b = read_metrics(tmp_path / "straight" / "tiny"), read_metrics(tmp_path / "resumed" / "tiny")
    for step in range(1, 5):
        assert b[step]["train/loss"] == a[step]["train/loss"], step
        assert b[step]["train/grad_norm"] == a[step]["train/grad_norm"], step
    assert b[4]["val/nll"] == a[4]["val/nll"]
    root = tmp_path / "resumed" / "tiny" / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == ["step_00000004"]  # keep_last=1
    assert sorted(p.name for p in (root / "step_00000004").glob("mp_rank_*")) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]  # one model file per pipeline stage


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory):
    """A TP=2 run of 4 steps with checkpoints at 2 and 4, and its step-2 checkpoint consolidated."""
    tmp = tmp_path_factory.mktemp("tp2")
    r = recipe(tmp)
    pretrain(2, r, tmp / "runs", "parallel.tp=2", *NO_DROPOUT)
    return r, tmp / "runs" / "tiny"


def _from_step_2(run: Path, dest: Path) -> Path:
    """A copy of `run` as it was after its step-2 save, with that checkpoint consolidated."""
    run_as_of(run, dest, 2)
    assert consolidate_main(["--checkpoint", str(dest)]) == 0
    assert (dest / "checkpoints" / "step_00000002" / "consolidated.pt").is_file()
    return dest


def _check_continuation(saved_run: Path, cont_run: Path) -> None:
    steps = [json.loads(line)["step"] for line in (cont_run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)), steps  # one row per step, also across the re-layout resume
    saved, cont = read_metrics(saved_run), read_metrics(cont_run)
    # the loaded weights' validation at step 2 rides on the next row: metrics.jsonl keeps one row per step
    assert close(cont[3]["relayout/val/nll"], saved[2]["val/nll"], 1e-6), (cont[3], saved[2]["val/nll"])
    for step in (3, 4):
        assert close(cont[step]["train/loss"], saved[step]["train/loss"]), (step, cont[step], saved[step])
    assert close(cont[4]["val/nll"], saved[4]["val/nll"]), (cont[4]["val/nll"], saved[4]["val/nll"])


def test_tp2_checkpoint_continues_under_tp1(tp2_run, tmp_path, model_parallel):
    r, run = tp2_run
    run1 = _from_step_2(run, tmp_path / "tiny")
    cfg = load_config(r, [f"run.out_dir={tmp_path}", *NO_DROPOUT])
    Trainer(cfg).train()
    _check_continuation(run, run1)


def test_tp2_checkpoint_continues_under_pp2_zero1(tp2_run, tmp_path):
    r, run = tp2_run
    run2 = _from_step_2(run, tmp_path / "tiny")
    out = pretrain(2, r, tmp_path, "parallel.pp=2", "parallel.zero_stage=1", *NO_DROPOUT)
    assert "re-layout" in out
    _check_continuation(run, run2)


def test_relayout_without_consolidation_fails_clearly(tp2_run, tmp_path, model_parallel):
    r, run = tp2_run
    shutil.copytree(run, tmp_path / "tiny")
    cfg = load_config(r, [f"run.out_dir={tmp_path}", *NO_DROPOUT])
    with pytest.raises(ValueError, match="setdlm convert consolidate"):
        Trainer(cfg).train()


def test_tp2_checkpoint_loads_and_decodes_without_a_process_group(tp2_run, tmp_path):
    """load_model merges the TP=2 shards in memory in a plain interpreter (no launcher variables):
    the weights are the consolidated ones, it decodes, torch.distributed stays uninitialised and
    os.environ unchanged; nothing is written into the checkpoint."""
    import torch

    from pretrain.checkpoint.consolidate import consolidated_state

    _, run = tp2_run
    code = (
        "import os, sys, torch\n"
        "import pretrain.checkpoint.inference, model.sampling\n"
        "before = dict(os.environ)\n"
        "m, tok, cfg = pretrain.checkpoint.inference.load_model(sys.argv[1])\n"
        "out = model.sampling.generate(m, [tok.encode('The')], model.sampling.SamplingConfig(family='setdlm',\n"
        "    window=4, max_new_tokens=4), mask_id=cfg.model.mask_id, tokenizer=tok)[0]\n"
        "assert len(out.tokens) == 4 and not torch.distributed.is_initialized() and dict(os.environ) == before\n"
        "torch.save(m.state_dict(), sys.argv[2])\n")
    r = subprocess.run([sys.executable, "-c", code, str(run), str(tmp_path / "w.pt")], cwd=REPO, env=cli_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = torch.load(tmp_path / "w.pt", weights_only=True)
    ckpt = rundir.latest_checkpoint(run / "checkpoints")
    assert not (ckpt / "consolidated.pt").exists()
    want = consolidated_state(ckpt, optimizer=False)
    want = {**want["module"], **want["ema"]}
    assert {k for k, v in want.items() if torch.is_tensor(v)} == {k for k, v in got.items() if torch.is_tensor(v)}
    assert all(torch.equal(got[k], want[k].float()) for k in got if torch.is_tensor(got[k]))
