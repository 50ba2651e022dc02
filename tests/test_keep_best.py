"""train.keep_best keeps the checkpoint with the best validation metric outside keep_last, `RUN:best`
selects it wherever a checkpoint is named (and loads its EMA weights), a resumed run continues from the
recorded best; train.epochs resolves max_steps from the training split."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import read_metrics, setdlm, write_recipe


def _run(tmp_path, name, *overrides, **train):
    recipe = write_recipe(tmp_path / f"{name}.yaml", run={"name": name},
                          train={"max_steps": 6, "eval_every": 2, "save_every": 100, "keep_last": 1, **train})
    out = setdlm("pretrain", "--config", recipe, "--out", tmp_path, *overrides, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp_path / name, out


def _val_rows(run):
    return {s: r["val/nll"] for s, r in read_metrics(run).items() if s > 0 and r.get("val/nll") is not None}


@pytest.mark.slow
def test_best_checkpoint_is_kept_outside_keep_last_and_selected_by_run_best(tmp_path):
    from pretrain.checkpoint import rundir
    from pretrain.checkpoint.inference import checkpoint_weights, load_model

    # best_mode max on a falling val/nll: the best is the first validation, long before `latest`
    run, out = _run(tmp_path, "kb", "train.keep_best=true", "train.best_mode=max", "train.ema=0.9",
                    "train.export_hf=true")
    vals = _val_rows(run)
    assert sorted(vals) == [2, 4, 6]
    root = run / "checkpoints"
    record = json.loads((root / "best").read_text())
    want = max(vals, key=vals.get)
    assert record["tag"] == rundir.tag_for(want) and record["metric"] == "val/nll" and record["mode"] == "max"
    assert math.isclose(record["value"], vals[want], rel_tol=1e-6)
    kept = sorted(p.name for p in root.glob("step_*"))
    assert kept == sorted({rundir.tag_for(want), rundir.tag_for(6)})  # keep_last=1 plus the best
    assert rundir.resolve_checkpoint(f"{run}:best") == root / rundir.tag_for(want)
    assert rundir.resolve_checkpoint(f"{run}:latest") == root / rundir.tag_for(6)
    assert rundir.resolve_checkpoint(f"{run}:6") == root / rundir.tag_for(6)
    # RUN:best loads the EMA weights of the best checkpoint (the released-model convention)
    model, _, _ = load_model(f"{run}:best")
    from pretrain.checkpoint.distcp import whole_state

    ema = whole_state(root / rundir.tag_for(want), module=False)["ema"]
    for name, value in ema.items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0)
    raw, used = checkpoint_weights(root / rundir.tag_for(want), rundir.read_meta(root / rundir.tag_for(want)), ema=False)
    assert not used and any(not torch.equal(raw[n], ema[n]) for n in ema)
    # train.export_hf exports the best checkpoint (the released-model convention), and says so
    assert json.loads((run / "hf" / "setdlm_recipe.json").read_text())["step"] == want
    assert f"Hugging Face export of {run}:best" in out.stdout + out.stderr
    # every command takes it: sampling and the Hugging Face export
    s = setdlm("sample", "--checkpoint", f"{run}:best", "--prompt", "The", "--max-new-tokens", "4", timeout=300)
    assert s.returncode == 0, s.stderr[-2000:]
    e = setdlm("convert", "to-hf", "--checkpoint", f"{run}:best", "--out", tmp_path / "hf", timeout=300)
    assert e.returncode == 0, e.stderr[-2000:]
    assert json.loads((tmp_path / "hf" / "setdlm_recipe.json").read_text())["step"] == want
    # a selector that names nothing is one line naming it
    bad = setdlm("sample", "--checkpoint", f"{run}:9", "--prompt", "The", timeout=120)
    assert bad.returncode == 2 and "no complete checkpoint" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_a_resumed_run_continues_from_the_recorded_best(tmp_path):
    run, _ = _run(tmp_path, "kr", "train.keep_best=true", "train.max_steps=4")
    first = json.loads((run / "checkpoints" / "best").read_text())
    run, _ = _run(tmp_path, "kr", "train.keep_best=true", "train.max_steps=8")
    vals = _val_rows(run)
    assert sorted(vals) == [2, 4, 6, 8]
    best = json.loads((run / "checkpoints" / "best").read_text())
    assert best["step"] == min(vals, key=vals.get) and best["value"] <= first["value"]
    assert (run / "checkpoints" / best["tag"]).is_dir()


@pytest.mark.slow
def test_keep_best_errors_name_the_field(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", train={"max_steps": 2, "eval_every": 0, "keep_best": True})
    out = setdlm("pretrain", "--config", recipe, "--out", tmp_path, timeout=120)
    assert out.returncode == 2 and "train.keep_best:" in out.stderr and "Traceback" not in out.stderr
    recipe = write_recipe(tmp_path / "m.yaml", run={"name": "m"},
                          train={"max_steps": 2, "eval_every": 2, "keep_best": True, "best_metric": "val/acc"})
    out = setdlm("pretrain", "--config", recipe, "--out", tmp_path, timeout=300)
    assert out.returncode == 2 and "train.best_metric: 'val/acc'" in out.stderr and "val/nll" in out.stderr


@pytest.mark.slow
def test_epochs_resolve_max_steps_from_the_training_split(tmp_path):
    from data_pipeline.loader import build_loader
    from data_pipeline.tokenizers import load_tokenizer
    from pretrain.config import load_config

    recipe = write_recipe(tmp_path / "e.yaml", run={"name": "ep"}, train={"eval_every": 0, "save_every": 100})
    cfg = load_config(recipe, ["train.epochs=0.002"])
    n = build_loader(cfg.data, split="train", tokenizer=load_tokenizer("gpt2"), micro_batch=4,
                     global_batch=4).num_samples
    want = math.ceil(0.002 * n / 4)
    assert 1 < want < 20
    out = setdlm("pretrain", "--config", recipe, "--out", tmp_path, "train.epochs=0.002", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"-> train.max_steps {want}" in out.stdout + out.stderr
    assert max(read_metrics(tmp_path / "ep")) == want
    assert (tmp_path / "ep" / "checkpoints" / "latest").read_text() == f"step_{want:08d}"


def test_epochs_and_max_steps_are_one_or_the_other(tmp_path):
    from common.schema import ConfigError
    from pretrain.config import load_config

    both = write_recipe(tmp_path / "b.yaml", train={"max_steps": 5, "epochs": 2})
    with pytest.raises(ConfigError, match="train.epochs: set either"):
        load_config(both)
    one = write_recipe(tmp_path / "o.yaml", train={"max_steps": 5})
    assert load_config(one, ["train.epochs=2"]).train.epochs == 2  # the command line's replaces the file's
    assert load_config(write_recipe(tmp_path / "e.yaml", train={"epochs": 3}), ["train.max_steps=7"]).train.epochs is None
