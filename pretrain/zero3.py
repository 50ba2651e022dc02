"""ZeRO-3 parameters: which are partitioned, and how a rank initialises its partition of one.

Under ZeRO-3 the model is built inside `deepspeed.zero.Init` (pretrain/engine.py `zero3_init`), so each
parameter is partitioned as soon as its module is constructed: this rank owns one flat slice
`[r * n, (r + 1) * n)` of the flattened (tensor-parallel) parameter (`p.ds_tensor`, n = ceil(numel /
dp)) and `p.data` is empty. `init_partitions` then draws the model's layout-invariant values
(model/init.py) into the slices: each rank draws only the units that overlap its slice (from the same
per-unit generators) and writes the overlap: no collective, no full parameter anywhere, and the values
are those of the unpartitioned model bit for bit (also in bf16: one rounding of the same fp32 draw). A
weight split along dim 0 (embedding, QKV, fc1, head) overlaps about 1/dp of its units; one split along
dim 1 (attn.proj, mlp.fc2) overlaps all of them, as each unit spans every row.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from model.init import ShardInit, fill


def is_partitioned(p: torch.Tensor) -> bool:
    """A ZeRO-3 parameter built under deepspeed.zero.Init: `p.data` is empty, `p.ds_tensor` is this
    rank's flat slice."""
    return getattr(p, "ds_tensor", None) is not None


def local_shape(p: torch.Tensor) -> tuple:
    """The shape of the tensor-parallel shard `p` stands for (partitioned or not)."""
    return tuple(p.ds_shape) if is_partitioned(p) else tuple(p.shape)


def _slice(p: torch.Tensor) -> tuple[int, int]:
    """[start, stop) of the flattened parameter that this rank's ZeRO-3 partition holds."""
    n = p.ds_tensor.ds_numel if hasattr(p.ds_tensor, "ds_numel") else p.ds_tensor.numel()
    start = n * dist.get_rank(group=p.ds_process_group)
    return start, min(start + n, p.ds_numel)


def fill_partition(p: torch.Tensor, init: ShardInit) -> None:
    """Write this rank's ZeRO-3 slice of `init`'s values (a plain tensor: all of them). The slice
    covers rows [r0, r1) of dim 0; a band of those rows is assembled on the partition's device from
    the overlapping part of each unit, then its slice is copied."""
    if not is_partitioned(p):
        fill(p, init)
        return
    flat = p.ds_tensor
    start, stop = _slice(p)
    flat.zero_()  # the padding past the end of the parameter stays zero
    if stop <= start:
        return
    if init.constant is not None:
        flat[:stop - start].fill_(init.constant)
        return
    shape, dim, width = list(init.shape), init.dim, init.width
    row = math.prod(shape[1:])
    r0, r1 = start // row, -(-stop // row)
    band = torch.empty([r1 - r0, *shape[1:]], dtype=flat.dtype, device=flat.device)
    for j, u in enumerate(init.units):
        if dim == 0:  # unit j holds rows [j * width, (j + 1) * width)
            a, b = max(r0, j * width), min(r1, (j + 1) * width)
            if a >= b:
                continue  # no overlap: this unit is never drawn here
            band[a - r0:b - r0].copy_(init.draw(u).narrow(0, a - j * width, b - a))
        else:  # every unit spans all rows: its rows [r0, r1) go to its columns of the band
            band.narrow(dim, j * width, width).copy_(init.draw(u).narrow(0, r0, r1 - r0))
    flat[:stop - start].copy_(band.reshape(-1)[start - r0 * row:stop - r0 * row])


def init_partitions(model) -> None:
    """Initialise a model built with `init=False` inside `deepspeed.zero.Init`: each rank its partitions."""
    model.init_weights(shape=local_shape, fill=fill_partition)


__all__ = ["fill_partition", "init_partitions", "is_partitioned", "local_shape"]
