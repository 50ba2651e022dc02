"""The DeepSpeed engine that owns data parallelism, the optimizer (ZeRO 0-3), clipping and accumulation."""

from __future__ import annotations

import importlib
import os
import warnings

import torch
from .mcore import parallel_state

from .parallel import replica_group, replica_rank, replica_size
from .schedules import build_scheduler
from .zero3 import is_partitioned

# torch 2.13 deprecates the two collectives DeepSpeed's ZeRO calls every step (they forward to
# all_gather_single / reduce_scatter_single); the warning is about DeepSpeed's code, not the recipe.
for _name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
    warnings.filterwarnings("ignore", message=f"`torch.distributed.{_name}` is deprecated", category=FutureWarning)


def _skip_cpu_shm_op() -> None:
    """On CPU, DeepSpeed compiles a shared-memory op on first use (~30 s) that serves only inference
    all-reduce; training does not use it. Mark it unavailable so no process waits for the compile.

    DeepSpeed has no option for this: its communication backend builds the op whenever its table of
    compatible ops says it can (a private, lazily probed module attribute, which DeepSpeed keeps as one
    dict so that edits to it persist). docs/architecture.md lists this among the private uses."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _model_parallel_rank() -> int:
    return torch.distributed.get_rank(group=parallel_state.get_model_parallel_group())


def _model_parallel_world_size() -> int:
    return torch.distributed.get_world_size(group=parallel_state.get_model_parallel_group())


class MegatronMPU:
    """DeepSpeed's `mpu` protocol over megatron-core's groups.

    "Model parallel" is megatron's model-parallel group, tensor x pipeline (as in Megatron-LM): DeepSpeed
    names checkpoint files by its rank (`mp_rank_XX`: one file per TP x PP shard) and sums gradient
    norms over it (so norms are reduced across pipeline stages). Which parameters are replicated is
    decided by the *tensor*-parallel rank (DeepSpeed asks `get_tensor_model_parallel_rank`), and a
    tied-embedding copy on the last stage is skipped through its `ds_pipe_replicated` flag. "Data
    parallel" to DeepSpeed is the replica group, the dp x cp ranks that hold the same weights
    (pretrain/parallel.py): gradients are averaged and ZeRO partitions its states over it, and its rank
    numbers the ZeRO checkpoint partitions (as Megatron-LM's distributed optimizer shards over dp x cp)."""

    get_data_parallel_group = staticmethod(replica_group)
    get_data_parallel_rank = staticmethod(replica_rank)
    get_data_parallel_world_size = staticmethod(replica_size)
    get_model_parallel_group = staticmethod(parallel_state.get_model_parallel_group)
    get_model_parallel_rank = staticmethod(_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_pipeline_model_parallel_group = staticmethod(parallel_state.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(parallel_state.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(parallel_state.get_pipeline_model_parallel_world_size)


def param_groups(model: torch.nn.Module, weight_decay: float, style: str = "adamw", lr: float = 1.0) -> list[dict]:
    """AdamW parameter groups of the trainable parameters (a frozen LoRA base has none).

    `style` "adamw" (torch): every matrix decays by lr_t * weight_decay per step, norm weights and
    biases not at all. "decoupled" (Composer's DecoupledAdamW, the reference's optimizer): every
    parameter decays by (lr_t / lr) * weight_decay per step, i.e. torch's AdamW with weight_decay /
    lr, the peak LR `lr`, on one group."""
    if style == "decoupled":
        return [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": weight_decay / lr}]
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        dims = len(p.ds_shape) if hasattr(p, "ds_shape") else p.dim()  # a zero.Init parameter's data is empty
        (no_decay if dims < 2 or "norm" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def resolve_precision(cfg, device: torch.device) -> str:
    """`auto` is bf16 on GPUs that support it, fp32 elsewhere."""
    p = cfg.train.precision
    if p == "auto":
        p = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return p


def deepspeed_config(cfg, world_size: int, precision: str = "fp32") -> dict:
    """bf16 is Megatron-style mixed precision: bf16 weights and activations, fp32 master weights and
    optimizer states held by DeepSpeed (its BF16 optimizer, or ZeRO's fp32 partitions)."""
    t, p = cfg.train, cfg.parallel
    micro, accum = t.micro_batch, cfg.grad_accum(world_size)
    if p.pp > 1:
        # megatron's pipeline schedule runs the micro-batches of a step (pretrain/pipeline.py): to
        # DeepSpeed a step is one "micro-batch" of micro * accum sequences.
        micro, accum = micro * accum, 1
    return {
        "bf16": {"enabled": precision == "bf16"},
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        # ZeRO-0 optimizers take the norm wrongly under TP/PP (fp32: replication decided by the
        # model-parallel rank; bf16: their fp32 copies lose the tensor-parallel and pipeline-replica
        # marks, so TP shards are counted on one rank only): we clip ourselves there (clip_gradients).
        "gradient_clipping": t.grad_clip if p.zero_stage > 0 else 0.0,
        # parallel.overlap_comm: ZeRO-1/2 reduce beside the backward (ZeRO-3 keeps DeepSpeed's default, on)
        "zero_optimization": {"stage": p.zero_stage, **({"overlap_comm": p.overlap_comm} if p.zero_stage in (1, 2) else {})},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


def zero3_init(cfg, world_size: int, precision: str = "fp32"):
    """`deepspeed.zero.Init` for a ZeRO-3 run (None otherwise): built inside it, every parameter is
    partitioned over the data-parallel group as soon as its module is constructed, so no rank ever
    holds the full model, and model/init.py then fills each rank's partition with the layout-independent
    values. It takes the engine's own DeepSpeed config (dtype, ZeRO options, offload) and megatron's
    data-parallel group, so `deepspeed.initialize` finds the parameters already partitioned as it would
    have partitioned them. The context has `.dtype`: the dtype to build the parameters in."""
    if cfg.parallel.zero_stage != 3:
        return None
    _skip_cpu_shm_op()
    import deepspeed

    # torch imports dynamo on the first call of some of its functions (torch.randint in the model's
    # constructor); inside zero.Init, whose Tensor.__new__ dynamo's polyfills cannot check, it would fail
    importlib.import_module("torch._dynamo")

    # zero.Init reads the local device from LOCAL_RANK (torchrun sets it; a single process may not)
    os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device() if torch.cuda.is_available() else 0))
    return deepspeed.zero.Init(data_parallel_group=replica_group(),
                               config_dict_or_path=deepspeed_config(cfg, world_size, precision), mpu=MegatronMPU())


def zero3_notes(model: torch.nn.Module, cfg) -> list[str]:
    """The start-of-run log line saying how a ZeRO-3 model was partitioned (nothing below ZeRO-3)."""
    if cfg.parallel.zero_stage != 3:
        return []
    params = list(model.parameters())
    if not all(is_partitioned(p) for p in params):
        return ["ZeRO-3: parameters partitioned at deepspeed.initialize (model.fp8 builds its TE layers from "
                "the full weights, so the model is built whole first)"]
    dp = replica_size()
    over = f"dp={dp}" if parallel_state.get_context_parallel_world_size() == 1 else f"dp x cp={dp}"
    mine = sum(p.ds_tensor.numel() for p in params)
    total = sum(p.ds_numel for p in params)
    return [f"ZeRO-3: parameters partitioned at construction (deepspeed.zero.Init) over {over}: this rank holds "
            f"{mine:,} of {total:,} parameter values (during the build at most one module's parameters in full, "
            f"largest parameter {max(p.ds_numel for p in params):,})"]


def gradients_from_outside(engine) -> None:
    """Tell the engine that gradients are produced outside `engine.backward()` (megatron's pipeline
    schedule runs the backward): its ZeRO-1 reduction then allocates the reduction buckets that the
    engine's own backward would have, as under DeepSpeed's pipeline engine, which sets the same flag.

    DeepSpeed has no public switch for this (`managed_gradient_accumulation: false` still expects the
    backward to run through the engine): the flag is the engine's own `pipeline_parallelism`, written
    once after `deepspeed.initialize`. docs/architecture.md lists this among the private uses."""
    engine.pipeline_parallelism = True


def build_engine(model: torch.nn.Module, cfg, world_size: int, precision: str = "fp32"):
    """Wrap the model in a DeepSpeed engine with a client AdamW and our LR schedule."""
    _skip_cpu_shm_op()
    import deepspeed

    # torch imports dynamo on the first call of some of its functions (torch.randint in the model's
    # constructor); inside zero.Init, whose Tensor.__new__ dynamo's polyfills cannot check, it would fail
    importlib.import_module("torch._dynamo")

    t = cfg.train
    # torch's fused AdamW (one kernel per parameter group, CUDA and CPU alike) instead of its
    # per-parameter loop.
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay, t.weight_decay_style, t.lr), lr=t.lr,
                                  betas=(t.beta1, t.beta2),
                                  eps=t.adam_eps, fused=True)
    scheduler = build_scheduler(optimizer, t)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg, world_size, precision),
        mpu=MegatronMPU(), dist_init_required=False)
    if engine.zero_optimization_stage() == 0 and replica_size() == 1:
        # Nothing to reduce over one replica: skip DeepSpeed's flatten / all-reduce /
        # unflatten of every gradient at each accumulation boundary.
        engine.enable_backward_allreduce = False
    return engine, optimizer, scheduler


def global_grad_norm(params) -> torch.Tensor:
    """L2 norm of the whole model's gradients (call after the data-parallel reduction).

    Tensor-parallel shards count on every TP rank, replicated parameters on TP rank 0 only, a
    pipeline-replicated copy (the last stage's tied embedding) not at all; the sum of squares is then
    reduced over the model-parallel (TP x PP) group, so every rank gets the same norm."""
    import torch.distributed as dist

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    grads = [p.grad.detach() for p in params if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
             and (tp_rank == 0 or getattr(p, "tensor_model_parallel", False))]
    if grads:  # one foreach pass accumulating in float64 (exact; no float64 copy of any gradient)
        sq = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).pow(2).sum()
    else:
        sq = torch.zeros((), dtype=torch.float64, device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    group = parallel_state.get_model_parallel_group()
    if dist.get_world_size(group=group) > 1:
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_gradients(engine, max_norm: float) -> torch.Tensor | None:
    """Gradient norm of the step (after DP reduction), clipping to `max_norm` where DeepSpeed does not.

    Call after the last backward of an optimizer step and before `engine.step()`. At ZeRO-0 the
    gradients are the parameters' `.grad` (fp32 or bf16), and `global_grad_norm` is right under any
    TP x PP layout where DeepSpeed's ZeRO-0 optimizers are not (see deepspeed_config). The norm stays a
    device tensor and the clip factor min(1, max_norm / norm) is applied on the device (torch's
    `clip_grads_with_norm_`): nothing waits for the device here; the trainer reads the norm on logged
    steps only."""
    if engine.zero_optimization_stage() > 0:
        return None  # DeepSpeed clips and records the norm; read it after step()
    params = [p for p in engine.module.parameters() if p.grad is not None]
    norm = global_grad_norm(params)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
