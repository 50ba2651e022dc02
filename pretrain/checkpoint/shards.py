"""Reading the shard files of one checkpoint (any TP x PP x DP layout, ZeRO 0-3) and merging them
into full (TP=1, PP=1) tensors.

Sources, per TP x PP shard (DeepSpeed names files by the model-parallel rank, `mp_rank_XX`):
- weights: the fp32 master partitions of the ZeRO-1/2 (and DeepSpeed bf16) optimizer files, cut per
  parameter by their `param_slice_mappings` and concatenated over data-parallel ranks; otherwise the
  module weights of `mp_rank_XX_model_states.pt`; ZeRO-3 through DeepSpeed's `zero_to_fp32`;
- tensor-parallel shards are concatenated along each parameter's split dimension, recorded at save
  time in the model file (`shard`, see save.py: no name patterns), which is exact because the model's
  weight layouts do not depend on the TP size (model/transformer.py);
- pipeline stages are a union (layer names are global); the last stage's copy of a tied embedding
  equals the first stage's and is dropped.

Every shard the layout implies must be present (each TP x PP model file, each data-parallel rank's
ZeRO optimizer file, each EMA file): a checkpoint with one missing is refused, naming it, rather
than merged into a smaller model. Files are read as weights only (pretrain/safe_load.py); DeepSpeed
is imported only for ZeRO-3 files.
"""

from __future__ import annotations

import contextlib
import io
from collections import defaultdict
from pathlib import Path

import torch

from ..safe_load import CheckpointError, load as safe_load, restricted_torch_load
from .rundir import ema_file

MOMENTS = ("exp_avg", "exp_avg_sq")


def _load(path: Path):
    return safe_load(path, map_location="cpu", mmap=True)  # a TP=1 model file is the whole model


def _part(state, key: str, path: Path):
    """state[key] of a loaded file, or a CheckpointError naming the file when it is not there."""
    if not isinstance(state, dict) or key not in state:
        raise CheckpointError(f"{path}: not a DeepSpeed checkpoint file of this run (no `{key}`)")
    return state[key]


def shard_info(engine) -> dict:
    """How this rank's part of the model is cut out of the full model (format-1 model files carried it;
    `merge` reads it): its
    tensor/pipeline ranks, each parameter's tensor-parallel split dimension (-1: replicated), the
    parameters that are copies of another stage's (a tied embedding on the last stage) and, for a
    client torch optimizer saved in the model file, the parameter names in the optimizer's order."""
    from ..mcore import parallel_state

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


# -- merging shards ---------------------------------------------------------------------------------
def merge_tp(shards: list[tuple[dict, dict]]) -> dict:
    """[(shard info, {name: tensor})] of one pipeline stage, any order -> full tensors."""
    shards = sorted(shards, key=lambda s: s[0]["tp_rank"])
    info0, first = shards[0]
    out = {}
    for name, value in first.items():
        dim = info0["partition"].get(name, -1)
        if dim >= 0 and torch.is_tensor(value) and len(shards) > 1:
            out[name] = torch.cat([s[1][name] for s in shards], dim=dim)
        else:
            out[name] = value
    return out


def merge_stages(stages: list[tuple[dict, dict]]) -> dict:
    """[(shard info of the stage, its TP-merged tensors)] -> one state dict; copies are dropped."""
    out: dict = {}
    for info, state in sorted(stages, key=lambda s: s[0]["pp_rank"]):
        copies = set(info.get("copies", []))
        for name, value in state.items():
            if name in copies or name in out:
                continue
            out[name] = value
    return out


def merge(shards: list[tuple[dict, dict]]) -> dict:
    """All (shard info, tensors) of a checkpoint (one per TP x PP rank) -> the full state dict."""
    by_stage = defaultdict(list)
    for info, state in shards:
        by_stage[info["pp_rank"]].append((info, state))
    return merge_stages([(group[0][0], merge_tp(group)) for group in by_stage.values()])


