"""Shared test helpers: tiny recipes and running the CLI in a fresh process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent

TINY_RECIPE = {
    "run": {"name": "tiny", "seed": 7},
    "model": {"n_layers": 1, "hidden": 32, "n_heads": 2, "ffn_hidden": 64, "dropout": 0.0, "max_seq_len": 64,
              "tie_embeddings": True},
    "objective": {"name": "setdlm", "set_size": 4},
    "data": {"source": "builtin:pydoc_topics", "tokenizer": "gpt2", "seq_len": 32},
    "train": {"max_steps": 8, "micro_batch": 4, "global_batch": 4, "lr": 3e-3, "warmup_steps": 2,
              "log_every": 1, "eval_every": 4, "eval_batches": 2, "save_every": 4, "keep_last": 3},
    "logging": {"wandb": "disabled", "progress": False},
}


def write_recipe(path: Path, **sections) -> Path:
    recipe = {k: dict(v) for k, v in TINY_RECIPE.items()}
    for name, values in sections.items():
        recipe.setdefault(name, {}).update(values)
    path.write_text(yaml.safe_dump(recipe))
    return path


def eval_result(out) -> tuple[dict, dict, dict]:
    """(metrics, spec, {key: record}) of a merged `setdlm eval` output directory."""
    d = json.loads((Path(out) / "metrics.json").read_text())
    recs = [json.loads(line) for line in (Path(out) / "examples.jsonl").read_text().splitlines()]
    return d["metrics"], d["spec"], {r["key"]: r for r in recs}


def cli_env() -> dict:
    env = dict(os.environ)
    # The repository first; an existing PYTHONPATH (the GPU check's carried wheels) stays after it.
    path = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=path)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def setdlm(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launch.cli", *map(str, args)], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout, **kw)


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """step -> merged metrics; a step logged again after a resume keeps its last values."""
    rows: dict[int, dict] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return rows


def kill_after_checkpoint(recipe, out, run_name: str, step: int, timeout: float = 240) -> str:
    """Start `setdlm pretrain` on `recipe`, SIGKILL it once checkpoint `step` is published, and
    return what `latest` names then (the tests check it is before the last step)."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "pretrain", "--config", str(recipe), "--out", str(out)],
                            cwd=REPO, env=cli_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = Path(out) / run_name / "checkpoints" / "latest"
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if latest.is_file() and latest.read_text() >= f"step_{step:08d}":
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return latest.read_text()


def run_as_of(run: Path, dest: Path, step: int) -> Path:
    """A copy of run directory `run` at `dest` as it was after its checkpoint `step` was saved: the later
    checkpoints and metrics rows left out, `latest` naming that step."""
    shutil.copytree(run, dest)
    metrics = dest / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(keepends=True)
                               if json.loads(line)["step"] <= step))
    root = dest / "checkpoints"
    for ckpt in root.glob("step_*"):
        if int(ckpt.name[len("step_"):]) > step:
            shutil.rmtree(ckpt)
    (root / "latest").write_text(f"step_{step:08d}")
    return dest
