"""Weight and config mapping between the training Transformer and the Hugging Face export format.

Pure tensor code (no checkpoints, no process groups): `to_hf_state_dict` / `from_hf_state_dict` map a
tp=1 state dict of `model.transformer.Transformer` to and from the names of
`hf_code/modeling_setdlm.py`; `hf_config` / `configs_from_hf` do the same for the configuration;
`write_weights` / `read_weights` store tensors as (sharded) safetensors with an index, and reading
checks the directory and says what is wrong with it.

Layout differences handled here:
- QKV rows are grouped per KV head in training ([q_0..q_{g-1}, k, v] per group) and split into
  q_proj / k_proj / v_proj (heads in order) in the export;
- SwiGLU fc1 rows alternate gate/up in training and are split into gate_proj / up_proj;
- the training vocabulary is padded to `vocab_pad_multiple`; the export keeps the real vocabulary
  only (padding rows are never used: their logits are -inf), and import pads with zeros.
"""

from __future__ import annotations

from common.errors import Error

import json
import os
import re
from pathlib import Path

import torch

HF_CODE_DIR = Path(__file__).resolve().parent / "hf_code"
CODE_FILES = ("configuration_setdlm.py", "modeling_setdlm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_setdlm.SetDLMConfig",
    "AutoModel": "modeling_setdlm.SetDLMForMaskedLM",
    "AutoModelForMaskedLM": "modeling_setdlm.SetDLMForMaskedLM",
}
ARCHITECTURE = "SetDLMForMaskedLM"
SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
RECIPE_FILE = "setdlm_recipe.json"
FORMAT_VERSION = 1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class ConvertError(Error):
    """A checkpoint or export directory cannot be converted; the message says what is wrong."""


# -- config ----------------------------------------------------------------------------------------
def schedule_fields(objective, seq_len: int) -> dict:
    """The objective's schedule, as recorded in config.json's `set_diffusion` section."""
    out = {"family": objective.name, "length": int(seq_len), "block_size": int(objective.block_size),
           "eps": float(objective.eps)}
    if objective.name == "setdlm":
        from ..schedule import SlidingWindow

        sw = SlidingWindow.build(seq_len, objective.set_size, objective.s_max, objective.k)
        out.update(set_size=sw.set_size, s_max=sw.s_max, k=sw.k, b=sw.b, order=objective.order,
                   expected_budget=sw.expected_budget, k_explicit=objective.k is not None,
                   s_max_explicit=objective.s_max is not None)
    elif objective.name == "ar":
        out.update(set_size=1)
    elif objective.name == "bd3lm":
        out.update(set_size=int(objective.block_size))
    return out


def hf_config(model_cfg, objective, seq_len: int, *, tokenizer_meta: dict | None = None, dtype: str = "fp32",
              extra: dict | None = None) -> dict:
    """config.json for an export of a model trained with `objective` at sequence length `seq_len`."""
    m = model_cfg
    tok = tokenizer_meta or {}
    sd = schedule_fields(objective, seq_len)
    sd["mask_token_id"] = int(m.mask_id)
    sd["vocab_pad_multiple"] = int(m.vocab_pad_multiple)
    cfg = {
        "architectures": [ARCHITECTURE],
        "auto_map": dict(AUTO_MAP),
        "model_type": "setdlm",
        "vocab_size": int(m.vocab_size),
        "hidden_size": int(m.hidden),
        "intermediate_size": int(m.ffn_hidden),
        "num_hidden_layers": int(m.n_layers),
        "num_attention_heads": int(m.n_heads),
        "num_key_value_heads": int(m.kv_heads),
        "head_dim": int(m.dim_head),
        "norm_type": m.norm,
        "norm_eps": float(m.norm_eps),
        "mlp_type": m.activation,
        "qk_norm": bool(m.qk_norm),
        "bias": bool(m.bias),
        "lm_head_bias": bool(getattr(m, "head_bias", False)),
        "rope_theta": float(m.rope_base),
        "max_position_embeddings": int(m.max_seq_len),
        "hidden_dropout": float(m.dropout),
        "attention_dropout": float(m.attention_dropout),
        "initializer_range": float(m.init_std),
        "tie_word_embeddings": bool(m.tie_embeddings),
        "mask_token_id": int(m.mask_id),
        "bos_token_id": tok.get("bos_id"),
        "eos_token_id": tok.get("eos_id"),
        "pad_token_id": tok.get("pad_id"),
        "dtype": {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype],
        "set_diffusion": sd,
        "setdlm_format_version": FORMAT_VERSION,
    }
    if extra:
        cfg.update(extra)
    return cfg


