"""The parameters of `model.transformer.Transformer`, read from the module itself.

One block is built on the `meta` device (no memory, no initialisation, well under a millisecond) and
its parameters give every per-layer tensor's name, shape and tensor-parallel split; the embedding,
the final norm (a norm of the block's kind) and the head complete the model. The parameter count
(`parameter_count`), the memory plan (pretrain/plan.py), the FLOP count (pretrain/flops.py) and the
Hugging Face name map (model/convert/hf_map.py) all read them, so a change to the block shows up in
each without a formula to keep in step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["ParamShape", "block_params", "model_params", "parameter_count", "matmul_params_per_layer"]


@dataclass(frozen=True)
class ParamShape:
    shape: tuple[int, ...]
    sharded: bool  # split over the tensor-parallel ranks (else every TP rank holds it in full)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def block_params(cfg) -> dict[str, ParamShape]:
    """Name (inside a block: `attn.qkv.weight`, ...) -> shape of one block's parameters at TP=1."""
    from .layers import TensorParallel
    from .transformer import Block

    with torch.device("meta"):
        block = Block(cfg, TensorParallel(), 0)
    return {n: ParamShape(tuple(p.shape), bool(getattr(p, "tensor_model_parallel", False)))
            for n, p in block.named_parameters()}


def model_params(cfg, layers: range | None = None, *, pre_process: bool = True,
                 post_process: bool = True) -> dict[str, ParamShape]:
    """Name -> shape of every parameter of `Transformer(cfg, pre_process=..., post_process=...,
    layers=...)` at TP=1 (the whole model by default), in its state dict's names and order. A last
    stage without the input embedding holds its copy when the embeddings are tied (`embed.weight`)."""
    V, h = cfg.padded_vocab_size, cfg.hidden
    block = block_params(cfg)
    out: dict[str, ParamShape] = {}
    if pre_process or (post_process and cfg.tie_embeddings):
        out["embed.weight"] = ParamShape((V, h), True)
    for i in range(cfg.n_layers) if layers is None else layers:
        out.update({f"layers.{i}.{n}": s for n, s in block.items()})
    if post_process:
        out.update({f"final_norm.{n.split('.', 1)[1]}": s for n, s in block.items() if n.startswith("norm1.")})
        if not cfg.tie_embeddings:
            out["head.weight"] = ParamShape((V, h), True)
            if cfg.head_bias:
                out["head.bias"] = ParamShape((V,), True)
    return out


def parameter_count(cfg, embeddings: bool = True) -> int:
    """Parameters of the whole model (every stage, TP=1): exactly what `Transformer(cfg)` holds.
    `embeddings=False` leaves out the embedding and the head."""
    return sum(s.numel for n, s in model_params(cfg).items()
               if embeddings or not n.startswith(("embed.", "head.")))


def matmul_params_per_layer(cfg) -> int:
    """Weights of one block's matrix products (its 2-D parameters: QKV, output projection, MLP)."""
    return sum(s.numel for s in block_params(cfg).values() if len(s.shape) == 2)
