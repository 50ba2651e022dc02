"""Loading a trained model for inference in this process, from a checkpoint of any layout.

`load_model(path)` gives (model, tokenizer, recipe config): a TP=1 Transformer of plain torch layers
(model/layers.py), with no process group created, nothing in os.environ set and torch.distributed
left uninitialised. `checkpoint_weights` gives the full (TP=1, PP=1) weights alone (HF export,
`train.init_from`). Neither megatron-core nor DeepSpeed is needed here for a format-2 checkpoint (any
layout) or an unsharded format-1 one: they are imported only to merge the DeepSpeed shards of another
format-1 layout (shards.py) or to read format-1 ZeRO-3 files.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..safe_load import CheckpointError, load as safe_load
from . import rundir, versions

MODEL_FILE = "mp_rank_00_model_states.pt"  # DeepSpeed's model file of an unsharded (TP=1, PP=1) run


def _sharded(meta: dict) -> bool:
    layout = meta.get("layout") or {}
    return (layout.get("tp") or 1) != 1 or (layout.get("pp") or 1) != 1 or (layout.get("zero_stage") or 0) >= 3


def lora_section(meta: dict) -> dict | None:
    """The `train.lora` section a checkpoint was trained with (None: no adapters)."""
    lora = ((meta.get("config") or {}).get("train") or {}).get("lora")
    return lora if isinstance(lora, dict) else None


def checkpoint_weights(ckpt: Path, meta: dict, *, ema: bool = True, merge_lora: bool = True) -> tuple[dict, bool]:
    """The full (TP=1, PP=1) weights of checkpoint `ckpt`, whatever layout saved it, and whether they
    are the EMA weights. Format 2 (distcp.py): the model (or EMA) tensors read chunk by chunk into one
    whole copy, whatever layout wrote them; a consolidated.pt (memory-mapped); format 1: the model file of
    an unsharded run, else DeepSpeed's shards merged in memory (shards.py, which refuses an incomplete
    checkpoint). Weights renamed since the checkpoint's format version get their current names
    (versions.py). The LoRA adapters of a `train.lora` run are merged into the base weights
    (W + (alpha / r) B A), so the result is a plain model's; `merge_lora=False` keeps them (names
    `....lora.A` / `.lora.B`)."""
    ckpt = Path(ckpt)
    cons = ckpt / rundir.CONSOLIDATED
    ema_where = None
    kind = rundir.storage(ckpt, meta)
    if kind == "dcp":
        from .distcp import whole_state

        state, where = whole_state(ckpt, ema=ema, ema_over_module=True), ckpt
    elif cons.is_file():
        state, where = safe_load(cons, mmap=True), cons
    elif _sharded(meta):
        from .consolidate import consolidated_state

        state, where = consolidated_state(ckpt, optimizer=False), ckpt
    else:
        where = ckpt / MODEL_FILE
        model_state = safe_load(where, mmap=True)
        ema_file = rundir.ema_file(ckpt, 0)
        shadow = safe_load(ema_file, mmap=True) if ema and ema_file.is_file() else None
        state = {"module": model_state.get("module") if isinstance(model_state, dict) else None,
                 "ema": shadow.get("shadow") if isinstance(shadow, dict) else None}
        ema_where = ema_file
    if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
        raise CheckpointError(f"{where}: holds no model weights (`module`): not a setdlm checkpoint file")
    weights, used_ema = dict(state["module"]), False
    if ema and isinstance(state.get("ema"), dict) and state["ema"]:
        _check_ema_matches(weights, state["ema"], where, ema_where)
        weights.update(state["ema"])
        used_ema = True
    weights = versions.current_names({k: v for k, v in weights.items() if torch.is_tensor(v)}, meta)
    lora = lora_section(meta)
    if merge_lora and any(k.endswith(".lora.A") for k in weights):
        from model.lora import merge

        if lora is None:
            raise CheckpointError(f"{ckpt}: holds LoRA adapters but its recipe has no train.lora section to merge them by")
        weights = merge(weights, rank=int(lora["rank"]), alpha=float(lora["alpha"]))
    return weights, used_ema


def _check_ema_matches(module: dict, shadow: dict, where: Path, ema_where: Path | None) -> None:
    """The EMA weights replace the model's by name: a model file of another shape (a damaged or mixed
    copy) would otherwise pass unseen behind an intact EMA file."""
    for k, v in shadow.items():
        own = module.get(k)
        if torch.is_tensor(v) and torch.is_tensor(own) and tuple(own.shape) != tuple(v.shape):
            ema_name = ema_where.name if ema_where is not None else "its EMA weights"
            raise CheckpointError(f"{where}: {k} has shape {tuple(own.shape)} where {ema_name} has "
                                  f"{tuple(v.shape)}: the checkpoint's files do not belong together (a damaged or "
                                  f"mixed copy); restore the checkpoint or name another one (RUN:STEP)")


def build_model(model_cfg) -> torch.nn.Module:
    """The one place inference builds a model: a TP=1 Transformer of `model_cfg` (its initial values
    are overwritten by the caller; the caller's RNG is left alone)."""
    from model.transformer import Transformer

    with torch.random.fork_rng(devices=[]):
        return Transformer(model_cfg)


def model_with_weights(model_cfg, weights: dict, where) -> torch.nn.Module:
    """A TP=1 model of `model_cfg` holding `weights` (every parameter and buffer, checked by name and
    shape; CheckpointError naming `where` otherwise)."""
    model = build_model(model_cfg)
    own = model.state_dict()
    wrong = [f"{k} has shape {tuple(v.shape)}, the model expects {tuple(own[k].shape)}" for k, v in weights.items()
             if k in own and torch.is_tensor(own[k]) and tuple(own[k].shape) != tuple(v.shape)]
    if wrong:
        raise CheckpointError(f"{where}: weights of another model shape: {'; '.join(wrong[:2])} (a different model "
                              "configuration?)")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"{where}: weights do not match the model (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    return model


def load_model(path: str | os.PathLike, *, ema: bool = True, device: str | torch.device = "cpu"):
    """Load a trained model for inference in this process: (model, tokenizer, recipe config).

    `path` is a run directory, its checkpoints/ folder or one checkpoint. Any checkpoint works, whatever
    TP x PP x DP layout and ZeRO stage saved it (sharded ones are merged in memory; `setdlm convert
    consolidate` writes the merge once for repeated use)."""
    ckpt = rundir.resolve_checkpoint(path)
    meta = rundir.read_meta(ckpt)
    cfg = rundir.read_recipe(ckpt, meta)
    weights, _ = checkpoint_weights(ckpt, meta, ema=ema)
    tokenizer = rundir.checkpoint_tokenizer(ckpt, meta, cfg.data.tokenizer)
    model = model_with_weights(cfg.model, weights, f"checkpoint {ckpt}")
    from model.sampling.first_hitting import record

    record(model, cfg.objective, cfg.data.seq_len)  # the run's decoding defaults (cache order), for generate()
    return model.to(device).eval(), tokenizer, cfg
