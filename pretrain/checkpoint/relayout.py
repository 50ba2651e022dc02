"""A full (TP=1, PP=1) state into this rank's shard of an engine of any layout.

`load_consolidated` takes a consolidated state (consolidate.py's format: full weights, EMA and
AdamW moments) and fills this rank's piece of the model, its fp32 master weights and its optimizer
states, under any TP x PP x DP layout and ZeRO stage. The re-layout resume (resume.py) and
`train.init_from` (weights only) use it.

DeepSpeed's public `deepspeed.utils.safe_set_full_fp32_param` / `safe_set_full_optimizer_state`
write each parameter's piece of the flat fp32 partitions. Before the first optimizer step those
partitions have no AdamW states yet (torch creates them lazily), so `_init_flat_optimizer_states`
creates them and links each parameter's fragment to them with DeepSpeed's public
`lazy_init_hp_params_optimizer_state`, the call DeepSpeed itself makes after its first step
(docs/architecture.md lists the DeepSpeed internals this reads).
"""

from __future__ import annotations

import torch

from ..safe_load import CheckpointError


def _local_shard(full: torch.Tensor, p: torch.nn.Parameter, tp: int, tp_rank: int) -> torch.Tensor:
    """This tensor-parallel rank's piece of a full (TP=1) tensor for parameter `p`."""
    if getattr(p, "tensor_model_parallel", False) and tp > 1:
        full = full.chunk(tp, dim=p.partition_dim)[tp_rank]
    return full


def _deepspeed_partitioned(p: torch.nn.Parameter) -> bool:
    """Whether DeepSpeed keeps `p`'s fp32 master in a flat partition (ZeRO-1/2 and its bf16 optimizer
    link `_hp_mapping`, ZeRO-3 partitions set `ds_id`) rather than a client torch optimizer holding it."""
    return hasattr(p, "_hp_mapping") or hasattr(p, "ds_id")


def load_consolidated(engine, state: dict, *, ema=None, optimizer: bool = True, optional=None) -> list[str]:
    """Load a consolidated (TP=1, PP=1) state into this rank's shard of the model, its fp32 master
    weights and, when present, the Adam moments; `ema` (an EMA) gets its slice of the consolidated
    EMA. Works under any TP x PP x DP layout and ZeRO stage. Parameters for which `optional(name)` is
    true may be absent from the state (LoRA adapters on imported weights): they keep their values.
    Returns notes."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
    from ..mcore import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    module, notes = engine.module, []
    weights = state["module"]
    params = [(n, p) for n, p in module.named_parameters() if n in weights or not (optional and optional(n))]
    missing = [n for n, _ in params if n not in weights]
    if missing:
        raise CheckpointError(f"consolidated checkpoint: no weights for {missing[:3]} (a different model?)")
    zero3 = engine.zero_optimization_stage() == 3
    with torch.no_grad():
        for n, p in params:
            value = _local_shard(weights[n], p, tp, tp_rank)
            shape = tuple(p.ds_shape) if zero3 else tuple(p.shape)
            if tuple(value.shape) != shape:
                raise CheckpointError(f"consolidated checkpoint: {n} has shape {tuple(value.shape)} here, the model "
                                      f"expects {shape} (a different model configuration?)")
            if zero3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    p.data.copy_(value.to(p.dtype))
            else:
                p.data.copy_(value.to(p.dtype))
            if p.requires_grad:  # ZeRO / bf16 fp32 masters (no-op without them; none for a frozen parameter)
                safe_set_full_fp32_param(p, value.float())
    opt = state.get("optimizer") if optimizer else None
    if opt:
        step = int(opt["step"])
        inner = engine.optimizer
        client = isinstance(inner, torch.optim.Optimizer) and not any(_deepspeed_partitioned(p) for _, p in params)
        if not client:
            _init_flat_optimizer_states(inner, step, [p for _, p in params])
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


def _init_flat_optimizer_states(inner, step: int, params: list[torch.nn.Parameter]) -> None:
    """Create the AdamW states of DeepSpeed's flat fp32 partitions before the first step (torch creates
    them lazily) and link each parameter's fragment to them, so `safe_set_full_optimizer_state` can
    fill them. Linking again (DeepSpeed does after its first step) finds the same tensors."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state

    base = getattr(inner, "optimizer", None)
    if not isinstance(base, torch.optim.Optimizer):
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
    for p in params:  # ZeRO-1/2 and bf16: the fragment of each parameter this rank holds (ZeRO-3 needs none)
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is not None:
            flat = base.param_groups[mapping.param_group_index]["params"][0]
            lazy_init_hp_params_optimizer_state([p], flat, base.state)
