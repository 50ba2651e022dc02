"""Model FLOPs per training step and MFU (dense matmul count, fwd + bwd = 3x forward)."""

from __future__ import annotations

import torch

# Dense bf16 peak TFLOP/s per device.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "GH200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


def forward_flops(model_cfg, tokens_in: int, tokens_out: int) -> float:
    """Matmul FLOPs of one forward over `tokens_in` tokens with the output head on `tokens_out`."""
    c = model_cfg
    d, h, f = c.dim_head, c.hidden, c.ffn_hidden
    qkv = 2 * h * (c.n_heads + 2 * c.kv_heads) * d
    proj = 2 * c.n_heads * d * h
    mlp = 2 * h * f * (3 if c.activation == "swiglu" else 2)
    attn = 4 * c.n_heads * d * tokens_in  # scores and weighted sum, dense
    per_token = c.n_layers * (qkv + proj + mlp + attn)
    return per_token * tokens_in + 2 * h * c.padded_vocab_size * tokens_out


def train_step_flops(model_cfg, objective_name: str, seq_len: int, sequences: int) -> float:
    two_stream = objective_name in ("setdlm", "bd3lm")
    t_in = 2 * seq_len if two_stream else seq_len
    return 3.0 * sequences * forward_flops(model_cfg, t_in, seq_len)


def device_peak_tflops(override: float = 0.0) -> float | None:
    if override > 0:
        return override
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    return None
