"""The DeepSpeed engine that owns data parallelism, the optimizer (ZeRO 0-3), clipping and accumulation."""

from __future__ import annotations

import torch
from megatron.core import parallel_state

from .schedules import build_scheduler


def _skip_cpu_shm_op() -> None:
    """On CPU, DeepSpeed compiles a shared-memory op on first use (~30 s) that serves only inference
    all-reduce; training does not use it. Mark it unavailable so no process waits for the compile."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class MegatronMPU:
    """DeepSpeed's `mpu` protocol over megatron-core's groups: "model parallel" means tensor parallel
    (the convention of Megatron-DeepSpeed); data parallel is megatron's data-parallel group."""

    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)
    get_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_pipeline_model_parallel_group = staticmethod(parallel_state.get_pipeline_model_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(parallel_state.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(parallel_state.get_pipeline_model_parallel_world_size)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or "norm" in name else decay).append(p)
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
    return {
        "bf16": {"enabled": precision == "bf16"},
        "train_micro_batch_size_per_gpu": t.micro_batch,
        "gradient_accumulation_steps": cfg.grad_accum(world_size),
        # fp32 ZeRO-0 clips without reporting the norm: we clip ourselves there (see clip_gradients).
        "gradient_clipping": t.grad_clip if p.zero_stage > 0 or precision == "bf16" else 0.0,
        "zero_optimization": {"stage": p.zero_stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
    }


def build_engine(model: torch.nn.Module, cfg, world_size: int, precision: str = "fp32"):
    """Wrap the model in a DeepSpeed engine with a client AdamW and our LR schedule."""
    _skip_cpu_shm_op()
    import deepspeed

    t = cfg.train
    fused = torch.cuda.is_available()
    optimizer = torch.optim.AdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.beta1, t.beta2),
                                  eps=t.adam_eps, fused=fused or None)
    scheduler = build_scheduler(optimizer, t)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=deepspeed_config(cfg, world_size, precision),
        mpu=MegatronMPU(), dist_init_required=False)
    return engine, optimizer, scheduler


def clip_gradients(engine, max_norm: float) -> float | None:
    """Gradient norm of the step (after DP reduction), clipping to `max_norm` where DeepSpeed does not.

    Call after the last backward of an optimizer step and before `engine.step()`."""
    if engine.zero_optimization_stage() > 0 or engine.bfloat16_enabled():
        return None  # DeepSpeed clips and records the norm; read it after step()
    from deepspeed.runtime.utils import clip_grad_norm_

    params = [p for p in engine.module.parameters() if p.grad is not None]
    if max_norm > 0:
        return float(clip_grad_norm_(params, max_norm=max_norm, mpu=engine.mpu))
    from deepspeed.runtime.utils import get_global_norm_of_tensors

    return float(get_global_norm_of_tensors([p.grad for p in params], mpu=engine.mpu))
