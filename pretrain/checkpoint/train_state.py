"""What each rank holds of the training state, as chunks of the global (TP=1, PP=1) tensors.

A format-2 checkpoint (distcp.py) stores, per parameter NAME (the TP=1 model's state-dict name):

    model/NAME             fp32 weights: the fp32 master weights where DeepSpeed keeps them (ZeRO 1-3),
                           else the parameter itself (ZeRO-0 fp32, frozen parameters)
    optim/exp_avg/NAME     AdamW's moments (fp32), for the trainable parameters
    optim/exp_avg_sq/NAME
    ema/NAME               the EMA average (fp32), with train.ema

Where a rank's values come from, and which part of the global tensor they are:
- tensor parallelism: a rank's parameter is the global tensor's slice along its `partition_dim`, at
  offset tp_rank * local size (megatron-core's layers; exact because the model's weight layouts do not
  depend on the TP size); a parameter that is not split (norms, biases of row-parallel layers) is
  written by TP rank 0 only and read by every TP rank;
- pipeline parallelism: a stage holds its own layers (names are global); the last stage's copy of a
  tied embedding is not written (the first stage's is) and is read like any parameter;
- ZeRO-1/2: DeepSpeed's flat fp32 partition of a rank crosses parameter boundaries; each parameter's
  fragment in it (`_hp_mapping`: a flat range of the parameter) is at most three rectangles of the
  parameter, and the moments have the same fragments. After a load the weights are refreshed from the
  masters and all-gathered by DeepSpeed's own `update_lp_params`;
- ZeRO-3: a rank owns the flat slice [r * n, (r + 1) * n) of each parameter (`p.ds_tensor`), its fp32
  master and moments (deepspeed.utils' local-partition API), and the same slice of the EMA;
- ZeRO-0 (a client torch AdamW) and frozen parameters: every replica holds the whole tensor; for a
  save the replica group (the dp x cp ranks that hold the same weights, pretrain/parallel.py) splits
  it into equal flat ranges, one per rank, and for a load every rank reads the whole tensor it holds.

So each rank writes only what it owns and reads only what it holds: its peak host memory while
loading is its own state plus DCP's read buffer (one stored chunk at a time), never the whole model.
The DeepSpeed internals read here (`_hp_mapping`, `update_lp_params`, the ZeRO-3 partition getters)
are listed in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.distributed as dist

from ..mcore import parallel_state
from ..parallel import replica_rank, replica_size
from ..safe_load import CheckpointError
from ..zero3 import is_partitioned
from .distcp import EMA as EMA_KEY, EXP_AVG, EXP_AVG_SQ, MODEL, Chunked

MOMENTS = ("exp_avg", "exp_avg_sq")
PREFIX = {"exp_avg": EXP_AVG, "exp_avg_sq": EXP_AVG_SQ}


@dataclasses.dataclass
class Param:
    """One parameter of this rank: where its local tensor sits in the global one."""

    name: str
    p: torch.nn.Parameter
    local_shape: tuple[int, ...]
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    split: bool  # tensor-parallel split (else replicated over TP)
    copy: bool  # the last pipeline stage's copy of a tied embedding


def _tp() -> tuple[int, int]:
    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def params(module: torch.nn.Module) -> list[Param]:
    tp, tp_rank = _tp()
    out = []
    for name, p in module.named_parameters():
        local = tuple(p.ds_shape) if is_partitioned(p) else tuple(p.shape)
        split = bool(getattr(p, "tensor_model_parallel", False)) and tp > 1
        glob, offset = list(local), [0] * len(local)
        if split:
            d = int(p.partition_dim)
            glob[d] = local[d] * tp
            offset[d] = local[d] * tp_rank
        out.append(Param(name, p, local, tuple(glob), tuple(offset), split, bool(getattr(p, "shared_embedding", False))))
    return out


def _writes_replicated(e: Param) -> bool:
    """Whether this rank writes (its share of) a tensor the TP ranks hold alike: TP rank 0 does."""
    return e.split or _tp()[1] == 0


def _replica_range(n: int) -> tuple[int, int]:
    """This rank's share [start, end) of n replicated elements for a save (equal ranges over the replica group)."""
    size, rank = replica_size(), replica_rank()
    part = -(-n // size)
    return min(n, rank * part), min(n, (rank + 1) * part)


# -- where each kind of state lives ------------------------------------------------------------------
def _zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage())


def _zero3_slice(p) -> tuple[int, int]:
    n = p.ds_tensor.ds_numel if hasattr(p.ds_tensor, "ds_numel") else p.ds_tensor.numel()
    start = n * dist.get_rank(group=p.ds_process_group)
    return start, max(start, min(start + n, p.ds_numel))


