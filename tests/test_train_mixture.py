"""Training on a mixture (data.mixture) through the Trainer: validation per source equals one-source
runs, a killed run resumes with identical losses and per-source counts, re-weighting on resume is
refused or starts a new schedule, a source that runs out ends the run, and DP=2 / accumulation read the
same mixture as one process. The corpora are real shards made with `setdlm data prepare`."""
import json
import math
from pathlib import Path

import pytest
from distributed_run import run_distributed
from helpers import killed_and_resumed, read_metrics, setdlm, write_recipe
from mixture_data import mixture, prepare_corpora

from common.schema import ConfigError
from launch.cli import data_main as setdlm_data
from pretrain.config import load_config
from pretrain.trainer import Trainer

WEIGHTS = {"a": 0.6, "b": 0.4}


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    return prepare_corpora(tmp_path_factory.mktemp("corpora"), {"a": (0, 20), "b": (36, 56), "small": (10, 17)})


def _recipe(path: Path, corpora, weights=WEIGHTS, **train) -> Path:
    return write_recipe(path, data={"source": None, "mixture": mixture(corpora, weights), "seq_len": 32},
                        train={"max_steps": 10, "save_every": 2, "eval_every": 5, "global_batch": 8,
                               "micro_batch": 8, **train}, model={"dropout": 0.1})


def _train(recipe: Path, out: Path, *overrides: str) -> dict:
    return Trainer(load_config(recipe, [f"run.out_dir={out}", *overrides])).train()


def _record(run: Path) -> dict:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return json.loads((run / "checkpoints" / latest / "meta.json").read_text())["data"]


@pytest.mark.slow
def test_per_source_validation_equals_one_source_runs(tmp_path, corpora, model_parallel):
    recipe = _recipe(tmp_path / "r.yaml", corpora, max_steps=1, eval_every=1, eval_batches=3)
    _train(recipe, tmp_path / "mix")
    mix = read_metrics(tmp_path / "mix" / "tiny")[0]
    for name in WEIGHTS:
        _train(recipe, tmp_path / name, f"data.source={corpora[name]}", "data.mixture=[]")
        one = read_metrics(tmp_path / name / "tiny")[0]
        assert mix[f"val/nll/{name}"] == one["val/nll"], name  # the same weights, data and draws
        assert mix[f"val/tokens/{name}"] == one["val/tokens"] == 3 * 8 * 32
    total = sum(w * mix[f"val/nll/{n}"] for n, w in WEIGHTS.items())
    assert math.isclose(mix["val/nll"], total, rel_tol=1e-12) and math.isclose(mix["val/ppl"], math.exp(total))


def test_the_exported_model_card_lists_the_mixture_sources_with_weights(tmp_path, corpora, model_parallel):
    from pretrain.convert.export import export_checkpoint

    _train(_recipe(tmp_path / "r.yaml", corpora, max_steps=1, eval_every=0, save_every=1), tmp_path)
    out = export_checkpoint(tmp_path / "tiny", tmp_path / "hf", log=lambda *_: None)
    card = (Path(out) / "README.md").read_text()
    row = next(line for line in card.splitlines() if line.startswith("| data "))
    assert row == (f"| data mixture (weight, share) | a: `{corpora['a']}` (0.6, 60.0%); "
                   f"b: `{corpora['b']}` (0.4, 40.0%) |"), row
    assert "None" not in row


