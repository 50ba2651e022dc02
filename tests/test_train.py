"""End-to-end training on CPU: every objective learns; a killed run resumes exactly; bad input fails early."""


import pytest

from helpers import killed_and_resumed, read_metrics, write_recipe
from launch.cli import main as cli_main
from model import families
from pretrain.config import load_config
from pretrain.trainer import Trainer


@pytest.mark.parametrize("objective", families.names())
def test_every_objective_reduces_validation_nll(tmp_path, model_parallel, objective):
    recipe = write_recipe(tmp_path / "r.yaml")
    cfg = load_config(recipe, [f"objective.name={objective}", f"run.out_dir={tmp_path}", "train.max_steps=30",
                               "train.eval_every=30", "train.save_every=30", "train.log_every=10", "train.eval_batches=4"])
    Trainer(cfg).train()
    m = read_metrics(tmp_path / "tiny")
    assert m[30]["val/nll"] < m[0]["val/nll"] - 1.0, (m[0]["val/nll"], m[30]["val/nll"])
    assert (tmp_path / "tiny" / "checkpoints" / "latest").read_text() == "step_00000030"


@pytest.mark.slow
def test_killed_run_resumes_with_identical_losses(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", train={"max_steps": 10, "save_every": 2, "eval_every": 5},
                          model={"dropout": 0.1})
    # Same run, SIGKILLed after its step-4 checkpoint, then started again: it resumes by itself.
    a, b, _ = killed_and_resumed(recipe, tmp_path)
    for step in range(1, 11):
        assert b[step]["train/loss"] == a[step]["train/loss"], step
    assert b[10]["val/nll"] == a[10]["val/nll"]


@pytest.mark.parametrize("override,field", [
    ("objective.set_size=100", "objective.set_size"),
    ("objective.s_max=2", "objective.s_max"),
    ("objective.name=gpt", "objective.name"),
    ("parallel.tp=2", "parallel.tp"),
    ("data.source=/no/such/shards", "data.source"),
    ("train.global_batch=6", "train.global_batch"),
    ("model.n_heads=3", "model.n_heads"),
    ("train.bogus=1", "train.bogus"),
])
def test_bad_config_fails_before_training_naming_the_field(tmp_path, capsys, model_parallel, override, field):
    recipe = write_recipe(tmp_path / "r.yaml")
    code = cli_main(["pretrain", "--config", str(recipe), "--out", str(tmp_path), override])
    err = capsys.readouterr().err
    assert code == 2
    assert field in err, err
    assert not (tmp_path / "tiny" / "checkpoints").exists()


def test_missing_config_file(tmp_path, capsys):
    assert cli_main(["pretrain", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "--config" in capsys.readouterr().err


def test_bf16_autocast_and_ema_train(tmp_path, model_parallel):
    recipe = write_recipe(tmp_path / "r.yaml")
    cfg = load_config(recipe, [f"run.out_dir={tmp_path}", "train.max_steps=4", "train.precision=bf16",
                               "train.ema=0.9", "train.eval_every=4", "train.save_every=4"])
    trainer = Trainer(cfg)
    last = trainer.train()
    assert last["val/nll"] == last["val/nll"] and last["val/nll"] < 20  # finite
    ckpt = tmp_path / "tiny" / "checkpoints" / "step_00000004"
    import torch

    from pretrain.checkpoint import rundir

    assert rundir.has_ema(ckpt, rundir.read_meta(ckpt))
    # EMA weights differ from the raw weights after a few steps, and load_model picks them.
    from pretrain.checkpoint.inference import load_model

    ema_model, _, _ = load_model(ckpt, ema=True)
    raw_model, _, _ = load_model(ckpt, ema=False)
    name = "layers.0.mlp.fc1.weight"
    assert not (ema_model.state_dict()[name] == raw_model.state_dict()[name]).all()
    # the checkpoint's weights are the fp32 master weights, of which the bf16 weights are the rounding
    trained = trainer.model.state_dict()[name]
    assert trained.dtype == torch.bfloat16 and (raw_model.state_dict()[name].to(torch.bfloat16) == trained).all()


def test_bf16_tracks_fp32(tmp_path, model_parallel):
    """bf16 (fp32 master weights) follows the fp32 run closely over the first steps; DeepSpeed's bf16
    path without ZeRO drifted, so bf16 promotes ZeRO-0 to ZeRO-1."""
    losses = {}
    for prec in ("fp32", "bf16"):
        out = tmp_path / prec
        recipe = write_recipe(tmp_path / f"{prec}.yaml")
        cfg = load_config(recipe, [f"run.out_dir={out}", "train.max_steps=3", f"train.precision={prec}",
                                   "train.eval_every=0", "train.save_every=100"])
        Trainer(cfg).train()
        losses[prec] = [read_metrics(out / "tiny")[s]["train/loss"] for s in (1, 2, 3)]
        if prec == "bf16":
            assert cfg.parallel.zero_stage == 1
    for a, b in zip(losses["fp32"], losses["bf16"]):
        assert abs(a - b) < 2e-3, losses


def test_fp8_without_transformer_engine_or_gpu_is_a_clear_error(tmp_path, capsys, model_parallel):
    recipe = write_recipe(tmp_path / "r.yaml")
    assert cli_main(["pretrain", "--config", str(recipe), "--out", str(tmp_path), "model.fp8=hybrid",
                     "model.hidden=32", "model.ffn_hidden=64"]) == 2
    err = capsys.readouterr().err
    assert "model.fp8=hybrid" in err and ("CUDA" in err or "Transformer Engine" in err), err
    assert cli_main(["pretrain", "--config", str(recipe), "--out", str(tmp_path), "model.fp8=fp4"]) == 2
    assert "model.fp8" in capsys.readouterr().err
