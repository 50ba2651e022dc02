"""Tiny random models for sampler tests and benchmarks (fp32, no dropout).

`sharpness` scales the final norm's weight so that the random model's next-token distributions are
peaked (confidences spread over (0, 1)), which makes thresholds and stopping meaningful."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..transformer import Transformer


def tiny_model(seed: int = 0, *, sharpness: float = 60.0, vocab_size: int = 50, **overrides) -> Transformer:
    from ..parallel import ensure_model_parallel

    ensure_model_parallel(1, 1)
    torch.manual_seed(seed)
    cfg = dict(n_layers=2, hidden=32, n_heads=4, ffn_hidden=64, vocab_size=vocab_size, mask_id=vocab_size - 1,
               dropout=0.0, max_seq_len=256, vocab_pad_multiple=8)
    cfg.update(overrides)
    model = Transformer(ModelConfig(**cfg)).eval()
    with torch.no_grad():
        model.final_norm.weight.mul_(sharpness)
    return model
