"""Model and objective configuration (the `model:` and `objective:` sections of a recipe)."""

from __future__ import annotations

from typing import Literal

from common.schema import ConfigError, Field, check_keys, section

from . import families

# Named shapes. A recipe may name a preset and override any field of it.
PRESETS: dict[str, dict] = {
    # Tests and the CPU quickstart.
    "tiny": dict(n_layers=2, hidden=64, n_heads=4, ffn_hidden=256, max_seq_len=256),
    "small-cpu": dict(n_layers=4, hidden=256, n_heads=4, ffn_hidden=1024, max_seq_len=256),
    # The paper's OWT / LM1B backbone: 12 x 768, GELU MLP, pre-LayerNorm, untied head.
    "paper-12x768": dict(
        n_layers=12, hidden=768, n_heads=12, ffn_hidden=3072, norm="layernorm", activation="gelu",
        bias=True, rope_base=10000.0, dropout=0.1, tie_embeddings=False, max_seq_len=1024,
    ),
    # Qwen3-style 1.7B block (GQA, RMSNorm, SwiGLU, QK-norm, tied embeddings).
    "qwen3-1.7b": dict(
        n_layers=28, hidden=2048, n_heads=16, n_kv_heads=8, head_dim=128, ffn_hidden=6144,
        norm="rmsnorm", norm_eps=1e-6, activation="swiglu", qk_norm=True, bias=False,
        rope_base=1_000_000.0, dropout=0.0, tie_embeddings=True, max_seq_len=4096,
    ),
    # Qwen3-8B's shape (its config.json: 36 x 4096, 32 query / 8 KV heads of 128, SwiGLU 12288, RMSNorm
    # eps 1e-6, QK-norm, rope theta 1e6, untied head): 8.19B parameters with its 151,936-row embedding.
    "qwen3-8b": dict(
        n_layers=36, hidden=4096, n_heads=32, n_kv_heads=8, head_dim=128, ffn_hidden=12288,
        norm="rmsnorm", norm_eps=1e-6, activation="swiglu", qk_norm=True, bias=False,
        rope_base=1_000_000.0, dropout=0.0, tie_embeddings=False, max_seq_len=4096,
    ),
}

# The vocabulary a preset's run gets from its model's tokenizer: (model.vocab_size, model.mask_id) as
# train.init_from of the model's Hugging Face directory and the built-in tokenizer give them (Qwen3:
# 151,669 tokens, MASK appended as id 151669). The dry run plans with it when the directory is absent.
PRESET_VOCAB: dict[str, tuple[int, int]] = {"qwen3-1.7b": (151670, 151669), "qwen3-8b": (151670, 151669)}

OBJECTIVES = families.names()
ORDERS = ("sliding_window", "any_order", "left_to_right")
CACHE_ORDERS = ("position", "first_hitting")  # how one SetDLM decoding step's accepted tokens enter the cache