def configs_from_hf(config: dict) -> tuple[dict, dict, int]:
    """(model section, objective section, seq_len) of a recipe, from an export's config.json."""
    def need(key):
        if key not in config:
            raise ConvertError(f"config.json: missing field {key!r}")
        return config[key]

    sd = dict(config.get("set_diffusion") or {})
    vocab = int(need("vocab_size"))
    heads = int(need("num_attention_heads"))
    model = {
        "n_layers": int(need("num_hidden_layers")), "hidden": int(need("hidden_size")), "n_heads": heads,
        "n_kv_heads": int(config.get("num_key_value_heads") or heads), "head_dim": config.get("head_dim"),
        "ffn_hidden": int(need("intermediate_size")), "norm": config.get("norm_type", "layernorm"),
        "norm_eps": float(config.get("norm_eps", 1e-5)), "activation": config.get("mlp_type", "gelu"),
        "qk_norm": bool(config.get("qk_norm", False)), "bias": bool(config.get("bias", True)),
        "head_bias": bool(config.get("lm_head_bias", False)), "rope_base": float(config.get("rope_theta", 10000.0)),
        "dropout": float(config.get("hidden_dropout", 0.0)), "attention_dropout": float(config.get("attention_dropout", 0.0)),
        "vocab_size": vocab, "mask_id": int(config.get("mask_token_id", sd.get("mask_token_id", -1))),
        "vocab_pad_multiple": int(sd.get("vocab_pad_multiple", 128)),
        "max_seq_len": int(config.get("max_position_embeddings", sd.get("length", 1024))),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "init_std": float(config.get("initializer_range", 0.02)),
    }
    if model["n_kv_heads"] == heads:
        model["n_kv_heads"] = None
    if model["head_dim"] is not None:
        model["head_dim"] = int(model["head_dim"])
        if model["head_dim"] * heads == model["hidden"]:
            model["head_dim"] = None
    family = sd.get("family", "setdlm")
    objective = {"name": family, "block_size": int(sd.get("block_size", 4)), "eps": float(sd.get("eps", 1e-3))}
    if family == "setdlm":
        objective["set_size"] = int(sd.get("set_size", 4))
        objective["order"] = sd.get("order", "sliding_window")
        if sd.get("s_max_explicit") or ("s_max" in sd and int(sd["s_max"]) != 2 * objective["set_size"]):
            objective["s_max"] = int(sd["s_max"])
        if sd.get("k_explicit"):
            objective["k"] = float(sd["k"])
    seq_len = int(sd.get("length", model["max_seq_len"]))
    return model, objective, seq_len


# -- weights ---------------------------------------------------------------------------------------
def _layer_ids(sd: dict) -> list[int]:
    return sorted({int(m.group(1)) for k in sd for m in [re.match(r"layers\.(\d+)\.", k)] if m})


def to_hf_state_dict(sd: dict, cfg) -> dict[str, torch.Tensor]:
    """Training (tp=1) state dict -> export tensor names (real vocabulary only)."""
    V, d = cfg.vocab_size, cfg.dim_head
    g, qpg = cfg.kv_heads, cfg.n_heads // cfg.kv_heads
    out: dict[str, torch.Tensor] = {}

    def get(k):
        if k not in sd or sd[k] is None:
            raise ConvertError(f"checkpoint weights: missing tensor {k!r}")
        return sd[k]

    out["model.embed_tokens.weight"] = get("embed.weight")[:V]
    for i in range(cfg.n_layers):
        src, dst = f"layers.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = get(src + "norm1.weight")
        out[dst + "post_attention_layernorm.weight"] = get(src + "norm2.weight")
        if cfg.norm == "layernorm" and cfg.bias:
            out[dst + "input_layernorm.bias"] = get(src + "norm1.bias")
            out[dst + "post_attention_layernorm.bias"] = get(src + "norm2.bias")
        for suffix in (("weight", "bias") if cfg.bias else ("weight",)):
            qkv = get(src + f"attn.qkv.{suffix}")
            grouped = qkv.reshape(g, qpg + 2, d, *qkv.shape[1:])
            out[dst + f"self_attn.q_proj.{suffix}"] = grouped[:, :qpg].reshape(g * qpg * d, *qkv.shape[1:])
            out[dst + f"self_attn.k_proj.{suffix}"] = grouped[:, qpg].reshape(g * d, *qkv.shape[1:])
            out[dst + f"self_attn.v_proj.{suffix}"] = grouped[:, qpg + 1].reshape(g * d, *qkv.shape[1:])
            out[dst + f"self_attn.o_proj.{suffix}"] = get(src + f"attn.proj.{suffix}")
            fc1 = get(src + f"mlp.fc1.{suffix}")
            if cfg.activation == "swiglu":
                out[dst + f"mlp.gate_proj.{suffix}"] = fc1[0::2]
                out[dst + f"mlp.up_proj.{suffix}"] = fc1[1::2]
            else:
                out[dst + f"mlp.up_proj.{suffix}"] = fc1
            out[dst + f"mlp.down_proj.{suffix}"] = get(src + f"mlp.fc2.{suffix}")
        if cfg.qk_norm:
            out[dst + "self_attn.q_norm.weight"] = get(src + "attn.q_norm.weight")
            out[dst + "self_attn.k_norm.weight"] = get(src + "attn.k_norm.weight")
    out["model.norm.weight"] = get("final_norm.weight")
    if cfg.norm == "layernorm" and cfg.bias:
        out["model.norm.bias"] = get("final_norm.bias")
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = get("head.weight")[:V]
        if getattr(cfg, "head_bias", False):
            out["lm_head.bias"] = get("head.bias")[:V]
    return {k: v.contiguous() for k, v in out.items()}


