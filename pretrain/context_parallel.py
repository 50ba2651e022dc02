"""Context parallelism over megatron-core's CP group: the multi-rank `model.context_parallel.ContextParallel`.

The model splits a sequence into head-tail chunks and decides which stream's K/V every attention
layer exchanges (model/context_parallel.py); this class does the exchange over the CP process group
(pretrain/parallel.py `cp_group`): an all-gather of each rank's K/V chunks in the forward and a
reduce-scatter of their gradients in the backward (each rank's keys are attended by the queries of
every rank, so a rank's dK/dV is the sum of what every rank's queries contribute). One collective of
K and V stacked per layer and direction. The collectives run eagerly (a compiled block calls them
outside its graph).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from model.context_parallel import ContextParallel


def _all_gather(out, x, group):
    # torch 2.13 renamed all_gather_into_tensor (older torch has only the old name); looked up at each
    # call, so a wrapper around torch.distributed's collectives (a test's byte counter) sees it
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def _reduce_scatter(out, x, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, group=group)


class _AllGather(torch.autograd.Function):
    """[*shape] -> [size, *shape] over `group`; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group = group
        x = x.contiguous()
        out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # the concatenated form (gloo takes no other)
        _all_gather(out, x, group=group)
        return out.view(size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter(out, grad.view(-1, *grad.shape[2:]), group=ctx.group)
        return out, None, None


class DistributedContextParallel(ContextParallel):
    """A sequence split over the `size` ranks of megatron's context-parallel group."""

    def __init__(self, group, size: int, rank: int):
        self.group, self.size, self.rank = group, size, rank
        # compiled blocks leave the collective out of their graphs; applied here rather than as a decorator,
        # which would import torch._dynamo (about a second) in every process that imports this module
        self.all_gather = torch.compiler.disable(self._all_gather)

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return _AllGather.apply(x, self.group, self.size)

    def __deepcopy__(self, memo):  # a copied model (EMA shadows, tests) shares the process group
        return self


def context_parallel(cp: int) -> ContextParallel:
    """The model's `ContextParallel` for `cp` ranks: over megatron's CP group (initialised by
    pretrain.parallel.ensure_model_parallel), or at cp = 1 the one-process one."""
    if cp == 1:
        return ContextParallel()
    from .parallel import cp_group, cp_rank, cp_size

    if cp_size() != cp:
        raise RuntimeError(f"context_parallel: megatron's CP group has {cp_size()} ranks, the recipe asks for {cp}")
    return DistributedContextParallel(cp_group(), cp, cp_rank())


__all__ = ["DistributedContextParallel", "context_parallel"]
