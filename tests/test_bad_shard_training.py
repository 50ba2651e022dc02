"""Training on through a bad shard (data.skip_bad_shards: true): a micro-batch whose rows all sat in the
bad shard is empty, and one only partly there is short. The trainer fills such a micro-batch up with
weight-0 filler rows (data_pipeline/reader.py `fill_rows`), so it adds zero loss and zero tokens while
every rank and pipeline stage runs the same shapes and collectives; tokens_seen counts the real rows.

Data: 20 shards of 8 rows (seq_len 32), read in order (shuffle off), shard 1 (positions 8..15) broken
on disk. Global batch 16, so step 1 is shard 0 (good) + shard 1 (bad):
  A  one process, micro_batch 8: step 1's second micro-batch is empty
  C  DP=2, micro_batch 4: rank 1's whole step 1 is empty, rank 0's is full
  D  PP=2, micro_batch 8: the empty micro-batch passes through both stages (megatron's 1F1B schedule)
  R  the intact data, global batch 8: its step 1 is A's good micro-batch alone (the same rows, the same
     per-sample noise)
A's step 1 must equal R's step 1 (loss, gradient norm, weights after the step): the empty micro-batch
adds nothing to the loss, the gradient or the normalising token count. C and D must train as A does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from distributed_run import run_distributed
from helpers import read_metrics, setdlm, write_recipe
from model import families

OBJECTIVES = families.names()
REL = 1e-5
SEQ, ROWS = 32, 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(intact shards, the same shards with shard 1 broken)."""
    tmp = tmp_path_factory.mktemp("bad_shard")
    good = tmp / "good"
    r = setdlm("data", "prepare", "--input", "builtin:pydoc_topics", "--out", good, "--seq-len", SEQ,
               "--samples-per-shard", ROWS, "--max-docs", "4", "--num-proc", "1")
    assert r.returncode == 0, r.stderr
    bad = tmp / "bad"
    shutil.copytree(good, bad)
    (bad / "train" / "shard-000001.tar").write_bytes(b"not a tar")
    return good, bad


def _recipe(tmp: Path, data: Path, **train) -> Path:
    return write_recipe(tmp / "r.yaml", model={"n_layers": 2, "dropout": 0.0},
                        data={"source": str(data), "seq_len": SEQ, "skip_bad_shards": True, "shuffle": False},
                        train={"max_steps": 3, "global_batch": 16, "micro_batch": 8, "lr": 3e-3, "warmup_steps": 0,
                               "eval_every": 0, "save_every": 1, "log_every": 1, "keep_last": 3, "grad_clip": 0.5,
                               "sample_at_end": False, **train})


def train_runs(recipe: str, out: str, runs: list[str]) -> None:
    """One rank: NAME:OVERRIDES trains `recipe` with run.name=NAME, run.out_dir=OUT and the overrides."""
    from pretrain.config import load_config
    from pretrain.parallel import ensure_process_group
    from pretrain.trainer import Trainer

    ensure_process_group()
    for run in runs:
        name, _, overrides = run.partition(":")
        cfg = load_config(Path(recipe), [f"run.name={name}", f"run.out_dir={out}", *filter(None, overrides.split(","))])
        Trainer(cfg).train()


def _weights(run: Path, step: int) -> dict:
    from pretrain.checkpoint.inference import checkpoint_weights
    from pretrain.checkpoint.rundir import read_meta

    ckpt = run / "checkpoints" / f"step_{step:08d}"
    return checkpoint_weights(ckpt, read_meta(ckpt), ema=False)[0]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b))


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.slow
def test_an_empty_micro_batch_adds_no_loss_no_gradient_no_tokens(tmp_path, data, model_parallel, objective):
    good, bad = data
    extra = ["objective.block_size=4"] if objective == "bd3lm" else []
    train_runs(str(_recipe(tmp_path, bad)), str(tmp_path), [f"A:objective.name={objective}", *extra])
    a = read_metrics(tmp_path / "A")
    assert all(a[s]["train/loss"] == a[s]["train/loss"] and a[s]["train/loss"] > 0 for s in (1, 2, 3)), a  # finite
    # 8 rows of step 1 were in the bad shard: 16 + 16 + 8 real rows in three steps
    assert [a[s]["train/tokens_seen"] for s in (1, 2, 3)] == [8 * SEQ, 24 * SEQ, 40 * SEQ]
    meta = json.loads((tmp_path / "A" / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["tokens_seen"] == 40 * SEQ
    if objective not in ("setdlm", "ar"):
        return  # MDLM / BD3-LM noise levels are stratified over the global batch: R's differ from A's
    ref = tmp_path / "ref"
    ref.mkdir()
    train_runs(str(_recipe(ref, good, global_batch=8)), str(ref), [f"R:objective.name={objective}"])
    r = read_metrics(ref / "R")
    assert _close(a[1]["train/loss"], r[1]["train/loss"]), (a[1], r[1])
    assert _close(a[1]["train/grad_norm"], r[1]["train/grad_norm"]), (a[1], r[1])
    wa, wr = _weights(tmp_path / "A", 1), _weights(ref / "R", 1)
    assert wa.keys() == wr.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wr[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.slow
def test_an_empty_micro_batch_under_dp2_and_pp2_trains_as_one_process(tmp_path, data, model_parallel):
    _, bad = data
    recipe = _recipe(tmp_path, bad)
    train_runs(str(recipe), str(tmp_path), ["A:"])
    run_distributed(train_runs, 2, str(recipe), str(tmp_path),
                    ["C:train.micro_batch=4", "D:parallel.pp=2"], timeout=900)
    a = read_metrics(tmp_path / "A")
    for name in ("C", "D"):
        m = read_metrics(tmp_path / name)
        for s in (1, 2, 3):
            for k in ("train/loss", "train/grad_norm"):
                assert _close(m[s][k], a[s][k]), (name, s, k, m[s][k], a[s][k])
            assert m[s]["train/tokens_seen"] == a[s]["train/tokens_seen"], (name, s)
