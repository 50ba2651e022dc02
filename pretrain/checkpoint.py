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


def shard_info(engine) -> dict:
    """How this rank's model file is cut out of the full model (read by pretrain/consolidate.py): its
    tensor/pipeline ranks, each parameter's tensor-parallel split dimension (-1: replicated), the
    parameters that are copies of another stage's (a tied embedding on the last stage) and, for a
    client torch optimizer saved in the model file, the parameter names in the optimizer's order."""
    from megatron.core import parallel_state

    module = engine.module
    init = parallel_state.model_parallel_is_initialized()
    names = {id(p): n for n, p in module.named_parameters()}
    order = None
    opt = getattr(engine, "optimizer", None)
    if isinstance(opt, torch.optim.Optimizer):
        ids = [id(p) for g in opt.param_groups for p in g["params"]]
        order = [names[i] for i in ids] if all(i in names for i in ids) else None
    return {
        "tp": parallel_state.get_tensor_model_parallel_world_size() if init else 1,
        "pp": parallel_state.get_pipeline_model_parallel_world_size() if init else 1,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank() if init else 0,
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank() if init else 0,
        "partition": {n: int(p.partition_dim) if getattr(p, "tensor_model_parallel", False) else -1
                      for n, p in module.named_parameters()},
        "copies": [n for n, p in module.named_parameters() if getattr(p, "shared_embedding", False)],
        "optimizer_order": order,
    }


def save(engine, ckpt_root: Path, step: int, *, meta: dict, extra: dict, ema_state: dict | None,
         keep_last: int, mp_rank: int, dp_rank: int, rank: int) -> Path:
    ckpt_root = Path(ckpt_root)
    tag = tag_for(step)
    tmp_tag = ".tmp-" + tag
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(ckpt_root / tmp_tag, ignore_errors=True)
    _barrier()
    engine.save_checkpoint(str(ckpt_root), tag=tmp_tag, client_state={"step": step, "shard": shard_info(engine)},
                           save_latest=False)
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


def read_meta(path: Path) -> dict:
    return json.loads((Path(path) / "meta.json").read_text())


def set_scheduler_step(scheduler, step: int) -> None:
    """Put a fresh LR scheduler at optimizer step `step` (as if it had stepped `step` times)."""
    import warnings

    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
        scheduler.step()


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


def _local_shard(full: torch.Tensor, p: torch.nn.Parameter, tp: int, tp_rank: int) -> torch.Tensor:
    """This tensor-parallel rank's piece of a full (TP=1) tensor for parameter `p`."""
    if getattr(p, "tensor_model_parallel", False) and tp > 1:
        full = full.chunk(tp, dim=p.partition_dim)[tp_rank]
    return full


