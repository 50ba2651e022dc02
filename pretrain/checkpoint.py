"""Atomic, resumable checkpoints on top of DeepSpeed's (sharded) engine checkpoints.

Layout of a run directory:

    RUN/config.yaml              resolved recipe
    RUN/metrics.jsonl            one JSON object per logged step
    RUN/tokenizer/               the tokenizer files (inference needs nothing else)
    RUN/checkpoints/latest       name of the newest complete checkpoint (replaced atomically)
    RUN/checkpoints/step_000100/ DeepSpeed files (model, optimizer shards, LR scheduler) plus
                                 meta.json (step, layout, config), extra_rank*.pt (RNG, data
                                 position per rank), ema_mp_rank_*.pt (EMA weights), COMPLETE

A checkpoint is written under a temporary name and renamed once every rank has finished, and
`latest` is replaced only after that, so a kill during a save never damages the last good one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

LATEST = "latest"
COMPLETE = "COMPLETE"


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    pointer = Path(ckpt_root) / LATEST
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    path = Path(ckpt_root) / tag
    if not (path / COMPLETE).is_file():
        raise RuntimeError(f"checkpoint {path}: `latest` points to an incomplete checkpoint (no {COMPLETE} marker)")
    return path


def clean_partial(ckpt_root: Path) -> None:
    """Remove checkpoints whose save was interrupted (rank 0, before training starts)."""
    for p in Path(ckpt_root).glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def save(engine, ckpt_root: Path, step: int, *, meta: dict, extra: dict, ema_state: dict | None,
         keep_last: int, mp_rank: int, dp_rank: int, rank: int) -> Path:
    ckpt_root = Path(ckpt_root)
    tag = tag_for(step)
    tmp_tag = ".tmp-" + tag
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(ckpt_root / tmp_tag, ignore_errors=True)
    _barrier()
    engine.save_checkpoint(str(ckpt_root), tag=tmp_tag, client_state={"step": step}, save_latest=False)
    tmp = ckpt_root / tmp_tag
    torch.save(extra, tmp / f"extra_rank{rank:05d}.pt")
    if ema_state is not None and dp_rank == 0:
        torch.save(ema_state, tmp / f"ema_mp_rank_{mp_rank:02d}.pt")
    _barrier()
    final = ckpt_root / tag
    if rank == 0:
        _atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1, default=str))
        (tmp / COMPLETE).touch()
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(ckpt_root / LATEST, tag)
        prune(ckpt_root, keep_last)
    _barrier()
    return final


def prune(ckpt_root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    done = sorted(p for p in Path(ckpt_root).glob("step_*") if (p / COMPLETE).is_file())
    latest = (Path(ckpt_root) / LATEST).read_text().strip()
    for p in done[:-keep_last]:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)


def load(engine, path: Path, *, rank: int, mp_rank: int) -> tuple[dict, dict, dict | None]:
    """Restore engine state from `path`; returns (meta, this rank's extra, EMA state or None)."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                          load_lr_scheduler_states=True)
    if load_path is None:
        raise RuntimeError(f"checkpoint {path}: DeepSpeed found no engine state to load")
    extra_file = path / f"extra_rank{rank:05d}.pt"
    extra = torch.load(extra_file, weights_only=False) if extra_file.is_file() else {}
    ema_file = path / f"ema_mp_rank_{mp_rank:02d}.pt"
    ema = torch.load(ema_file, weights_only=False) if ema_file.is_file() else None
    return meta, extra, ema


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """Accept a run directory, its checkpoints/ folder, or one checkpoint folder."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p}: no such file or directory")
    if (p / "meta.json").is_file():
        return p
    for root in (p / "checkpoints", p):
        if (root / LATEST).is_file():
            found = latest_checkpoint(root)
            if found is not None:
                return found
    raise FileNotFoundError(f"checkpoint {p}: not a run directory or checkpoint (no checkpoints/{LATEST} or meta.json)")


def load_model(path: str | os.PathLike, *, ema: bool = True, device: str | torch.device = "cpu"):
    """Load a trained model for inference in this process: (model, tokenizer, recipe config).

    Works for checkpoints written with tp=1, pp=1 and ZeRO stage < 3 (the weights are then in one
    file); other layouts must be consolidated first (see `setdlm convert consolidate`)."""
    from data_pipeline.tokenizers import load_tokenizer
    from model.parallel import ensure_model_parallel
    from model.transformer import Transformer, megatron_config

    from .config import from_dict

    ckpt = resolve_checkpoint(path)
    meta = json.loads((ckpt / "meta.json").read_text())
    cfg = from_dict(meta["config"])
    layout = meta.get("layout", {})
    state_file = ckpt / "consolidated.pt"
    if state_file.is_file():
        state = torch.load(state_file, map_location="cpu", weights_only=False)
        weights = state["ema"] if ema and state.get("ema") else state["module"]
    else:
        if layout.get("tp", 1) != 1 or layout.get("pp", 1) != 1 or layout.get("zero_stage", 0) >= 3:
            raise ValueError(f"checkpoint {ckpt}: saved with layout {layout}; consolidate it first "
                             f"(setdlm convert consolidate --checkpoint {ckpt})")
        weights = torch.load(ckpt / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
        ema_file = ckpt / "ema_mp_rank_00.pt"
        if ema and ema_file.is_file():
            shadow = torch.load(ema_file, map_location="cpu", weights_only=False)["shadow"]
            weights = {**weights, **shadow}
    tok_dir = ckpt.parent.parent / "tokenizer"
    tokenizer = load_tokenizer(str(tok_dir) if tok_dir.is_dir() else cfg.data.tokenizer)
    if meta.get("tokenizer_sha256") and tokenizer.sha256 != meta["tokenizer_sha256"]:
        raise ValueError(f"checkpoint {ckpt}: tokenizer hash {tokenizer.sha256[:12]} differs from the one "
                         f"it was trained with ({meta['tokenizer_sha256'][:12]})")
    ensure_model_parallel(1, 1)
    model = Transformer(cfg.model, megatron_config())
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(device).eval(), tokenizer, cfg
