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

Under ZeRO-3 the model is built inside `deepspeed.zero.Init` (pretrain/engine.py `zero3_init`), so each
parameter is already partitioned when `init_weights` runs: this rank owns one flat slice
`[r * n, (r + 1) * n)` of the flattened parameter (`p.ds_tensor`, n = ceil(numel / dp)). Each rank
then draws only the units that overlap its slice (from the same per-unit generators) and writes the
overlap into its slice: no collective, no full parameter anywhere, and the values are those of the
unpartitioned model bit for bit (also in bf16: one rounding of the same fp32 draw). A weight split
along dim 0 (embedding, QKV, fc1, head) overlaps about 1/dp of its units; one split along dim 1
(attn.proj, mlp.fc2) overlaps all of them, as each unit spans every row.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.distributed as dist
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


def is_partitioned(p: torch.Tensor) -> bool:
    """A ZeRO-3 parameter built under deepspeed.zero.Init: `p.data` is empty, `p.ds_tensor` is this
    rank's flat slice."""
    return getattr(p, "ds_tensor", None) is not None


def _draw(base: int, name: str, unit: int, shape, std: float) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(_seed(base, name, unit))
    return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=gen)


def _slice(p: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of the flattened parameter that this rank's ZeRO-3 partition holds."""
    n = p.ds_tensor.ds_numel if hasattr(p.ds_tensor, "ds_numel") else p.ds_tensor.numel()
    start = n * dist.get_rank(group=p.ds_process_group)
    return start, min(start + n, p.ds_numel)


def _fill_vector(p: torch.Tensor, value: float) -> None:
    if not is_partitioned(p):
        p.fill_(value)
        return
    start, stop = _slice(p)
    p.ds_tensor.zero_()  # the padding past the end of the parameter stays zero
    p.ds_tensor[:max(stop - start, 0)].fill_(value)


def _fill_partition(p: torch.Tensor, shape: list, dim: int, width: int, units: range, draw) -> None:
    """Write this rank's ZeRO-3 slice of the (TP-local) weight of `shape` whose units `units` lie along
    `dim`, `width` each: the slice covers rows [r0, r1) of dim 0; a band of those rows is assembled
    on the partition's device from the overlapping part of each unit, then its slice is copied."""
    flat = p.ds_tensor
    start, stop = _slice(p)
    flat.zero_()
    if stop <= start:
        return
    row = math.prod(shape[1:])
    r0, r1 = start // row, -(-stop // row)
    band = torch.empty([r1 - r0, *shape[1:]], dtype=flat.dtype, device=flat.device)
    for j, u in enumerate(units):
        if dim == 0:  # unit j holds rows [j * width, (j + 1) * width)
            a, b = max(r0, j * width), min(r1, (j + 1) * width)
            if a >= b:
                continue  # no overlap: this unit is never drawn here
            band[a - r0:b - r0].copy_(draw(u).narrow(0, a - j * width, b - a))
        else:  # every unit spans all rows: its rows [r0, r1) go to its columns of the band
            band.narrow(dim, j * width, width).copy_(draw(u).narrow(0, r0, r1 - r0))
    flat[:stop - start].copy_(band.reshape(-1)[start - r0 * row:stop - r0 * row])


@torch.no_grad()
def init_weights(model: torch.nn.Module, cfg, base: int, tp: int = 1, tp_rank: int | None = None) -> None:
    """Fill every parameter of `model` (a stage of model.transformer.Transformer) in place: the local
    tensor, or under ZeRO-3 (built in deepspeed.zero.Init) this rank's partition of it."""
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank() if tp > 1 else 0
    g = units(cfg)
    out_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        local_shape = list(p.ds_shape) if is_partitioned(p) else list(p.shape)
        if len(local_shape) < 2:
            _fill_vector(p, 1.0 if "norm" in name and name.endswith("weight") else 0.0)
            continue
        std = out_std if name.endswith(_OUT_PROJ) else cfg.init_std
        split = getattr(p, "tensor_model_parallel", False)  # a TP-sharded weight (also at tp=1)
        dim = p.partition_dim if split else 0
        ranks, rank = (tp, tp_rank) if split else (1, 0)
        n_units = g if split else 1
        full = local_shape[dim] * ranks
        if full % n_units or n_units % ranks:
            raise ValueError(f"model init: {name} ({full} along dim {dim}) does not split into {n_units} units over tp={tp}")
        per_rank, width = n_units // ranks, full // n_units
        first = rank * per_rank
        shape = list(local_shape)
        shape[dim] = width
        mine = range(first, first + per_rank)
        if is_partitioned(p):
            _fill_partition(p, local_shape, dim, width, mine,
                            lambda u, name=name, shape=shape, std=std: _draw(base, name, u, shape, std))
            continue
        for j, u in enumerate(mine):
            p.narrow(dim, j * width, width).copy_(_draw(base, name, u, shape, std))


__all__ = ["init_weights", "is_partitioned", "mark_tensor_parallel", "units"]
