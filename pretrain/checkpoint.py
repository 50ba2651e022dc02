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
`latest` is replaced only after that, so a kill during a save never damages the last good one. A
save that fails (disk full) removes its temporary directory and keeps the last good checkpoint; a
`latest` that names a missing or incomplete step falls back to the newest complete one.

Every file is read with `safe_load.load` (weights only: nothing in a checkpoint can run code), and
every problem with a checkpoint is a `CheckpointError` naming the file.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from common.io import atomic_write_text

from .safe_load import CheckpointError, load as safe_load, read_meta_json, restricted_torch_load

LATEST = "latest"
COMPLETE = "COMPLETE"


def _barrier():
    if dist.is_initialized():
        dist.barrier()


_atomic_write_text = atomic_write_text  # common/io.py (fsyncs the file and its directory)


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict:
    """Python, numpy, torch (and CUDA) generator states as plain values and tensors (loadable as
    weights only: numpy's key array is stored as a tensor)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32) if torch.is_tensor(keys) else keys, *rest))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_complete(path: Path) -> bool:
    """A finished save: the COMPLETE marker and a readable meta.json."""
    try:
        return (Path(path) / COMPLETE).is_file() and isinstance(json.loads((Path(path) / "meta.json").read_text()), dict)
    except (OSError, ValueError):
        return False


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """The complete step_* checkpoints under `ckpt_root`, oldest first."""
    return sorted(p for p in Path(ckpt_root).glob("step_*") if p.is_dir() and is_complete(p))


def latest_checkpoint(ckpt_root: Path, notes: list[str] | None = None) -> Path | None:
    """The checkpoint `latest` names; when that is missing or incomplete, the newest complete one
    (saying so in `notes`, a list the caller prints). None when there is no `latest` pointer."""
    pointer = Path(ckpt_root) / LATEST
    if not pointer.is_file():
        return None
    try:
        tag = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        tag = ""
    path = Path(ckpt_root) / tag
    if tag and "/" not in tag and is_complete(path):
        return path
    why = ("is empty or unreadable" if not tag else
           f"names {tag}, which is missing" if not path.is_dir() else
           f"names {tag}, which is incomplete (no {COMPLETE} marker or unreadable meta.json)")
    done = complete_checkpoints(ckpt_root)
    if not done:
        raise CheckpointError(f"{pointer}: {why}, and there is no complete checkpoint in {ckpt_root}; "
                              f"remove {ckpt_root} to start the run afresh")
    if notes is not None:
        notes.append(f"checkpoint: {pointer} {why}; resuming from the newest complete checkpoint, {done[-1]}")
    return done[-1]


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
    tmp = ckpt_root / tmp_tag
    failure = None
    try:
        engine.save_checkpoint(str(ckpt_root), tag=tmp_tag, client_state={"step": step, "shard": shard_info(engine)},
                               save_latest=False)
        torch.save(extra, tmp / f"extra_rank{rank:05d}.pt")
        if ema_state is not None and dp_rank == 0:
            torch.save(ema_state, tmp / f"ema_mp_rank_{mp_rank:02d}.pt")
        if rank == 0:
            _atomic_write_text(tmp / "meta.json", json.dumps(meta, indent=1, default=str))
    except OSError as e:
        failure = e
    _raise_if_any_failed(failure, ckpt_root, tmp, step, rank)
    final = ckpt_root / tag
    if rank == 0:
        (tmp / COMPLETE).touch()
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _atomic_write_text(ckpt_root / LATEST, tag)
        prune(ckpt_root, keep_last)
    _barrier()
    return final


def _raise_if_any_failed(failure: OSError | None, ckpt_root: Path, tmp: Path, step: int, rank: int) -> None:
    """After every rank has written its files: if any rank failed (disk full, permissions), remove
    the partial save and raise a CheckpointError on every rank; the last good checkpoint stays."""
    failed = torch.tensor([1.0 if failure is not None else 0.0])
    if dist.is_initialized() and dist.get_world_size() > 1:  # also the barrier before COMPLETE is written
        if dist.get_backend() == "nccl":
            failed = failed.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    try:
        kept = (ckpt_root / LATEST).read_text().strip()
    except OSError:
        kept = None
    if failure is None:
        cause = "another rank could not write its files"
    elif failure.errno == errno.ENOSPC:
        cause = f"the disk is full ({failure.filename or ckpt_root})"
    else:
        cause = f"{failure.strerror or failure} ({failure.filename or ckpt_root})"
    raise CheckpointError(f"saving checkpoint step {step} failed: {cause}; the partial save was removed and "
                          + (f"the last good checkpoint ({kept}) is kept" if kept else "no earlier checkpoint exists")
                          + "; free space and rerun the same command to resume") from None


def prune(ckpt_root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    done = complete_checkpoints(ckpt_root)
    latest = (Path(ckpt_root) / LATEST).read_text().strip()
    for p in done[:-keep_last]:
        if p.name != latest:
            shutil.rmtree(p, ignore_errors=True)


def read_meta(path: Path) -> dict:
    """meta.json of checkpoint `path` (CheckpointError when missing, truncated or not a setdlm one)."""
    meta = read_meta_json(path)
    if not isinstance(meta.get("config"), dict) or "step" not in meta:
        raise CheckpointError(f"{Path(path) / 'meta.json'}: not a setdlm checkpoint's metadata (needs `step` and `config`)")
    return meta


def check_compatible(meta: dict, cfg, path: Path) -> None:
    """Refuse to resume `cfg` from a checkpoint of another model shape or objective (naming the
    fields that differ), before DeepSpeed loads any of it."""
    saved, now = meta.get("config", {}), cfg.to_dict()
    diffs = []
    for section, keys in _IDENTITY.items():
        a, b = saved.get(section) or {}, now.get(section) or {}
        diffs += [f"{section}.{k}: checkpoint {a[k]!r}, recipe {b[k]!r}" for k in keys
                  if k in a and k in b and a[k] != b[k]]
    if diffs:
        raise CheckpointError(f"checkpoint {path} holds another model or objective (" + "; ".join(diffs[:3])
                              + "); continue it with its own recipe, or use a new run.name for a new model")


# the recipe fields that define a checkpoint's weights and what they are trained for
_IDENTITY = {"model": ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "norm", "activation",
                       "qk_norm", "bias", "vocab_size", "mask_id", "vocab_pad_multiple", "tie_embeddings", "head_bias"),
             "objective": ("name",)}


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
    meta = read_meta(path)
    expected = sorted(path.glob("*model_states.pt"))
    if not expected:
        raise CheckpointError(f"checkpoint {path}: no DeepSpeed model files (*model_states.pt): an incomplete copy")
    try:
        with restricted_torch_load():  # DeepSpeed's own torch.load calls: weights only
            load_path, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
    except (FileNotFoundError, AssertionError) as e:  # DeepSpeed: a shard of this rank is absent
        raise CheckpointError(f"checkpoint {path}: a file DeepSpeed needs is missing ({e}); the checkpoint is "
                              "incomplete") from None
    except (KeyError, RuntimeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {path}: DeepSpeed cannot load it into this model "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None
    if load_path is None:
        raise CheckpointError(f"checkpoint {path}: DeepSpeed found no engine state to load")
    extra_file = path / f"extra_rank{rank:05d}.pt"
    extra = safe_load(extra_file) if extra_file.is_file() else {}
    ema_file = path / f"ema_mp_rank_{mp_rank:02d}.pt"
    ema = safe_load(ema_file) if ema_file.is_file() else None
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
    meta = read_meta(path)
    cons = path / "consolidated.pt"
    saved = meta["layout"]
    if not cons.is_file():
        raise ValueError(f"checkpoint {path}: saved with tp={saved['tp']} pp={saved['pp']} dp={saved['dp']}; to continue "
                         f"under another layout consolidate it first (setdlm convert consolidate --checkpoint {path})")
    state = safe_load(cons)
    notes = load_consolidated(engine, state, ema=ema)
    extras = [safe_load(f) for f in sorted(path.glob("extra_rank*.pt"))]
    extra = {"rng": extras[0]["rng"]} if extras else {}
    # The data order is one global sequence (data_pipeline/order.py): any rank's loader state continues
    # it under any data-parallel size.
    data = [e["data"] for e in extras if isinstance(e.get("data"), dict)]
    if data:
        extra["data"] = data[0]
    else:
        notes.append("no data position in the checkpoint: the data order starts from the beginning")
    return meta, extra, notes


def resolve_checkpoint(path: str | os.PathLike, notes: list[str] | None = None) -> Path:
    """Accept a run directory, its checkpoints/ folder, or one checkpoint folder. When `latest` is
    broken, the newest complete checkpoint is used and the fallback is reported in `notes` (printed to
    stderr when no list is given)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"checkpoint {p}: no such file or directory")
    if (p / "meta.json").is_file():
        return p
    for root in (p / "checkpoints", p):
        if (root / LATEST).is_file():
            said: list[str] = []
            found = latest_checkpoint(root, notes=said)
            if notes is not None:
                notes += said
            else:
                for line in said:
                    print(f"setdlm: {line}", file=sys.stderr)
            if found is not None:
                return found
    raise FileNotFoundError(f"checkpoint {p}: not a run directory or checkpoint (no checkpoints/{LATEST} or meta.json)")


