"""Training is a function of the global batch, not of the layout (CPU, gloo, fp32, through the Trainer).

For every objective (AR, MDLM, BD3-LM, SetDLM), three steps of a global batch of 8 sequences under
  A  one process, micro_batch 8 (no accumulation)
  B  one process, micro_batch 2 (accumulation 4)
  C  DP=2, micro_batch 4, ZeRO-1
  D  TP=2, micro_batch 8
give the same losses, gradient norms and validation NLL (EMA weights), and A, B, C the same weights:
the step loss is normalised by the global predicted-token count, per-sample noise is keyed by the
sample's global position, and every layout reads the same global batches. MDLM under DP=2 with ZeRO-3
(E) trains the same way with its EMA kept as ZeRO-3 partitions; its gathered EMA checkpoint equals A's.
A run saved under DP=2 continues under DP=1 (each rank reads its part of the sharded checkpoint: no
consolidation), and a run continues under another `data.num_workers`, exactly as the uninterrupted
runs do (same next losses, same data position).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed_run import run_distributed
from helpers import read_metrics, run_as_of, write_recipe
from model import families
from pretrain.checkpoint.distcp import whole_state
from pretrain.config import load_config
from pretrain.trainer import Trainer

pytestmark = pytest.mark.slow

OBJECTIVES = families.names()
REL = 1e-5
ATOL = 3e-5  # weights: one Adam step moves a weight by up to lr = 3e-3; reduction order differs by layout


def _recipe(tmp: Path) -> Path:
    return write_recipe(tmp / "r.yaml", model={"n_layers": 2, "dropout": 0.0},
                        train={"max_steps": 3, "global_batch": 8, "micro_batch": 8, "lr": 3e-3, "warmup_steps": 0,
                               "eval_every": 3, "eval_batches": 2, "save_every": 2, "log_every": 1, "keep_last": 3,
                               "ema": 0.5, "grad_clip": 0.5})


def train_runs(recipe: Path, out: Path, runs: list[str]) -> None:
    """One rank: trains tiny runs through the real Trainer, one after another. Each NAME:OVERRIDES trains
    the recipe with `run.name=NAME run.out_dir=OUT` and the comma-separated overrides."""
    from pretrain.parallel import ensure_process_group
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    ensure_process_group()
    for run in runs:
        name, _, overrides = run.partition(":")
        cfg = load_config(Path(recipe), [f"run.name={name}", f"run.out_dir={out}", *filter(None, overrides.split(","))])
        Trainer(cfg).train()


def _launch(recipe: Path, out: Path, runs: list[str]) -> None:
    run_distributed(train_runs, 2, recipe, out, runs, timeout=900)


def _train(recipe: Path, out: Path, name: str, *overrides: str) -> None:
    Trainer(load_config(recipe, [f"run.name={name}", f"run.out_dir={out}", *overrides])).train()


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_parallel):
    tmp = tmp_path_factory.mktemp("layouts")
    recipe = _recipe(tmp)
    for obj in OBJECTIVES:
        _train(recipe, tmp, f"A-{obj}", f"objective.name={obj}")
        _train(recipe, tmp, f"B-{obj}", f"objective.name={obj}", "train.micro_batch=2")
    _launch(recipe, tmp, [f"C-{o}:objective.name={o},train.micro_batch=4,parallel.zero_stage=1" for o in OBJECTIVES]
            + ["E-mdlm:objective.name=mdlm,train.micro_batch=4,parallel.zero_stage=3"])
    _launch(recipe, tmp, [f"D-{o}:objective.name={o},parallel.tp=2" for o in OBJECTIVES])
    return recipe, tmp


def _close(a, b, rel=REL):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _same_metrics(a: dict, b: dict, what: str) -> None:
    for step in (1, 2, 3):
        for key in ("train/loss", "train/grad_norm"):
            assert _close(a[step][key], b[step][key]), (what, step, key, a[step][key], b[step][key])
    for step in (0, 3):
        assert _close(a[step]["val/nll"], b[step]["val/nll"]), (what, step, a[step]["val/nll"], b[step]["val/nll"])


def _weights(run: Path, step: int = 2) -> dict:
    return whole_state(run / "checkpoints" / f"step_{step:08d}", ema=False)["module"]


def _ema(run: Path, step: int = 2) -> dict:
    return whole_state(run / "checkpoints" / f"step_{step:08d}", module=False)["ema"]


def _max_diff(a: dict, b: dict) -> float:
    a, b = ({k: v for k, v in d.items() if torch.is_tensor(v)} for d in (a, b))
    assert a and set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_same_training_under_every_layout(runs, objective):
    _, tmp = runs
    ref = read_metrics(tmp / f"A-{objective}")
    for layout in ("B", "C", "D"):
        _same_metrics(ref, read_metrics(tmp / f"{layout}-{objective}"), f"{objective} {layout}")
    for layout in ("B", "C"):
        assert _max_diff(_weights(tmp / f"A-{objective}"), _weights(tmp / f"{layout}-{objective}")) <= ATOL, layout


def test_zero3_ema_matches_one_process(runs):
    _, tmp = runs
    _same_metrics(read_metrics(tmp / "A-mdlm"), read_metrics(tmp / "E-mdlm"), "mdlm ZeRO-3")
    ema_a, ema_e = _ema(tmp / "A-mdlm"), _ema(tmp / "E-mdlm")
    assert _max_diff(ema_a, ema_e) <= ATOL
    assert _max_diff(ema_a, _weights(tmp / "A-mdlm")) > 1e-4  # the EMA is not just the weights




def _position(run: Path, step: int = 3) -> int:
    data = torch.load(run / "checkpoints" / f"step_{step:08d}" / "extra_rank00000.pt", weights_only=False)["data"]
    return data["start"] + data["batches"] // (data["global_batch"] // (data["micro_batch"] * data["dp_size"])) \
        * data["global_batch"]


@pytest.mark.parametrize("source,overrides", [("C", []), ("A", ["data.num_workers=2"])],
                         ids=["dp2_to_dp1", "workers0_to_2"])
def test_resume_under_another_layout_continues_the_global_order(runs, tmp_path, source, overrides):
    recipe, tmp = runs
    run = run_as_of(tmp / f"{source}-mdlm", tmp_path / "cont", 2)
    _train(recipe, tmp_path, "cont", "objective.name=mdlm", *overrides)
    saved, cont = read_metrics(tmp / f"{source}-mdlm"), read_metrics(run)
    assert _close(cont[3]["train/loss"], saved[3]["train/loss"]), (cont[3], saved[3])
    assert _close(cont[3]["val/nll"], saved[3]["val/nll"]), (cont[3], saved[3])
    assert _position(run) == _position(tmp / "A-mdlm") == 3 * 8