def expected_hf_shapes(cfg) -> dict[str, tuple]:
    """Name -> shape of every tensor an export of `cfg` holds."""
    V, H, F, d = cfg.vocab_size, cfg.hidden, cfg.ffn_hidden, cfg.dim_head
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    lin = {"self_attn.q_proj": (cfg.n_heads * d, H), "self_attn.k_proj": (cfg.kv_heads * d, H),
           "self_attn.v_proj": (cfg.kv_heads * d, H), "self_attn.o_proj": (H, cfg.n_heads * d),
           "mlp.up_proj": (F, H), "mlp.down_proj": (H, F)}
    if cfg.activation == "swiglu":
        lin["mlp.gate_proj"] = (F, H)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            shapes[p + name + ".weight"] = (H,)
            if cfg.norm == "layernorm" and cfg.bias:
                shapes[p + name + ".bias"] = (H,)
        for name, shape in lin.items():
            shapes[p + name + ".weight"] = shape
            if cfg.bias:
                shapes[p + name + ".bias"] = (shape[0],)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
    if cfg.norm == "layernorm" and cfg.bias:
        shapes["model.norm.bias"] = (H,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (V, H)
        if getattr(cfg, "head_bias", False):
            shapes["lm_head.bias"] = (V,)
    return shapes


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


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)
    return torch.cat((t, pad), 0)


def from_hf_state_dict(hf: dict, cfg, where: str = "export") -> dict[str, torch.Tensor]:
    """Export tensors -> training (tp=1) state dict, vocabulary padded to cfg.padded_vocab_size."""
    check_hf_tensors(hf, cfg, where)
    g, qpg, d, Vp = cfg.kv_heads, cfg.n_heads // cfg.kv_heads, cfg.dim_head, cfg.padded_vocab_size
    sd: dict[str, torch.Tensor] = {"embed.weight": _pad_rows(hf["model.embed_tokens.weight"], Vp)}
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        sd[dst + "norm1.weight"] = hf[src + "input_layernorm.weight"]
        sd[dst + "norm2.weight"] = hf[src + "post_attention_layernorm.weight"]
        if cfg.norm == "layernorm" and cfg.bias:
            sd[dst + "norm1.bias"] = hf[src + "input_layernorm.bias"]
            sd[dst + "norm2.bias"] = hf[src + "post_attention_layernorm.bias"]
        for suffix in (("weight", "bias") if cfg.bias else ("weight",)):
            q, k, v = (hf[src + f"self_attn.{n}_proj.{suffix}"] for n in ("q", "k", "v"))
            tail = q.shape[1:]
            qkv = torch.cat((q.reshape(g, qpg, d, *tail), k.reshape(g, 1, d, *tail), v.reshape(g, 1, d, *tail)), 1)
            sd[dst + f"attn.qkv.{suffix}"] = qkv.reshape(g * (qpg + 2) * d, *tail)
            sd[dst + f"attn.proj.{suffix}"] = hf[src + f"self_attn.o_proj.{suffix}"]
            up = hf[src + f"mlp.up_proj.{suffix}"]
            if cfg.activation == "swiglu":
                gate = hf[src + f"mlp.gate_proj.{suffix}"]
                sd[dst + f"mlp.fc1.{suffix}"] = torch.stack((gate, up), 1).reshape(2 * up.shape[0], *up.shape[1:])
            else:
                sd[dst + f"mlp.fc1.{suffix}"] = up
            sd[dst + f"mlp.fc2.{suffix}"] = hf[src + f"mlp.down_proj.{suffix}"]
        if cfg.qk_norm:
            sd[dst + "attn.q_norm.weight"] = hf[src + "self_attn.q_norm.weight"]
            sd[dst + "attn.k_norm.weight"] = hf[src + "self_attn.k_norm.weight"]
    sd["final_norm.weight"] = hf["model.norm.weight"]
    if cfg.norm == "layernorm" and cfg.bias:
        sd["final_norm.bias"] = hf["model.norm.bias"]
    if not cfg.tie_embeddings:
        sd["head.weight"] = _pad_rows(hf["lm_head.weight"], Vp)
        if getattr(cfg, "head_bias", False):
            sd["head.bias"] = _pad_rows(hf["lm_head.bias"], Vp)
    return {k: v.contiguous() for k, v in sd.items()}