def checkpoint_weights(ckpt: Path, meta: dict, *, ema: bool = True) -> tuple[dict, bool]:
    """The full (TP=1, PP=1) weights of checkpoint `ckpt`, whatever layout saved it, and whether they
    are the EMA weights: consolidated.pt when present, the model file of an unsharded run, else the
    shards merged in memory (pretrain/consolidate.py, which refuses an incomplete checkpoint)."""
    ckpt = Path(ckpt)
    layout = meta.get("layout") or {}
    cons = ckpt / "consolidated.pt"
    sharded = (layout.get("tp") or 1) != 1 or (layout.get("pp") or 1) != 1 or (layout.get("zero_stage") or 0) >= 3
    if cons.is_file():
        state, where = safe_load(cons), cons
    elif sharded:
        from .consolidate import consolidated_state

        state, where = consolidated_state(ckpt, optimizer=False), ckpt
    else:
        where = ckpt / "mp_rank_00_model_states.pt"
        model_state = safe_load(where)
        ema_file = ckpt / "ema_mp_rank_00.pt"
        shadow = safe_load(ema_file) if ema and ema_file.is_file() else None
        state = {"module": model_state.get("module") if isinstance(model_state, dict) else None,
                 "ema": shadow.get("shadow") if isinstance(shadow, dict) else None}
    if not isinstance(state, dict) or not isinstance(state.get("module"), dict):
        raise CheckpointError(f"{where}: holds no model weights (`module`): not a setdlm checkpoint file")
    weights, used_ema = dict(state["module"]), False
    if ema and isinstance(state.get("ema"), dict) and state["ema"]:
        weights.update(state["ema"])
        used_ema = True
    return {k: v for k, v in weights.items() if torch.is_tensor(v)}, used_ema


