"""Per-block torch.compile of model.transformer.Transformer (`train.compile`), after activation
checkpointing, as torchtitan orders them.

`apply_compile` compiles each block separately (`Block.compile()`, torchtitan's per-block compile):
identical blocks share one graph, the graph stays small, and the embedding, the head and the
vocab-parallel loss stay eager. Masks are static tensors (or a `MaskSpec` constant for flex
attention), so one graph serves every step. The backend is checked once before compiling (a tiny
compiled function is run); where it cannot work (no C++ compiler for inductor on CPU, no Triton on
CUDA) the model stays eager and the returned message says why.

Flex attention in compiled blocks on the CPU is refused (`CpuFlexCompileError`, a ConfigError naming
the keys): inductor's CPU flex-attention kernel reads an operand that is a view into a larger tensor
from the start of that tensor, ignoring the view's offset (torch 2.11 and 2.13, CPU only). In a block
q and k are computed from the fused QKV projection and v is a view of it, so the logits come out wrong,
silently. docs/gpu.md records the reproduction. On CUDA the
compiled blocks run flex through Triton; tests/test_gpu_compile.py checks them against eager there.
"""

from __future__ import annotations

import torch

from common.schema import ConfigError


class CpuFlexCompileError(ConfigError):
    """train.compile with flex attention on the CPU: inductor computes it wrong there (module docstring)."""


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
    from .mcore import parallel_state  # megatron-core first through .mcore

    import megatron.core.utils as mutils  # noqa: I001

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
    if device.type == "cpu" and model.use_flex(device):
        raise CpuFlexCompileError(
            f"train.compile: true with model.attention_backend: {model.cfg.attention_backend} on the CPU gives wrong "
            "logits (inductor's CPU flex-attention kernel ignores a view's offset; docs/gpu.md); set train.compile: "
            "false or model.attention_backend: sdpa")
    why = compile_unavailable(device)
    if why:
        return f"train.compile: {why}; running the blocks eager"
    _trace_megatron_group_lookup()
    blocks = list(model.layers.values())
    for block in blocks:
        block.compile(dynamic=False)
    return f"torch.compile: {len(blocks)} blocks compiled separately (inductor on {device.type})"


__all__ = ["CpuFlexCompileError", "apply_compile", "compile_unavailable"]
