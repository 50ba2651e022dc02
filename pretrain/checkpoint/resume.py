"""Continuing a run from its checkpoint, under the layout it was saved with or any other.

- format 2 (`load_sharded`): every rank reads the chunks of the global tensors it holds under this run's
  TP x PP x DP x CP layout and ZeRO stage (train_state.py, distcp.py): weights, fp32 masters, Adam
  moments, EMA; then its RNG states and the data position (global: any rank's loader state continues
  the one data order under any data-parallel size). No consolidated file is written or read.
- format 1, the same layout (`load`): DeepSpeed's own loader.
- format 1 under another layout, or an imported run's consolidated.pt (`load_relayout`): the full
  state, merged from the shards in memory (or the consolidated.pt, memory-mapped), then this rank's
  part of it (relayout.py).

The trainer asks `check_compatible` first, so a checkpoint whose weights compute something else (its
identity: every model key but the runtime ones, the family, the LoRA shapes) or that was trained with
another tokenizer is refused before any of it is read. DeepSpeed's own `torch.load` calls run inside
`restricted_torch_load` (weights only, pretrain/safe_load.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from model.config import identity_keys

from ..safe_load import CheckpointError, load as safe_load, restricted_torch_load
from . import distcp, rundir, versions
from .relayout import load_consolidated
from .rng import check_rng_state

def identity(recipe: dict) -> dict[str, object]:
    """What a checkpoint's weights are, by dotted recipe key: every model key that changes the function
    they compute (model/config.py: all but RUNTIME_KEYS), the objective's family, and the LoRA adapters'
    shapes (rank, targets)."""
    model, lora = recipe.get("model") or {}, (recipe.get("train") or {}).get("lora")
    out = {f"model.{k}": model.get(k) for k in identity_keys()}
    out["objective.name"] = (recipe.get("objective") or {}).get("name")
    out["train.lora"] = "off" if not lora else "on"
    if lora:
        out.update({"train.lora.rank": lora.get("rank"), "train.lora.targets": sorted(lora.get("targets") or [])})
    return out


def check_compatible(meta: dict, cfg, path: Path, tokenizer=None) -> None:
    """Refuse to resume `cfg` from a checkpoint whose weights compute something else (another shape,
    norm, rotary base, vocabulary, family or LoRA rank), or with another tokenizer: one line naming the
    keys that differ, before DeepSpeed loads any of it."""
    saved, now = identity(meta.get("config") or {}), identity(cfg.to_dict())
    diffs = []
    want = meta.get("tokenizer_sha256")
    if tokenizer is not None and want and tokenizer.sha256 != want:  # first: it explains a vocabulary change too
        diffs.append(f"data.tokenizer: the checkpoint was trained with {meta.get('tokenizer')!r} (sha256 {want[:12]}), "
                     f"the recipe gives {tokenizer.name!r} (sha256 {tokenizer.sha256[:12]})")
    diffs += [f"{k}: the checkpoint has {saved[k]!r}, the recipe {now[k]!r}" for k in now
              if k in saved and saved[k] is not None and saved[k] != now[k]]
    if diffs:
        raise CheckpointError("; ".join(diffs[:3]) + f" (resuming {path}); continue it with its own values, or "
                              "start another run (run.name) for another model")


def same_layout(meta: dict, tp: int, pp: int, dp: int, zero_stage: int, cp: int = 1) -> bool:
    """Whether the checkpoint was saved under this TP x PP x DP x CP layout and ZeRO stage."""
    saved = meta["layout"]
    return ((saved.get("tp"), saved.get("pp"), saved.get("dp"), saved.get("zero_stage", 0), saved.get("cp", 1))
            == (tp, pp, dp, zero_stage, cp))


def describe(layout: dict) -> str:
    """`tp=2 pp=1 dp=2 cp=1 ZeRO-1` of a meta.json layout."""
    return (f"tp={layout.get('tp')} pp={layout.get('pp')} dp={layout.get('dp')} cp={layout.get('cp', 1)} "
            f"ZeRO-{layout.get('zero_stage')}")


def set_scheduler_step(scheduler, step: int) -> None:
    """Put a fresh LR scheduler at optimizer step `step` (as if it had stepped `step` times)."""
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
        scheduler.step()


def load(engine, path: Path, *, rank: int, mp_rank: int) -> tuple[dict, dict, dict | None]:
    """Restore engine state from `path` (saved under this layout); returns (meta, this rank's extra,
    EMA state or None)."""
    path = Path(path)
    meta = rundir.read_meta(path)
    if not sorted(path.glob("*model_states.pt")):
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
    extra, ema = rundir.extra_file(path, rank), rundir.ema_file(path, mp_rank)
    if not extra.is_file():
        raise CheckpointError(f"{extra}: missing (this rank's random-number state and data position); the checkpoint "
                              "is incomplete: use another step")
    return meta, checked_extra(extra), safe_load(ema) if ema.is_file() else None


def checked_extra(f: Path) -> dict:
    """An extra_rank*.pt file: RNG states and the data position, checked (the message names the file)."""
    extra = safe_load(f)
    if not isinstance(extra, dict):
        raise CheckpointError(f"{f}: not a setdlm extra-state file (a dict with `rng` and `data`); use another step")
    check_rng_state(extra.get("rng"), f)
    if "data" in extra and not isinstance(extra["data"], dict):
        raise CheckpointError(f"{f}: its data-loader position is damaged (not a dict); use another step")
    return extra


def _rank_extra(path: Path, rank: int) -> dict:
    """This rank's RNG states and data position: its own file when the checkpoint has one for this rank,
    else rank 0's (another world size: the data position is global, the RNG states only drive dropout)."""
    own = rundir.extra_file(path, rank)
    f = own if own.is_file() else rundir.extra_file(path, 0)
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (the random-number state and data position); the checkpoint is "
                              "incomplete: use another step")
    return checked_extra(f)


