"""Conversion of a checkpoint saved under tensor parallelism (TP=2, two gloo processes): the export
consolidates the shards on the fly, its logits equal the consolidated training model's, and the
re-imported run continues training under TP=2."""

from __future__ import annotations

import pytest

from helpers import setdlm, write_recipe
from test_convert_hf import _close, _inputs, _logits, _run_hf


@pytest.mark.slow
def test_tp2_checkpoint_round_trip(tmp_path, model_parallel):
    from pretrain.checkpoint.inference import load_model
    from pretrain.checkpoint.consolidate import consolidate
    from pretrain.convert.export import export_checkpoint
    from pretrain.convert.from_hf import import_hf

    recipe = write_recipe(tmp_path / "r.yaml", model={"n_heads": 4, "tie_embeddings": False},
                          train={"max_steps": 2, "save_every": 2, "eval_every": 0, "ema": 0.5})
    common = ["--config", recipe, "--out", tmp_path, "parallel.tp=2"]
    r = setdlm("launch", "local", "-n", "2", "--", "-m", "launch.cli", "pretrain", *common, timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    run = tmp_path / "tiny"
    hf = export_checkpoint(run, tmp_path / "hf", log=lambda s: None)  # shards merged on the fly
    assert not list((run / "checkpoints").glob("*/consolidated.pt")), "the export must not modify the checkpoint"
    consolidate(run, log=lambda s: None)
    model, _, cfg = load_model(run)
    ids, pos, mask = _inputs(cfg, seed=5)
    ref = _logits(model, ids, pos, mask)
    out = _run_hf({"tp2": {"dir": str(hf), "ids": ids, "pos": pos, "mask": mask}}, tmp_path)
    _close(out["tp2"]["logits"], ref)
    back = import_hf(hf, tmp_path / "back", log=lambda s: None)
    model2, _, _ = load_model(back)
    _close(_logits(model2, ids, pos, mask), ref)
    # The re-imported run continues under TP=2 (consolidated checkpoint, re-layout path).
    r = setdlm("launch", "local", "-n", "2", "--", "-m", "launch.cli", "pretrain", "--config", back / "config.yaml",
               "parallel.tp=2", "train.max_steps=1", "train.save_every=1", "train.eval_every=0", timeout=400)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert (back / "checkpoints" / "latest").read_text() == "step_00000001"