def _fragment(engine, e: Param, kind: str | None) -> tuple[int, torch.Tensor] | None:
    """(flat start, 1-D fp32 view) of this rank's own partition of `e`'s master (`kind` None) or moment
    under ZeRO 1-3; None when this rank holds none of it."""
    p = e.p
    if hasattr(p, "ds_id"):  # ZeRO-3: this rank's slice of the parameter
        start, end = _zero3_slice(p)
        if end <= start:
            return None
        opt = p._z3_optimizer
        flat, _ = opt._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=kind)
        return start, flat[:end - start]
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    view = mapping.get_hp_fragment(kind)
    return mapping.lp_fragment_address.start, view


def _client_moment(engine, p, kind: str) -> torch.Tensor | None:
    """A client torch optimizer's moment of `p` (ZeRO-0), or None before its first step."""
    st = engine.optimizer.state.get(p) if isinstance(engine.optimizer, torch.optim.Optimizer) else None
    return st.get(kind) if st else None


def _deepspeed_owns(p) -> bool:
    return hasattr(p, "_hp_mapping") or hasattr(p, "ds_id")


# -- save ---------------------------------------------------------------------------------------------
def save_state(engine, ema=None) -> dict[str, Chunked]:
    """This rank's pieces of every tensor of the checkpoint (views: `distcp.stage` copies them)."""
    out: dict[str, Chunked] = {}
    entries = params(engine.module)
    if _zero_stage(engine) in (1, 2):  # each fragment's views of the moments, (re)linked as DeepSpeed links them
        from .relayout import _init_flat_optimizer_states

        _init_flat_optimizer_states(engine.optimizer, optimizer_step(engine) or 0,
                                    [e.p for e in entries if e.p.requires_grad])

    def add(key: str, e: Param, flat: torch.Tensor, start: int) -> None:
        out.setdefault(key, Chunked(e.global_shape, torch.float32)).add_flat(e.local_shape, e.offset, flat, start)

    def replicated(key: str, e: Param, tensor: torch.Tensor) -> None:
        if _writes_replicated(e):
            s, t = _replica_range(tensor.numel())
            add(key, e, tensor.detach().reshape(-1)[s:t], s)
        else:
            out.setdefault(key, Chunked(e.global_shape, torch.float32))

    for e in entries:
        if e.copy:
            continue
        p = e.p
        owned = p.requires_grad and _deepspeed_owns(p)
        if owned:
            frag = _fragment(engine, e, None)
            if frag is not None and _writes_replicated(e):
                add(MODEL + e.name, e, frag[1], frag[0])
                for k in MOMENTS:
                    add(PREFIX[k] + e.name, e, _fragment(engine, e, k)[1], frag[0])
            else:
                for key in (MODEL, EXP_AVG, EXP_AVG_SQ):
                    out.setdefault(key + e.name, Chunked(e.global_shape, torch.float32))
        elif is_partitioned(p):  # a frozen ZeRO-3 parameter: its slice
            start, end = _zero3_slice(p)
            if _writes_replicated(e) and end > start:
                add(MODEL + e.name, e, p.ds_tensor.reshape(-1)[:end - start], start)
        else:
            replicated(MODEL + e.name, e, p.data)
            if p.requires_grad:
                for k in MOMENTS:
                    m = _client_moment(engine, p, k)
                    replicated(PREFIX[k] + e.name, e, m if m is not None else torch.zeros_like(p, dtype=torch.float32))
        if ema is not None and e.name in ema.shadow:
            shadow = ema.shadow[e.name]
            if is_partitioned(p):
                start, end = _zero3_slice(p)
                if _writes_replicated(e) and end > start:
                    add(EMA_KEY + e.name, e, shadow.reshape(-1)[:end - start], start)
                else:
                    out.setdefault(EMA_KEY + e.name, Chunked(e.global_shape, torch.float32))
            else:
                replicated(EMA_KEY + e.name, e, shadow)
    return out


def optimizer_step(engine) -> int | None:
    """AdamW's step count on this rank (None when it has not stepped)."""
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    for st in getattr(base, "state", {}).values():
        if isinstance(st, dict) and "step" in st:
            s = st["step"]
            return int(float(s.item() if torch.is_tensor(s) else s))
    return None


# -- load ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class LoadPlan:
    """Where each checkpoint tensor goes on this rank, and what to run once the values are in."""

    targets: dict[str, Chunked]
    after: list[Callable[[], None]]
    notes: list[str]


