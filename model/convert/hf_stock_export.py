"""Exports in a stock Hugging Face architecture (Qwen3, Llama, Mistral) for AR models whose shape is one.

An autoregressive model with RMSNorm, SwiGLU, no output-head bias and one bias switch that the stock
class has (Qwen3: no biases, QK-norm; Llama: no QK-norm, attention and MLP biases together; Mistral:
no QK-norm, no biases) is exactly that architecture: the same tensors under the same names
(hf_map.py), the same rotary convention, the same norms. Its export then loads with
`AutoModelForCausalLM` without `trust_remote_code`, runs `generate`, and serves in any engine that
knows the architecture. Set-diffusion families (and AR shapes outside these classes) keep the
custom `setdlm` code (hf_config.py).

The export's vocabulary is the training tokenizer's (MASK included, as the tokenizer saved with it
has it); a stock model has no -inf bias on MASK, so its MASK logit is finite where setdlm's is -inf
(an AR model never trains towards MASK, which pushes that logit down). Every other logit is setdlm's.
generation_config.json suppresses MASK (`suppress_tokens`), so transformers' `generate()` never picks
it and gives setdlm's greedy tokens even where the MASK logit would be the largest.
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import families
from .errors import ConvertError
from .hf_stock import SUPPORTED

__all__ = ["STOCK_CLASSES", "FORMATS", "why_not_stock", "stock_type", "export_type", "stock_config", "generation_config"]

FORMATS = ("auto", "stock", "setdlm")  # `setdlm convert to-hf --format`
STOCK_CLASSES = {"qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
                 "mistral": ("MistralConfig", "MistralForCausalLM")}


def why_not_stock(model_cfg, objective_name: str, model_type: str) -> str | None:
    """Why `model_cfg` trained with `objective_name` cannot be exported as `model_type` (None: it can)."""
    m = model_cfg
    if not families.get(objective_name).stock_export:
        return f"a {objective_name} model needs setdlm's decoding (only AR models export as stock architectures)"
    if model_type not in STOCK_CLASSES:
        return f"model_type {model_type!r} is not one of {', '.join(STOCK_CLASSES)}"
    if m.norm != "rmsnorm" or m.activation != "swiglu":
        return f"model.norm={m.norm} / model.activation={m.activation}: stock classes are RMSNorm + SwiGLU"
    if m.head_bias:
        return "model.head_bias: the stock classes have no output-head bias"
    if m.qk_norm != SUPPORTED[model_type]["qk_norm"]:
        return f"model.qk_norm={m.qk_norm}: {model_type} {'has' if SUPPORTED[model_type]['qk_norm'] else 'has no'} QK-norm"
    if m.bias and model_type in ("qwen3", "mistral"):
        return f"model.bias: {model_type} has no biases in its attention and MLP linears"
    return None


def stock_type(model_cfg, objective_name: str, source_type: str | None = None) -> str | None:
    """The stock model_type an export of this model takes: the one it was imported from (`source_type`,
    the init_from directory's) when it still fits, else qwen3 (QK-norm) or llama; None when none fits."""
    order = ([source_type] if source_type in STOCK_CLASSES else []) + (["qwen3"] if model_cfg.qk_norm else ["llama"])
    for t in order:
        if why_not_stock(model_cfg, objective_name, t) is None:
            return t
    return None


def _source_model_type(cfg) -> str | None:
    """model_type of the Hugging Face directory the run started from (train.init_from), when readable."""
    src = cfg.train.init_from
    try:
        return json.loads((Path(str(src)) / "config.json").read_text()).get("model_type") if src else None
    except (OSError, ValueError, AttributeError):
        return None


def export_type(cfg, fmt: str = "auto") -> str | None:
    """The stock model_type of an export of recipe `cfg` (None: setdlm's own modeling code); `fmt`: auto
    (stock where the model is one), stock (or a ConvertError saying why not) or setdlm."""
    if fmt not in FORMATS:
        raise ConvertError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "setdlm":
        return None
    src = _source_model_type(cfg)
    mtype = stock_type(cfg.model, cfg.objective.name, src)
    if mtype is None and fmt == "stock":
        why = why_not_stock(cfg.model, cfg.objective.name, src if src in STOCK_CLASSES else
                            ("qwen3" if cfg.model.qk_norm else "llama"))
        raise ConvertError(f"--format stock: this model is not a stock architecture: {why}; use --format setdlm")
    return mtype


def stock_config(model_cfg, model_type: str, *, tokenizer_meta: dict | None = None, dtype: str = "fp32",
                 max_positions: int | None = None):
    """The transformers config object of the export (save_pretrained writes config.json)."""
    import transformers

    m, tok = model_cfg, tokenizer_meta or {}
    config_cls, arch = STOCK_CLASSES[model_type]
    kw = dict(architectures=[arch], vocab_size=int(m.vocab_size), hidden_size=int(m.hidden),
              intermediate_size=int(m.ffn_hidden), num_hidden_layers=int(m.n_layers),
              num_attention_heads=int(m.n_heads), num_key_value_heads=int(m.kv_heads), head_dim=int(m.dim_head),
              hidden_act="silu", max_position_embeddings=int(max_positions or m.max_seq_len),
              initializer_range=float(m.init_std), rms_norm_eps=float(m.norm_eps),
              tie_word_embeddings=bool(m.tie_embeddings),
              rope_parameters={"rope_theta": float(m.rope_base), "rope_type": "default"},
              attention_dropout=float(m.attention_dropout), bos_token_id=tok.get("bos_id"),
              eos_token_id=tok.get("eos_id"), pad_token_id=tok.get("pad_id"),
              dtype={"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[dtype])
    if model_type == "qwen3":
        kw.update(attention_bias=False, use_sliding_window=False)
    elif model_type == "llama":
        kw.update(attention_bias=bool(m.bias), mlp_bias=bool(m.bias))
    else:
        kw.update(sliding_window=None)
    try:
        return getattr(transformers, config_cls)(**kw)
    except (TypeError, ValueError) as e:
        raise ConvertError(f"--format stock: transformers {transformers.__version__} cannot build {config_cls} "
                           f"({e})") from None


def generation_config(tokenizer_meta: dict | None, max_new_tokens: int = 256) -> dict:
    """generation_config.json of a stock export: greedy, stopping at the tokenizer's EOS, the MASK token
    suppressed (setdlm's logits give it -inf; a stock head does not)."""
    tok = tokenizer_meta or {}
    return {"bos_token_id": tok.get("bos_id"), "eos_token_id": tok.get("eos_id"),
            "pad_token_id": tok.get("pad_id") if tok.get("pad_id") is not None else tok.get("eos_id"),
            "do_sample": False, "max_new_tokens": max_new_tokens,
            **({"suppress_tokens": [int(tok["mask_id"])]} if tok.get("mask_id") is not None else {})}
