"""Layout-specific stepping: one optimizer step and one evaluation pass under any TP x PP x DP layout.

The trainer hands `StepRunner` the micro-batches of a step (already prepared `ModelInputs`, the same
on every TP/PP peer of a data-parallel rank) and gets back the summed loss metrics and the gradient
norm; `reduce` turns per-rank metric sums into run-wide ones. Who does what:

- pp = 1: the DeepSpeed engine runs each micro-batch (forward, `engine.backward`, `engine.step`):
  gradient accumulation, data-parallel reduction and ZeRO 0-3 are DeepSpeed's.
- pp > 1: megatron-core's non-interleaved 1F1B schedule (`get_forward_backward_func`) runs the
  micro-batches through the stages, sending activations and their gradients point to point. After it,
  the tied-embedding copies' gradients are summed over megatron's embedding group (first and last
  stage), DeepSpeed reduces gradients over the data-parallel group (ZeRO 0 or 1; to DeepSpeed the whole
  step is one micro-batch), the gradient norm is taken over the model-parallel group and the engine
  steps. On a CPU-only torch the schedule runs inside `pretrain.compat_cpu.cpu_compat()`.

Why megatron's schedules rather than DeepSpeed's pipeline engine: the model stays our `Transformer`
with global layer names (state dicts and checkpoints are the same under any split, so consolidation
and re-layout are a concatenation), stage boundaries carry one hidden-state tensor, and the schedule is
the one Megatron-LM users run. DeepSpeed still owns the optimizer, data parallelism and checkpoints.
See docs/parallelism.md.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from .mcore import parallel_state

from common.schema import ConfigError

from model.transformer import Transformer

from .compat_cpu import megatron_compat, sequence_parallel_compat

from .engine import clip_gradients, gradients_from_outside
from .parallel import replica_group


def schedule_config(cfg, dtype: torch.dtype):
    """The megatron `TransformerConfig` its schedules read (shapes, dtypes, p2p options); the model's
    layers use their own `ModelParallelConfig` (pretrain/tensor_parallel.py)."""
    from megatron.core.transformer import TransformerConfig

    m = cfg.model
    return TransformerConfig(
        num_layers=m.n_layers, hidden_size=m.hidden, num_attention_heads=m.n_heads, ffn_hidden_size=m.ffn_hidden,
        tensor_model_parallel_size=cfg.parallel.tp, pipeline_model_parallel_size=cfg.parallel.pp,
        pipeline_dtype=dtype, params_dtype=dtype, use_cpu_initialization=True,
        sequence_parallel=getattr(cfg.parallel, "sequence_parallel", False),  # p2p shapes: seq_length / tp
        batch_p2p_comm=torch.cuda.is_available(),  # gloo: plain isend/irecv pairs
    )


class _Stage:
    """What megatron's schedules look up on a model (`config`, `model_type`, `set_input_tensor`)."""

    def __init__(self, module: Transformer, config):
        from megatron.core.enums import ModelType

        self.module, self.config, self.model_type = module, config, ModelType.encoder_or_decoder
        self.input_tensor = None

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, (list, tuple)) else tensors


