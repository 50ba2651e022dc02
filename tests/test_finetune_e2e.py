"""Fine-tuning end to end on CPU: a tiny random Qwen3 saved as a stock Hugging Face directory is
fine-tuned with SW-SetDLM on GSM8K-schema prompt/answer rows (tests/fixtures/finetune), killed and
resumed (identical losses, the source directory no longer needed), and evaluated on held-out GSM8K
problems. The same on the real GSM8K train file when it is there: $GSM8K, else shared/data/gsm8k/train.jsonl
beside the repository (the default of scripts/finetune_gsm8k_cpu.sh)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from helpers import REPO, kill_after_checkpoint, read_metrics, setdlm
from hf_fixtures import make_hf_model

pytestmark = pytest.mark.slow
FIX = REPO / "tests" / "fixtures" / "finetune"
SHARED_GSM8K = Path(os.environ.get("GSM8K") or REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl")


def _recipe(path: Path, hf: Path, data: Path, **train) -> Path:
    recipe = {"run": {"name": "ft", "seed": 5},
              "model": {"max_seq_len": 128},
              "objective": {"name": "setdlm", "set_size": 2},
              "data": {"source": str(data), "seq_len": 96, "packing": "padded"},
              "train": {"init_from": str(hf), "max_steps": 8, "micro_batch": 4, "global_batch": 4, "lr": 1e-3,
                        "lr_schedule": "cosine", "warmup_steps": 2, "log_every": 1, "eval_every": 4, "eval_batches": 2,
                        "save_every": 2, "keep_last": 4, **train},
              "logging": {"wandb": "disabled", "progress": False}}
    path.write_text(yaml.safe_dump(recipe))
    return path


def _prepare(hf: Path, src: Path, out: Path, *extra) -> Path:
    r = setdlm("data", "prepare", "--format", "prompt_answer", "--input", src, "--output", out, "--tokenizer", hf,
               "--add-mask", "--prompt-field", "question", "--seq-len", 96, "--template", "plain",
               "--samples-per-shard", 8, *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_finetune_from_hf_kill_resume_and_gsm8k(tmp_path):
    hf = make_hf_model(tmp_path / "hf", "qwen3")
    data = _prepare(hf, FIX / "gsm8k_train.jsonl", tmp_path / "data", "--val-docs", "8")
    recipe = _recipe(tmp_path / "r.yaml", hf, data)
    ref = setdlm("pretrain", "--config", recipe, "--out", tmp_path / "ref", timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "init_from: weights of" in ref.stdout + ref.stderr
    # Killed after a checkpoint, the source moved away: the run resumes from its own checkpoint.
    out = tmp_path / "resumed"
    killed_at = kill_after_checkpoint(recipe, out, "ft", 4, timeout=400)
    assert killed_at < "step_00000008", "the run finished before it could be killed"
    hf.rename(tmp_path / "hf-moved")
    again = setdlm("pretrain", "--config", recipe, "--out", out, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    text = again.stdout + again.stderr
    assert "resumed at step" in text and "init_from: weights of" not in text
    a, b = read_metrics(tmp_path / "ref" / "ft"), read_metrics(out / "ft")
    assert a[0]["val/nll"] > a[8]["val/nll"]
    for step in range(1, 9):
        assert b[step]["train/loss"] == a[step]["train/loss"], step
    assert b[8]["val/nll"] == a[8]["val/nll"]
    # GSM8K accuracy on held-out problems (the prompt template of the training data).
    ev = setdlm("eval", "gsm8k", "--checkpoint", out / "ft", "--data", FIX / "gsm8k_test.jsonl", "--limit", 3,
                "--backend", "direct", "--max-new-tokens", 12, "--out", tmp_path / "eval", timeout=600)
    assert ev.returncode == 0, ev.stderr[-3000:]
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())["metrics"]
    _check_accuracy(metrics, tmp_path / "eval" / "examples.jsonl", FIX / "gsm8k_test.jsonl", 3)


def _check_accuracy(metrics: dict, examples: Path, data: Path, n: int) -> None:
    """The reported accuracy, recomputed from the written records against the test's own reading of the
    data file: the records are its first `n` problems in order, their gold answers are the numbers after
    "####", each prediction comes from its generation, and the accuracy is the share of predictions
    equal to the gold answer."""
    rows = [json.loads(line) for line in data.read_text().splitlines()][:n]
    recs = [json.loads(line) for line in examples.read_text().splitlines()]
    assert [r["question"] for r in recs] == [r["question"] for r in rows]
    gold = [r["answer"].rsplit("####", 1)[1].strip().replace(",", "") for r in rows]
    assert [r["gold"] for r in recs] == gold
    digits = lambda text: re.sub(r"\D", "", text)  # noqa: E731
    for r in recs:
        assert r["prediction"] is None or digits(r["prediction"]) in digits(r["generation"]), r
    correct = [r["prediction"] == g for r, g in zip(recs, gold)]
    assert [r["correct"] for r in recs] == correct
    assert metrics["n"] == n and metrics["accuracy"] == sum(correct) / n, (metrics, correct)


@pytest.mark.skipif(not SHARED_GSM8K.is_file(), reason=f"{SHARED_GSM8K} is not here (GSM8K=path/to/train.jsonl)")
def test_real_gsm8k_train_rows_prepare_and_train(tmp_path):
    hf = make_hf_model(tmp_path / "hf", "llama")
    data = _prepare(hf, SHARED_GSM8K, tmp_path / "data", "--val-docs", "16", "--max-docs", "200")
    m = json.loads((data / "manifest.json").read_text())
    c = m["splits"]["train"]["examples"]
    assert c["examples"] + c.get("skipped_no_room", 0) == 184  # over-long ones are truncated, and counted
    r = setdlm("pretrain", "--config", _recipe(tmp_path / "r.yaml", hf, data, max_steps=2, eval_every=2),
               "--out", tmp_path / "run", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
