"""Exponential moving average of the trainable weights (kept in fp32 on the parameters' device)."""

from __future__ import annotations

import torch


class EMA:
    def __init__(self, module: torch.nn.Module, decay: float):
        self.decay = decay
        self.shadow = {n: p.detach().float().clone() for n, p in module.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, module: torch.nn.Module) -> None:
        for n, p in module.named_parameters():
            if n in self.shadow:
                self.shadow[n].lerp_(p.detach().float(), 1.0 - self.decay)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "shadow": self.shadow}

    def load_state_dict(self, state: dict) -> None:
        self.decay = state["decay"]
        for n, t in state["shadow"].items():
            self.shadow[n].copy_(t)

    @torch.no_grad()
    def copy_to(self, module: torch.nn.Module) -> None:
        for n, p in module.named_parameters():
            if n in self.shadow:
                p.copy_(self.shadow[n].to(p.dtype))
