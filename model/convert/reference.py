"""Import of the reference implementation's DiT checkpoints into the training Transformer's layout.

The reference code (github.com/kuleshov-group/setdlms, `src/backbone/dit.py`, inherited from the
MDLM and BD3-LM code bases) trains a "DiT" backbone. Its state dict, read from the repository (not
from a published checkpoint, which the hub would be needed for), is:

    vocab_embed.embedding                 [V, H]       token embedding (a bare Parameter)
    sigma_map.mlp.{0,2}.{weight,bias}     [C, 256], [C, C]   timestep embedder (only with adaLN)
    rotary_emb.inv_freq                   [d / 2]      rotary buffer, base 10000 (gives head_dim d)
    blocks.N.norm1.weight                 [H]          LayerNorm without bias (eps 1e-5)
    blocks.N.attn_qkv.weight              [3H, H]      rows [q (all heads); k; v], no bias
    blocks.N.attn_out.weight              [H, H]       no bias
    blocks.N.norm2.weight                 [H]
    blocks.N.mlp.0.{weight,bias}          [F, H], [F]  GELU (tanh approximation)
    blocks.N.mlp.2.{weight,bias}          [H, F], [H]
    blocks.N.adaLN_modulation.{weight,bias}  [6H, C], [6H]  (only with adaLN)
    output_layer.norm_final.weight        [H]
    output_layer.linear.{weight,bias}     [V, H], [V]  untied output head WITH bias
    output_layer.adaLN_modulation.{weight,bias}  [2H, C], [2H]  (only with adaLN)

Published Hugging Face repositories save the whole denoiser, so the keys carry a `backbone.` prefix
(and `model.`, `_orig_mod.` or `module.` wrappers from Composer, torch.compile or DDP); Lightning
`.ckpt` files keep them under `state_dict` with EMA weights in `ema.shadow_params` (a list in
parameter order). The vocabulary is GPT-2's 50,257 tokens plus MASK appended as id 50257 (or
bert-base-uncased's 30,522 with [MASK] = 103 for LM1B).

The mapping into our blocks is exact: pre-LayerNorm blocks with rotary (rotate-half) attention and a
GELU MLP; LayerNorm and attention biases are zero; QKV rows are regrouped per head. A backbone with
adaLN (time conditioning) is folded at a fixed noise level `sigma` (default 0, which is what the
reference feeds models trained without time conditioning): the modulation is then a constant, so
`shift`/`scale` become LayerNorm bias/weight and `gate` scales the attention and MLP output
projections. For a model that was trained *with* time conditioning the fold is exact only at that
`sigma` (the reference samplers vary it), and the importer says so.
"""

from __future__ import annotations

import math
import re

import torch

from .errors import ConvertError
from .hf_map import group_qkv

_ROOT = re.compile(r"(vocab_embed\.|sigma_map\.|rotary_emb\.|blocks\.\d+\.|output_layer\.)")
BUFFERS = ("rotary_emb.inv_freq",)