def load_sharded(engine, path: Path, *, ema, rank: int, process_group=None) -> tuple[dict, dict, list[str]]:
    """Continue a run from a format-2 checkpoint under this run's layout, whatever layout saved it (every
    rank calls it: DCP's read is collective); returns (meta, this rank's extra, notes)."""
    from . import train_state

    path = Path(path)
    meta = rundir.read_meta(path)
    md = distcp.read_metadata(path)
    distcp.check_files(path, md)
    saved = {}  # current key -> the checkpoint's key (weights renamed since its format version)
    for key in distcp.tensor_shapes(md):
        prefix, _, name = key.partition("/")
        if prefix == "optim":
            sub, _, name = name.partition("/")
            prefix = f"optim/{sub}"
        saved[f"{prefix}/{versions.current_names({name: None}, meta).popitem()[0]}"] = key
    step = int(meta.get("optimizer_step") or meta["step"])
    plan = train_state.load_targets(engine, ema, set(saved), step=step)
    targets = {saved[k]: v for k, v in plan.targets.items()}
    distcp.check_shapes(targets, md, path)
    distcp.load(targets, path, process_group=process_group)
    for after in plan.after:
        after()
    return meta, _rank_extra(path, rank), plan.notes


def load_relayout(engine, path: Path, *, ema) -> tuple[dict, dict, list[str]]:
    """Continue a run from a format-1 checkpoint saved under another TP/PP/DP layout (its shards merged
    in memory, or its consolidated.pt), or from an imported run's consolidated.pt: weights, fp32 masters,
    Adam moments, EMA (relayout.load_consolidated); returns (meta, extra, notes) where extra holds the RNG
    state of the old rank 0 and the data position (valid under any data-parallel size)."""
    path = Path(path)
    meta = rundir.read_meta(path)
    cons = path / rundir.CONSOLIDATED
    if cons.is_file():
        state = safe_load(cons, mmap=True)
        if isinstance(state, dict) and isinstance(state.get("module"), dict):
            state = {**state, **{k: versions.current_names(state[k], meta) for k in ("module", "ema")
                                 if isinstance(state.get(k), dict)}}
    else:
        from .consolidate import consolidated_state

        state = consolidated_state(path)
    notes = load_consolidated(engine, state, ema=ema)
    extras = [checked_extra(f) for f in sorted(path.glob("extra_rank*.pt"))]
    extra = {"rng": extras[0]["rng"]} if extras else {}
    # The data order is one global sequence (data_pipeline/order.py): any rank's loader state continues
    # it under any data-parallel size.
    data = [e["data"] for e in extras if isinstance(e.get("data"), dict)]
    if data:
        extra["data"] = data[0]
    else:
        notes.append("no data position in the checkpoint: the data order starts from the beginning")
    return meta, extra, notes
