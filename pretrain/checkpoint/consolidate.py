"""Consolidate a checkpoint (any TP x PP x DP layout, ZeRO 0-3, format 1 or 2) into one unsharded state dict.

    setdlm convert consolidate --checkpoint RUN_OR_CKPT [--out FILE] [--no-optimizer] [--overwrite]

writes CKPT/consolidated.pt (atomically) holding

    module     {name: full fp32 tensor}  the TP=1, PP=1 state dict of the whole model
    ema        {name: full tensor} or None
    optimizer  {"step": int, "exp_avg": {name: full}, "exp_avg_sq": {name: full}} or None (AdamW moments)
    meta       step, tokens seen, the layout it came from

A format-2 checkpoint's global tensors are read whole (distcp.py); a format-1 checkpoint's shards are
read and merged by shards.py; both refuse a checkpoint with a rank's file missing. Training never
needs this file: `setdlm pretrain` continues a format-2 checkpoint under any layout by itself, and
`load_model` and the exports read any checkpoint. It is a one-file export (for other tools), read back
memory-mapped (`torch.load(mmap=True, weights_only=True)`) wherever setdlm reads one.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.cli import ArgumentParser
from common.errors import StorageError, UsageError
from common.io import atomic_save
from common.storage import check_output_file

from ..safe_load import CheckpointError
from . import rundir, versions
from .distcp import whole_state
from .shards import MOMENTS, merge, read_shards


def consolidated_state(ckpt: Path, *, optimizer: bool = True) -> dict:
    """The consolidated state dict of one checkpoint folder, in memory (see the module doc)."""
    ckpt = Path(ckpt)
    meta = rundir.read_meta(ckpt, require=())
    state = _dcp_state(ckpt, meta, optimizer) if rundir.storage(ckpt, meta) == "dcp" else _deepspeed_state(ckpt, meta, optimizer)
    names = lambda d: versions.current_names(d, meta) if isinstance(d, dict) else d  # noqa: E731
    state["module"], state["ema"] = names(state["module"]), names(state["ema"])
    if state["optimizer"]:
        state["optimizer"] = {k: (names(v) if k in MOMENTS else v) for k, v in state["optimizer"].items()}
    return state


def _meta_part(ckpt: Path, meta: dict) -> dict:
    return {"step": meta.get("step"), "tokens_seen": meta.get("tokens_seen"), "layout": meta.get("layout", {}),
            "source": str(ckpt)}


def _dcp_state(ckpt: Path, meta: dict, optimizer: bool) -> dict:
    """Format 2: the global tensors, read whole (distcp.py)."""
    state = whole_state(ckpt, optimizer=optimizer)
    opt = state["optimizer"]
    if opt is not None:
        opt = {"step": int(meta.get("optimizer_step") or meta.get("step") or 0), **opt}
    return {"module": state["module"], "ema": state["ema"], "optimizer": opt, "meta": _meta_part(ckpt, meta)}


def _deepspeed_state(ckpt: Path, meta: dict, optimizer: bool) -> dict:
    """Format 1: DeepSpeed's shard files merged (shards.py)."""
    shards = read_shards(ckpt, meta, optimizer=optimizer)
    module = merge([(s[0], s[1]) for s in shards])
    ema = merge([(s[0], s[2]) for s in shards]) if all(s[2] is not None for s in shards) else None
    opt = None
    if optimizer and shards and all(s[3] for s in shards):
        opt = {"step": max(s[4] for s in shards)}
        for k in MOMENTS:
            opt[k] = merge([(s[0], s[3][k]) for s in shards])
    return {"module": module, "ema": ema, "optimizer": opt, "meta": _meta_part(ckpt, meta)}


def consolidate(path, *, out=None, optimizer: bool = True, overwrite: bool = True, log=print) -> Path:
    """Write the consolidated state dict of checkpoint `path` (a run dir, its checkpoints/ or one
    checkpoint); returns the file written."""
    if out:
        check_output_file(out, "--out")  # a directory, a read-only mount: refused before the shards are read
    ckpt = rundir.resolve_checkpoint(path)
    target = Path(out) if out else ckpt / rundir.CONSOLIDATED
    if target.exists() and not overwrite:
        raise UsageError(f"--out {target}: exists (pass --overwrite to replace it)")
    if not out:
        check_output_file(target, "--checkpoint")
    state = consolidated_state(ckpt, optimizer=optimizer)
    module, ema, opt, meta = state["module"], state["ema"], state["optimizer"], state["meta"]
    layout = meta["layout"]
    size = sum(t.numel() * t.element_size() for part in (module, ema or {}, *(opt or {}).values())
               if isinstance(part, dict) for t in part.values() if torch.is_tensor(t))
    try:
        atomic_save(target, lambda f: torch.save(state, f), size=size)
    except StorageError as e:
        raise StorageError(f"{e}; nothing was changed") from None
    except OSError as e:
        raise CheckpointError(f"{target}: cannot be written ({e.strerror or e}); nothing was changed") from None
    n = sum(v.numel() for v in module.values() if torch.is_tensor(v))
    log(f"setdlm convert consolidate: {ckpt} (tp={layout.get('tp', 1)} pp={layout.get('pp', 1)} "
        f"dp={layout.get('dp', 1)} ZeRO-{layout.get('zero_stage', 0)}, step {meta.get('step')}) -> {target}: "
        f"{len(module)} tensors, {n / 1e6:.2f}M parameters, EMA {'yes' if ema else 'no'}, "
        f"optimizer moments {'yes' if opt else 'no'}")
    return target


def main(argv: list[str] | None = None) -> int:
    """`setdlm convert consolidate` (errors are reported by common.cli.run_command)."""
    parser = ArgumentParser(prog="setdlm convert consolidate",
                            description="Merge a checkpoint of any layout (TP/PP/DP, ZeRO 0-3) into one state dict (a one-file export).")
    parser.add_argument("--checkpoint", required=True, help="run directory (newest checkpoint), RUN:best / RUN:STEP, its checkpoints/ folder, or one checkpoint")
    parser.add_argument("--out", help="output file (default: CHECKPOINT/consolidated.pt: a one-file export; training does not need it)")
    parser.add_argument("--no-optimizer", action="store_true", help="leave out the Adam moments (weights and EMA only)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    args = parser.parse_args(argv)
    consolidate(args.checkpoint, out=args.out, optimizer=not args.no_optimizer, overwrite=args.overwrite or not args.out)
    return 0