def strip_prefixes(state: dict) -> dict[str, torch.Tensor]:
    """Keep the backbone tensors, with wrapper prefixes (`backbone.`, `model.`, `_orig_mod.`, ...) removed."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if not torch.is_tensor(value):
            continue
        k = key.replace("_orig_mod.", "")
        m = _ROOT.search(k)
        if m is None:
            continue
        name = k[m.start():]
        if name in out:
            raise ConvertError(f"reference checkpoint: two tensors map to {name!r} (second: {key!r}); "
                               "pass a state dict of one model")
        out[name] = value
    if "vocab_embed.embedding" not in out:
        raise ConvertError("reference checkpoint: no DiT backbone found (no key ending in 'vocab_embed.embedding'); "
                           "expected the reference implementation's state dict (backbone.vocab_embed.embedding, "
                           "backbone.blocks.0.attn_qkv.weight, ...)")
    return out


def ema_state(state: dict, shadow: list) -> dict[str, torch.Tensor]:
    """Replace parameters by EMA shadows given as a list in parameter order (Lightning checkpoints)."""
    params = [k for k in state if not k.endswith(BUFFERS)]
    if len(shadow) < len(params):
        raise ConvertError(f"reference checkpoint: EMA has {len(shadow)} tensors for {len(params)} backbone "
                           "parameters; use --no-ema")
    out = dict(state)
    for k, s in zip(params, shadow):
        if tuple(s.shape) != tuple(state[k].shape):
            raise ConvertError(f"reference checkpoint: EMA tensor for {k!r} has shape {tuple(s.shape)}, the "
                               f"parameter {tuple(state[k].shape)}; the EMA order is not the parameter order "
                               "(use --no-ema)")
        out[k] = s.to(state[k].dtype)
    return out


def describe(sd: dict, n_heads: int | None = None) -> dict:
    """Architecture read from tensor shapes (n_heads from the rotary buffer when not given)."""
    V, H = sd["vocab_embed.embedding"].shape
    layers = sorted({int(m.group(1)) for k in sd for m in [re.match(r"blocks\.(\d+)\.", k)] if m})
    if layers != list(range(len(layers))) or not layers:
        raise ConvertError(f"reference checkpoint: block indices {layers[:5]}... are not 0..N-1")
    F = sd["blocks.0.mlp.0.weight"].shape[0]
    if n_heads is None:
        inv = sd.get("rotary_emb.inv_freq")
        if inv is None:
            raise ConvertError("reference checkpoint: the number of attention heads cannot be read from the weights "
                               "(no rotary_emb.inv_freq and no config.json backbone_config.n_heads); pass --n-heads")
        n_heads = H // (2 * inv.numel())
    if H % n_heads:
        raise ConvertError(f"reference checkpoint: hidden size {H} is not divisible by n_heads={n_heads}")
    adaln = "blocks.0.adaLN_modulation.weight" in sd
    if "output_layer.linear.weight" not in sd:
        raise ConvertError("reference checkpoint: no output head (output_layer.linear.weight)")
    return {"n_layers": len(layers), "hidden": int(H), "n_heads": int(n_heads), "ffn_hidden": int(F),
            "vocab": int(V), "adaln": adaln, "head_bias": "output_layer.linear.bias" in sd,
            "out_vocab": int(sd["output_layer.linear.weight"].shape[0])}


def _timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float64) / half)
    args = t[:, None].double() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def conditioning(sd: dict, sigma: float) -> torch.Tensor:
    """c = silu(sigma_map(sigma)): the adaLN input at a fixed noise level, float64 [C]."""
    w0, b0 = sd["sigma_map.mlp.0.weight"].double(), sd["sigma_map.mlp.0.bias"].double()
    w2, b2 = sd["sigma_map.mlp.2.weight"].double(), sd["sigma_map.mlp.2.bias"].double()
    t = _timestep_embedding(torch.tensor([float(sigma)]), w0.shape[1])[0]
    h = torch.nn.functional.silu(w0 @ t + b0)
    return torch.nn.functional.silu(w2 @ h + b2)


def dit_to_training(sd: dict, arch: dict, sigma: float = 0.0) -> dict[str, torch.Tensor]:
    """DiT state dict (prefixes stripped) -> training Transformer state dict (unpadded vocabulary).

    The result has LayerNorm and linear biases everywhere (model.bias=True) and an output-head bias
    (model.head_bias=True); the vocabulary rows are those of the DiT (pad them to the model's padded
    vocabulary before loading)."""
    H, nH = arch["hidden"], arch["n_heads"]
    d = H // nH
    c = conditioning(sd, sigma) if arch["adaln"] else None
    out: dict[str, torch.Tensor] = {"embed.weight": sd["vocab_embed.embedding"]}
    zeros = lambda n, like: torch.zeros(n, dtype=like.dtype)  # noqa: E731

    def modulation(prefix: str, chunks: int):
        if c is None:
            return None
        w, b = sd[prefix + "adaLN_modulation.weight"].double(), sd[prefix + "adaLN_modulation.bias"].double()
        return (w @ c + b).chunk(chunks)

    def norm(weight, shift, scale):
        if shift is None:
            return weight, zeros(weight.shape[0], weight)
        return (weight.double() * (1 + scale)).to(weight.dtype), shift.to(weight.dtype)

    for i in range(arch["n_layers"]):
        src, dst = f"blocks.{i}.", f"layers.{i}."
        mods = modulation(src, 6)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods if mods else (None,) * 6
        out[dst + "norm1.weight"], out[dst + "norm1.bias"] = norm(sd[src + "norm1.weight"], shift_msa, scale_msa)
        out[dst + "norm2.weight"], out[dst + "norm2.bias"] = norm(sd[src + "norm2.weight"], shift_mlp, scale_mlp)
        qkv = sd[src + "attn_qkv.weight"]
        if qkv.shape != (3 * H, H):
            raise ConvertError(f"reference checkpoint: {src}attn_qkv.weight has shape {tuple(qkv.shape)}, expected {(3 * H, H)}")
        out[dst + "attn.qkv.weight"] = group_qkv(*qkv.view(3, nH * d, H), nH, 1, d).contiguous()  # MHA: 1 q per kv head
        out[dst + "attn.qkv.bias"] = zeros(3 * H, qkv)
        proj = sd[src + "attn_out.weight"]
        out[dst + "attn.proj.weight"] = proj if gate_msa is None else (proj.double() * gate_msa[:, None]).to(proj.dtype)
        out[dst + "attn.proj.bias"] = zeros(H, proj)
        out[dst + "mlp.fc1.weight"] = sd[src + "mlp.0.weight"]
        out[dst + "mlp.fc1.bias"] = sd[src + "mlp.0.bias"]
        w2, b2 = sd[src + "mlp.2.weight"], sd[src + "mlp.2.bias"]
        if gate_mlp is not None:
            w2, b2 = (w2.double() * gate_mlp[:, None]).to(w2.dtype), (b2.double() * gate_mlp).to(b2.dtype)
        out[dst + "mlp.fc2.weight"], out[dst + "mlp.fc2.bias"] = w2, b2
    mods = modulation("output_layer.", 2)
    shift, scale = mods if mods else (None, None)
    out["final_norm.weight"], out["final_norm.bias"] = norm(sd["output_layer.norm_final.weight"], shift, scale)
    out["head.weight"] = sd["output_layer.linear.weight"]
    head_b = sd.get("output_layer.linear.bias")
    out["head.bias"] = head_b if head_b is not None else zeros(out["head.weight"].shape[0], out["head.weight"])
    return {k: v.contiguous() for k, v in out.items()}


def model_section(arch: dict, vocab_size: int, mask_id: int, seq_len: int, dropout: float = 0.1) -> dict:
    """The recipe's `model:` section for an imported DiT (paper shapes: pre-LayerNorm, GELU, RoPE 10000;
    dropout as the checkpoint's backbone_config records it)."""
    return {"n_layers": arch["n_layers"], "hidden": arch["hidden"], "n_heads": arch["n_heads"],
            "ffn_hidden": arch["ffn_hidden"], "norm": "layernorm", "norm_eps": 1e-5, "activation": "gelu",
            "qk_norm": False, "bias": True, "head_bias": True, "rope_base": 10000.0, "dropout": float(dropout),
            "vocab_size": int(vocab_size), "mask_id": int(mask_id), "max_seq_len": int(seq_len),
            "tie_embeddings": False}


