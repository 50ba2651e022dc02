"""A set diffusion language model for Hugging Face transformers, exported by `setdlm convert to-hf`.

MAINTAINERS: this file is a second, stand-alone copy of setdlm's model (model/transformer.py) and of its
decoding (model/sampling/). It ships inside every export and imports nothing of the setdlm package, on
purpose (docs/architecture.md, "The exported modeling code"). A change to the block (norm, MLP,
attention, rotary) or to decoding must be made here too; tests/test_family_contract.py checks this
copy's logits and greedy tokens against the package's for every family and block choice. It reads
the two inference traits of config.json's `set_diffusion` (`inference_mask`, `decoding`) and never
the name of the family a model was trained as.

Self-contained: depends only on torch and transformers, so

    model = AutoModelForMaskedLM.from_pretrained(DIR, trust_remote_code=True)
    logits = model(input_ids, position_ids=..., attention_mask=...).logits

works without the setdlm package. One decoder-only transformer serves every set schedule; what
differs is the attention mask and the positions, so `forward` takes both:

* `position_ids` [B, T]: the original sequence position of every token (rotary phases). Set-diffusion
  layouts permute tokens, so positions need not be increasing. Default: 0..T-1.
* `attention_mask`: a boolean [T, T], [B, T, T] or [B, 1, T, T] matrix (True = may attend), a float
  additive [B, T, T] / [B, 1, T, T] mask, or a Hugging Face [B, T] padding mask (1 = token,
  0 = padding) combined with `attention_type`. `attention_type` (one of MASK_KINDS) builds the mask
  when no full matrix is given; the default is config.set_diffusion's `inference_mask` (causal,
  bidirectional, or block-causal in blocks of `block_size`). `build_attention_mask(kind, length)` also
  returns the two-stream training layouts over 2L tokens ("set_causal", "block_diffusion").

Logits cover the whole vocabulary; the MASK token's logit is -inf (it is never a prediction).

`set_diffusion_generate(...)` decodes by config.set_diffusion's `decoding` mode:

* `next_token`: one token per step after the prompt, with a KV cache.
* `set_window`: each step predicts every masked position of a window of `w` positions starting at the
  leftmost masked one, accepts the most confident prediction plus every one whose confidence reaches
  `threshold`, and caches the keys and values of accepted tokens (causal among themselves, after
  everything decoded earlier).
* `block`: blocks of `block_size` positions left to right; each step predicts the masked positions of
  the current block (bidirectional inside it, seeing the cache) and accepts the k most confident, k =
  ceil(masked / steps left in the block), plus every one over `threshold`; a completed block enters the
  cache (bidirectional among its tokens) with the next block's first step.
* `full_sequence`: no cache; every step re-reads the whole sequence (bidirectional) and unmasks the k
  most confident positions of the span, k = ceil(masked / steps left), plus every one over `threshold`.

Rows are decoded one after another.

Weight layout (Llama/Qwen-style names): model.embed_tokens, model.layers.N.{input_layernorm,
self_attn.{q,k,v,o}_proj, self_attn.{q,k}_norm, post_attention_layernorm, mlp.{gate,up,down}_proj
(SwiGLU) or mlp.{up,down}_proj (GELU, tanh approximation)}, model.norm, lm_head (absent when tied).
Rotary embeddings use the rotate-half convention with inv_freq = rope_theta^(-2i/head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import MaskedLMOutput

from .configuration_setdlm import SetDLMConfig

MASK_KINDS = ("causal", "bidirectional", "block_causal", "set_causal", "block_diffusion")
TWO_STREAM = ("set_causal", "block_diffusion")  # training layouts over 2L tokens


# -- masks ---------------------------------------------------------------------------------------
def build_attention_mask(kind: str, length: int, block_size: int = 1, device=None) -> torch.Tensor:
    """Boolean attention mask (True = may attend).

    causal / bidirectional / block_causal: [L, L]. Two-stream training layouts, [2L, 2L]:
    set_causal       clean stream [0, L) then MASK queries [L, 2L), both in generation order: clean r
                     sees clean s <= r; query r sees clean s < r and itself.
    block_diffusion  noisy x_t [0, L) then clean x_0 [L, 2L), blocks of `block_size`: x_t sees its own
                     block and clean earlier blocks; x_0 is block-causal.
    """
    L = int(length)
    i = torch.arange(L, device=device)
    if kind == "causal":
        return i[:, None] >= i[None, :]
    if kind == "bidirectional":
        return torch.ones(L, L, dtype=torch.bool, device=device)
    if kind == "block_causal":
        blk = i // max(int(block_size), 1)
        return blk[:, None] >= blk[None, :]
    m = torch.zeros(2 * L, 2 * L, dtype=torch.bool, device=device)
    if kind == "set_causal":
        m[:L, :L] = i[:, None] >= i[None, :]
        m[L:, :L] = i[:, None] > i[None, :]
        m[L:, L:] = torch.eye(L, dtype=torch.bool, device=device)
        return m
    if kind == "block_diffusion":
        blk = i // max(int(block_size), 1)
        m[:L, :L] = blk[:, None] == blk[None, :]
        m[:L, L:] = blk[:, None] > blk[None, :]
        m[L:, L:] = blk[:, None] >= blk[None, :]
        return m
    raise ValueError(f"attention mask kind {kind!r}: valid kinds are {', '.join(MASK_KINDS)}")


# -- layers --------------------------------------------------------------------------------------
class SetDLMRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        dtype = x.dtype  # pragma: no cover - torch < 2.4
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype)


class SetDLMLayerNorm(nn.LayerNorm):
    def __init__(self, dim: int, eps: float, bias: bool):
        super().__init__(dim, eps=eps, elementwise_affine=True, bias=bias)


def _norm(config: SetDLMConfig, dim: int) -> nn.Module:
    if config.norm_type == "rmsnorm":
        return SetDLMRMSNorm(dim, config.norm_eps)
    return SetDLMLayerNorm(dim, config.norm_eps, config.bias)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float):
    """[B, T] positions -> (cos, sin), each [B, 1, T, head_dim // 2] in float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=position_ids.device) / head_dim))
    freqs = position_ids.float()[..., None] * inv_freq.float()
    return freqs.cos()[:, None], freqs.sin()[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half convention: pairs (i, i + d/2) rotate together; computed in float32."""
    dtype = x.dtype
    x = x.float()
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


def _sdpa(q, k, v, mask, dropout_p, groups):
    if groups > 1:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, enable_gqa=True)
        except TypeError:  # pragma: no cover - torch < 2.5
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class SetDLMAttention(nn.Module):
    def __init__(self, config: SetDLMConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.theta = config.head_dim, config.rope_theta
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=config.bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=config.bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=config.bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=config.bias)
        if config.qk_norm:
            self.q_norm = SetDLMRMSNorm(d, config.norm_eps)
            self.k_norm = SetDLMRMSNorm(d, config.norm_eps)
        self.qk_norm = config.qk_norm
        self.dropout = config.attention_dropout

    def forward(self, x, cos, sin, mask, cache=None, commit: int = 0):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k_all, v_all = cache.attend(self.layer_idx, k, v, commit)
        else:
            k_all, v_all = k, v
        out = _sdpa(q, k_all, v_all, mask, self.dropout if self.training else 0.0, self.n_heads // self.n_kv)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class SetDLMMLP(nn.Module):
    def __init__(self, config: SetDLMConfig):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.swiglu = config.mlp_type == "swiglu"
        if self.swiglu:
            self.gate_proj = nn.Linear(h, f, bias=config.bias)
        self.up_proj = nn.Linear(h, f, bias=config.bias)
        self.down_proj = nn.Linear(f, h, bias=config.bias)

    def forward(self, x):
        if self.swiglu:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class SetDLMDecoderLayer(nn.Module):
    def __init__(self, config: SetDLMConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = _norm(config, config.hidden_size)
        self.self_attn = SetDLMAttention(config, layer_idx)
        self.post_attention_layernorm = _norm(config, config.hidden_size)
        self.mlp = SetDLMMLP(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, x, cos, sin, mask, cache=None, commit: int = 0):
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, commit))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class SetDLMKVCache:
    """Keys/values (rotary applied) of committed tokens, per layer, and their token positions; new
    tokens attend to the cache and themselves, and the first `commit` of them are appended after the
    forward. `fit(limit, incoming)` drops the lowest-position entries so that the cache plus a forward
    of `incoming` tokens fit in `limit` positions (decoding past max_position_embeddings)."""

    def __init__(self):
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.pos: list[int] = []  # token position of each entry, in cache order

    def fit(self, limit: int, incoming: int) -> None:
        over = len(self.pos) + incoming - limit
        if over <= 0:
            return
        drop = set(sorted(range(len(self.pos)), key=self.pos.__getitem__)[:over])
        keep = [i for i in range(len(self.pos)) if i not in drop]
        self.pos = [self.pos[i] for i in keep]
        for d in (self.k, self.v):
            for layer, t in d.items():
                d[layer] = t[:, :, keep]

    def length(self) -> int:
        return next(iter(self.k.values())).shape[2] if self.k else 0

    def attend(self, layer: int, k, v, commit: int):
        if layer in self.k:
            k_all, v_all = torch.cat((self.k[layer], k), 2), torch.cat((self.v[layer], v), 2)
        else:
            k_all, v_all = k, v
        if commit:
            n = self.length_of(layer)
            self.k[layer] = k_all[:, :, : n + commit]
            self.v[layer] = v_all[:, :, : n + commit]
        return k_all, v_all

    def length_of(self, layer: int) -> int:
        return self.k[layer].shape[2] if layer in self.k else 0


# -- models --------------------------------------------------------------------------------------
class SetDLMPreTrainedModel(PreTrainedModel):
    config_class = SetDLMConfig
    base_model_prefix = "model"
    _no_split_modules = ["SetDLMDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (SetDLMRMSNorm, SetDLMLayerNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class SetDLMModel(SetDLMPreTrainedModel):
    """The decoder stack: embeddings, layers, final norm (hidden states out)."""

    def __init__(self, config: SetDLMConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([SetDLMDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = _norm(config, config.hidden_size)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, position_ids=None, mask=None, inputs_embeds=None, cache=None, commit: int = 0):
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = rotary_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, commit)
        return self.norm(x)


@dataclass
class SetDiffusionOutput:
    """Output of `set_diffusion_generate`: per row, the generated tokens (cut before EOS; the span for
    infilling), the number of decoding steps (model forwards after the prefill) and tokens per step."""

    sequences: list = field(default_factory=list)
    steps: list = field(default_factory=list)
    tokens_per_step: list = field(default_factory=list)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the `top_k` largest logits (0: all), then the smallest most likely set whose probability
    reaches `top_p` (1: all; at least one token); the rest become -inf."""
    if top_k and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(-1, idx, drop), float("-inf"))
    return logits


class _FirstHitting:
    """First-hitting times of a plain row's n generated positions under the staggered schedule of the
    model's length L (b, k as the paper's evaluation sets them: S_max = 2 w, D the model's set size);
    every row draws from the same starting state of the generator, which then moves on by one draw."""

    def __init__(self, sd: dict, w: int, device, generator):
        L = int(sd.get("length") or 1024)
        D, S = min(int(sd.get("set_size") or w), L), min(2 * int(w), L)
        area = D / (2 * L)
        k = sd.get("k") if sd.get("k_explicit") else None
        if k is not None:
            self.k = float(k)
            self.b = area * (self.k + 1) / self.k
        elif D not in (1, S):
            self.b = S / (L + S - 1)
            self.k = area / (self.b - area)
        else:
            self.b, self.k = 2 * area, 1.0
        self.L, self.device = L, torch.device(device)
        if generator is None:
            generator = torch.default_generator if self.device.type == "cpu" else torch.cuda.default_generators[
                self.device.index if self.device.index is not None else torch.cuda.current_device()]
        self.src, self.state, self.moved = generator, generator.get_state(), False

    def times(self, n: int) -> list:
        g = torch.Generator(device=self.device)
        g.set_state(self.state)
        e = torch.empty(1, n, dtype=torch.float64, device=self.device).exponential_(generator=g)[0]
        if not self.moved:
            self.moved = True
            if torch.equal(self.src.get_state(), self.state):
                self.src.set_state(g.get_state())
        loc = torch.linspace(0.0, 1.0 - self.b, self.L, dtype=torch.float64, device=self.device).flip(0)
        if n <= self.L:
            loc = loc[self.L - n:]
        else:  # past the model's length: the same spacing continues
            step = (1.0 - self.b) / max(self.L - 1, 1)
            loc = torch.cat((step * torch.arange(n - 1, self.L - 1, -1, dtype=torch.float64, device=self.device), loc))
        return (loc + self.b * -torch.expm1(-e / self.k)).tolist()


class SetDLMForMaskedLM(SetDLMPreTrainedModel, GenerationMixin):
    """Logits over the vocabulary for every input token (MASK logit -inf), plus the set sampler
    (`set_diffusion_generate`) and transformers' `generate()` over it."""

    _sample_filters = (0, 1.0)  # (top_k, top_p) of sampled steps: set by generate() for its call

    def __init__(self, config: SetDLMConfig):
        super().__init__(config)
        self.model = SetDLMModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return None if self.config.tie_word_embeddings else self.lm_head

    # -- forward -----------------------------------------------------------------------------
    def _mask(self, attention_mask, attention_type, B, T, device, dtype):
        """A full [T, T] (bool), [B, T, T] or [B, 1, T, T] matrix is used as given (bool: True = attend;
        float: additive); any other 2-D mask is a [B, T] padding mask applied to `attention_type`."""
        m = attention_mask
        if m is not None and (m.dim() in (3, 4) or (m.dim() == 2 and m.dtype == torch.bool and m.shape == (T, T))):
            if m.shape[-2:] != (T, T):
                raise ValueError(f"attention_mask: a {m.dim()}-D attention matrix must end in [T, T] = [{T}, {T}], "
                                 f"got shape {tuple(m.shape)}")
            m = m.to(device)
            m = m[:, None] if m.dim() == 3 else m
            return m if m.dtype == torch.bool else m.to(dtype)
        kind = attention_type or self.config.inference_mask
        block = self.config.block_size
        two_stream = kind in TWO_STREAM
        if two_stream and T % 2:
            raise ValueError(f"attention_type={kind!r} needs an even number of tokens (two streams of L), got {T}")
        pattern = build_attention_mask(kind, T // 2 if two_stream else T, block, device)
        if m is None:
            return pattern
        if m.dim() != 2 or tuple(m.shape) != (B, T):
            raise ValueError(f"attention_mask: expected a [B, T] = [{B}, {T}] padding mask or a bool [T, T] / "
                             f"[B, T, T] / [B, 1, T, T] attention matrix, got shape {tuple(m.shape)}")
        keep = m.to(device) != 0
        full = pattern[None, None] & keep[:, None, None, :]
        return full | torch.eye(T, dtype=torch.bool, device=device)[None, None]  # padded rows keep themselves

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                attention_type: str | None = None, return_dict: bool | None = None, **kwargs):
        ref = input_ids if input_ids is not None else inputs_embeds
        if ref is None:
            raise ValueError("forward: pass input_ids or inputs_embeds")
        B, T = ref.shape[:2]
        device = ref.device
        if position_ids is None:
            position_ids = torch.arange(T, device=device).expand(B, T)
        mask = self._mask(attention_mask, attention_type, B, T, device, self.model.embed_tokens.weight.dtype)
        hidden = self.model(input_ids, position_ids.to(device), mask, inputs_embeds)
        logits = self.logits(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).to(device), ignore_index=-100)
        if return_dict is False:
            return (loss, logits) if loss is not None else (logits,)
        return MaskedLMOutput(loss=loss, logits=logits)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            out = F.linear(hidden, self.model.embed_tokens.weight)
        else:
            out = self.lm_head(hidden)
        out = out.float()
        if self.config.mask_token_id is not None:
            out[..., int(self.config.mask_token_id)] = float("-inf")
        return out

    # -- decoding ----------------------------------------------------------------------------
    def _step(self, cache, ids, pos, mask, commit, n_out):
        dev = self.model.embed_tokens.weight.device
        ids_t = torch.tensor([ids], dtype=torch.long, device=dev)
        pos_t = torch.tensor([pos], dtype=torch.long, device=dev)
        keys = torch.ones(len(ids), cache.length(), dtype=torch.bool, device=dev)
        full = torch.cat((keys, mask.to(dev)), 1)[None, None]
        hidden = self.model(ids_t, pos_t, full, cache=cache, commit=commit)
        cache.pos += pos[:commit]
        return self.logits(hidden[:, len(ids) - n_out:]) if n_out else None

    def _fit(self, cache, incoming: int) -> None:
        limit = int(self.config.max_position_embeddings)
        if incoming > limit:
            raise ValueError(f"set_diffusion_generate: a step forwards {incoming} tokens, more than "
                             f"max_position_embeddings {limit}; lower the window")
        cache.fit(limit, incoming)

    def _choose(self, logits, temperature, generator):
        if temperature and temperature > 0:
            probs = _filter_top_k_top_p(logits / temperature, *self._sample_filters).softmax(-1)
            tok = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=generator).view(probs.shape[:-1])
            return tok, probs.gather(-1, tok[..., None])[..., 0]
        probs = logits.softmax(-1)
        conf, tok = probs.max(-1)
        return tok, conf

    @torch.no_grad()
    def generate(self, input_ids=None, attention_mask=None, generation_config: GenerationConfig | None = None, *,
                 window: int | None = None, threshold: float | None = None, steps: int | None = None,
                 generator: torch.Generator | None = None, **kwargs):
        """transformers' `generate()` for set decoding: a thin wrapper over `set_diffusion_generate`.

        `input_ids` [B, P] with an optional `attention_mask` [B, P] (0 = padding, left or right: each
        row's prompt is its unmasked tokens); the settings come from `generation_config` (default: the
        export's generation_config.json) updated by keyword arguments, as transformers' generate()
        takes them: `max_new_tokens` (or `max_length`), `do_sample` (False: greedy), `temperature`,
        `top_k`, `top_p`, `num_return_sequences`, `eos_token_id`, `pad_token_id`,
        `return_dict_in_generate`. Set decoding's own settings: `window`, `threshold` and `steps`
        (default: generation_config.set_diffusion's `window`, `confidence_threshold` and `steps`); `generator` seeds
        sampling. Returns [B * num_return_sequences, P + N] token ids, the prompt followed by the new
        tokens, an EOS that ended a row kept and the rest padded with `pad_token_id` (a
        GenerateDecoderOnlyOutput with `sequences` when `return_dict_in_generate`). Greedy, it gives the
        tokens of the setdlm package's `model.sampling.generate` for the same prompts."""
        base = generation_config if generation_config is not None else getattr(self, "generation_config", None)
        config = GenerationConfig.from_dict(base.to_dict()) if base is not None else GenerationConfig()  # a copy
        unused = config.update(**kwargs)
        if unused:
            raise ValueError(f"generate: unsupported arguments {sorted(unused)} (set decoding takes generation "
                             "settings, window, threshold, steps and generator)")
        for name, neutral in (("num_beams", 1), ("repetition_penalty", 1.0), ("no_repeat_ngram_size", 0),
                              ("penalty_alpha", None)):
            if getattr(config, name, None) not in (None, neutral):
                raise NotImplementedError(f"generate: {name}={getattr(config, name)!r} is not part of set decoding; "
                                          "use the setdlm package's sampler")
        if input_ids is None:
            raise ValueError("generate: pass input_ids [B, P]")
        input_ids = torch.as_tensor(input_ids)
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else \
            torch.as_tensor(attention_mask).to(input_ids.device) != 0
        n = int(config.num_return_sequences or 1)
        prompts = [row[m].tolist() for row, m in zip(input_ids, keep) for _ in range(n)]
        P = input_ids.shape[1]
        max_new = config.max_new_tokens
        if max_new is None:
            max_new = max(int(config.max_length) - P, 0) if config.max_length else 20
        eos = config.eos_token_id
        if isinstance(eos, (list, tuple)):
            if len(eos) > 1:
                raise NotImplementedError(f"generate: set decoding stops at one eos_token_id, got {list(eos)}")
            eos = eos[0] if eos else None
        eos = int(eos) if eos is not None else None
        pad = config.pad_token_id if config.pad_token_id is not None else (eos if eos is not None else 0)
        pad = int(pad[0] if isinstance(pad, (list, tuple)) else pad)
        sd = getattr(config, "set_diffusion", None) or {}
        window = window if window is not None else sd.get("window")
        threshold = threshold if threshold is not None else sd.get("confidence_threshold")
        steps = steps if steps is not None else sd.get("steps")
        sample = bool(config.do_sample)
        temperature = (float(config.temperature) if config.temperature is not None else 1.0) if sample else 0.0
        self._sample_filters = (int(config.top_k or 0), float(config.top_p if config.top_p is not None else 1.0))
        try:
            out = self.set_diffusion_generate(prompts, max_new_tokens=int(max_new), window=window, threshold=threshold,
                                              eos_token_id=eos, stop_on_eos=eos is not None, temperature=temperature,
                                              generator=generator, steps=steps)
        finally:
            del self._sample_filters  # back to the class's (no filtering)
        rows = [list(t) + ([eos] if eos is not None and len(t) < max_new else []) for t in out.sequences]
        width = max((len(r) for r in rows), default=0)
        new = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=input_ids.dtype,
                           device=input_ids.device).view(len(rows), width)
        sequences = torch.cat((input_ids.repeat_interleave(n, 0), new), 1)
        if config.return_dict_in_generate:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    @torch.no_grad()
    def set_diffusion_generate(self, input_ids, max_new_tokens: int = 128, window: int | None = None,
                               threshold: float | None = None, eos_token_id: int | None = None,
                               stop_on_eos: bool = True, suffix_ids=None, temperature: float = 0.0,
                               generator: torch.Generator | None = None,
                               cache_order: str | None = None, steps: int | None = None) -> SetDiffusionOutput:
        """Decode after each prompt (a list of token-id lists, or a [B, P] tensor without padding), in the
        model's decoding mode (config.set_diffusion["decoding"]; the module's docstring says what each
        mode does). Tokens are chosen greedily (`temperature` 0) or sampled.

        `threshold`: every masked position whose probability is >= it is accepted too (None: set_window
        accepts exactly one per step, block and full_sequence their k). `window` (set_window): masked
        positions from the leftmost one predicted per step (default: the model's D, set_size). `steps`:
        denoising steps per block (block; default block_size) or over the span (full_sequence; default its
        length). `suffix_ids` (one list per row) turns a row into infilling: prefix + `max_new_tokens`
        MASK + suffix, with prefix and suffix visible and no EOS stop (next_token conditions on the
        prefix alone). A generated EOS ends a plain row (`stop_on_eos`); next_token starts an empty
        prompt at EOS.

        `cache_order` (set_window; "position" or "first_hitting"; default: config.set_diffusion["cache_order"],
        the mode the model was trained or released with): the order in which one step's accepted tokens
        are cached and attend among themselves. "first_hitting" (the paper's GSM8K mode) orders them by
        descending first-hitting time T_j = loc_{L-n+j} + b (1 - exp(-E_j / k)) of the span's n
        positions, E ~ Exp(1) drawn once per row from `generator` (else torch's global generator),
        every row from the same starting state; infilling rows keep position order.

        The prompt (prefix and suffix) must fit in max_position_embeddings (full_sequence: the whole
        sequence); the cached modes decode past it as the setdlm package's sampler does: before each
        forward, the cached tokens with the lowest positions are dropped so that cache + the forward's
        tokens fit (positions keep counting up).
        """
        mode = self.config.decoding
        mask_id = self.config.mask_token_id
        if mask_id is None:
            raise ValueError("set_diffusion_generate: config.mask_token_id is not set")
        if eos_token_id is None:
            eos_token_id = self.config.eos_token_id if isinstance(self.config.eos_token_id, int) else None
        w = int(window or self.config.set_diffusion.get("set_size") or 4)
        cache_order = cache_order or self.config.set_diffusion.get("cache_order") or "position"
        if cache_order not in ("position", "first_hitting"):
            raise ValueError("set_diffusion_generate: cache_order must be 'position' or 'first_hitting', got "
                             f"{cache_order!r}")
        if steps is not None and int(steps) < 1:
            raise ValueError(f"set_diffusion_generate: steps must be >= 1, got {steps}")
        ordered = cache_order == "first_hitting" and mode == "set_window" and threshold is not None and threshold < 1.0
        fht = _FirstHitting(self.config.set_diffusion, w, self.model.embed_tokens.weight.device, generator) \
            if ordered else None
        if hasattr(input_ids, "tolist"):
            input_ids = input_ids.tolist()
        if input_ids and isinstance(input_ids[0], int):
            raise TypeError("set_diffusion_generate: input_ids must be a batch (list of lists or a [B, P] tensor)")
        suffixes = suffix_ids if suffix_ids is not None else [None] * len(input_ids)
        run = {"next_token": self._decode_next_token, "set_window": self._decode_set_window,
               "block": self._decode_block, "full_sequence": self._decode_full_sequence}[mode]
        limit = int(self.config.max_position_embeddings)
        was_training = self.training
        self.eval()
        out = SetDiffusionOutput()
        try:
            for prefix, suffix in zip(input_ids, suffixes):
                prefix = [int(t) for t in prefix]
                suffix = None if suffix is None else [int(t) for t in (suffix.tolist() if hasattr(suffix, "tolist") else suffix)]
                if mode == "next_token":
                    suffix_seen = 0  # conditions on the prefix alone
                    if not prefix and eos_token_id is not None:
                        prefix = [int(eos_token_id)]  # an empty prompt starts at EOS (GPT-2's convention)
                else:
                    suffix_seen = len(suffix or [])
                if mode == "full_sequence" and len(prefix) + int(max_new_tokens) + suffix_seen > limit:
                    raise ValueError(f"set_diffusion_generate: {len(prefix) + int(max_new_tokens) + suffix_seen} "
                                     f"tokens (prompt + span) exceed max_position_embeddings {limit}; this model "
                                     "re-reads the whole sequence every step, which must fit")
                if len(prefix) + suffix_seen > limit:  # prefilled in one forward: it must fit
                    raise ValueError(f"set_diffusion_generate: {len(prefix) + suffix_seen} prompt tokens exceed "
                                     f"max_position_embeddings {limit} (decoding past it drops the oldest cached "
                                     "tokens, but the prompt must fit)")
                times = fht.times(int(max_new_tokens)) if fht is not None and suffix is None else None
                opts = dict(w=w, threshold=threshold, temperature=temperature, generator=generator, times=times,
                            steps=steps)
                toks, n_steps = run(prefix, suffix if suffix_seen else None, int(max_new_tokens), mask_id,
                                    eos_token_id if stop_on_eos and suffix is None else None, opts)
                out.sequences.append(toks)
                out.steps.append(n_steps)
                out.tokens_per_step.append(len(toks) / n_steps if n_steps else 0.0)
        finally:
            self.train(was_training)
        return out

    # -- the decoding modes: (prefix, suffix, n, mask_id, eos, opts) -> (tokens, steps) of one row -------
    def _prefill(self, cache, canvas, visible, mask) -> None:
        if visible:
            self._step(cache, [canvas[p] for p in visible], visible, mask, len(visible), 0)

    def _top_k(self, conf, active, k, threshold) -> list:
        """The k most confident active positions (ties: the lower index) plus every active one whose
        confidence is >= threshold."""
        ranked = sorted((i for i in range(len(active)) if active[i]), key=lambda i: -float(conf[i]))
        accept = set(ranked[:k])
        if threshold is not None and threshold < 1.0:
            accept |= {i for i in range(len(active)) if active[i] and float(conf[i]) >= threshold}
        return sorted(accept)

    @staticmethod
    def _write(canvas, todo, end, positions, tokens, eos) -> int:
        """Accepted tokens written; the span ends at the first EOS among them (its later masks dropped)."""
        for p, t in zip(positions, tokens):
            canvas[p], todo[p] = t, False
        if eos is not None:
            hits = [p for p, t in zip(positions, tokens) if t == eos]
            if hits and min(hits) < end:
                end = min(hits)
                for p in range(end, len(todo)):
                    todo[p] = False
        return end

    def _decode_set_window(self, prefix, suffix, n, mask_id, eos, opts):
        w, threshold, times = opts["w"], opts["threshold"], opts["times"]
        P = len(prefix)
        canvas = prefix + [mask_id] * n + (suffix or [])
        todo = [False] * P + [True] * n + [False] * len(suffix or [])
        end = P + n
        cache = SetDLMKVCache()
        visible = list(range(P)) + list(range(P + n, len(canvas)))
        self._prefill(cache, canvas, visible, torch.ones(len(visible), len(visible), dtype=torch.bool).tril())
        pend_tok, pend_pos = [], []
        steps = 0
        while True:
            start = next((p for p in range(P, end) if todo[p]), None)
            if start is None:
                break
            q = [p for p in range(start, min(start + w, end)) if todo[p]]
            c, m = len(pend_tok), len(q)
            self._fit(cache, c + m)
            mask = torch.zeros(c + m, c + m, dtype=torch.bool)
            mask[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
            mask[c:, :c] = True
            mask[c:, c:] = torch.eye(m, dtype=torch.bool)
            logits = self._step(cache, pend_tok + [mask_id] * m, pend_pos + q, mask, c, m)[0]
            steps += 1
            tok, conf = self._choose(logits, opts["temperature"], opts["generator"])
            best = int(conf.argmax())
            accept = [i for i in range(m) if i == best or (threshold is not None and threshold < 1.0
                                                           and float(conf[i]) >= threshold)]
            end = self._write(canvas, todo, end, [q[i] for i in accept], [int(tok[i]) for i in accept], eos)
            pend_pos = [q[i] for i in accept if q[i] < end]
            pend_tok = [canvas[p] for p in pend_pos]
            if times is not None:  # first-hitting cache order: the latest first-hitting time first
                order = sorted(range(len(pend_pos)), key=lambda i: -times[pend_pos[i] - P])
                pend_tok, pend_pos = [pend_tok[i] for i in order], [pend_pos[i] for i in order]
        return canvas[P:end], steps

    def _decode_block(self, prefix, suffix, n, mask_id, eos, opts):
        B = self.config.block_size
        per_block = int(opts["steps"] or B)
        P = len(prefix)
        canvas = prefix + [mask_id] * n + (suffix or [])
        todo = [False] * P + [True] * n + [False] * len(suffix or [])
        end = P + n
        cache = SetDLMKVCache()
        visible = list(range(P)) + list(range(P + n, len(canvas)))
        blk = torch.tensor(visible, dtype=torch.long) // B
        self._prefill(cache, canvas, visible, blk[:, None] >= blk[None, :])  # block-causal
        pend_pos = []  # the last completed block, entering the cache with the next step
        block, used, steps = -1, 0, 0
        while True:
            start = next((p for p in range(P, end) if todo[p]), None)
            if start is None:
                break
            if start // B != block:
                block, used = start // B, 0
            q = [p for p in range(block * B, block * B + B) if P <= p < end]
            pend_pos = [p for p in pend_pos if p < end]
            c, m = len(pend_pos), len(q)
            self._fit(cache, c + m)
            mask = torch.ones(c + m, c + m, dtype=torch.bool)
            mask[:c, c:] = False  # the completed block never sees the current one
            logits = self._step(cache, [canvas[p] for p in pend_pos + q], pend_pos + q, mask, c, m)[0]
            steps += 1
            tok, conf = self._choose(logits, opts["temperature"], opts["generator"])
            active = [todo[p] for p in q]
            left = max(per_block - used, 1)
            used += 1
            accept = self._top_k(conf, active, -(-sum(active) // left), opts["threshold"])
            end = self._write(canvas, todo, end, [q[i] for i in accept], [int(tok[i]) for i in accept], eos)
            complete = not any(todo[p] for p in q)
            pend_pos = [p for p in q if p < end] if complete else []
        return canvas[P:end], steps

    def _decode_full_sequence(self, prefix, suffix, n, mask_id, eos, opts):
        P = len(prefix)
        canvas = prefix + [mask_id] * n + (suffix or [])
        todo = [False] * P + [True] * n + [False] * len(suffix or [])
        end = P + n
        total = int(opts["steps"] or n)
        dev = self.model.embed_tokens.weight.device
        pos = torch.arange(len(canvas), device=dev)[None]
        full = torch.ones(1, 1, len(canvas), len(canvas), dtype=torch.bool, device=dev)
        steps = 0
        while any(todo[P:end]):
            ids = torch.tensor([canvas], dtype=torch.long, device=dev)
            logits = self.logits(self.model(ids, pos, full)[:, P:P + n])[0]
            tok, conf = self._choose(logits, opts["temperature"], opts["generator"])
            active = todo[P:P + n]
            left = max(total - steps, 1)
            steps += 1
            accept = self._top_k(conf, active, -(-sum(active) // left), opts["threshold"])
            end = self._write(canvas, todo, end, [P + i for i in accept], [int(tok[i]) for i in accept], eos)
        return canvas[P:end], steps

    def _decode_next_token(self, prefix, suffix, n, mask_id, eos, opts):
        if not prefix:
            raise ValueError("set_diffusion_generate: next-token decoding needs at least one prompt token (or an "
                             "eos_token_id to start from)")
        cache = SetDLMKVCache()
        P = len(prefix)
        logits = self._step(cache, prefix, list(range(P)), torch.ones(P, P, dtype=torch.bool).tril(), P, 1)[0]
        out, steps = [], 0
        for i in range(n):
            tok, _ = self._choose(logits, opts["temperature"], opts["generator"])
            t = int(tok[-1])
            steps += 1
            if eos is not None and t == eos:
                break
            out.append(t)
            if i + 1 < n:
                self._fit(cache, 1)
                logits = self._step(cache, [t], [P + i], torch.ones(1, 1, dtype=torch.bool), 1, 1)[0]
        return out, steps
