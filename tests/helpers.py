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


# A word-level vocabulary of 32 ids (EOS 0, MASK 31): tokenizers' own WordLevel model, for exports and
# fixtures that must stay small (the GPT-2 embedding alone is 50258 rows).
TINY_WORDS = ("the a of and to in is was it he she they cat dog sat on mat ran far red blue big small one two "
              "three . , !").split()


def tiny_tokenizer(directory: Path | None = None):
    """A data_pipeline Tokenizer over TINY_WORDS (whitespace-split words, unknown words as <unk>), saved
    to `directory` when given (load_tokenizer(directory) reads it back)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from data_pipeline.tokenizer import Tokenizer

    vocab = {w: i for i, w in enumerate(("<eos>", "<unk>", *TINY_WORDS, "<mask>"))}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # words joined by spaces
    tok = Tokenizer(backend, name="tiny-words", mask_id=vocab["<mask>"], eos_id=vocab["<eos>"])
    if directory is not None:
        tok.save(directory)
    return tok


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



def killed_and_resumed(recipe, tmp_path: Path, run_name: str = "tiny", kill_at: int = 4, steps: int = 10):
    """(metrics of an uninterrupted run, metrics of the same run SIGKILLed after its `kill_at`
    checkpoint and started again, the resumed run's directory); the resumed run must say so."""
    ref = setdlm("pretrain", "--config", recipe, "--out", tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    out = tmp_path / "resumed"
    killed_at = kill_after_checkpoint(recipe, out, run_name, kill_at, timeout=240)
    assert killed_at < f"step_{steps:08d}", "the run finished before it could be killed"
    again = setdlm("pretrain", "--config", recipe, "--out", out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed at step" in again.stdout + again.stderr
    return read_metrics(tmp_path / "ref" / run_name), read_metrics(out / run_name), out / run_name


def loader_steps(cfg, tok, steps: int, keys=("sample_index", "sample_id"), *, global_batch: int, micro_batch: int,
                 dp_size: int = 1, state=None, seed: int = 3):
    """Per optimizer step, a tuple with one list per key of what all ranks' loaders read (rank order,
    micro-batches in order); and the loaders. `state`: a loader state every rank starts from."""
    import torch

    from data_pipeline.loader import build_loader

    loaders = [build_loader(cfg, split="train", tokenizer=tok, micro_batch=micro_batch, dp_rank=r, dp_size=dp_size,
                            seed=seed, global_batch=global_batch) for r in range(dp_size)]
    accum = global_batch // (micro_batch * dp_size)
    its = []
    for ld in loaders:
        if state is not None:
            ld.load_state_dict(state)
        its.append(iter(ld))
    out = []
    for _ in range(steps):
        batches = [next(it) for it in its for _ in range(accum)]
        out.append(tuple(torch.cat([b[k] for b in batches]).tolist() for k in keys))
    return out, loaders

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


def gathered_weights(module, zero3: bool) -> dict:
    """name -> an fp32 copy of each of `module`'s parameters, whole under ZeRO-3 (a collective: every rank
    of the data-parallel group calls it)."""
    params = list(module.named_parameters())
    if not zero3:
        return {n: p.detach().float().clone() for n, p in params}
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {n: p.detach().float().clone() for n, p in params}


def run_transformers_only(script: str, jobs: dict, tmp: Path, timeout: float = 600) -> dict:
    """`script` (reads jobs from argv[1], writes results to argv[2] with torch.save) run on `jobs` in a
    fresh interpreter that sees transformers and the exported files only (no PYTHONPATH to this repo)."""
    import torch

    torch.save(jobs, tmp / "jobs.pt")
    (tmp / "hf_script.py").write_text(script)
    env = cli_env()
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, str(tmp / "hf_script.py"), str(tmp / "jobs.pt"), str(tmp / "out.pt")],
                       cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(tmp / "out.pt")
