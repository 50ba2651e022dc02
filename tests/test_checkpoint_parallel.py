"""Checkpoints resumed under another layout and another number of processes (CPU, gloo, the real trainer).

Every run trains the same tiny model (dropout 0, an EMA) on the same global batches, so every layout
trains alike to float rounding (tests/test_layout_invariance.py), and a run saved at step 2 under one
layout and continued under another must continue the uninterrupted one-process run R: the losses and
gradient norms of steps 3 and 4 and the step-4 validation (EMA weights) within REL, and its step-4
checkpoint's weights, Adam moments and EMA within ATOL (a moment dropped at the resume would be off by
far more). Under the same layout the continuation is exact. No consolidated file is written anywhere.

The runs, one launch per process count, each rank training several runs in a row (`train_runs`;
`A<-B`: a copy of run B as of its step-2 checkpoint, continued under A's layout):

    1 process (here)  R
    2 processes       pp2 (PP=2, ZeRO-1), z3 (ZeRO-3, DP=2), pp2-again<-pp2 (the same layout),
                      tp2<-R (TP1 -> TP2), dp2<-R (1 -> DP=2 with ZeRO-1)
    4 processes       tp2dp2 (TP=2 x DP=2, ZeRO-1), tp2dp2<-pp2 (PP2 -> TP2, 2 -> 4 processes)
    2 processes       tp2<-tp2dp2 (4 -> 2 processes), dp2<-z3 (ZeRO-3 -> ZeRO-1)
    1 process (here)  R<-tp2dp2 (TP2 -> TP1 and DP2 -> DP1)

tp2<-... and R<-tp2dp2 are the acceptance check's two directions at CPU size: saved at TP=2 on 2+
processes and continued on 1; saved on 1 process and continued on 2 (DP=2, ZeRO-1).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distributed_run import run_distributed
from helpers import REPO, read_metrics, run_as_of, write_recipe

pytestmark = pytest.mark.slow

REL = 1e-5  # losses, gradient norms, validation (the acceptance check asks for 1e-3)
ATOL = 3e-5  # weights and EMA after 4 steps (tests/test_layout_invariance.py)
MOMENT_REL = 1e-4  # Adam moments, relative to their largest value
LAYOUTS = {"R": [], "pp2": ["parallel.pp=2", "parallel.zero_stage=1"], "z3": ["parallel.zero_stage=3"],
           "tp2": ["parallel.tp=2"], "dp2": ["parallel.zero_stage=1"],
           "tp2dp2": ["parallel.tp=2", "parallel.zero_stage=1"]}


# a 100-character vocabulary (the frozen format-1 fixture's tokenizer): small checkpoints, fast steps
CHARS = REPO / "tests" / "fixtures" / "checkpoint_format1" / "format1" / "tokenizer"


def _recipe(tmp: Path) -> Path:
    return write_recipe(tmp / "r.yaml", model={"n_layers": 2, "dropout": 0.0},
                        data={"tokenizer": str(CHARS), "add_mask_token": True},
                        train={"max_steps": 4, "save_every": 2, "eval_every": 4, "eval_batches": 1, "log_every": 1,
                               "keep_last": 3, "ema": 0.5, "micro_batch": 2, "global_batch": 4})


def train_runs(recipe: str, out: str, runs: list[str]) -> list[str]:
    """One rank: trains runs one after another. `NAME` trains LAYOUTS[NAME] as run NAME; `NAME<-SOURCE`
    continues a copy of run SOURCE as of its step-2 checkpoint under LAYOUTS[NAME] (run `NAME<-SOURCE`)."""
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.parallel import ensure_process_group
    from pretrain.trainer import Trainer

    ensure_process_group()
    for run in runs:
        layout, _, source = run.partition("<-")
        if source and dist.get_rank() == 0:
            run_as_of(Path(out) / source, Path(out) / run, 2)
        dist.barrier()
        Trainer(load_config(Path(recipe), [f"run.name={run}", f"run.out_dir={out}", *LAYOUTS[layout]])).train()
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_parallel):
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    tmp = tmp_path_factory.mktemp("ckpt_layouts")
    recipe = _recipe(tmp)
    Trainer(load_config(recipe, [f"run.name=R", f"run.out_dir={tmp}"])).train()
    run_distributed(train_runs, 2, str(recipe), str(tmp), ["pp2", "z3", "pp2<-pp2", "tp2<-R", "dp2<-R"], timeout=900)
    run_distributed(train_runs, 4, str(recipe), str(tmp), ["tp2dp2", "tp2dp2<-pp2"], timeout=900)
    run_distributed(train_runs, 2, str(recipe), str(tmp), ["tp2<-tp2dp2", "dp2<-z3"], timeout=900)
    train_runs(str(recipe), str(tmp), ["R<-tp2dp2"])
    return tmp


def _close(a, b, rel=REL):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _state(run: Path, step: int = 4) -> dict:
    from pretrain.checkpoint.distcp import whole_state

    return whole_state(run / "checkpoints" / f"step_{step:08d}", optimizer=True)


def _check_state(got: dict, ref: dict, what: str) -> None:
    for part in ("module", "ema"):
        assert set(got[part]) == set(ref[part]), (what, part, set(got[part]) ^ set(ref[part]))
        worst = max(((got[part][k] - ref[part][k]).abs().max().item(), k) for k in ref[part])
        assert worst[0] <= ATOL, (what, part, worst)
    for key in ("exp_avg", "exp_avg_sq"):
        r, g = ref["optimizer"][key], got["optimizer"][key]
        assert set(g) == set(r), (what, key, set(g) ^ set(r))
        scale = max(t.abs().max().item() for t in r.values())
        diff = max((g[n] - r[n]).abs().max().item() for n in r)
        assert diff <= MOMENT_REL * scale, (what, key, diff, scale)


CONTINUED = ["tp2<-R", "dp2<-R", "tp2dp2<-pp2", "tp2<-tp2dp2", "dp2<-z3", "R<-tp2dp2"]


@pytest.mark.parametrize("name", CONTINUED)
def test_a_checkpoint_continues_under_another_layout(runs, name):
    ref, cont = read_metrics(runs / "R"), read_metrics(runs / name)
    steps = [json.loads(line)["step"] for line in (runs / name / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)), steps  # one row per step across the resume
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm"):
            assert _close(cont[step][key], ref[step][key]), (name, step, key, cont[step][key], ref[step][key])
    assert _close(cont[4]["val/nll"], ref[4]["val/nll"]), (name, cont[4]["val/nll"], ref[4]["val/nll"])
    assert "relayout/val/nll" in cont[3] or name == "pp2<-pp2"  # the loaded weights were validated
    _check_state(_state(runs / name), _state(runs / "R"), name)


def test_the_same_layout_continues_exactly(runs):
    straight, again = read_metrics(runs / "pp2"), read_metrics(runs / "pp2<-pp2")
    for step in (3, 4):
        assert again[step]["train/loss"] == straight[step]["train/loss"], step
        assert again[step]["train/grad_norm"] == straight[step]["train/grad_norm"], step
    assert again[4]["val/nll"] == straight[4]["val/nll"]
    a, b = _state(runs / "pp2<-pp2"), _state(runs / "pp2")
    for part in ("module", "ema"):
        assert all((a[part][k] == b[part][k]).all() for k in b[part]), part
    for key in ("exp_avg", "exp_avg_sq"):
        assert all((a["optimizer"][key][k] == b["optimizer"][key][k]).all() for k in b["optimizer"][key]), key


def test_no_whole_model_file_and_every_rank_wrote_its_part(runs):
    """Nothing consolidated anywhere; a checkpoint of W processes has W data files (each rank's part,
    none of them the whole state) and meta.json records the layout, cp included."""
    from pretrain.checkpoint.distcp import read_metadata

    assert not list(runs.rglob("consolidated.pt")) and not list(runs.rglob("*model_states.pt"))
    for name, world in (("R", 1), ("pp2", 2), ("z3", 2), ("tp2dp2", 4), ("tp2<-tp2dp2", 2)):
        ckpt = runs / name / "checkpoints" / "step_00000004"
        files = sorted(p.name for p in ckpt.glob("*.distcp"))
        assert files == [f"__{r}_0.distcp" for r in range(world)], (name, files)
        meta = json.loads((ckpt / "meta.json").read_text())
        assert meta["storage"] == "dcp" and meta["layout"]["world"] == world and meta["layout"]["cp"] == 1
        if world > 1:
            sizes = [p.stat().st_size for p in ckpt.glob("*.distcp")]
            assert max(sizes) < sum(sizes), (name, sizes)
        md = read_metadata(ckpt)
        assert {k.split("/")[0] for k in md.state_dict_metadata} == {"model", "optim", "ema"}


def test_load_model_reads_a_sharded_checkpoint_in_a_plain_process(runs, tmp_path):
    """load_model reads the TP=2 x DP=2 ZeRO-1 checkpoint in a plain interpreter with megatron-core and
    DeepSpeed unimportable (no launcher variables, no process group): the weights are the checkpoint's
    EMA, it decodes, torch.distributed stays uninitialised and os.environ unchanged."""
    import subprocess
    import sys

    import torch

    from helpers import REPO, cli_env

    code = (
        "import os, sys, torch\n"
        "for name in ('megatron', 'megatron.core', 'deepspeed'):\n"
        "    sys.modules[name] = None\n"
        "import pretrain.checkpoint.inference, model.sampling\n"
        "before = dict(os.environ)\n"
        "m, tok, cfg = pretrain.checkpoint.inference.load_model(sys.argv[1])\n"
        "out = model.sampling.generate(m, [tok.encode('The')], model.sampling.SamplingConfig(family='setdlm',\n"
        "    window=4, max_new_tokens=4), mask_id=cfg.model.mask_id, tokenizer=tok)[0]\n"
        "assert len(out.tokens) == 4 and not torch.distributed.is_initialized() and dict(os.environ) == before\n"
        "torch.save(m.state_dict(), sys.argv[2])\n")
    r = subprocess.run([sys.executable, "-c", code, str(runs / "tp2dp2"), str(tmp_path / "w.pt")], cwd=REPO,
                       env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = torch.load(tmp_path / "w.pt", weights_only=True)
    want = _state(runs / "tp2dp2")
    assert set(want["ema"]) <= set(got) and all(torch.equal(got[k], want["ema"][k]) for k in want["ema"])
