"""Low-rank adapters (LoRA, Hu et al. 2021) on the block linears, tensor-parallel like the layer they adapt.

An adapted linear computes `W x + (alpha / r) B A x`: A [r, in], B [out, r]. The adapter is a child
module `lora` of the linear (`layers.3.attn.qkv.lora.A`, `.lora.B`), added to the linear's output by a
forward hook, so the base parameters keep their names and every path that reads them (checkpoints,
re-layout, the Hugging Face name map, `train.init_from`) is unchanged. The adapter's initial values
come from model/init.py like every other weight (A Gaussian with std 1/r, PEFT's "gaussian" init; B
zero, so an adapted model starts as its base) and do not depend on the layout.

Under tensor parallelism the adapter is split the way its linear is, with the communication of the
linear's own region (model/layers.py `TensorParallel`):

- column-parallel linear (output split; `qkv`, `fc1`): A replicated, B split on its output rows (the
  same rows as W, so B's shard matches W's). `h = A x` is the same on every rank; its gradient is the
  sum of every rank's `B_t^T dy_t`, so `h` passes `all_reduce_grad` (identity forward, sum backward),
  after which A's and x's gradients are complete and equal on every rank. Under sequence parallelism
  x is this rank's slice of the sequence: `h` is computed on the slice and gathered, with a
  reduce-scatter backward, and A (used on a slice) sums its gradient over the ranks.
- row-parallel linear (input split; `proj`, `fc2`): A split on its input columns (the columns of W
  this rank holds), B replicated. `A_t x_t` is this rank's part of `h`, summed over the ranks
  (`reduce`), and B gets the whole `h` on every rank. Under sequence parallelism the sum is a
  reduce-scatter along the sequence, as the linear's own output, and B (used on a slice) sums its
  gradient over the ranks.

So A's and B's full (TP=1) tensors are the concatenation of their shards along `partition_dim`, as
every other weight's (checkpoints and consolidation need nothing new). `merge` folds trained adapters
into the base weights (W + (alpha / r) B A) for inference and export.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .layers import TensorParallel, mark_split

__all__ = ["TARGETS", "LoRAAdapter", "attach", "attach_block", "block_adapter_params", "adapter_count", "is_adapter", "adapted",
           "freeze_base", "merge", "rank_limit", "scale"]

# target name -> (module path inside a block, kind of the linear)
TARGETS = {"qkv": ("attn.qkv", "column"), "proj": ("attn.proj", "row"), "fc1": ("mlp.fc1", "column"),
           "fc2": ("mlp.fc2", "row")}
SUFFIXES = (".lora.A", ".lora.B")


def is_adapter(name: str) -> bool:
    """Whether parameter `name` is an adapter's A or B."""
    return name.endswith(SUFFIXES)


def scale(rank: int, alpha: float) -> float:
    return float(alpha) / int(rank)


class LoRAAdapter(torch.nn.Module):
    """The adapter of one linear (`kind`: "column" or "row"), this rank's shard of it."""

    def __init__(self, kind: str, in_features: int, out_features: int, *, rank: int, alpha: float,
                 dropout: float, tp: TensorParallel, dtype: torch.dtype = torch.float32):
        super().__init__()
        if kind not in ("column", "row"):
            raise ValueError(f"LoRAAdapter: kind must be 'column' or 'row', got {kind!r}")
        self.kind, self.rank, self.scaling, self.tp = kind, rank, scale(rank, alpha), tp
        a_in = in_features // tp.size if kind == "row" else in_features
        b_out = out_features // tp.size if kind == "column" else out_features
        self.A = torch.nn.Parameter(torch.empty(rank, a_in, dtype=dtype))
        self.B = torch.nn.Parameter(torch.empty(b_out, rank, dtype=dtype))
        mark_split(self.B if kind == "column" else self.A, 0 if kind == "column" else 1)
        self.drop = torch.nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's term of the linear's output, for the linear's input `x`."""
        tp, sp = self.tp, self.tp.sequence_parallel
        x = self.drop(x)
        if self.kind == "column":
            if sp:  # x: this rank's slice of the sequence [T/tp, B, in]
                h = tp.gather_sequence(F.linear(x, tp.all_reduce_grad(self.A)), reduce_grad=True)
            else:
                h = tp.all_reduce_grad(F.linear(x, self.A))
            return F.linear(h * self.scaling, self.B)
        h = F.linear(x, self.A)  # this rank's part of A x (x: its slice of the input features)
        if sp:
            return F.linear(tp.reduce_scatter_sequence(h) * self.scaling, tp.all_reduce_grad(self.B))
        return F.linear(tp.reduce(h) * self.scaling, self.B)


