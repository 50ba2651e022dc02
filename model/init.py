"""Weight initialisation that does not depend on the layout: the same seed gives the same full weights
under any tensor-parallel x pipeline split, and a rank draws only what it holds.

* A weight that tensor parallelism splits along dimension `d` (size N in full) is cut into
  `g = gcd(n_heads, n_kv_heads, ffn_hidden, vocab_pad_multiple)` equal units along `d` (`units`).
  Every valid TP size divides g (model.config validates tp against each of those), so a TP shard is a
  whole number of units. Unit u is drawn from its own CPU generator seeded by (base seed, parameter
  name, u) (`draw`): its values do not depend on who draws it. Replicated weights are one unit.
* Names are global (`layers.7.attn.qkv.weight` on any pipeline split), and the last stage's copy of
  a tied embedding has the embedding's name, hence the same values.
* Normal(0, init_std) for the embedding, QKV, fc1 and the head; Normal(0, init_std / sqrt(2 n_layers))
  for the output projections (attn.proj, mlp.fc2); norm weights 1, biases 0. LoRA adapters
  (model/lora.py): A ~ Normal(0, 1 / rank), B = 0, so an adapted model starts as its base.

`shard_init` says which units of a named parameter one TP rank holds and how they are drawn
(`ShardInit`); `fill` writes them into the rank's tensor one unit at a time, so the host never holds
more than one unit (at most 1/g of one weight matrix). `init_weights` does that for every parameter of
a model; a caller whose parameters are stored otherwise passes its own `shape` and `fill`
(pretrain/zero3.py fills data-parallel partitions of the same values).
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import torch

from common.schema import ConfigError

_OUT_PROJ = ("attn.proj.weight", "mlp.fc2.weight")


def units(cfg) -> int:
    """Units per split dimension: every valid tensor-parallel size divides this."""
    return math.gcd(math.gcd(cfg.n_heads, cfg.kv_heads), math.gcd(cfg.ffn_hidden, cfg.vocab_pad_multiple))


def _seed(base: int, name: str, unit: int) -> int:
    return (base * 1_000_003 + zlib.crc32(f"{name}#{unit}".encode())) % (2**63 - 1)


def draw(base: int, name: str, unit: int, shape, std: float) -> torch.Tensor:
    """Unit `unit` of parameter `name` (fp32, on the CPU): the same values whoever draws it."""
    gen = torch.Generator(device="cpu").manual_seed(_seed(base, name, unit))
    return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen)


@dataclasses.dataclass(frozen=True)
class ShardInit:
    """The values of one tensor-parallel shard (of `shape`) of parameter `name`: `constant` for a
    vector; else its units `units`, each `width` long along `dim`, in order."""

    name: str
    shape: tuple
    constant: float | None = None
    dim: int = 0
    width: int = 0
    units: range = range(0)
    std: float = 0.0
    base: int = 0

    def draw(self, unit: int) -> torch.Tensor:
        shape = list(self.shape)
        shape[self.dim] = self.width
        return draw(self.base, self.name, unit, shape, self.std)


def shard_init(name: str, shape, split_dim: int | None, cfg, base: int, tp: int = 1, tp_rank: int = 0) -> ShardInit:
    """How TP rank `tp_rank` of `tp` initialises its shard (of `shape`) of parameter `name`;
    `split_dim` is the dimension tensor parallelism splits (None: replicated)."""
    shape = tuple(shape)
    if len(shape) < 2 or name.endswith(".lora.B"):
        return ShardInit(name, shape, constant=1.0 if "norm" in name and name.endswith("weight") else 0.0)
    if name.endswith(".lora.A"):
        std = 1.0 / shape[0]  # A [rank, in]: PEFT's gaussian init
    else:
        std = cfg.init_std / math.sqrt(2 * cfg.n_layers) if name.endswith(_OUT_PROJ) else cfg.init_std
    dim = split_dim if split_dim is not None else 0
    ranks, rank = (tp, tp_rank) if split_dim is not None else (1, 0)
    n_units = units(cfg) if split_dim is not None else 1
    full = shape[dim] * ranks
    if full % n_units or n_units % ranks:
        raise ConfigError(f"model init: {name} ({full} along dim {dim}) does not split into {n_units} units over tp={tp}")
    per_rank = n_units // ranks
    return ShardInit(name, shape, dim=dim, width=full // n_units, units=range(rank * per_rank, (rank + 1) * per_rank),
                     std=std, base=base)


def fill(p: torch.Tensor, init: ShardInit) -> None:
    """Write `init`'s values into the tensor `p` (this rank's shard), one unit at a time."""
    if init.constant is not None:
        p.fill_(init.constant)
        return
    for j, u in enumerate(init.units):
        p.narrow(init.dim, j * init.width, init.width).copy_(init.draw(u))


def split_dim(p: torch.Tensor) -> int | None:
    """The dimension tensor parallelism splits `p` along (layout attributes, model/layers.py)."""
    return p.partition_dim if getattr(p, "tensor_model_parallel", False) else None


@torch.no_grad()
def init_weights(model: torch.nn.Module, cfg, base: int, tp: int = 1, tp_rank: int = 0, *,
                 shape=lambda p: p.shape, fill=fill) -> None:
    """Fill every parameter of `model` (a stage of model.transformer.Transformer) in place: `fill(p,
    init)` with the `ShardInit` of its shard, whose shape is `shape(p)`."""
    for name, p in model.named_parameters():
        fill(p, shard_init(name, shape(p), split_dim(p), cfg, base, tp, tp_rank))


__all__ = ["ShardInit", "draw", "fill", "init_weights", "shard_init", "split_dim", "units"]
