"""Consolidate a sharded checkpoint (any TP x PP x DP layout, ZeRO 0-3) into one unsharded state dict.

    setdlm convert consolidate --checkpoint RUN_OR_CKPT [--out FILE] [--no-optimizer] [--overwrite]

writes CKPT/consolidated.pt (atomically) holding

    module     {name: full fp32 tensor}  the TP=1, PP=1 state dict of the whole model
    ema        {name: full tensor} or None
    optimizer  {"step": int, "exp_avg": {name: full}, "exp_avg_sq": {name: full}} or None (AdamW moments)
    meta       step, tokens seen, the layout it came from

The shards are read and merged by shards.py, which refuses a checkpoint with a shard missing.
`load_model` (inference.py: inference, eval, HF export) reads consolidated.pt, or merges the shards
in memory when there is none, and `setdlm pretrain` continues training from it under a different
TP/PP/DP layout (resume.py, relayout.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.cli import ArgumentParser
from common.errors import StorageError, UsageError
from common.io import atomic_save
from common.storage import check_output_file

from ..safe_load import CheckpointError
from . import rundir
from .shards import MOMENTS, merge, read_shards


def consolidated_state(ckpt: Path, *, optimizer: bool = True) -> dict:
    """The consolidated state dict of one checkpoint folder, in memory (see the module doc)."""
    ckpt = Path(ckpt)
    meta = rundir.read_meta(ckpt, require=())
    shards = read_shards(ckpt, meta, optimizer=optimizer)
    module = merge([(s[0], s[1]) for s in shards])
    ema = merge([(s[0], s[2]) for s in shards]) if all(s[2] is not None for s in shards) else None
    opt = None
    if optimizer and shards and all(s[3] for s in shards):
        opt = {"step": max(s[4] for s in shards)}
        for k in MOMENTS:
            opt[k] = merge([(s[0], s[3][k]) for s in shards])
    layout = meta.get("layout", {})
    return {"module": module, "ema": ema, "optimizer": opt,
            "meta": {"step": meta.get("step"), "tokens_seen": meta.get("tokens_seen"), "layout": layout,
                     "source": str(ckpt)}}


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
                            description="Merge a sharded (TP/PP/DP, ZeRO 0-3) checkpoint into one state dict.")
    parser.add_argument("--checkpoint", required=True, help="run directory (newest checkpoint), RUN:best / RUN:STEP, its checkpoints/ folder, or one checkpoint")
    parser.add_argument("--out", help="output file (default: CHECKPOINT/consolidated.pt, read by load_model and re-layout)")
    parser.add_argument("--no-optimizer", action="store_true", help="leave out the Adam moments (weights and EMA only)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    args = parser.parse_args(argv)
    consolidate(args.checkpoint, out=args.out, optimizer=not args.no_optimizer, overwrite=args.overwrite or not args.out)
    return 0