def _add_adapter(module, args, output):
    """Forward hook of an adapted linear: its `(output, bias)` with the adapter's term added."""
    out, bias = output
    return out + module.lora(args[0]).to(out.dtype), bias


def attach_block(block: torch.nn.Module, tp: TensorParallel, *, rank: int, alpha: float, dropout: float = 0.0,
                 targets=tuple(TARGETS)) -> None:
    """Give the linears `targets` of one block an adapter (see `attach`)."""
    for target in targets:
        path, kind = TARGETS[target]
        linear = block.get_submodule(path)
        if hasattr(linear, "lora"):
            raise RuntimeError(f"LoRA: {path} of layer {block.attn.layer_id} already has an adapter")
        weight = linear.weight
        shape = tuple(getattr(weight, "ds_shape", weight.shape))  # a ZeRO-3 parameter's data is empty
        out_f, in_f = (shape[0] * tp.size, shape[1]) if kind == "column" else (shape[0], shape[1] * tp.size)
        linear.add_module("lora", LoRAAdapter(kind, in_f, out_f, rank=rank, alpha=alpha, dropout=dropout, tp=tp,
                                              dtype=weight.dtype))
        linear.register_forward_hook(_add_adapter)


def attach(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float = 0.0, targets=tuple(TARGETS)) -> None:
    """Give the linears `targets` of every block of `model` (a Transformer stage) an adapter, allocated
    where and as the model's parameters are (surrounding `torch.device` / ZeRO-3 context) and left
    uninitialised (the model's `init_weights` draws them)."""
    for block in model.layers.values():
        attach_block(block, model.tp, rank=rank, alpha=alpha, dropout=dropout, targets=targets)


def block_adapter_params(cfg, *, rank: int, targets=tuple(TARGETS)) -> dict:
    """Name (inside a block: `attn.qkv.lora.A`, ...) -> ParamShape of one block's adapters at TP=1
    (model/shapes.py's convention: read from a block built on the meta device)."""
    from .shapes import ParamShape
    from .transformer import Block

    tp = TensorParallel()
    with torch.device("meta"):
        block = Block(cfg, tp, 0)
        attach_block(block, tp, rank=rank, alpha=1.0, targets=targets)
    return {n: ParamShape(tuple(p.shape), bool(getattr(p, "tensor_model_parallel", False)))
            for n, p in block.named_parameters() if is_adapter(n)}


def rank_limit(cfg, targets=tuple(TARGETS)) -> tuple[int, str, tuple[int, int]]:
    """(the largest adapter rank the linears `targets` can use, the narrowest one's target name, its
    (in, out) features at TP=1): a rank above a linear's narrower side adds parameters, not capacity
    (B A has rank at most min(in, out))."""
    from .shapes import block_params

    params = block_params(cfg)
    sides = {t: params[f"{TARGETS[t][0]}.weight"].shape[::-1] for t in targets}  # (in, out) of W [out, in]
    name = min(sides, key=lambda t: min(sides[t]))
    return min(sides[name]), name, tuple(sides[name])


def adapter_count(cfg, *, rank: int, targets=tuple(TARGETS)) -> int:
    """Adapter parameters of the whole model (every block, TP=1)."""
    return cfg.n_layers * sum(s.numel for s in block_adapter_params(cfg, rank=rank, targets=targets).values())


def adapted(model: torch.nn.Module) -> bool:
    return any(is_adapter(n) for n, _ in model.named_parameters())


def freeze_base(model: torch.nn.Module) -> tuple[int, int]:
    """Only the adapters train: every other parameter gets requires_grad=False. Returns (trainable,
    frozen) parameter counts of this rank's shard."""
    trainable = frozen = 0
    for name, p in model.named_parameters():
        n = int(getattr(p, "ds_numel", p.numel()))
        if is_adapter(name):
            trainable += n
        else:
            p.requires_grad_(False)
            frozen += n
    return trainable, frozen


@torch.no_grad()
def merge(weights: dict, *, rank: int, alpha: float) -> dict:
    """Full (TP=1) weights holding adapters -> the same model without them: W += (alpha / r) B A for
    every adapted linear (computed in float32, stored in W's dtype)."""
    s = scale(rank, alpha)
    out = {k: v for k, v in weights.items() if not is_adapter(k)}
    for name in [k for k in weights if k.endswith(".lora.A")]:
        module = name[: -len(".lora.A")]
        a, b = weights[name].float(), weights[f"{module}.lora.B"].float()
        w = out[f"{module}.weight"]
        out[f"{module}.weight"] = (w.float() + s * (b @ a)).to(w.dtype)
    return out