def load_model(path: str | os.PathLike, *, ema: bool = True, device: str | torch.device = "cpu"):
    """Load a trained model for inference in this process: (model, tokenizer, recipe config).

    Any checkpoint works, whatever TP x PP x DP layout and ZeRO stage saved it (sharded ones are merged
    in memory; `setdlm convert consolidate` writes the merge once for repeated use). The model is a
    TP=1 Transformer (torch alone, model/layers.py): no process group is created, nothing
    in os.environ is set, and torch.distributed stays uninitialised."""
    from data_pipeline.tokenizers import load_tokenizer
    from model.transformer import Transformer

    from .config import from_dict

    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    try:
        cfg = from_dict(meta["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{ckpt / 'meta.json'}: its recipe is not valid here ({e})") from None
    weights, _ = checkpoint_weights(ckpt, meta, ema=ema)
    tok_dir = ckpt.parent.parent / "tokenizer"
    tokenizer = load_tokenizer(str(tok_dir) if tok_dir.is_dir() else cfg.data.tokenizer)
    if meta.get("tokenizer_sha256") and tokenizer.sha256 != meta["tokenizer_sha256"]:
        raise CheckpointError(f"checkpoint {ckpt}: tokenizer hash {tokenizer.sha256[:12]} differs from the one "
                              f"it was trained with ({meta['tokenizer_sha256'][:12]})")
    with torch.random.fork_rng(devices=[]):  # the initial values are overwritten: leave the caller's RNG alone
        model = Transformer(cfg.model)
    own = model.state_dict()
    wrong = [f"{k} {tuple(v.shape)} (the recipe's model has {tuple(own[k].shape)})" for k, v in weights.items()
             if k in own and torch.is_tensor(own[k]) and tuple(own[k].shape) != tuple(v.shape)]
    if wrong:
        raise CheckpointError(f"checkpoint {ckpt}: weights of another model shape: {'; '.join(wrong[:2])}")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {ckpt}: weights do not match the model (missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]})")
    return model.to(device).eval(), tokenizer, cfg