# -- files -----------------------------------------------------------------------------------------
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(text))
    unit = (m.group(2) or "B").upper() if m else ""
    if not m or unit not in _UNITS:
        raise ConvertError(f"--max-shard-size: cannot read {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[unit])


def write_weights(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_bytes: int) -> list[str]:
    """Write model.safetensors, or model-0000i-of-0000n.safetensors + an index when the tensors are
    larger than `max_shard_bytes` (a tensor larger than the limit gets a shard of its own)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    umask = os.umask(0)
    os.umask(umask)

    def save(tensors_, name):
        save_file(tensors_, str(out_dir / name), metadata={"format": "pt"})
        os.chmod(out_dir / name, 0o666 & ~umask)  # safetensors creates files readable by the owner only

    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(sizes.values())
    if total <= max_shard_bytes:
        save(tensors, SAFE_SINGLE)
        return [SAFE_SINGLE]
    shards: list[list[str]] = [[]]
    used = 0
    for k in tensors:
        if shards[-1] and used + sizes[k] > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(k)
        used += sizes[k]
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for name, keys in zip(names, shards):
        save({k: tensors[k] for k in keys}, name)
        weight_map.update({k: name for k in keys})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return names


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise ConvertError(f"{path.parent}: weight file {path.name} is missing (incomplete export?)")
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises several error types
        raise ConvertError(f"{path}: not a readable safetensors file, the export is corrupt or truncated "
                           f"({type(e).__name__}: {e})") from None


def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise ConvertError(f"{path.parent}: {path.name} is missing ({what})")
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ConvertError(f"{path}: not valid JSON, the file is corrupt ({e})") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{path}: expected a JSON object")
    return data


def read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of an export directory (single file or sharded with an index)."""
    d = Path(model_dir)
    index = d / SAFE_INDEX
    if index.is_file():
        data = read_json(index, "the shard index")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{index}: no weight_map, the index is corrupt")
        out: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            tensors = _load_file(d / shard)
            listed = {k for k, v in weight_map.items() if v == shard}
            absent = sorted(listed - set(tensors))
            if absent:
                raise ConvertError(f"{d / shard}: tensor {absent[0]!r} listed in the index is not in the shard")
            out.update(tensors)
        return out
    if (d / SAFE_SINGLE).is_file():
        return _load_file(d / SAFE_SINGLE)
    if (d / "pytorch_model.bin").is_file():
        try:
            return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            if "Unsupported global" in str(e) or "Can only build" in str(e):
                raise ConvertError(f"{d / 'pytorch_model.bin'}: refused: it holds Python objects that would run code "
                                   "when loaded (weights only are read)") from None
            raise ConvertError(f"{d / 'pytorch_model.bin'}: unreadable ({type(e).__name__}: "
                               f"{str(e).splitlines()[0][:160] if str(e) else 'truncated'})") from None
    raise ConvertError(f"{d}: no weights ({SAFE_SINGLE}, {SAFE_INDEX} or pytorch_model.bin); incomplete export?")


def cast(tensors: dict[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    to = DTYPES[dtype]
    return {k: (v.to(to) if v.is_floating_point() else v).contiguous() for k, v in tensors.items()}


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"  # pragma: no cover


def parameter_total(tensors: dict[str, torch.Tensor]) -> int:
    return int(sum(t.numel() for t in tensors.values()))


__all__ = ["ConvertError", "hf_config", "configs_from_hf", "schedule_fields", "to_hf_state_dict",
           "from_hf_state_dict", "expected_hf_shapes", "check_hf_tensors", "write_weights", "read_weights",
           "read_json", "parse_size", "cast", "human_bytes", "parameter_total", "HF_CODE_DIR", "CODE_FILES",
           "AUTO_MAP", "RECIPE_FILE", "SAFE_SINGLE", "SAFE_INDEX", "DTYPES"]
