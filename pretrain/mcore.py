"""megatron-core, imported for the whole package through this module.

When `megatron.core` is first imported it wraps about two dozen fused elementwise functions
(`megatron.core.fusions`, activations, MoE routing; `megatron.core.jit.jit_fuser`) in
`torch.compile`. The stack calls none of them: from megatron-core it takes `parallel_state`, the
tensor-parallel linears, embedding, mappings, vocab-parallel cross entropy and RNG tracker, and the
pipeline schedules, none of which go through `jit_fuser`. Those wrappers alone cost every process
that imports megatron-core 1-1.7 s on a CPU (they import dynamo and inductor, and build their
configs), which every rank of every run and every `setdlm` command pays at start-up.

So the first import happens here, with `torch.compile` replaced by the identity decorator for the
duration of that import only: the fused functions stay plain Python functions, and `torch.compile`
is restored before anything else runs (`train.compile` and the decoders compile as always). An
import of megatron-core elsewhere after this one changes nothing; one before it only costs the time.
Measured on the 2-core CPU machine (2026-12-05): `import megatron.core` 4.25 s -> 2.6 s; a tiny
`setdlm pretrain` run 5.9 s -> 4.8 s (docs/testing.md).

The same import also imports `wandb` (megatron-core's dynamic inference context and engine try it at
module level, to log inference metrics the stack never asks for): about 0.65 CPU s per process. So for
that import only, `wandb` reads as absent (those two modules then set their `HAVE_WANDB = False`); it is
restored at once, and the stack's logger (pretrain/logger.py) imports the real `wandb` when a run logs
to it. Where `wandb` was imported before, nothing changes.
"""

from __future__ import annotations

import sys

import torch


def _identity(model=None, **_options):
    """`torch.compile` as a no-op: `@torch.compile`, `torch.compile(fn, ...)` and `@torch.compile(...)`."""
    return model if model is not None else (lambda fn: fn)


if "megatron.core" not in sys.modules:
    _compile, _hide_wandb = torch.compile, "wandb" not in sys.modules
    torch.compile = _identity
    if _hide_wandb:
        sys.modules["wandb"] = None  # `import wandb` raises ImportError while megatron-core is imported
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = _compile
        if _hide_wandb and sys.modules.get("wandb", 0) is None:
            del sys.modules["wandb"]

from megatron.core import parallel_state, tensor_parallel  # noqa: E402

__all__ = ["parallel_state", "tensor_parallel"]
