"""Model and objective configuration (the `model:` and `objective:` sections of a recipe)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

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
}

OBJECTIVES = ("ar", "mdlm", "bd3lm", "setdlm")
ORDERS = ("sliding_window", "any_order", "left_to_right")


@dataclass
class ModelConfig:
    preset: str | None = None
    n_layers: int = 12
    hidden: int = 768
    n_heads: int = 12
    n_kv_heads: int | None = None  # None: equal to n_heads (multi-head attention)
    head_dim: int | None = None  # None: hidden // n_heads
    ffn_hidden: int = 3072
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    activation: str = "gelu"  # gelu | swiglu
    qk_norm: bool = False
    bias: bool = True
    rope_base: float = 10000.0
    dropout: float = 0.1
    attention_dropout: float = 0.0
    attention_backend: str = "auto"  # auto (flex on CUDA, sdpa elsewhere) | sdpa | flex
    fp8: str = "none"  # none | hybrid | e4m3: Transformer Engine FP8 block linears (H100/H200; model/fp8.py)
    vocab_size: int = 0  # 0: taken from the tokenizer (MASK included)
    mask_id: int = -1  # -1: taken from the tokenizer
    vocab_pad_multiple: int = 128  # padded vocabulary is independent of the TP size
    max_seq_len: int = 1024
    tie_embeddings: bool = False
    head_bias: bool = False  # bias on the (untied) output head, as in imported reference checkpoints
    init_std: float = 0.02

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

    def validate(self, tp: int = 1) -> None:
        def bad(name, msg):
            raise ValueError(f"model.{name}: {msg}")

        for name in ("n_layers", "hidden", "n_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) <= 0:
                bad(name, f"must be a positive integer, got {getattr(self, name)}")
        if self.norm not in ("layernorm", "rmsnorm"):
            bad("norm", f"unknown norm {self.norm!r}; valid: layernorm, rmsnorm")
        if self.attention_backend not in ("auto", "sdpa", "flex"):
            bad("attention_backend", f"unknown backend {self.attention_backend!r}; valid: auto, sdpa, flex")
        if self.attention_backend == "flex" and self.attention_dropout > 0:
            bad("attention_dropout", "flex attention has no attention-probability dropout; use 0 or attention_backend=sdpa")
        if self.fp8 not in ("none", "hybrid", "e4m3"):
            bad("fp8", f"unknown mode {self.fp8!r}; valid: none, hybrid, e4m3")
        if self.fp8 != "none" and (self.hidden % 16 or (self.ffn_hidden // tp) % 16):
            bad("fp8", f"FP8 GEMMs need hidden ({self.hidden}) and ffn_hidden/tp ({self.ffn_hidden // tp}) divisible by 16")
        if self.activation not in ("gelu", "swiglu"):
            bad("activation", f"unknown activation {self.activation!r}; valid: gelu, swiglu")
        if self.head_dim is None and self.hidden % self.n_heads:
            bad("n_heads", f"hidden={self.hidden} is not divisible by n_heads={self.n_heads} (or set model.head_dim)")
        if self.dim_head % 2:
            bad("head_dim", f"rotary embeddings need an even head dimension, got {self.dim_head}")
        if self.n_heads % self.kv_heads:
            bad("n_kv_heads", f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.kv_heads}")
        if not 0.0 <= self.dropout < 1.0:
            bad("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.vocab_size <= 0:
            bad("vocab_size", "unknown: set it or let the tokenizer fill it in")
        if not 0 <= self.mask_id < self.vocab_size:
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


@dataclass
class ObjectiveConfig:
    name: str = "setdlm"  # ar | mdlm | bd3lm | setdlm
    # SW-SetDLM schedule (SETDLM.md section 2)
    set_size: int = 4  # D: equivalent block size; expected prediction budget D/2
    s_max: int | None = None  # window of overlapping intervals; None: 2 * D
    k: float | None = None  # masking-curve exponent; None: derived so that the budget is D/2
    order: str = "sliding_window"  # sliding_window | any_order | left_to_right
    # BD3-LM
    block_size: int = 4
    # MDLM / BD3-LM noise
    eps: float = 1e-3
    antithetic: bool = True

    def validate(self, seq_len: int) -> None:
        def bad(name, msg):
            raise ValueError(f"objective.{name}: {msg}")

        if self.name not in OBJECTIVES:
            bad("name", f"unknown objective {self.name!r}; valid: {', '.join(OBJECTIVES)}")
        if self.name == "setdlm":
            if self.order not in ORDERS:
                bad("order", f"unknown order {self.order!r}; valid: {', '.join(ORDERS)}")
            if not 1 <= self.set_size <= seq_len:
                bad("set_size", f"D={self.set_size} must be in [1, seq_len={seq_len}]")
            s_max = self.s_max if self.s_max is not None else 2 * self.set_size
            if s_max < self.set_size:
                bad("s_max", f"S_max={s_max} must be >= D={self.set_size}")
            if self.k is not None and self.k <= 0:
                bad("k", f"must be positive, got {self.k}")
        if self.name == "bd3lm" and (self.block_size < 1 or seq_len % self.block_size):
            bad("block_size", f"block size {self.block_size} must divide seq_len={seq_len}")
        if self.name in ("mdlm", "bd3lm") and not 0.0 < self.eps < 1.0:
            bad("eps", f"must be in (0, 1), got {self.eps}")


def apply_preset(section: dict) -> dict:
    """Expand `preset: NAME` in a raw `model:` section; explicit keys win over the preset's."""
    section = dict(section or {})
    name = section.get("preset")
    if name is None:
        return section
    if name not in PRESETS:
        raise ValueError(f"model.preset: unknown preset {name!r}; valid: {', '.join(sorted(PRESETS))}")
    return {**PRESETS[name], **section}


def model_config_from_dict(section: dict) -> ModelConfig:
    section = apply_preset(section)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(section) - names)
    if unknown:
        raise ValueError(f"model.{unknown[0]}: unknown key; valid keys: {', '.join(sorted(names))}")
    return ModelConfig(**section)


__all__ = ["ModelConfig", "ObjectiveConfig", "PRESETS", "OBJECTIVES", "ORDERS", "apply_preset", "model_config_from_dict"]
