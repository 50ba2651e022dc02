"""From the plain model to this rank's trainable part of it, in one order (torchtitan's `parallelize`:
parallel layers, then checkpointing, then compile, then sharding; ZeRO-3 comes first here because it
partitions while the model is constructed).

`build_stage` (construction; every model a run trains comes from here):

1. tensor / sequence parallelism: the model takes its linears, embedding, head, loss and their
   communication from a `TensorParallel` (model/layers.py); at TP > 1 that is megatron-core's layers
   over its group (pretrain/tensor_parallel.py), at TP = 1 the model's own plain layers;
2. pipeline parallelism: this rank's stage (its global layer range, embedding on the first stage, head
   on the last) is built, nothing else;
3. placement and ZeRO-3: the stage is allocated on `device` directly, and under ZeRO-3 inside
   `deepspeed.zero.Init`, which partitions each parameter over the data-parallel group as its module
   is constructed; then the layout-invariant initialisation fills each rank's shard (model/init.py),
   or each rank's partition of it (pretrain/zero3.py). No rank holds the whole stage, nor on the host
   a whole weight matrix;
   With `train.lora`, the block linears get their low-rank adapters (model/lora.py) before that
   initialisation: allocated and partitioned like every other parameter, split over TP like the
   layer each adapts, drawn by the same layout-invariant init (A Gaussian, B zero, so the adapted
   model starts as its base); then every other parameter is frozen, so gradients, AdamW states and
   DeepSpeed's fp32 masters exist for the adapters alone (pretrain/engine.py `param_groups` takes
   only trainable parameters; pretrain/memory.py counts what that saves);
4. pipeline stage flags: a last stage's copy of a tied embedding is marked (`shared_embedding` for
   the checkpoint and the gradient sync, `ds_pipe_replicated` so DeepSpeed's norm skips it).

`prepare_model` (what wraps the built stage, in this order):

5. FP8: the block linears become Transformer Engine layers under fp8_autocast (pretrain/fp8.py);
6. the tensor-parallel random stream dropout draws from under sequence parallelism (seeded per TP rank);
7. activation checkpointing (pretrain/recompute.py), then 8. per-block torch.compile
   (pretrain/block_compile.py), which compiles the checkpointed blocks.

Data parallelism and the optimizer are DeepSpeed's (pretrain/engine.py `build_engine`, after this).
"""

from __future__ import annotations

import contextlib

import torch
from .mcore import parallel_state

from common.schema import ConfigError

from model import lora as model_lora
from model.transformer import Transformer

from . import fp8, zero3
from .block_compile import apply_compile
from .context_parallel import context_parallel
from .recompute import apply_activation_checkpointing
from .tensor_parallel import tensor_parallel


def stage_layers(n_layers: int, pp: int, stage: int) -> range:
    """Global layer indices of pipeline stage `stage`: contiguous, sizes differing by at most one, the
    extra layers on the first stages (the last stage also carries the output head and the loss)."""
    if not 1 <= pp <= n_layers:
        raise ConfigError(f"parallel.pp: {pp} stages for {n_layers} layers")
    base, extra = divmod(n_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def mark_pipeline_copies(model: Transformer) -> None:
    """Flag the last stage's copy of a tied embedding (a stage without the input embedding holding
    `embed`): the training step sums its gradient with the first stage's, and norms count it once."""
    if not model.pre_process and hasattr(model, "embed"):
        model.embed.weight.shared_embedding = True
        model.embed.weight.ds_pipe_replicated = True


def build_stage(model_cfg, tp: int, pp: int, *, device=None, sequence_parallel: bool = False,
                zero_init=None, lora=None, cp: int = 1) -> Transformer:
    """This rank's part of the model: its pipeline stage's layers, tensor-parallel over `tp` ranks
    (megatron's parallel state must be initialised for (tp, pp) when either is > 1). With `device`,
    the shards are allocated and initialised there directly: the host never holds the stage. With
    `zero_init` (ZeRO-3: pretrain.engine.zero3_init), the stage is built inside that
    `deepspeed.zero.Init` context, in its dtype, and each rank initialises only its partition. With
    `lora` (a `train.lora` section), the block linears carry adapters and only those train. With `cp` > 1
    the attention layers exchange K/V over megatron's context-parallel group (pretrain/context_parallel.py)."""
    stage = parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0
    dtype = zero_init.dtype if zero_init is not None else torch.float32
    layers = tensor_parallel(tp, sequence_parallel=sequence_parallel, params_dtype=dtype)
    with torch.device(device) if device is not None else contextlib.nullcontext(), \
            zero_init if zero_init is not None else contextlib.nullcontext():
        model = Transformer(model_cfg, layers, pre_process=stage == 0, post_process=stage == pp - 1,
                            layers=stage_layers(model_cfg.n_layers, pp, stage), init=False, cp=context_parallel(cp))
        if lora is not None:
            model_lora.attach(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, targets=lora.targets)
        if zero_init is not None:
            zero3.init_partitions(model)
        else:
            model.init_weights()
    if lora is not None:
        model_lora.freeze_base(model)
    mark_pipeline_copies(model)
    return model


def _seed_sequence_parallel_dropout(cfg) -> None:
    """Dropout on a slice of the sequence draws from megatron's tensor-parallel RNG stream."""
    if not (cfg.parallel.sequence_parallel and cfg.model.dropout > 0):
        return
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(cfg.run.seed)
    else:
        from .compat_cpu import install_cpu_rng_tracker

        install_cpu_rng_tracker(cfg.run.seed, parallel_state.get_tensor_model_parallel_rank())


def lora_note(cfg) -> str:
    """The start-of-run line of a LoRA run: what is adapted and how much of the model trains."""
    from model.shapes import parameter_count

    lo = cfg.train.lora
    n = model_lora.adapter_count(cfg.model, rank=lo.rank, targets=lo.targets)
    total = parameter_count(cfg.model)
    return (f"LoRA: rank {lo.rank}, alpha {lo.alpha:g}, dropout {lo.dropout:g} on {', '.join(lo.targets)} of "
            f"{cfg.model.n_layers} blocks: {n:,} trainable parameters ({100 * n / total:.2f}% of "
            f"{total:,}); the base is frozen (no gradients, optimizer states or fp32 masters for it)")


def prepare_model(model: Transformer, cfg) -> list[str]:
    """After `build_stage`: FP8 layers, the sequence-parallel dropout stream, activation checkpointing,
    then per-block torch.compile. Returns the log lines."""
    fp8.apply_fp8(model, cfg.model.fp8)
    _seed_sequence_parallel_dropout(cfg)
    notes = [lora_note(cfg)] if cfg.train.lora is not None else []
    note = apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    if note:
        notes.append(note)
    if cfg.train.compile:
        notes.append(apply_compile(model))
    return notes


__all__ = ["build_stage", "lora_note", "mark_pipeline_copies", "prepare_model", "stage_layers"]
