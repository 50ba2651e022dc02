"""FP8 training with Transformer Engine on Hopper-class GPUs (H100/H200): `model.fp8: hybrid | e4m3`.

With FP8 on (pretrain/parallelize.py, after the model is built), the linears of every block become
Transformer Engine `Linear` layers (column / row parallel over megatron's TP group) and the blocks run
under `fp8_autocast` (the model's `block_context`) with a
delayed-scaling recipe whose amax is reduced over megatron's amax-reduction group. Embeddings, norms,
attention and the output head stay in bf16, as in Megatron-LM's FP8 recipes. The TE layers take the
weights the model was initialised with (model/init.py), and parameter names and shapes are the same,
so checkpoints move freely between FP8 and bf16 runs.

Transformer Engine cannot be installed on a CPU machine (it needs CUDA headers); it ships in the NGC
PyTorch image (see the Dockerfile). Where it or an FP8-capable GPU is missing, `check_available`
raises before any work starts. Not run in this project's CI: only the error paths are tested here.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from common.schema import ConfigError

FP8_MODES = ("none", "hybrid", "e4m3")


def check_available(mode: str) -> None:
    """Raise a clear error unless FP8 can run here (CUDA GPU with compute capability >= 8.9 and TE)."""
    if mode == "none":
        return
    if mode not in FP8_MODES:
        raise ConfigError(f"model.fp8: unknown mode {mode!r}; valid: {', '.join(FP8_MODES)}")
    if not torch.cuda.is_available():
        raise ConfigError(f"model.fp8={mode}: FP8 needs a CUDA GPU with FP8 tensor cores (H100/H200 or newer); "
                           "no CUDA device is visible. Use model.fp8=none here.")
    cap = torch.cuda.get_device_capability()
    if cap < (8, 9):
        raise ConfigError(f"model.fp8={mode}: {torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]}) "
                           "has no FP8 tensor cores; FP8 needs 8.9 (Ada) or 9.0 (Hopper) and newer")
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"model.fp8={mode}: Transformer Engine is not installed ({e}); it ships in the NGC "
                           "PyTorch image this project's Dockerfile builds on") from None


class TELinear(torch.nn.Module):
    """A Transformer Engine Linear with the model's `(output, bias)` interface and layout attributes.

    Built from an already initialised linear of the model (column or row parallel) so the weights are
    identical to the non-FP8 model's."""

    def __init__(self, linear: torch.nn.Module, parallel_mode: str):
        super().__init__()
        import transformer_engine.pytorch as te
        from .mcore import parallel_state

        w = linear.weight
        tp = parallel_state.get_tensor_model_parallel_world_size()
        has_bias = getattr(linear, "bias", None) is not None
        out_local, in_local = w.shape
        in_features = in_local * (tp if parallel_mode == "row" else 1)
        out_features = out_local * (tp if parallel_mode == "column" else 1)
        self.linear = te.Linear(in_features, out_features, bias=has_bias, parallel_mode=parallel_mode,
                                tp_group=parallel_state.get_tensor_model_parallel_group(), tp_size=tp,
                                params_dtype=w.dtype, device="cuda")
        with torch.no_grad():
            self.linear.weight.copy_(w)
            if has_bias:
                self.linear.bias.copy_(linear.bias)
        dim = 0 if parallel_mode == "column" else 1
        for name, p in self.linear.named_parameters():
            parallel = name == "weight" or parallel_mode == "column"
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = parallel, (dim if parallel else -1), 1

    @property
    def weight(self):
        return self.linear.weight

    @property
    def bias(self):
        return getattr(self.linear, "bias", None)

    def forward(self, x):
        return self.linear(x), None

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Same keys as the layer it replaces (weight, bias): FP8 and bf16 checkpoints interchange.
        for name, p in self.linear.named_parameters():
            destination[prefix + name] = p if keep_vars else p.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
        for name, p in self.linear.named_parameters():
            key = prefix + name
            if key in state_dict:
                with torch.no_grad():
                    p.copy_(state_dict[key])
            elif strict:
                missing_keys.append(key)


_BLOCK_LINEARS = {"qkv": "column", "fc1": "column", "proj": "row", "fc2": "row"}


def apply_fp8(model: torch.nn.Module, mode: str) -> None:
    """Replace the attention and MLP linears of every block with TE layers and run the blocks under
    `fp8_autocast` (call on a CUDA model; mode "none" leaves it as it is)."""
    if mode == "none":
        return
    for block in model.layers.values():
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if name in _BLOCK_LINEARS:
                    setattr(parent, name, TELinear(child, _BLOCK_LINEARS[name]))
    model.block_context = functools.partial(autocast, mode)


def autocast(mode: str):
    """`fp8_autocast` with a delayed-scaling recipe, or a no-op context for mode "none"."""
    if mode == "none":
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    from .mcore import parallel_state
    from transformer_engine.common import recipe

    fmt = recipe.Format.HYBRID if mode == "hybrid" else recipe.Format.E4M3
    fp8_recipe = recipe.DelayedScaling(fp8_format=fmt, amax_history_len=1024, amax_compute_algo="max")
    return te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe, fp8_group=parallel_state.get_amax_reduction_group())
