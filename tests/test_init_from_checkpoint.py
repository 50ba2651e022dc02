"""`train.init_from` with a setdlm run as the source, when a `latest` pointer names a deleted step.

- A fine-tune run (init_from = a setdlm run) whose own newest checkpoint was deleted resumes from its
  newest complete checkpoint, as the same run without init_from does, and says so in one line
  (`init_from.prepare` used to read `checkpoints/latest` itself and stopped the run at start-up).
- A fine-tune run whose source's `latest` names a deleted step starts from the source's newest
  complete checkpoint, and says so in one line.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from helpers import setdlm, write_recipe

STEPS = {"max_steps": 4, "save_every": 2, "eval_every": 0, "log_every": 2, "sample_at_end": False, "keep_last": 3}
FALLBACK = "newest complete checkpoint"


@pytest.fixture
def source(tiny_run, model_parallel) -> Path:
    """A tiny setdlm run with checkpoints at steps 2 and 4 (the fine-tune source; conftest.py, shared)."""
    return tiny_run[1]


def _finetune(tmp_path: Path, src: Path) -> Path:
    return write_recipe(tmp_path / "ft.yaml", run={"name": "ft", "seed": 7}, train={**STEPS, "init_from": str(src)})


def _lines(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


@pytest.mark.slow
def test_a_finetune_run_whose_latest_names_a_deleted_step_resumes_from_the_newest_complete(source, tmp_path,
                                                                                           model_parallel):
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    recipe = _finetune(tmp_path, source)
    Trainer(load_config(recipe, [f"run.out_dir={tmp_path / 'runs'}"])).train()  # the fine-tune: steps 2 and 4
    root = tmp_path / "runs" / "ft" / "checkpoints"
    assert (root / "latest").read_text() == "step_00000004"
    shutil.rmtree(root / "step_00000004")
    r = setdlm("pretrain", "--config", recipe, "--out", tmp_path / "runs", timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "resumed at step 2" in out and "init_from: weights of" not in out, out[-3000:]
    said = _lines(out, FALLBACK)
    assert len(said) == 1 and "names step_00000004, which is missing" in said[0] and "step_00000002" in said[0], said
    assert (root / "latest").read_text() == "step_00000004"  # trained on from step 2 and saved step 4 again


@pytest.mark.slow
def test_a_finetune_from_a_source_whose_latest_names_a_deleted_step_starts_from_its_newest_complete(
        source, tmp_path):
    src = tmp_path / "source"
    shutil.copytree(source, src)
    shutil.rmtree(src / "checkpoints" / "step_00000004")
    r = setdlm("pretrain", "--config", _finetune(tmp_path, src), "--out", tmp_path / "runs", timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    said = _lines(out, FALLBACK)
    assert len(said) == 1 and str(src / "checkpoints" / "latest") in said[0] and "step_00000002" in said[0], said
    step_2 = src / "checkpoints" / "step_00000002"
    assert _lines(out, f"init_from: weights of checkpoint {step_2} (step 2)"), out[-3000:]
    assert "resumed at step" not in out
