"""config.json of a setdlm Hugging Face export, both ways: `hf_config` writes it from a recipe's
model and objective sections (with the schedule and the family's inference traits in `set_diffusion`,
`schedule_fields`), and `configs_from_hf` reads those sections back; `migrate_export` brings an older
export's config.json to the current format and checks the fields read back. The tensors are mapped by
hf_map.py, stored by hf_files.py; the model code the export ships is hf_code/.
"""

from __future__ import annotations

from pathlib import Path

from .. import families
from .errors import ConvertError

__all__ = ["HF_CODE_DIR", "CODE_FILES", "AUTO_MAP", "ARCHITECTURE", "RECIPE_FILE", "FORMAT_VERSION",
           "MIGRATIONS", "migrate_export", "check_export_config", "schedule_fields", "hf_config", "configs_from_hf"]

HF_CODE_DIR = Path(__file__).resolve().parent / "hf_code"
CODE_FILES = ("configuration_setdlm.py", "modeling_setdlm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_setdlm.SetDLMConfig",
    "AutoModel": "modeling_setdlm.SetDLMForMaskedLM",
    "AutoModelForMaskedLM": "modeling_setdlm.SetDLMForMaskedLM",
}
ARCHITECTURE = "SetDLMForMaskedLM"
RECIPE_FILE = "setdlm_recipe.json"
# config.json's setdlm_format_version (and setdlm_recipe.json's format_version):
#   1  the first recorded version
#   2  set_diffusion gains the family's inference traits (inference_mask, decoding), which the exported
#      modeling code reads instead of the family's name
FORMAT_VERSION = 2


def _v1_to_v2(record: dict) -> dict:
    """config.json 1 -> 2: the inference traits of its family (from the registry). The recipe file has
    no set_diffusion section: it passes unchanged."""
    if not isinstance(record.get("set_diffusion"), dict):
        return record
    sd = dict(record["set_diffusion"])
    family = sd.get("family") or families.DEFAULT.name
    if family in families.names():  # else check_export_config names the unknown family
        for key, value in families.get(family).inference_traits().items():
            sd.setdefault(key, value)
    return {**record, "set_diffusion": sd}


# migrations from an older export format (common/versions.py): version v -> v + 1, on config.json and
# on the recipe file alike
MIGRATIONS: dict = {1: _v1_to_v2}


def migrate_export(record: dict, key: str, where) -> dict:
    """An export's config.json (key `setdlm_format_version`) or recipe file (`format_version`) at the
    current format version, its migrated fields checked (`check_export_config`); a newer one is a
    ConvertError."""
    from common.versions import migrate

    out = migrate(record, key=key, current=FORMAT_VERSION, migrations=MIGRATIONS, what=str(where), error=ConvertError)
    if isinstance(out.get("set_diffusion"), dict):
        check_export_config(out, where)
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_export_config(config: dict, where) -> None:
    """The fields of config.json that setdlm reads back, by type and range (after migration, so a
    migration that fills a field wrongly fails here, naming it): one ConvertError naming the first."""
    sd = config["set_diffusion"]

    def bad(key, msg):
        raise ConvertError(f"{where}: {key}: {msg}")

    family = sd.get("family")
    if family is not None and family not in families.names():
        bad("set_diffusion.family", f"unknown family {family!r}; valid: {', '.join(families.names())}")
    for key, valid in (("inference_mask", families.INFERENCE_MASKS), ("decoding", families.DECODING_MODES)):
        if sd.get(key) not in valid:
            bad(f"set_diffusion.{key}", f"must be one of {', '.join(valid)}, got {sd.get(key)!r}")
    if family is not None:
        spec = families.get(family)
        for key, value in spec.inference_traits().items():
            if sd[key] != value:
                bad(f"set_diffusion.{key}", f"{sd[key]!r} is not the {family} family's ({value!r})")
    for key in ("length", "block_size", "set_size", "s_max", "vocab_pad_multiple"):
        if key in sd and not (_is_int(sd[key]) and sd[key] >= 1):
            bad(f"set_diffusion.{key}", f"must be a whole number >= 1, got {sd[key]!r}")
    if "eps" in sd and not (isinstance(sd["eps"], (int, float)) and not isinstance(sd["eps"], bool)
                            and 0.0 < sd["eps"] < 1.0):
        bad("set_diffusion.eps", f"must be a number in (0, 1), got {sd['eps']!r}")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings"):
        if key in config and not (_is_int(config[key]) and config[key] >= 1):
            bad(key, f"must be a whole number >= 1, got {config[key]!r}")
    mask = config.get("mask_token_id", sd.get("mask_token_id"))
    if mask is not None and not (_is_int(mask) and 0 <= mask < config.get("vocab_size", mask + 1)):
        bad("mask_token_id", f"must be a token id in [0, vocab_size), got {mask!r}")


def schedule_fields(objective, seq_len: int) -> dict:
    """The objective's schedule, as recorded in config.json's `set_diffusion` section: its family, the
    family's inference traits (what the exported modeling code reads), length, block size, noise eps
    and the family's own fields."""
    spec = families.get(objective.name)
    out = {"family": objective.name, **spec.inference_traits(), "length": int(seq_len),
           "block_size": int(objective.block_size), "eps": float(objective.eps)}
    out.update(spec.schedule_fields(objective, seq_len))
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
    spec = families.get(sd.get("family") or families.DEFAULT.name, "set_diffusion.family")
    objective = {"name": spec.name, "block_size": int(sd.get("block_size", 4)), "eps": float(sd.get("eps", 1e-3))}
    objective.update(spec.objective_from_schedule(sd))
    seq_len = int(sd.get("length", model["max_seq_len"]))
    return model, objective, seq_len