# -- reading one shard ------------------------------------------------------------------------------
def _flat_partitions(files: list[Path], shapes: dict) -> tuple[dict, dict, int] | None:
    """fp32 masters and Adam moments of ZeRO-1/2 (or DeepSpeed bf16) optimizer files of one TP x PP
    shard, one file per data-parallel rank: ({name: master}, {moment: {name: tensor}}, step)."""
    pieces: dict = defaultdict(list)
    moments: dict = {k: defaultdict(list) for k in MOMENTS}
    step = 0
    for f in files:
        osd = _part(_load(f), "optimizer_state_dict", f)
        mappings = osd.get("param_slice_mappings")
        fp32 = osd.get("single_partition_of_fp32_groups")
        if mappings is None or fp32 is None:
            return None
        base = osd.get("base_optimizer_state", {}).get("state", {})
        for g, mapping in enumerate(mappings):
            state = base.get(g, {})
            step = max(step, int(state.get("step", 0)))
            for name, frag in mapping.items():
                pieces[name].append(fp32[g].narrow(0, frag.start, frag.numel))
                for k in MOMENTS:
                    if k in state:
                        moments[k][name].append(state[k].narrow(0, frag.start, frag.numel))

    def join(parts):
        return {n: torch.cat(v).view(shapes[n]).clone() for n, v in parts.items()}

    return join(pieces), {k: join(v) for k, v in moments.items() if v}, step


def _torch_moments(optimizer_state: dict, order: list[str] | None) -> tuple[dict, int] | None:
    """Adam moments of a client torch optimizer saved in the model file (ZeRO-0, fp32)."""
    if not optimizer_state or not order or "state" not in optimizer_state:
        return None
    ids = [i for g in optimizer_state["param_groups"] for i in g["params"]]
    if len(ids) != len(order):
        return None
    out = {k: {} for k in MOMENTS}
    step = 0
    for idx, name in zip(ids, order):
        st = optimizer_state["state"].get(idx, {})
        for k in MOMENTS:
            if k in st:
                out[k][name] = st[k].clone()
        if "step" in st:
            step = max(step, int(float(st["step"])))
    return out, step


def _ema_shadow(ckpt: Path, mp_rank: int) -> dict | None:
    f = ema_file(ckpt, mp_rank)
    return _part(_load(f), "shadow", f) if f.is_file() else None


def _int(layout: dict, key: str) -> int:
    return int(layout.get(key) or 1) if key != "zero_stage" else int(layout.get(key) or 0)


def check_complete(ckpt: Path, layout: dict, ema: bool) -> None:
    """Every file the saved layout implies is present, else a CheckpointError naming the first missing
    ones: mp_rank_XX_model_states.pt per TP x PP rank (ZeRO-3: one model file per data-parallel rank),
    zero_pp_rank_D_mp_rank_XX_optim_states.pt per data-parallel rank under ZeRO >= 1, and the EMA file
    of every model-parallel rank when the run kept an EMA."""
    tp, pp, dp, zero = _int(layout, "tp"), _int(layout, "pp"), _int(layout, "dp"), _int(layout, "zero_stage")
    dp *= _int(layout, "cp")  # ZeRO partitions over the replica set: dp x cp ranks (pretrain/parallel.py)
    mps = [f"{m:02d}" for m in range(tp * pp)]
    if zero >= 3:
        need = [f"zero_pp_rank_{d}_mp_rank_{m}_{kind}_states.pt" for m in mps for d in range(dp) for kind in ("model", "optim")]
    else:
        need = [f"mp_rank_{m}_model_states.pt" for m in mps]
        if zero >= 1:  # DeepSpeed's ZeRO-1/2 optimizers: the fp32 masters and moments, one file per DP rank
            need += [f"zero_pp_rank_{d}_mp_rank_{m}_optim_states.pt" for m in mps for d in range(dp)]
    if ema:
        need += [f"ema_mp_rank_{m}.pt" for m in mps]
    missing = [n for n in need if not (ckpt / n).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt}: incomplete: {', '.join(missing[:3])}"
                              + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
                              + f" missing (saved with tp={tp} pp={pp} dp={dp} ZeRO-{zero}: {len(need)} shard files); "
                              "copy the whole checkpoint directory")


