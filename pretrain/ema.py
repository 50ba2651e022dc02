"""Exponential moving average of the trainable weights (kept in fp32 on the parameters' device).

Under ZeRO-3 DeepSpeed keeps only this rank's flat partition of each parameter (``param.ds_tensor``;
``param.data`` is empty outside a gather), so the EMA keeps partitioned shadows too: each rank averages
its own partition. `applied` swaps the averaged partitions in (a forward then gathers EMA weights as
usual; parameters DeepSpeed keeps gathered between steps, its "persistent" small ones, get the
gathered average in ``param.data`` too), and `state_dict` all-gathers the partitions into full tensors
(a collective over the data-parallel group: every rank calls it), so checkpoints, consolidation and
exports see the same full-tensor EMA under every ZeRO stage.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .zero3 import is_partitioned


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank owns: the ZeRO-3 partition, or the parameter itself."""
    return p.ds_tensor if is_partitioned(p) else p


class EMA:
    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay = decay
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        self.shadow = {n: _local(p).detach().float().clone() for n, p in self.params.items()}
        self.partitioned = any(is_partitioned(p) for p in self.params.values())

    @torch.no_grad()
    def update(self) -> None:
        decay = 1.0 - self.decay
        names = [n for n in self.shadow]
        torch._foreach_lerp_([self.shadow[n] for n in names],
                             [_local(self.params[n]).detach().float() for n in names], decay)

    # -- full tensors (checkpoints, exports) ----------------------------------------------------------
    def full(self, name: str) -> torch.Tensor:
        """One parameter's average as a full tensor (collective over its ZeRO-3 group when partitioned)."""
        p, shadow = self.params[name], self.shadow[name]
        if not is_partitioned(p):
            return shadow
        group = p.ds_process_group
        parts = [torch.empty_like(shadow) for _ in range(dist.get_world_size(group=group))]
        dist.all_gather(parts, shadow, group=group)
        return torch.cat(parts)[:p.ds_numel].view(p.ds_shape)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": {n: self.full(n) for n in self.shadow}}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        for n, t in state["shadow"].items():
            self.set_full(n, t)

    @torch.no_grad()
    def set_full(self, name: str, full: torch.Tensor) -> None:
        """Set one parameter's average from its full tensor (this rank keeps its ZeRO-3 partition)."""
        p, shadow = self.params[name], self.shadow[name]
        if not is_partitioned(p):
            shadow.copy_(full)
            return
        flat = full.reshape(-1).to(shadow.device, torch.float32)
        part = shadow.numel()
        start = part * dist.get_rank(group=p.ds_process_group)
        piece = flat[start:start + part]
        shadow.zero_()
        shadow[:piece.numel()].copy_(piece)

    # -- using the averaged weights ------------------------------------------------------------------
    @contextlib.contextmanager
    def applied(self):
        """Inside the block the model holds the EMA weights; the trained weights come back after."""
        backup = {n: _local(p).detach().clone() for n, p in self.params.items()}
        gathered = {n: p.data.clone() for n, p in self.params.items() if is_partitioned(p) and p.data.numel()}
        try:
            self.copy_to()
            yield
        finally:
            with torch.no_grad():
                for n, p in self.params.items():
                    _local(p).copy_(backup[n])
                    if n in gathered:
                        p.data.copy_(gathered[n])

    @torch.no_grad()
    def copy_to(self) -> None:
        """Write the averages into the model (ZeRO-3: into the partitions, and into ``param.data`` where
        DeepSpeed keeps the parameter gathered)."""
        for n, p in self.params.items():
            t = _local(p)
            t.copy_(self.shadow[n].to(t.dtype))
            if is_partitioned(p) and p.data.numel():
                p.data.copy_(self.full(n).to(p.dtype))