# -- stepping ---------------------------------------------------------------------------------------
class StepRunner:
    def __init__(self, engine, objective, cfg):
        self.engine, self.objective, self.cfg = engine, objective, cfg
        self.module: Transformer = engine.module
        self.pp = cfg.parallel.pp
        self.dp_group = replica_group()  # dp x cp: loss sums and token counts over every rank of the replica set
        self.cp = parallel_state.get_context_parallel_world_size()
        self.is_last = self.pp == 1 or parallel_state.is_pipeline_last_stage()
        # megatron's sequence-parallel collectives allocate on torch.cuda.current_device(): on a CPU-only
        # torch, run forward and backward inside the compatibility layer (as the pipeline schedule does)
        self.sp_compat = sequence_parallel_compat if getattr(cfg.parallel, "sequence_parallel", False) else contextlib.nullcontext
        if self.pp > 1:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            if engine.zero_optimization_stage() > 1:
                raise ConfigError(f"parallel.zero_stage: ZeRO-{engine.zero_optimization_stage()} cannot be combined "
                                  "with pipeline parallelism; use zero_stage 0 or 1")
            gradients_from_outside(engine)  # megatron's schedule runs the backward, not engine.backward()
            self.pp_group = parallel_state.get_pipeline_model_parallel_group()
            self.last_rank = parallel_state.get_pipeline_model_parallel_last_rank()
            self.fb = get_forward_backward_func()
            self.stage = _Stage(self.module, schedule_config(cfg, next(self.module.parameters()).dtype))
            self.tied = cfg.model.tie_embeddings and parallel_state.is_rank_in_embedding_group()

    # -- train ------------------------------------------------------------------------------------
    def train_step(self, micro: list) -> tuple[dict, torch.Tensor | float | None]:
        """One optimizer step over `micro` (this data-parallel rank's micro-batches, in order).

        Returns (summed loss metrics of the micro-batches on the last stage, {} elsewhere; grad norm).
        The metrics stay device tensors and the norm is returned as the engine holds it: nothing here
        waits for the device (`reduce` brings the metrics to the host once per logged step)."""
        self.normalise(micro)
        if self.pp == 1:
            return self._train_step_engine(micro)
        return self._train_step_pipeline(micro)

    def normalise(self, micro: list) -> None:
        """Global token normalisation: set each micro-batch's `loss_scale` so that the gradient of the
        step is d(sum of CE over the global batch) / (predicted tokens of the global batch).

        The count is summed over this rank's micro-batches and all-reduced over the data-parallel group
        before any forward (it is known once the micro-batches are prepared). What the loss must be
        multiplied by to get there: DeepSpeed averages gradients over the `dp` data-parallel ranks, and
        at pp = 1 `engine.backward` divides each loss by `gradient_accumulation_steps` (= the number of
        micro-batches); at pp > 1 megatron's schedule divides each micro-batch's loss by the number of
        micro-batches and DeepSpeed (one "micro-batch" per step) does not. Either way: scale =
        dp * n_micro / global_count. Under context parallelism `dp` is the replica group's size, dp * cp
        (each CP rank's loss holds its own tokens' CE, and DeepSpeed averages over all dp * cp ranks), and
        at pp > 1 megatron's schedule also multiplies each loss by cp (its own CP convention), which the
        scale undoes. The count stays a device tensor (no host synchronisation)."""
        if not micro:
            return
        count = torch.stack([m.loss_weight.sum(dtype=torch.float64) for m in micro]).sum()
        dp = dist.get_world_size(group=self.dp_group)
        if dp > 1:
            dist.all_reduce(count, group=self.dp_group)
        n_micro = self.engine.gradient_accumulation_steps() if self.pp == 1 else len(micro)
        if self.pp == 1 and n_micro != len(micro):
            raise RuntimeError(f"train_step: {len(micro)} micro-batches for DeepSpeed's gradient_accumulation_steps "
                               f"= {n_micro}")
        scale = (dp * n_micro / count.clamp(min=1.0)).float()
        if self.pp > 1 and self.cp > 1:
            scale = scale / self.cp
        for m in micro:
            m.loss_scale = scale

    def _train_step_engine(self, micro):
        acc: dict = {}
        gnorm = None
        for i, inputs in enumerate(micro):
            with self.sp_compat():
                logits = self.engine(inputs.input_ids, inputs.position_ids, **inputs.model_kwargs())
                loss, m = self.objective.loss(logits, inputs)
                self.engine.backward(loss)
            if i == len(micro) - 1:
                gnorm = clip_gradients(self.engine, self.cfg.train.grad_clip)
            self.engine.step()
            add_metrics(acc, {"loss_sum": m["loss_sum"], "loss_count": m["loss_count"]})
        if gnorm is None:
            gnorm = self._engine_norm()
        return acc, gnorm

    def _train_step_pipeline(self, micro):
        for p in self.module.parameters():  # as engine.backward does at the start of a step
            p.grad = None
        out = self._schedule(micro, forward_only=False)
        self._sync_tied_embedding_grads()
        if self.engine.enable_backward_allreduce or self.engine.zero_optimization_stage() > 0:
            self.engine.allreduce_gradients()  # data-parallel reduction (ZeRO-0 all-reduce, ZeRO-1 reduce-scatter)
        gnorm = clip_gradients(self.engine, self.cfg.train.grad_clip)
        self.engine.step()
        if gnorm is None:
            gnorm = self._engine_norm()
        acc: dict = {}
        for m in out:
            add_metrics(acc, {"loss_sum": m["loss_sum"], "loss_count": m["loss_count"]})
        return acc, gnorm

    def _engine_norm(self):
        """DeepSpeed's norm of the step (ZeRO >= 1), as it holds it: not brought to the host here."""
        return self.engine.get_global_grad_norm()

    def _sync_tied_embedding_grads(self) -> None:
        """Sum the gradients of the tied embedding's copies (first and last stage), as Megatron-LM does."""
        p = self.module.embed.weight if self.tied else None
        if p is None or not p.requires_grad:  # frozen under LoRA: no gradient to sum
            return
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        dist.all_reduce(grad, group=parallel_state.get_embedding_group())

    # -- evaluate ---------------------------------------------------------------------------------
    @torch.no_grad()
    def eval_step(self, micro: list) -> dict:
        """Forward only over `micro`; summed objective metrics on the last stage, {} elsewhere."""
        acc: dict = {}
        if self.pp == 1:
            for inputs in micro:
                with self.sp_compat():
                    logits = self.module(inputs.input_ids, inputs.position_ids, **inputs.model_kwargs())
                    add_metrics(acc, self.objective.loss(logits, inputs)[1])
            return acc
        chunk = max(2 * self.pp, 1)  # a few micro-batches in flight keep every stage busy
        for i in range(0, len(micro), chunk):
            for m in self._schedule(micro[i:i + chunk], forward_only=True):
                add_metrics(acc, m)
        return acc

    # -- megatron schedule ------------------------------------------------------------------------
    def _schedule(self, micro: list, forward_only: bool) -> list[dict]:
        if not micro:
            return []
        B, T = micro[0].position_ids.shape
        self.stage.config.pipeline_dtype = next(self.module.parameters()).dtype
        with megatron_compat():  # megatron divides seq_length by its CP size for the p2p shapes: T is this rank's
            return self.fb(forward_step_func=self._forward_step, data_iterator=iter(micro), model=[self.stage],
                           num_microbatches=len(micro), seq_length=T * self.cp, micro_batch_size=B,
                           forward_only=forward_only)

    def _forward_step(self, data_iterator, stage: _Stage):
        inputs = next(data_iterator)
        mod = stage.module
        # Stage boundaries carry megatron's [sequence, batch, hidden] layout; the model works in [B, T, H].
        hidden = None if mod.pre_process else stage.input_tensor.transpose(0, 1)
        out = mod(inputs.input_ids if mod.pre_process else None, inputs.position_ids, hidden_states=hidden,
                  **inputs.model_kwargs())
        if not mod.post_process:
            return out.transpose(0, 1).contiguous(), None
        return out, functools.partial(self._loss, inputs)

    def _loss(self, inputs, logits):
        loss, m = self.objective.loss(logits, inputs)
        return loss, {k: v.detach() if torch.is_tensor(v) else v for k, v in m.items()}

    # -- metrics ----------------------------------------------------------------------------------
    def reduce(self, values: dict) -> dict:
        """Run-wide sums of per-rank metric sums: summed over the dp x cp replica group (a CP rank's sums
        are those of its own tokens; counts of whole rows come from CP rank 0 alone); under pipeline
        parallelism taken from the last stage (which alone computes the loss) and given to every
        rank, so rank 0 (a first stage) logs the right values. TP peers hold equal values: not summed."""
        if self.pp > 1:
            keys = [sorted(values) if self.is_last else None]
            dist.broadcast_object_list(keys, src=self.last_rank, group=self.pp_group)
            keys = keys[0]
        else:
            keys = sorted(values)
        if not keys:
            return {}
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        t = torch.stack([torch.as_tensor(values.get(k, 0.0) if self.is_last else 0.0, dtype=torch.float64,
                                         device=device) for k in keys])
        if dist.get_world_size(group=self.dp_group) > 1:
            dist.all_reduce(t, group=self.dp_group)
        if self.pp > 1:
            dist.all_reduce(t, group=self.pp_group)
        return dict(zip(keys, t.tolist()))  # the one host synchronisation of a logged step


def add_metrics(acc: dict, metrics: dict) -> None:
    """Accumulate summed metrics into `acc` where they are: a tensor stays on its device (summed in
    float64, as the host would), so accumulating a micro-batch never waits for the device."""
    for k, v in metrics.items():
        v = v.detach().to(torch.float64) if torch.is_tensor(v) else v
        acc[k] = acc[k] + v if k in acc else v


__all__ = ["StepRunner", "schedule_config", "add_metrics"]
