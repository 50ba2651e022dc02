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


class CharTokenizer:
    """One character per token id of the tiny models: 0..25 -> a..z, 26..48 -> A..W; 49 is MASK."""

    mask_id, eos_id = 49, None

    def encode(self, text):
        return [ord(c) - 97 if c.islower() else ord(c) - 65 + 26 for c in text]

    def decode(self, ids, skip_special=False):
        return "".join(chr(97 + i) if i < 26 else chr(65 + i - 26) for i in ids)
