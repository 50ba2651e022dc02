"""Tiny random models for sampler tests and benchmarks (fp32, no dropout).

A large `init_std` makes the random model's outputs depend on the context (with the usual 0.02 a
tiny model predicts nearly the same token everywhere) and its distributions peaked enough for
thresholds to matter; `sharpness` scales the final norm's weight to sharpen them further."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..transformer import Transformer


def tiny_model(seed: int = 0, *, sharpness: float = 1.0, vocab_size: int = 50, **overrides) -> Transformer:
    torch.manual_seed(seed)
    cfg = dict(n_layers=2, hidden=32, n_heads=4, ffn_hidden=64, vocab_size=vocab_size, mask_id=vocab_size - 1,
               dropout=0.0, max_seq_len=256, vocab_pad_multiple=8, init_std=1.0)
    cfg.update(overrides)
    model = Transformer(ModelConfig(**cfg)).eval()
    with torch.no_grad():
        model.final_norm.weight.mul_(sharpness)
    return model