def positive(v, name: str, where, cast=int):
    """`v` as a positive number of type `cast`; a ConvertError naming `where` and `name` otherwise."""
    try:
        x = cast(v)
    except (TypeError, ValueError):
        raise ConvertError(f"{where}: {name}={v!r} is not {'an integer' if cast is int else 'a number'}") from None
    if x <= 0:
        raise ConvertError(f"{where}: {name}={v!r} must be positive")
    return x


def family_from_config(config: dict) -> str | None:
    """Best guess of the objective from a reference config.json (architectures / model_type)."""
    from model import families

    names = " ".join([*(config.get("architectures") or []), str(config.get("model_type", ""))]).lower()
    spec = families.from_reference_name(names)
    return spec.name if spec else None


def schedule_from_config(config: dict, length: int) -> dict:
    """SetDLM schedule recorded in a reference config.json: {"set_size", "s_max", "k"} (keys present
    only when recorded). D is `noise_config.desired_block_size` (or a top-level `desired_block_size`);
    S_max is `noise_config.max_block_size` unless it is missing or not below the sequence length
    (exported configs can carry max_block_size == length; the reference then uses 2 D, and so do we:
    S_max is left out). A recorded exponent `noise_config.k` is kept."""
    nc = config.get("noise_config") if isinstance(config.get("noise_config"), dict) else {}

    def num(v, name, cast=int):
        return None if v is None else positive(v, name, "reference config.json", cast)

    out: dict = {}
    d = num(nc.get("desired_block_size", config.get("desired_block_size")), "noise_config.desired_block_size")
    if d is not None:
        out["set_size"] = d
    block = num(nc.get("block_size"), "noise_config.block_size") or int(length)
    smax = num(nc.get("max_block_size"), "noise_config.max_block_size")
    if smax is not None and smax < min(block, int(length)) and (d is None or smax != 2 * d):
        out["s_max"] = smax
    k = num(nc.get("k"), "noise_config.k", float)
    if k is not None:
        out["k"] = k
    return out


__all__ = ["schedule_from_config", "strip_prefixes", "ema_state", "describe", "conditioning", "dit_to_training", "model_section",
           "family_from_config", "BUFFERS"]
