"""The tiny real training job that the Slurm / mpirun tests launch (`setdlm pretrain`)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEMPLATES = REPO / "launch" / "templates"
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def tiny_train_args(max_steps: int, save_every: int | None = None) -> list[str]:
    """`setdlm pretrain` arguments: the CPU quickstart recipe shrunk to ~0.1 s per step on 2 ranks."""
    return [
        "--config", str(QUICKSTART),
        f"train.max_steps={max_steps}", f"train.save_every={save_every or max_steps}",
        "train.micro_batch=2", "train.global_batch=4", "train.warmup_steps=2",
        "train.eval_every=0", "train.log_every=1", "train.sample_at_end=false", "train.keep_last=2",
        "model.n_layers=1", "model.hidden=64", "model.ffn_hidden=128", "model.max_seq_len=32",
        "data.seq_len=32", "logging.wandb=disabled", "logging.progress=false",
    ]


def job_env(**extra: str) -> dict[str, str]:
    """Environment for jobs: the venv's `setdlm`, `torchrun` and `python` first on PATH, offline."""
    bindir = str(Path(sys.executable).parent)
    env = {
        "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(REPO),
        "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
    }
    env.update(extra)
    return env


def metric_steps(run_dir: Path) -> list[int]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line being written
            continue
        if "train/loss" in rec:
            steps.append(int(rec["step"]))
    return steps


def checkpoint_steps(run_dir: Path) -> list[int]:
    ckpts = Path(run_dir) / "checkpoints"
    if not ckpts.is_dir():
        return []
    return sorted(int(p.name.split("_")[-1]) for p in ckpts.glob("step_*") if (p / "COMPLETE").exists())