@pytest.mark.slow
def test_killed_run_resumes_with_identical_losses_and_counts(tmp_path, corpora, model_parallel, capfd):
    recipe = _recipe(tmp_path / "r.yaml", corpora)
    recipe.write_text(recipe.read_text().replace("seq_len: 32", "seq_len: 32\n  num_workers: 2"))
    a, b, run = killed_and_resumed(recipe, tmp_path)
    out = run.parent
    for step in range(1, 11):
        assert b[step]["train/loss"] == a[step]["train/loss"], step
    for key in ("val/nll", *(f"val/nll/{n}" for n in WEIGHTS)):
        assert b[10][key] == a[10][key], key
    rec = _record(out / "tiny")
    assert rec == _record(tmp_path / "ref" / "tiny")
    assert rec["position"] == 80 and {n: r["samples"] for n, r in rec["sources"].items()} == {"a": 48, "b": 32}
    capfd.readouterr()
    assert setdlm_data(["inspect", str(out / "tiny")]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert "step 10, global position 80" in lines[0]
    assert [ln.split()[:6] for ln in lines[2:]] == [["a", "0.6", "0.6000", "48", "1,536", "0"],
                                                      ["b", "0.4", "0.4000", "32", "1,024", "0"]]

    # other weights on resume: refused naming the key, or (allowed) a new schedule from the resume step
    new = f"data.mixture={json.dumps(mixture(corpora, {'a': 0.25, 'b': 0.75}))}"
    with pytest.raises(ConfigError, match=r"^data\.mixture\[0\]\.weight: 0\.25 .*data\.allow_reweight=true"):
        _train(recipe, out, "train.max_steps=14", new)
    assert setdlm("pretrain", "--config", recipe, "--out", out, "train.max_steps=14", new).returncode == 2
    capfd.readouterr()
    _train(recipe, out, "train.max_steps=14", new, "data.allow_reweight=true")
    after = _record(out / "tiny")
    assert {n: r["samples"] for n, r in after["sources"].items()} == {"a": 48 + 8, "b": 32 + 24}  # 2 + 6 per step
    log = capfd.readouterr()
    assert "new schedule (weights) from global position 80" in log.out + log.err


def test_a_source_that_runs_out_ends_the_run(tmp_path, corpora, model_parallel, capfd):
    recipe = _recipe(tmp_path / "r.yaml", corpora, {"a": 0.75, "small": 0.25}, max_steps=200, global_batch=4,
                     micro_batch=2, eval_every=0, save_every=50)
    n_small = json.loads((corpora["small"] / "manifest.json").read_text())["splits"]["train"]["num_samples"]
    last = _train(recipe, tmp_path, "data.on_exhausted=stop")
    assert last["exhausted"] == "small" and last["step"] == n_small  # one sample of it per step
    rec = _record(tmp_path / "tiny")
    assert rec["sources"]["small"]["samples"] == n_small and rec["sources"]["small"]["epochs"] == 1
    out = capfd.readouterr()
    log = out.out + out.err
    assert f"source 'small' ran out (its {n_small} train samples read" in log
    assert f"saved checkpoint {tmp_path / 'tiny' / 'checkpoints' / f'step_{n_small:08d}'}" in log


def train_mixture(recipe: str, out: str, name: str, overrides: list[str]) -> None:
    """One rank of a DP=2 run (run_distributed)."""
    from pretrain.parallel import ensure_process_group

    ensure_process_group()
    Trainer(load_config(Path(recipe), [f"run.out_dir={out}", f"run.name={name}", *overrides])).train()


@pytest.mark.slow
def test_dp2_and_accumulation_read_the_same_mixture(tmp_path, corpora, model_parallel):
    recipe = _recipe(tmp_path / "r.yaml", corpora, max_steps=4, eval_every=4, eval_batches=2, save_every=4,
                     lr=3e-3, warmup_steps=0)
    over = ["model.dropout=0.0"]
    _train(recipe, tmp_path, "run.name=dp1", *over)
    _train(recipe, tmp_path, "run.name=accum", "train.micro_batch=2", "data.num_workers=2", *over)
    run_distributed(train_mixture, 2, str(recipe), str(tmp_path), "dp2", ["train.micro_batch=4", *over], timeout=900)
    ref = read_metrics(tmp_path / "dp1")
    for name in ("accum", "dp2"):
        m = read_metrics(tmp_path / name)
        for step in range(1, 5):
            assert math.isclose(m[step]["train/loss"], ref[step]["train/loss"], rel_tol=1e-5), (name, step)
        for key in ("val/nll/a", "val/nll/b"):
            assert math.isclose(m[4][key], ref[4][key], rel_tol=1e-5), (name, key)
        assert _record(tmp_path / name) == _record(tmp_path / "dp1")
