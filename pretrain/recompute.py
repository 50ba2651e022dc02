"""Activation checkpointing for model.transformer.Transformer: `apply_activation_checkpointing(model,
"full" | "selective" | "none")`, applied before per-block compile (pretrain/parallelize.py).

Modes (`train.activation_checkpointing`):

* `none`: autograd keeps every tensor the backward needs.
* `selective` (Megatron-LM's "selective recomputation", extended to the MLP activation): inside each
  block the attention core (scores, mask, softmax, weighted sum) and the MLP activation function
  (GELU, or SwiGLU's silu(gate) * up) are recomputed in the backward; every linear layer's input
  stays saved, so no matmul of a linear layer is recomputed. For SwiGLU it saves one ffn-wide
  tensor per token. Flash-style kernels (flex / flash on CUDA, and torch's CPU SDPA) keep only O(T)
  state besides q, k, v and the output, so the attention part saves little there (softmax statistics;
  on CPU a float copy of the mask); it saves the T x T probabilities where a kernel keeps them
  (SDPA's math fallback, e.g. with attention dropout).
* `full`: every block is recomputed: only each block's input is kept (plus one block's working
  set during its backward), at the cost of one more forward of the blocks.

Recomputation uses `torch.utils.checkpoint` (non-reentrant), which saves and restores the CPU and
CUDA RNG states around the recomputed region, so dropout masks are redrawn identically; when
megatron's tensor-parallel RNG tracker is in use (dropout under sequence parallelism), its states are
saved at the forward and restored for the recomputation as megatron's own `checkpoint` does. Collectives
inside a recomputed block (tensor-parallel all-reduces) run again on every TP rank alike. Nothing is
recomputed outside autograd (evaluation, decoding with a KV cache): the wrapped functions check.

Parameter names do not change (the block's forward is wrapped in place, not the module), so
checkpoints, ZeRO partitioning, EMA and the pipeline split see the same model.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from common.schema import ConfigError
from model.kv_cache import KVCache

MODES = ("none", "selective", "full")


def _tracker_states():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    if not tracker.is_initialized():
        return None
    return tracker


def _rng_context_fn():
    """(forward context, recompute context) that save megatron's tracker states at the forward and
    replay them during the recomputation (torch.utils.checkpoint handles the global RNG itself)."""
    tracker = _tracker_states()
    if tracker is None:
        return contextlib.nullcontext(), contextlib.nullcontext()
    saved = tracker.get_states()

    @contextlib.contextmanager
    def replay():
        current = tracker.get_states()
        tracker.set_states(saved)
        try:
            yield
        finally:
            tracker.set_states(current)

    return contextlib.nullcontext(), replay()


def _recomputed(fn):
    """`fn` recomputed in the backward (non-reentrant checkpoint) when autograd records it."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not torch.is_grad_enabled() or any(isinstance(a, KVCache) for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)
        context_fn = _rng_context_fn if _tracker_states() is not None else None
        extra = {"context_fn": context_fn} if context_fn is not None else {}
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs)

    wrapper.recomputed = True
    return wrapper


def _wrap(module: torch.nn.Module, name: str) -> None:
    fn = getattr(module, name)
    if getattr(fn, "recomputed", False):
        return
    setattr(module, name, _recomputed(fn))  # an instance attribute: shadows the class method


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> str | None:
    """Wrap the blocks of `model` for recomputation; returns a log line (None for `none`)."""
    if mode not in MODES:
        raise ConfigError(f"train.activation_checkpointing: unknown mode {mode!r}; valid: {', '.join(MODES)}")
    if mode == "none":
        return None
    blocks = list(model.layers.values())
    for block in blocks:
        if mode == "full":
            _wrap(block, "forward")
        else:
            _wrap(block.attn, "core")
            _wrap(block.mlp, "activation")
    what = "every block" if mode == "full" else "attention core + MLP activation of every block"
    return f"activation checkpointing: {mode} ({what} recomputed in the backward, {len(blocks)} blocks on this rank)"


__all__ = ["MODES", "apply_activation_checkpointing"]