def load_consolidated(engine, state: dict, *, ema=None, optimizer: bool = True) -> list[str]:
    """Load a consolidated (TP=1, PP=1; pretrain/consolidate.py) state into this rank's shard of the
    model, its fp32 master weights and, when present, the Adam moments; `ema` (an EMA) gets its slice
    of the consolidated EMA. Works under any TP x PP x DP layout and ZeRO stage. Returns notes."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    module, notes = engine.module, []
    weights = state["module"]
    params = list(module.named_parameters())
    missing = [n for n, _ in params if n not in weights]
    if missing:
        raise ValueError(f"consolidated checkpoint: no weights for {missing[:3]} (a different model?)")
    zero3 = engine.zero_optimization_stage() == 3
    with torch.no_grad():
        for n, p in params:
            value = _local_shard(weights[n], p, tp, tp_rank)
            shape = tuple(p.ds_shape) if zero3 else tuple(p.shape)
            if tuple(value.shape) != shape:
                raise ValueError(f"consolidated checkpoint: {n} has shape {tuple(value.shape)} here, the model "
                                 f"expects {shape} (a different model configuration?)")
            if zero3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    p.data.copy_(value.to(p.dtype))
            else:
                p.data.copy_(value.to(p.dtype))
            safe_set_full_fp32_param(p, value.float())  # ZeRO / bf16 fp32 masters (no-op without them)
    opt = state.get("optimizer") if optimizer else None
    if opt:
        step = int(opt["step"])
        inner = engine.optimizer
        client = isinstance(inner, torch.optim.Optimizer) and not any(hasattr(p, "_hp_mapping") or hasattr(p, "ds_id")
                                                                      for _, p in params)
        for n, p in params:
            if n not in opt["exp_avg"]:
                continue
            moments = {k: _local_shard(opt[k][n], p, tp, tp_rank).float() for k in ("exp_avg", "exp_avg_sq")}
            if client:
                group = next(g for g in inner.param_groups if any(q is p for q in g["params"]))
                on_device = group.get("fused") or group.get("capturable")
                inner.state[p] = {"step": torch.tensor(float(step), dtype=torch.float32, device=p.device if on_device else "cpu"),
                                  **{k: v.to(p.device, p.dtype).view_as(p) for k, v in moments.items()}}
            else:
                _init_flat_optimizer_states(inner, step)
                for k, v in moments.items():
                    safe_set_full_optimizer_state(p, v, k)
        if not client:  # flat fp32 partitions: one step count per group
            base = getattr(inner, "optimizer", inner)
            for st in base.state.values():
                if "step" in st:
                    st["step"] = torch.full_like(st["step"], float(step)) if torch.is_tensor(st["step"]) else step
    else:
        notes.append("optimizer moments not in the consolidated checkpoint: AdamW starts from zero moments")
    if ema is not None:
        if state.get("ema"):
            with torch.no_grad():
                for n, p in params:
                    if n in ema.shadow and n in state["ema"]:
                        ema.set_full(n, _local_shard(state["ema"][n], p, tp, tp_rank))
        else:
            notes.append("no EMA weights in the consolidated checkpoint: EMA restarts from the weights")
    return notes


def _init_flat_optimizer_states(inner, step: int) -> None:
    """Create the AdamW states of DeepSpeed's flat fp32 partitions before the first step (torch creates
    them lazily) and link them to the parameters, so `safe_set_full_optimizer_state` can fill them."""
    base = getattr(inner, "optimizer", None)
    if not isinstance(base, torch.optim.Optimizer) or getattr(inner, "_setdlm_states_ready", False):
        return
    flats = [q for g in base.param_groups for q in g["params"]]
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        flats += [t for t in getattr(inner, name, None) or [] if torch.is_tensor(t) and all(t is not f for f in flats)]
    on_device = base.defaults.get("fused") or base.defaults.get("capturable")
    for flat in flats:
        if flat not in base.state or "exp_avg" not in base.state[flat]:
            base.state[flat] = {
                "step": torch.tensor(float(step), dtype=torch.float32, device=flat.device if on_device else "cpu"),
                "exp_avg": torch.zeros_like(flat, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(flat, memory_format=torch.preserve_format)}
    if hasattr(inner, "_hp_optimizer_states_linked"):
        inner._hp_optimizer_states_linked = False
    if hasattr(inner, "_lazy_init_hp_params_optimizer_state"):
        inner._lazy_init_hp_params_optimizer_state()
    inner._setdlm_states_ready = True


def load_relayout(engine, path: Path, *, ema, dp_rank: int, dp_size: int) -> tuple[dict, dict, list[str]]:
    """Continue a run saved under another TP/PP/DP layout from its consolidated.pt: weights, fp32
    masters, Adam moments, EMA (load_consolidated); returns (meta, extra, notes) where extra holds the
    RNG state of the old rank 0 and the data position (valid under any data-parallel size)."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    cons = path / "consolidated.pt"
    saved = meta["layout"]
    if not cons.is_file():
        raise ValueError(f"checkpoint {path}: saved with tp={saved['tp']} pp={saved['pp']} dp={saved['dp']}; to continue "
                         f"under another layout consolidate it first (setdlm convert consolidate --checkpoint {path})")
    state = torch.load(cons, map_location="cpu", weights_only=False)
    notes = load_consolidated(engine, state, ema=ema)
    extras = [torch.load(f, weights_only=False) for f in sorted(path.glob("extra_rank*.pt"))]
    extra = {"rng": extras[0]["rng"]} if extras else {}
    # The data order is one global sequence (data_pipeline/order.py): any rank's loader state continues
    # it under any data-parallel size.
    data = [e["data"] for e in extras if isinstance(e.get("data"), dict)]
    if data:
        extra["data"] = data[0]
    else:
        notes.append("no data position in the checkpoint: the data order starts from the beginning")
    return meta, extra, notes


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
