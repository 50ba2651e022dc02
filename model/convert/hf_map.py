"""The one name map between the training Transformer and the Hugging Face Llama layout, both ways.

Our export (hf_code/modeling_setdlm.py) and the stock Qwen3 / Llama / Mistral directories that
`train.init_from` reads name their tensors alike (`model.layers.{i}.self_attn.q_proj.weight`, ...).
`LAYER` and `TOP` below say which Hugging Face tensors each of our parameters (tp=1 names of
model/transformer.py, listed by model/shapes.py) is made of; `split` and `fuse` are the two
directions of the one layout change per fused tensor, so the export (`to_hf_state_dict`), the
re-import (`from_hf_state_dict`) and the lazy stock import (hf_stock.HFWeights) share them:

- QKV rows are grouped per KV head in training ([q_0..q_{g-1}, k, v] per group) and split into
  q_proj / k_proj / v_proj (heads in order) in Hugging Face's layout;
- SwiGLU fc1 rows alternate gate/up in training (row 2j gate j, 2j+1 up j) and are gate_proj /
  up_proj; a GELU fc1 is up_proj alone;
- the training vocabulary is padded to `vocab_pad_multiple`: the export keeps the real vocabulary
  only (padding rows are never used: their logits are -inf), and import pads with zeros.

Rotary embeddings need no mapping: Hugging Face's rotate_half convention (first half / second half
of each head) is model/rotary.py's, with the same inverse frequencies; QK-norm (Qwen3) is an RMSNorm
over each head before rotary, as ours.
"""

from __future__ import annotations

import torch

from ..shapes import model_params
from .errors import ConvertError

__all__ = ["LAYER", "TOP", "VOCAB_ROWS", "hf_names", "split", "fuse", "group_qkv", "interleave", "pad_rows",
           "to_hf_state_dict", "from_hf_state_dict", "expected_hf_shapes", "check_hf_tensors"]

# a module of our block -> the Hugging Face module(s) under `model.layers.{i}.` it is made of
LAYER = {
    "norm1": ("input_layernorm",),
    "norm2": ("post_attention_layernorm",),
    "attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn.proj": ("self_attn.o_proj",),
    "attn.q_norm": ("self_attn.q_norm",),
    "attn.k_norm": ("self_attn.k_norm",),
    "mlp.fc1": ("mlp.gate_proj", "mlp.up_proj"),  # SwiGLU; a GELU MLP has up_proj only
    "mlp.fc2": ("mlp.down_proj",),
}
# our modules outside the blocks -> theirs
TOP = {"embed": "model.embed_tokens", "final_norm": "model.norm", "head": "lm_head"}
# tensors with one row per vocabulary entry (padded in training, the real vocabulary in an export)
VOCAB_ROWS = ("embed.weight", "head.weight", "head.bias")


def hf_names(name: str, cfg) -> tuple[str, ...]:
    """The Hugging Face tensor(s) our parameter `name` is made of, in the order `split` returns them."""
    module, suffix = name.rsplit(".", 1)
    if module in TOP:
        return (f"{TOP[module]}.{suffix}",)
    _, i, part = module.split(".", 2)
    parts = LAYER[part]
    if part == "mlp.fc1" and cfg.activation != "swiglu":
        parts = parts[1:]
    return tuple(f"model.layers.{i}.{p}.{suffix}" for p in parts)


def group_qkv(q, k, v, groups: int, q_per_group: int, head_dim: int) -> torch.Tensor:
    """q, k, v rows (heads in order) -> our fused QKV rows, grouped per KV head."""
    tail = q.shape[1:]
    qkv = torch.cat((q.reshape(groups, q_per_group, head_dim, *tail), k.reshape(groups, 1, head_dim, *tail),
                     v.reshape(groups, 1, head_dim, *tail)), 1)
    return qkv.reshape(groups * (q_per_group + 2) * head_dim, *tail)


def interleave(gate, up) -> torch.Tensor:
    """gate and up rows -> our SwiGLU fc1 rows (2j gate j, 2j+1 up j)."""
    return torch.stack((gate, up), 1).reshape(2 * up.shape[0], *up.shape[1:])


def split(name: str, tensor: torch.Tensor, cfg) -> list[torch.Tensor]:
    """Our parameter `name` -> its Hugging Face tensors (in `hf_names` order)."""
    if ".attn.qkv." in name:
        g, qpg, d = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.dim_head
        tail = tensor.shape[1:]
        grouped = tensor.reshape(g, qpg + 2, d, *tail)
        return [grouped[:, :qpg].reshape(g * qpg * d, *tail), grouped[:, qpg].reshape(g * d, *tail),
                grouped[:, qpg + 1].reshape(g * d, *tail)]
    if ".mlp.fc1." in name and cfg.activation == "swiglu":
        return [tensor[0::2], tensor[1::2]]
    return [tensor]


def fuse(name: str, parts: list[torch.Tensor], cfg) -> torch.Tensor:
    """Hugging Face tensors (in `hf_names` order) -> our parameter `name`: the inverse of `split`."""
    if ".attn.qkv." in name:
        return group_qkv(*parts, cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.dim_head)
    if ".mlp.fc1." in name and cfg.activation == "swiglu":
        return interleave(*parts)
    (tensor,) = parts
    return tensor


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """`t` with zero rows appended up to `rows` (the padded vocabulary)."""
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
    return torch.cat((t, pad), 0)


def to_hf_state_dict(sd: dict, cfg) -> dict[str, torch.Tensor]:
    """Training (tp=1) state dict -> Hugging Face tensor names (real vocabulary only)."""
    out: dict[str, torch.Tensor] = {}
    for name in model_params(cfg):
        if sd.get(name) is None:
            raise ConvertError(f"checkpoint weights: missing tensor {name!r}")
        tensor = sd[name][: cfg.vocab_size] if name in VOCAB_ROWS else sd[name]
        out.update(zip(hf_names(name, cfg), split(name, tensor, cfg)))
    return {k: v.contiguous() for k, v in out.items()}


def expected_hf_shapes(cfg) -> dict[str, tuple]:
    """Name -> shape of every tensor an export of `cfg` holds."""
    meta = {n: torch.empty(s.shape, device="meta") for n, s in model_params(cfg).items()}
    return {k: tuple(v.shape) for k, v in to_hf_state_dict(meta, cfg).items()}


def check_hf_tensors(tensors: dict, cfg, where: str) -> None:
    want = expected_hf_shapes(cfg)
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    if missing:
        raise ConvertError(f"{where}: incomplete weights, {len(missing)} tensor(s) missing (first: {missing[0]!r})")
    if unexpected:
        raise ConvertError(f"{where}: {len(unexpected)} unexpected tensor(s) for this config (first: {unexpected[0]!r})")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            raise ConvertError(f"{where}: tensor {k!r} has shape {tuple(tensors[k].shape)}, config.json implies {shape}")


def from_hf_state_dict(hf: dict, cfg, where: str = "export") -> dict[str, torch.Tensor]:
    """Hugging Face tensors of an export -> training (tp=1) state dict, vocabulary padded to
    cfg.padded_vocab_size."""
    check_hf_tensors(hf, cfg, where)
    sd: dict[str, torch.Tensor] = {}
    for name in model_params(cfg):
        tensor = fuse(name, [hf[n] for n in hf_names(name, cfg)], cfg)
        sd[name] = pad_rows(tensor, cfg.padded_vocab_size) if name in VOCAB_ROWS else tensor
    return {k: v.contiguous() for k, v in sd.items()}