def read_shards(ckpt: Path, meta: dict, *, optimizer: bool = True):
    """Per TP x PP shard of checkpoint `ckpt` (its meta.json: `meta`): (info, weights, ema or None,
    moments or None, step)."""
    ckpt = Path(ckpt)
    layout = meta.get("layout", {})
    has_ema = any(ckpt.glob("ema_mp_rank_*.pt")) or float((meta.get("config") or {}).get("train", {}).get("ema") or 0) > 0
    check_complete(ckpt, layout, has_ema)
    model_files = sorted(ckpt.glob("mp_rank_*_model_states.pt"))
    if _int(layout, "zero_stage") >= 3:
        return _read_zero3(ckpt, meta)
    if not model_files:
        raise CheckpointError(f"checkpoint {ckpt}: no mp_rank_*_model_states.pt files")
    out = []
    for f in model_files:
        mp = f.name[len("mp_rank_"):-len("_model_states.pt")]
        state = _load(f)
        module = _part(state, "module", f)
        info = state.get("shard") or _single_shard_info(module, layout)
        weights = dict(module)
        moments, step = None, 0
        shapes = {}
        for group in state.get("param_shapes") or []:
            shapes.update(group)
        optim_files = sorted(ckpt.glob(f"zero_pp_rank_*_mp_rank_{mp}_optim_states.pt"),
                             key=lambda p: int(p.name.split("_")[3]))
        flat = _flat_partitions(optim_files, shapes) if optim_files and shapes else None
        if flat is not None:
            masters, moments, step = flat
            weights.update(masters)  # fp32 masters (exact for fp32 training, better than bf16 weights)
        elif optimizer:
            got = _torch_moments(state.get("optimizer"), info.get("optimizer_order"))
            if got is not None:
                moments, step = got
        weights = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in weights.items()}
        ema = _ema_shadow(ckpt, int(mp))
        out.append((info, weights, ema, moments if optimizer else None, step))
    _check_grid(ckpt, [s[0] for s in out], layout)
    return out


def _check_grid(ckpt: Path, infos: list[dict], layout: dict) -> None:
    """The shards' recorded (tp_rank, pp_rank) cover the layout's grid exactly once."""
    tp, pp = _int(layout, "tp"), _int(layout, "pp")
    seen = sorted((int(i.get("tp_rank", 0)), int(i.get("pp_rank", 0))) for i in infos)
    want = sorted((t, p) for t in range(tp) for p in range(pp))
    if seen != want:
        lost = sorted(set(want) - set(seen))
        raise CheckpointError(f"checkpoint {ckpt}: its model files hold shards {seen}, the layout tp={tp} pp={pp} "
                              f"needs {want}" + (f" (missing tp_rank, pp_rank {lost})" if lost else ""))


def _single_shard_info(module_state: dict, layout: dict) -> dict:
    if _int(layout, "tp") != 1 or _int(layout, "pp") != 1:
        raise CheckpointError("checkpoint: sharded (tp/pp > 1) but written without shard information "
                              "(saved by an older setdlm); it cannot be consolidated")
    return {"tp": 1, "pp": 1, "tp_rank": 0, "pp_rank": 0, "partition": {}, "copies": []}


def _read_zero3(ckpt: Path, meta: dict):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    files = sorted(ckpt.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"))
    if not files:
        raise CheckpointError(f"checkpoint {ckpt}: no ZeRO-3 model files")
    state = _load(files[0])
    weights = {k: v for k, v in _part(state, "module", files[0]).items() if not torch.is_tensor(v)}  # extra states
    try:
        with restricted_torch_load(), contextlib.redirect_stdout(io.StringIO()):  # its torch.load: weights only
            full = get_fp32_state_dict_from_zero_checkpoint(str(ckpt.parent), tag=ckpt.name)
    except (KeyError, ValueError, AssertionError, IndexError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"checkpoint {ckpt}: its ZeRO-3 shards cannot be merged ({type(e).__name__}: {e})") from None
    weights.update({k: v.float() for k, v in full.items()})
    ema = _ema_shadow(ckpt, 0)
    info = state.get("shard") or _single_shard_info(weights, meta.get("layout", {}))
    return [(info, weights, ema, None, 0)]
