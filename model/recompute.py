"""Activation checkpointing and per-block torch.compile for model.transformer.Transformer.

    apply_activation_checkpointing(model, "full" | "selective" | "none")
    apply_compile(model)              # after checkpointing, as torchtitan orders them

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

`apply_compile` compiles each block separately (`Block.compile()`, torchtitan's per-block compile):
identical blocks share one graph, the graph stays small, and the embedding, the head and the
vocab-parallel loss stay eager. Masks are static tensors (or a `MaskSpec` constant for flex
attention), so one graph serves every step. The backend is checked once before compiling (a tiny
compiled function is run); where it cannot work (no C++ compiler for inductor on CPU, no Triton on
CUDA) the model stays eager and the returned message says why.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils.checkpoint import checkpoint

from .kv_cache import KVCache

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
        raise ValueError(f"train.activation_checkpointing: unknown mode {mode!r}; valid: {', '.join(MODES)}")
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


# -- compile ----------------------------------------------------------------------------------------
def compile_unavailable(device: torch.device) -> str | None:
    """Why torch.compile (inductor) cannot run on `device` here, or None when a probe compiles."""
    import shutil

    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton
        except ImportError:  # pragma: no cover - old torch
            has_triton = lambda: False  # noqa: E731
        if not has_triton():
            return "inductor on CUDA needs Triton (pip install triton)"
    elif not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "inductor on CPU needs a C++ compiler (g++ or clang++ on PATH)"
    try:
        probe = torch.compile(lambda x: torch.nn.functional.gelu(x) * 2 + 1, dynamic=False)
        probe(torch.ones(4, device=device))
    except Exception as e:  # noqa: BLE001 - any backend failure: report it and stay eager
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"inductor failed on a probe ({type(e).__name__}: {first[:200]})"
    return None


_POLYFILLED = False


def _trace_megatron_group_lookup() -> None:
    """megatron's row-parallel forward looks its TP group up through a helper that warns on rank 0
    (`tp_group is None`), and Dynamo cannot trace `warnings.warn`: without this, every row-parallel
    linear splits a block's graph in two. Give Dynamo the same lookup without the warning (eager
    execution keeps megatron's own function)."""
    global _POLYFILLED
    if _POLYFILLED:
        return
    import megatron.core.utils as mutils
    from megatron.core import parallel_state

    @torch._dynamo.substitute_in_graph(mutils.get_tensor_model_parallel_group_if_none, skip_signature_check=True)
    def _tp_group(tp_group, is_expert=False, check_initialized=True):
        if tp_group is not None:
            return tp_group
        if is_expert:
            return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
        return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)

    _POLYFILLED = True


def apply_compile(model: torch.nn.Module, device: torch.device | None = None) -> str:
    """Compile every block of `model` in place (after activation checkpointing). Returns a log line:
    what was compiled, or why the model stays eager."""
    device = device or next(model.parameters()).device
    why = compile_unavailable(device)
    if why:
        return f"train.compile: {why}; running the blocks eager"
    _trace_megatron_group_lookup()
    blocks = list(model.layers.values())
    for block in blocks:
        block.compile(dynamic=False)
    return f"torch.compile: {len(blocks)} blocks compiled separately (inductor on {device.type})"


def apply_training_features(model: torch.nn.Module, activation_checkpointing: str = "none",
                            compile: bool = False) -> list[str]:
    """Checkpointing then compile (torchtitan's order); returns the log lines."""
    notes = []
    note = apply_activation_checkpointing(model, activation_checkpointing)
    if note:
        notes.append(note)
    if compile:
        notes.append(apply_compile(model))
    return notes


__all__ = ["MODES", "apply_activation_checkpointing", "apply_compile", "apply_training_features", "compile_unavailable"]
