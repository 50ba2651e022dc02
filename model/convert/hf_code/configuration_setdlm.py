"""Configuration of a set diffusion language model exported by `setdlm convert to-hf`.

Self-contained: depends only on `transformers`. The architecture fields follow the usual Hugging Face
names; `set_diffusion` records the training objective and its order schedule, and the two inference
traits this code acts on (it never branches on the family's name, which is a record only):

    inference_mask   the attention of `forward` when no full mask is given, and of a prompt's prefill:
                     causal | bidirectional | block_causal (blocks of block_size)
    decoding         how `set_diffusion_generate` decodes: next_token | set_window | block | full_sequence
                     (modeling_setdlm.py says what each does)
    family           the training objective's name in setdlm (objective.name)
    length           L, the training sequence length
    set_size         D, the equivalent block size (expected D/2 positions predicted per step)
    s_max            S_max, window of overlapping reveal intervals (2 D by default)
    k                exponent of the per-position masking curve 1 - (1 - x)^k
    b                reveal-interval width S_max / (L + S_max - 1)
    order            sliding_window | any_order | left_to_right
    block_size       block size of block-causal attention and block decoding
    mask_token_id    id of the MASK token (its logit is always -inf)
"""

try:  # transformers >= 5 spells it PreTrainedConfig; 4.x only has PretrainedConfig
    from transformers import PreTrainedConfig as _BaseConfig
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers import PretrainedConfig as _BaseConfig

# The traits this code knows (setdlm's model/families/spec.py holds the same two lists).
INFERENCE_MASKS = ("causal", "bidirectional", "block_causal")
DECODING_MODES = ("next_token", "set_window", "block", "full_sequence")
# A configuration made without a set_diffusion section (transformers builds one to diff against): a causal LM.
DEFAULT_TRAITS = {"inference_mask": "causal", "decoding": "next_token"}


class SetDLMConfig(_BaseConfig):
    model_type = "setdlm"

    def __init__(
        self,
        vocab_size: int = 50258,
        hidden_size: int = 768,
        intermediate_size: int = 3072,
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        norm_type: str = "layernorm",
        norm_eps: float = 1e-5,
        mlp_type: str = "gelu",
        qk_norm: bool = False,
        bias: bool = True,
        lm_head_bias: bool = False,
        rope_theta: float = 10000.0,
        max_position_embeddings: int = 1024,
        hidden_dropout: float = 0.0,
        attention_dropout: float = 0.0,
        initializer_range: float = 0.02,
        mask_token_id: int | None = None,
        set_diffusion: dict | None = None,
        tie_word_embeddings: bool = False,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.norm_type = norm_type
        self.norm_eps = norm_eps
        self.mlp_type = mlp_type
        self.qk_norm = qk_norm
        self.bias = bias
        self.lm_head_bias = lm_head_bias
        self.rope_theta = rope_theta
        self.max_position_embeddings = max_position_embeddings
        self.hidden_dropout = hidden_dropout
        self.attention_dropout = attention_dropout
        self.initializer_range = initializer_range
        self.mask_token_id = mask_token_id
        self.set_diffusion = dict(set_diffusion) if set_diffusion is not None else dict(DEFAULT_TRAITS)
        self.tie_word_embeddings = tie_word_embeddings
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self._check()

    def _check(self) -> None:
        def bad(name, msg):
            raise ValueError(f"SetDLMConfig.{name}: {msg}")

        if self.norm_type not in ("layernorm", "rmsnorm"):
            bad("norm_type", f"{self.norm_type!r} is not one of layernorm, rmsnorm")
        if self.mlp_type not in ("gelu", "swiglu"):
            bad("mlp_type", f"{self.mlp_type!r} is not one of gelu, swiglu")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_key_value_heads", f"{self.num_attention_heads} heads are not a multiple of "
                                       f"{self.num_key_value_heads} KV heads")
        if self.head_dim % 2:
            bad("head_dim", f"rotary embeddings need an even head dimension, got {self.head_dim}")
        for key, valid in (("inference_mask", INFERENCE_MASKS), ("decoding", DECODING_MODES)):
            value = self.set_diffusion.get(key)
            if value is None:
                bad(f"set_diffusion.{key}", "missing (config.json of an export format before 2 ships its own, older "
                                            "modeling code; re-export the model with setdlm to use this code)")
            if value not in valid:
                bad(f"set_diffusion.{key}", f"{value!r} is not one of {', '.join(valid)}")
        block = self.set_diffusion.get("block_size")
        if block is not None and (not isinstance(block, int) or isinstance(block, bool) or block < 1):
            bad("set_diffusion.block_size", f"must be a whole number >= 1, got {block!r}")
        if self.mask_token_id is not None and not 0 <= int(self.mask_token_id) < self.vocab_size:
            bad("mask_token_id", f"{self.mask_token_id} is outside the vocabulary of {self.vocab_size}")
        if self.lm_head_bias and self.tie_word_embeddings:
            bad("lm_head_bias", "an output-head bias needs untied embeddings")

    @property
    def inference_mask(self) -> str:
        return self.set_diffusion["inference_mask"]

    @property
    def decoding(self) -> str:
        return self.set_diffusion["decoding"]

    @property
    def block_size(self) -> int:
        return int(self.set_diffusion.get("block_size") or 1)
