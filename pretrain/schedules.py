"""Learning-rate schedules: linear warm-up, then constant or cosine decay to min_lr."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, lr: float, min_lr: float, warmup: int, total: int, kind: str) -> float:
    if warmup > 0 and step < warmup:
        return lr * (step + 1) / warmup
    if kind == "constant":
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    t = train_cfg

    def factor(step: int) -> float:
        return lr_at(step, lr=t.lr, min_lr=t.min_lr, warmup=t.warmup_steps, total=t.max_steps, kind=t.lr_schedule) / t.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