@section("model")
class ModelConfig:
    preset: Literal[tuple(PRESETS)] | None = Field(None, description=(
        "named shape (" + ", ".join(PRESETS) + "); explicit keys override the preset's"))
    n_layers: int = Field(12, ge=1, description="transformer blocks")
    hidden: int = Field(768, ge=1, description="model width")
    n_heads: int = Field(12, ge=1, description="attention (query) heads")
    n_kv_heads: int | None = Field(None, ge=1, description="key/value heads for GQA (null: n_heads, multi-head attention)")
    head_dim: int | None = Field(None, ge=2, description="per-head dimension, even for rotary (null: hidden // n_heads)")
    ffn_hidden: int = Field(3072, ge=1, description="MLP inner width (SwiGLU: per gate/up branch)")
    norm: Literal["layernorm", "rmsnorm"] = Field("layernorm", description="normalisation of every block and the final norm")
    norm_eps: float = Field(1e-5, gt=0, description="epsilon of the norms")
    activation: Literal["gelu", "swiglu"] = Field("gelu", description="MLP activation")
    qk_norm: bool = Field(False, description="RMS-normalise queries and keys per head (Qwen3)")
    bias: bool = Field(True, description="biases in the attention and MLP linears")
    rope_base: float = Field(10000.0, gt=0, description="rotary embedding base (theta)")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="dropout on each block's attention and MLP outputs before the residual add (none on the embeddings)")
    attention_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on attention probabilities (sdpa only)")
    attention_backend: Literal["auto", "sdpa", "flex"] = Field("auto", description=(
        "attention kernel: auto (flex on CUDA, sdpa elsewhere), sdpa (dense mask) or flex (block mask)"))
    fp8: Literal["none", "hybrid", "e4m3"] = Field("none", description=(
        "Transformer Engine FP8 block linears (H100/H200; pretrain/fp8.py); none: bf16/fp32"))
    vocab_size: int = Field(0, ge=0, description="vocabulary size with MASK (0: taken from the tokenizer)")
    mask_id: int = Field(-1, ge=-1, description="MASK token id (-1: taken from the tokenizer)")
    vocab_pad_multiple: int = Field(128, ge=1, description="embedding rows padded to a multiple of this (independent of TP)")
    max_seq_len: int = Field(1024, ge=1, description="longest sequence the model is built for (>= data.seq_len)")
    tie_embeddings: bool = Field(False, description="share the input embedding and the output head")
    head_bias: bool = Field(False, description="bias on the untied output head (as in imported reference checkpoints)")
    init_std: float = Field(0.02, gt=0, description="standard deviation of the normal weight initialisation")

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.n_heads

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_pad_multiple
        return ((self.vocab_size + m - 1) // m) * m

    def validate(self, tp: int = 1, need_vocab: bool = True) -> None:
        """Checks across fields (each field's type and range are enforced on construction).
        `need_vocab=False` skips the vocabulary checks before the tokenizer has filled it in."""
        def bad(name, msg):
            raise ConfigError(f"model.{name}: {msg}")

        if self.attention_backend == "flex" and self.attention_dropout > 0:
            bad("attention_dropout", "flex attention has no attention-probability dropout; use 0 or attention_backend=sdpa")
        if self.fp8 != "none" and (self.hidden % 16 or (self.ffn_hidden // tp) % 16):
            bad("fp8", f"FP8 GEMMs need hidden ({self.hidden}) and ffn_hidden/tp ({self.ffn_hidden // tp}) divisible by 16")
        if self.head_dim is None and self.hidden % self.n_heads:
            bad("n_heads", f"hidden={self.hidden} is not divisible by n_heads={self.n_heads} (or set model.head_dim)")
        if self.dim_head % 2:
            bad("head_dim", f"rotary embeddings need an even head dimension, got {self.dim_head}")
        if self.n_heads % self.kv_heads:
            bad("n_kv_heads", f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.kv_heads}")
        if need_vocab and self.vocab_size <= 0:
            bad("vocab_size", "unknown: set it or let the tokenizer fill it in")
        if need_vocab and not 0 <= self.mask_id < self.vocab_size:
            bad("mask_id", f"{self.mask_id} is not a token id of a vocabulary of {self.vocab_size} (the tokenizer needs a MASK token)")
        if self.head_bias and self.tie_embeddings:
            bad("head_bias", "an output-head bias needs an untied head (set model.tie_embeddings: false)")
        if tp > 1:
            if self.n_heads % tp:
                bad("n_heads", f"{self.n_heads} heads are not divisible by parallel.tp={tp}")
            if self.kv_heads % tp:
                bad("n_kv_heads", f"{self.kv_heads} KV heads are not divisible by parallel.tp={tp}")
            if self.ffn_hidden % tp:
                bad("ffn_hidden", f"{self.ffn_hidden} is not divisible by parallel.tp={tp}")
            if self.vocab_pad_multiple % tp:
                bad("vocab_pad_multiple", f"{self.vocab_pad_multiple} is not divisible by parallel.tp={tp}")


@section("objective")
class ObjectiveConfig:
    name: Literal[OBJECTIVES] = Field(families.SETDLM.name, description=(
        "training objective, a registered family (model/families): " + ", ".join(
            f"{s.name} ({s.title})" for s in families.REGISTERED)))
    # SW-SetDLM schedule (SETDLM.md section 2)
    set_size: int = Field(4, ge=1, description="setdlm: D, the equivalent block size (expected prediction budget D/2)")
    s_max: int | None = Field(None, ge=1, description="setdlm: window of overlapping intervals, >= set_size (null: 2 * D)")
    k: float | None = Field(None, gt=0, description="setdlm: masking-curve exponent (null: derived so the budget is D/2)")
    order: Literal[ORDERS] = Field("sliding_window", description="setdlm: generation orders sampled in training")
    cache_order: Literal[CACHE_ORDERS] = Field("position", description=(
        "setdlm: the decoding default for the order in which one step's accepted tokens enter the KV cache: position, "
        "or first_hitting (the paper's GSM8K mode, recorded by imported checkpoints; docs/sampling.md)"))
    # BD3-LM
    block_size: int = Field(4, ge=1, description="bd3lm: block size, divides data.seq_len")
    # MDLM / BD3-LM noise
    eps: float = Field(1e-3, gt=0.0, lt=1.0, description="mdlm/bd3lm: smallest masking rate t ~ U[eps, 1]")
    antithetic: bool = Field(True, description="mdlm/bd3lm: antithetic (stratified) sampling of t across the batch")

    def validate(self, seq_len: int) -> None:
        """The checks of this family's keys (model/families)."""
        self.family.validate(self, seq_len)

    @property
    def family(self):
        """The FamilySpec of `name`."""
        return families.get(self.name)


# ModelConfig keys that choose how the computation runs or is regularised, not which function the
# weights compute; every other model key is part of a checkpoint's identity (a resume refuses a change,
# pretrain/checkpoint/resume.py), so a key added later is protected unless it is listed here.
RUNTIME_KEYS = ("preset", "dropout", "attention_dropout", "attention_backend", "fp8", "max_seq_len", "init_std")


def identity_keys() -> tuple[str, ...]:
    """The model keys that define what a checkpoint's weights compute (every key but RUNTIME_KEYS)."""
    import dataclasses

    return tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in RUNTIME_KEYS)


def apply_preset(section: dict) -> dict:
    """Expand `preset: NAME` in a raw `model:` section; explicit keys win over the preset's."""
    section = dict(section or {})
    name = section.get("preset")
    if name is None:
        return section
    if name not in PRESETS:
        raise ConfigError(f"model.preset: unknown preset {name!r}; valid: {', '.join(sorted(PRESETS))}")
    return {**PRESETS[name], **section}


def model_config_from_dict(section: dict) -> ModelConfig:
    section = apply_preset(section)
    check_keys(ModelConfig, "model", section)
    return ModelConfig(**section)


__all__ = ["ModelConfig", "ObjectiveConfig", "PRESETS", "PRESET_VOCAB", "OBJECTIVES", "ORDERS", "CACHE_ORDERS",
           "RUNTIME_KEYS", "identity_keys",
           "apply_preset", "model_config_from_dict"]