def load_targets(engine, ema, have: set[str], *, step: int, optimizer: bool = True) -> LoadPlan:
    """The pieces this rank reads (views into its own buffers, written in place) of a checkpoint that
    holds the keys `have`; moments that the checkpoint lacks stay zero (noted), an EMA it lacks restarts
    from the loaded weights (noted). Optimizer states are created first where torch creates them lazily."""
    from .relayout import _init_flat_optimizer_states

    zero = _zero_stage(engine)
    entries = params(engine.module)
    trainable = [e.p for e in entries if e.p.requires_grad]
    with_moments = optimizer and all(PREFIX[k] + e.name in have for e in entries if e.p.requires_grad for k in MOMENTS)
    inner = engine.optimizer
    client = isinstance(inner, torch.optim.Optimizer) and not any(_deepspeed_owns(p) for p in trainable)
    if not client:
        _init_flat_optimizer_states(inner, step, trainable)
    targets: dict[str, Chunked] = {}
    after: list[Callable[[], None]] = []
    notes: list[str] = []

    def want(key: str, e: Param, flat: torch.Tensor, start: int) -> None:
        targets.setdefault(key, Chunked(e.global_shape, torch.float32)).add_flat(e.local_shape, e.offset, flat, start)

    missing = [MODEL + e.name for e in entries if MODEL + e.name not in have]
    if missing:
        raise CheckpointError(f"no weights for {', '.join(m[len(MODEL):] for m in missing[:3])}"
                              + (f" and {len(missing) - 3} more" if len(missing) > 3 else "") + " (a different model?)")
    for e in entries:
        p = e.p
        if p.requires_grad and _deepspeed_owns(p):
            frag = _fragment(engine, e, None)
            if frag is not None:
                want(MODEL + e.name, e, frag[1], frag[0])
                if with_moments:
                    for k in MOMENTS:
                        want(PREFIX[k] + e.name, e, _fragment(engine, e, k)[1], frag[0])
            if is_partitioned(p) and p.data.numel():  # a ZeRO-3 parameter DeepSpeed keeps gathered
                want(MODEL + e.name, e, p.data.view(-1), 0)
        elif is_partitioned(p):
            start, end = _zero3_slice(p)
            if end > start:
                want(MODEL + e.name, e, p.ds_tensor.view(-1)[:end - start], start)
        else:
            want(MODEL + e.name, e, p.data.view(-1), 0)
            if p.requires_grad and with_moments:
                group = next(g for g in inner.param_groups if any(q is p for q in g["params"]))
                on_device = group.get("fused") or group.get("capturable")
                st = inner.state.setdefault(p, {})
                st["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device if on_device else "cpu")
                for k in MOMENTS:
                    if k not in st:
                        st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    want(PREFIX[k] + e.name, e, st[k].view(-1), 0)
    if optimizer and not with_moments and trainable:
        notes.append("no optimizer moments in the checkpoint: AdamW starts from zero moments")
    if ema is not None:
        if all(EMA_KEY + n in have for n in ema.shadow):
            for e in entries:
                if e.name in ema.shadow:
                    shadow = ema.shadow[e.name]
                    if is_partitioned(e.p):
                        start, end = _zero3_slice(e.p)
                        if end > start:
                            want(EMA_KEY + e.name, e, shadow.view(-1)[:end - start], start)
                    else:
                        want(EMA_KEY + e.name, e, shadow.view(-1), 0)
        else:
            notes.append("no EMA weights in the checkpoint: the EMA restarts from the loaded weights")
            after.append(lambda: _ema_from_weights(ema))
    after.insert(0, lambda: _refresh_weights(engine, entries, zero, step))
    return LoadPlan(targets, after, notes)


@torch.no_grad()
def _refresh_weights(engine, entries: list[Param], zero: int, step: int) -> None:
    """After the masters are in: the training weights from them (ZeRO 1-2: DeepSpeed's update_lp_params,
    which also all-gathers them; ZeRO-3: each rank's slice), and the optimizer's step count."""
    inner = engine.optimizer
    if zero in (1, 2) and hasattr(inner, "update_lp_params"):
        inner.update_lp_params()
    if zero == 3:
        for e in entries:
            p = e.p
            if p.requires_grad and hasattr(p, "ds_id"):
                start, end = _zero3_slice(p)
                if end > start:
                    flat, _ = p._z3_optimizer._get_fp32_opt_state_partition(p, release_swap_buffers=False)
                    p.ds_tensor.view(-1)[:end - start].copy_(flat[:end - start])
        if hasattr(inner, "checkpoint_event_epilogue"):  # what DeepSpeed runs after its own load: the small
            inner.checkpoint_event_epilogue()  # "persistent" parameters gathered from the new slices
    base = getattr(inner, "optimizer", inner)
    for st in getattr(base, "state", {}).values():
        if isinstance(st, dict) and "step" in st:
            st["step"] = torch.full_like(st["step"], float(step)) if torch.is_tensor(st["step"]) else step
    engine.global_steps = step


@torch.no_grad()
def _ema_from_weights(ema) -> None:
    from ..ema import _local

    for n, p in ema.params.items():
        ema.shadow[n].copy_(_local(p).detach().float())


def total_bytes(state: dict[str, Chunked]) -> int:
    return sum(c.nbytes() for c in state.values())


def numel(shape) -> int:
    return math.prod(shape)
