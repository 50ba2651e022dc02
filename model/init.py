"""Weight initialisation that scales: every rank initialises only its own shard, on its own device,
and the full weights are the same under any TP x PP layout.

Megatron's `use_cpu_initialization` draws each full weight on the host and keeps a slice, so a rank's
host memory holds whole matrices (the embedding of a 150k vocabulary, every layer's weights before
they move to the GPU). Here the layers are allocated without initialisation (megatron's
`perform_initialization=False`), on the device the model is built on (`torch.device(...)` context),
and `init_weights` fills them:

* A weight that tensor parallelism splits along dimension `d` (size N in full) is cut into
  `g = gcd(n_heads, n_kv_heads, ffn_hidden, vocab_pad_multiple)` equal units along `d`. Every valid TP
  size divides g (model.config validates tp against each of those), so a TP shard is a whole number
  of units. Unit u is drawn from its own CPU generator seeded by (base seed, parameter name, u) and
  copied into place: a rank draws only its own units, and the values of unit u do not depend on who
  draws it. Replicated weights are drawn as one unit.
* Names are global (`layers.7.attn.qkv.weight` on any pipeline split), and the last stage's copy of
  a tied embedding has the embedding's name, hence the same values.
* Normal(0, init_std) for the embedding, QKV, fc1 and the head; Normal(0, init_std / sqrt(2 n_layers))
  for the output projections (attn.proj, mlp.fc2); norm weights 1, biases 0.

The host never holds more than one unit (at most 1/g of one weight matrix) at a time.
"""

from __future__ import annotations

import math
import zlib

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

_OUT_PROJ = ("attn.proj.weight", "mlp.fc2.weight")


def units(cfg) -> int:
    """Units per split dimension: every valid tensor-parallel size divides this."""
    return math.gcd(math.gcd(cfg.n_heads, cfg.kv_heads), math.gcd(cfg.ffn_hidden, cfg.vocab_pad_multiple))


def mark_tensor_parallel(model: torch.nn.Module) -> None:
    """Set megatron's tensor-parallel attributes on the weights (its own initialisation does that, and
    it is skipped here): the embedding, column-parallel weights split on dim 0, row-parallel on dim 1."""
    for mod in model.modules():
        if isinstance(mod, (VocabParallelEmbedding, ColumnParallelLinear)) and mod.weight is not None:
            set_tensor_model_parallel_attributes(mod.weight, True, 0, 1)
        elif isinstance(mod, RowParallelLinear):
            set_tensor_model_parallel_attributes(mod.weight, True, 1, 1)


def _seed(base: int, name: str, unit: int) -> int:
    return (base * 1_000_003 + zlib.crc32(f"{name}#{unit}".encode())) % (2**63 - 1)


@torch.no_grad()
def init_weights(model: torch.nn.Module, cfg, base: int, tp: int = 1, tp_rank: int | None = None) -> None:
    """Fill every parameter of `model` (a stage of model.transformer.Transformer) in place."""
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    g = units(cfg)
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        if p.dim() < 2:
            if "norm" in name and name.endswith("weight"):
                p.fill_(1.0)
            else:
                p.zero_()
            continue
        std = out_std if name.endswith(_OUT_PROJ) else cfg.init_std
        split = getattr(p, "tensor_model_parallel", False)  # a TP-sharded weight (also at tp=1)
        dim = p.partition_dim if split else 0
        ranks, rank = (tp, tp_rank) if split else (1, 0)
        n_units = g if split else 1
        full = p.shape[dim] * ranks
        if full % n_units or n_units % ranks:
            raise ValueError(f"model init: {name} ({full} along dim {dim}) does not split into {n_units} units over tp={tp}")
        per_rank, width = n_units // ranks, full // n_units
        first = rank * per_rank
        shape = list(p.shape)
        shape[dim] = width
        for j in range(per_rank):
            gen = torch.Generator(device="cpu").manual_seed(_seed(base, name, first + j))
            block = torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen)
            p.narrow(dim, j * width, width).copy_(block)


__all__ = ["init_weights", "mark_tensor_parallel", "units"]
