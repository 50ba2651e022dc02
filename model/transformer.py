"""Transformer with per-token rotary positions, structured masks and a set-decoding KV cache.

One model serves every schedule (AR, MDLM, BD3-LM, SW-SetDLM): objectives decide the token layout,
positions and mask kind; the transformer only runs it. Layers are keyed by their *global* index so a
state dict is the same under any pipeline split.

The model is torch alone. Its linears, embedding and head, and the communication around them, come
from a `model.layers.TensorParallel`: by default one process (TP=1, plain torch layers, nothing to
communicate), so a model builds, trains, loads and decodes in any Python process. A tensor-parallel
run hands it a multi-rank implementation instead (pretrain/parallelize.py); nothing else changes.

Weight layouts are independent of the tensor-parallel size, so a TP=1 state dict slices into any TP:
- QKV rows are grouped per KV head: [q_0 .. q_{g-1}, k, v] x kv_heads (each block head_dim rows);
- SwiGLU fc1 rows alternate gate/up: row 2j is gate j, row 2j+1 is up j;
- the vocabulary is padded to a multiple of `vocab_pad_multiple`; padding and MASK logits are -inf.

Initialisation is independent of the layout and happens per shard (model/init.py): the layers are
allocated without values (on the device of the surrounding `torch.device` context), then every rank
draws only its own units of each weight from generators seeded by (base seed, parameter name, unit),
the base seed being one draw from the global CPU generator. So a model built after
`torch.manual_seed(s)` has the same full weights under any TP x PP layout, no rank ever holds a full
weight matrix on the host, and building a model leaves no trace on the global RNG beyond that one draw.

Sequence parallelism (a `TensorParallel` with `sequence_parallel`, TP > 1): between the tensor-parallel
regions the hidden states are split along the sequence, `[T/tp, B, H]`; column-parallel linears
gather them, row-parallel linears reduce-scatter. Norms, residuals and dropout then work on 1/tp of
the tokens; their replicated weights (norms, row-parallel biases) get their gradients summed over the
TP group inside autograd (`all_reduce_grad`). The head gathers the sequence back.

Context parallelism (a `model.context_parallel.ContextParallel` of size > 1, training only): the tokens
are a CP rank's head-tail chunks of every stream, `forward` is given that rank's `RankLayout`
(`context=`) and its rank-local mask, and every attention layer gathers the exchanged stream's K/V
(after QK-norm and rotary) from the CP group before its core (model/context_parallel.py).

Under pipeline parallelism a last stage with tied embeddings that does not hold the input embedding
keeps a copy of it (same name `embed.weight`, same seeded initialisation, hence equal values); the
training step keeps the copies equal.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .config import ModelConfig
from . import flex
from .context_parallel import ContextParallel, RankLayout, exchange_kv
from .init import init_weights
from .kv_cache import KVCache
from .layers import TensorParallel
from .masks import MaskSpec
from .rotary import Rotary, apply_rotary


# CPU inference: a head product over this many rows runs as [vocab, hidden] x [hidden, rows] on the
# weight's own layout (a decode step's few query rows: 1.2-1.5x faster than rows x the transposed copy
# at 3-5 rows on the development CPUs, docs/sampling.md); one row (a matrix-vector product) and more rows
# use the transposed copy (`Transformer.transposed_head`).
FEW_HEAD_ROWS = range(2, 6)


def _norm(cfg: ModelConfig, dim: int) -> torch.nn.Module:
    if cfg.norm == "rmsnorm":
        return torch.nn.RMSNorm(dim, eps=cfg.norm_eps)
    return torch.nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


def _sp_weight(w: torch.Tensor | None, tp: TensorParallel) -> torch.Tensor | None:
    """A replicated weight used on this rank's slice of the sequence (sequence parallelism): identity
    forward, gradient summed over the TP group backward, so the replicas stay equal."""
    return tp.all_reduce_grad(w) if tp.sequence_parallel and w is not None else w


def _apply_norm(norm: torch.nn.Module, x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    if not tp.sequence_parallel:
        return norm(x)
    if isinstance(norm, torch.nn.RMSNorm):
        return F.rms_norm(x, norm.normalized_shape, _sp_weight(norm.weight, tp), norm.eps)
    return F.layer_norm(x, norm.normalized_shape, _sp_weight(norm.weight, tp), _sp_weight(norm.bias, tp), norm.eps)


def _add_bias(out: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel) -> torch.Tensor:
    return out if bias is None else out + _sp_weight(bias, tp)


class Attention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer_id: int, cp: ContextParallel | None = None):
        super().__init__()
        self.tp = tp
        self.cp = cp or ContextParallel()
        self.layer_id = layer_id
        self.sp = tp.sequence_parallel
        self.head_dim = cfg.dim_head
        self.groups = cfg.kv_heads // tp.size  # KV heads on this rank
        self.q_per_group = cfg.n_heads // cfg.kv_heads
        qkv_out = (cfg.n_heads + 2 * cfg.kv_heads) * self.head_dim
        self.qkv = tp.column_linear(cfg.hidden, qkv_out, bias=cfg.bias)
        self.proj = tp.row_linear(cfg.n_heads * self.head_dim, cfg.hidden, bias=cfg.bias, skip_bias_add=self.sp)
        self.q_norm = torch.nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = torch.nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.dropout_p = cfg.attention_dropout

    def _head_norm(self, norm: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """QK-norm. Its weight is replicated over TP ranks but each rank normalises only its own heads:
        the weight's gradient is the sum over TP ranks (all-reduced in backward, like a sequence-parallel
        norm), else the replicas would drift apart."""
        if self.tp.size == 1:
            return norm(x)
        return F.rms_norm(x, norm.normalized_shape, self.tp.all_reduce_grad(norm.weight), norm.eps)

    def forward(self, x, rope, mask, cache: KVCache | None = None, context: RankLayout | None = None):
        qkv = self.qkv(x)[0]
        if self.sp:  # gathered [T, B, .] -> [B, T, .]
            qkv = qkv.transpose(0, 1)
        B, T = qkv.shape[:2]
        qkv = qkv.reshape(B, T, self.groups, self.q_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.q_per_group].reshape(B, T, -1, self.head_dim).transpose(1, 2)
        k = qkv[:, :, :, -2].transpose(1, 2)
        v = qkv[:, :, :, -1].transpose(1, 2)
        if self.q_norm is not None:
            q, k = self._head_norm(self.q_norm, q), self._head_norm(self.k_norm, k)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.attend_kv(self.layer_id, k, v)
        if context is not None:  # context parallelism: the exchanged stream's K/V from every CP rank
            k, v = exchange_kv(self.cp, context, k, v)
        out = self.core(q, k, v, mask)
        out = out.transpose(1, 2).reshape(B, T, -1)
        if not self.sp:
            return self.proj(out)[0]
        out = out.transpose(0, 1).contiguous()  # [B, T, .] -> [T, B, .]: the row-parallel linear reduce-scatters along the sequence
        out, bias = self.proj(out)
        return _add_bias(out, bias, self.tp)

    def core(self, q, k, v, mask):
        """The attention core (scores, mask, softmax, weighted sum): what selective recomputation reruns."""
        if flex.is_block_mask(mask):  # a static mask kind's block mask, built by Transformer.forward
            return flex.attend(q, k, v, mask, enable_gqa=self.q_per_group > 1)
        if isinstance(mask, MaskSpec):  # static mask kind: flex attention with a cached block mask
            return flex.attention(q, k, v, mask.kind, mask.length, mask.block_size, enable_gqa=self.q_per_group > 1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0,
            enable_gqa=self.q_per_group > 1)


class MLP(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.swiglu = cfg.activation == "swiglu"
        self.sp = tp.sequence_parallel
        width = cfg.ffn_hidden * (2 if self.swiglu else 1)
        self.fc1 = tp.column_linear(cfg.hidden, width, bias=cfg.bias)
        self.fc2 = tp.row_linear(cfg.ffn_hidden, cfg.hidden, bias=cfg.bias, skip_bias_add=self.sp)

    def forward(self, x):
        h = self.activation(self.fc1(x)[0])
        if not self.sp:
            return self.fc2(h)[0]
        out, bias = self.fc2(h)
        return _add_bias(out, bias, self.tp)

    def activation(self, h):
        """GELU, or SwiGLU over the interleaved gate/up rows: what selective recomputation reruns."""
        if self.swiglu:
            return F.silu(h[..., 0::2]) * h[..., 1::2]
        return F.gelu(h, approximate="tanh")


class Block(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, layer_id: int, cp: ContextParallel | None = None):
        super().__init__()
        self.tp = tp
        self.norm1 = _norm(cfg, cfg.hidden)
        self.attn = Attention(cfg, tp, layer_id, cp)
        self.norm2 = _norm(cfg, cfg.hidden)
        self.mlp = MLP(cfg, tp)
        self.drop = torch.nn.Dropout(cfg.dropout)
        self.sp = tp.sequence_parallel

    def forward(self, x, rope, mask, cache=None, context=None):
        with self._dropout_rng():
            x = x + self._drop(self.attn(_apply_norm(self.norm1, x, self.tp), rope, mask, cache, context))
            return x + self._drop(self.mlp(_apply_norm(self.norm2, x, self.tp)))

    def _drop(self, h: torch.Tensor) -> torch.Tensor:
        return self.drop(h) if self.training and self.drop.p > 0 else h  # (an eval-mode dropout is the identity)

    def _dropout_rng(self):
        """Under sequence parallelism each TP rank drops on its own slice of the sequence: draw from
        the tensor-parallel random stream (different per TP rank)."""
        if self.sp and self.training and self.drop.p > 0:
            return self.tp.dropout_rng()
        return contextlib.nullcontext()


class Transformer(torch.nn.Module):
    """Decoder stack; `pre_process`/`post_process` and the layer range make it a pipeline stage.

    `tp` builds the linears, embedding and head and carries their communication (default: one
    process). The weights are initialised at construction (model/init.py) unless `init=False`: then
    they are left unset and the caller fills them (`init_weights` with its own storage), as a build
    whose parameters are partitioned while they are constructed does. The base seed is drawn either
    way, so both builds consume the global generator alike."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None, *, pre_process: bool = True,
                 post_process: bool = True, layers: range | None = None, init: bool = True,
                 cp: ContextParallel | None = None):
        super().__init__()
        self.cfg = cfg
        self.tp = tp = tp or TensorParallel()
        self.cp = cp = cp or ContextParallel()
        self.pre_process, self.post_process = pre_process, post_process
        self.layer_range = layers if layers is not None else range(cfg.n_layers)
        self.sp = tp.sequence_parallel
        self.block_context = contextlib.nullcontext  # what the blocks run inside (pretrain/fp8.py: FP8 autocast)
        V = cfg.padded_vocab_size
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu").item())  # the one draw from the global generator
        if pre_process or (post_process and cfg.tie_embeddings):  # a last stage's copy of a tied embedding too
            self.embed = tp.vocab_embedding(V, cfg.hidden)
        self.rotary = Rotary(cfg.dim_head, cfg.rope_base)
        self.layers = torch.nn.ModuleDict({str(i): Block(cfg, tp, i, cp) for i in self.layer_range})
        if post_process:
            self.final_norm = _norm(cfg, cfg.hidden)
            if not cfg.tie_embeddings:  # the head runs on the gathered sequence (no sequence parallelism)
                self.head = tp.vocab_head(cfg.hidden, V, bias=cfg.head_bias)
            ids = torch.arange(tp.rank * V // tp.size, (tp.rank + 1) * V // tp.size)
            blocked = (ids >= cfg.vocab_size) | (ids == cfg.mask_id)
            bias = torch.zeros_like(ids, dtype=torch.float32)  # float32 whatever dtype the parameters are built in
            self.register_buffer("logit_bias", bias.masked_fill(blocked, float("-inf")), persistent=False)
        if init:
            self.init_weights()

    def init_weights(self, **storage) -> None:
        """Draw every weight (model/init.py `init_weights`; `storage`: its `shape` and `fill`)."""
        init_weights(self, self.cfg, self.init_seed, self.tp.size, self.tp.rank, **storage)

    # -- parts -------------------------------------------------------------------------------
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids)

    def output_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits (this rank's slice of the padded vocabulary) with MASK/padding at -inf."""
        hidden = self.final_norm(hidden)
        cpu_inference = hidden.device.type == "cpu" and torch.is_inference_mode_enabled() and not self.sp
        if cpu_inference and hidden.numel() // max(hidden.shape[-1], 1) in FEW_HEAD_ROWS:
            logits = self._few_rows_head(hidden)
            if logits is not None:
                return logits
        weight_t = self.transposed_head() if cpu_inference else None
        if weight_t is None and self.tp.size == 1:  # one pass over the logits: the head GEMM adds every bias
            return self._biased_head(hidden)
        if self.cfg.tie_embeddings:
            weight = self.shared_embedding_weight()
            hidden = self.tp.all_reduce_grad(hidden)  # each rank computes its slice of the vocabulary
            logits = hidden @ weight_t if weight_t is not None else F.linear(hidden, weight)
        elif weight_t is not None:  # the head's forward is a plain matmul in inference (its TP input copy is the identity)
            logits = hidden @ weight_t
            logits = logits + self.head.bias if self.head.bias is not None else logits
        else:
            logits, _ = self.head(hidden)
        if weight_t is not None and logits.dtype == torch.float32:
            return logits.add_(self.logit_bias)  # a fresh product: no second [rows, vocab] tensor
        return logits.float() + self.logit_bias

    def _few_rows_head(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """CPU inference over a few rows (FEW_HEAD_ROWS) at TP = 1 in fp32: logits^T = bias + W h^T with W
        in its [vocab, hidden] layout, every bias in the product; None where it does not apply."""
        weight = self.shared_embedding_weight() if self.cfg.tie_embeddings else self.head.weight
        if (self.tp.size != 1 or weight.dtype != torch.float32 or hidden.dtype != torch.float32
                or torch.compiler.is_compiling()):
            return None
        head_bias = None if self.cfg.tie_embeddings else self.head.bias
        bias = self.logit_bias if head_bias is None else self.logit_bias + head_bias.float()
        rows = hidden.reshape(-1, hidden.shape[-1])
        logits = torch.addmm(bias[:, None], weight, rows.t())  # [vocab, rows]
        return logits.t().contiguous().view(*hidden.shape[:-1], weight.shape[0])

    def _biased_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """One process: logits = hidden W^T + (head bias + MASK/padding -inf) in the head's matmul, so the
        [rows, vocab] logits are written once (not once more per bias). fp32 logits: in the parameters'
        dtype when they are fp32, else cast once after the bf16 product."""
        weight = self.shared_embedding_weight() if self.cfg.tie_embeddings else self.head.weight
        head_bias = None if self.cfg.tie_embeddings else self.head.bias
        bias = self.logit_bias if head_bias is None else self.logit_bias + head_bias.float()
        if weight.dtype != torch.float32:
            return F.linear(hidden, weight, bias.to(weight.dtype)).float()
        if hidden.dtype != torch.float32:
            hidden = hidden.float()
        return torch.addmm(bias, hidden.reshape(-1, hidden.shape[-1]), weight.t()).view(*hidden.shape[:-1], weight.shape[0])

    def transposed_head(self) -> torch.Tensor | None:
        """Inference fast path on CPU: a contiguous [hidden, vocab] copy of the output weight (the decode
        matmul with few rows runs 1.3-3x faster on it than on the [vocab, hidden] layout). Rebuilt when
        the weight changes (new storage or an in-place update); not part of the state dict. Inside a
        compiled region (a compiled decode step) the copy is read as it is: the storage checks are not
        traceable, so an eager call must have built it first (the sampler's DecodeStepRunner does); None if
        none was built (the plain layout is used)."""
        cached = self.__dict__.get("_head_t")
        if torch.compiler.is_compiling():
            return None if cached is None else cached[1]
        weight = self.shared_embedding_weight() if self.cfg.tie_embeddings else self.head.weight
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version, weight.dtype, weight.shape)
        if cached is None or cached[0] != key:
            cached = (key, weight.detach().t().contiguous())
            self.__dict__["_head_t"] = cached
        return cached[1]

    def shared_embedding_weight(self) -> torch.Tensor:
        """The tied input/output embedding (on a last stage without the input embedding: its copy)."""
        return self.embed.weight

    # -- forward -----------------------------------------------------------------------------
    def forward(self, input_ids=None, position_ids=None, attn_mask=None, *, hidden_states=None,
                cache: KVCache | None = None, commit: torch.Tensor | None = None, logits_slice: slice | None = None,
                mask_spec: MaskSpec | None = None, head: bool = True, context: RankLayout | None = None):
        """Run this stage.

        input_ids/position_ids [B, T]; attn_mask bool [T, T] or [B, 1, T, T] (True = attend) among the
        given tokens. With `cache`, tokens also attend to the valid cached entries, and those with
        `commit` [B, T] True are appended to the cache. Returns vocab-parallel logits for the tokens in
        `logits_slice` (all by default) on the last stage, hidden states otherwise (`head=False`: also on the
        last stage, before the final norm; `output_logits` applies the head to any of them). `mask_spec` names
        the static mask `attn_mask` holds; with it the flex-attention backend (model.attention_backend)
        uses a cached block mask instead of the dense one. `context` (context parallelism, training only):
        the tokens are this CP rank's part of the sequence (model/context_parallel.py), `attn_mask` its
        rank-local mask, and every attention layer gathers the exchanged stream's K/V from the CP group.
        """
        x = self.embed_tokens(input_ids) if self.pre_process else hidden_states
        if self.sp:
            x = self._to_sequence_parallel(x, cache)
        rope = self.rotary(position_ids)
        mask = attn_mask
        if context is not None and cache is not None:
            raise RuntimeError("context parallelism is a training layout: decode without a CP layout")
        if mask_spec is not None and cache is None and self.use_flex(x.device):  # built here, outside the blocks
            mask = (context.block_mask(x.device) if context is not None else
                    flex.block_mask(mask_spec.kind, int(mask_spec.length), int(mask_spec.block_size), str(x.device)))
        if cache is not None:
            B, T = position_ids.shape
            mask = cache.begin(commit if commit is not None else torch.zeros(B, T, dtype=torch.bool, device=x.device),
                               attn_mask, position_ids)
        with self.block_context():
            for block in self.layers.values():
                x = block(x, rope, mask, cache, context) if context is not None else block(x, rope, mask, cache)
        if cache is not None:
            cache.end()
        if self.sp:
            x = self._from_sequence_parallel(x)
        if not self.post_process or not head:
            return x
        if logits_slice is not None:
            x = x[:, logits_slice]
        return self.output_logits(x)

    def _to_sequence_parallel(self, x: torch.Tensor, cache) -> torch.Tensor:
        """[B, T, H] (embedding output) or [B, T/tp, H] (a received stage input) -> [T/tp, B, H]."""
        if cache is not None:
            raise RuntimeError("sequence parallelism is a training layout: decode with a model built without it")
        x = x.transpose(0, 1)
        if self.pre_process:  # this rank's slice of the sequence
            x = self.tp.scatter_sequence(x)
        return x

    def _from_sequence_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """[T/tp, B, H] -> [B, T, H] on the last stage (the head needs every token), [B, T/tp, H] before."""
        if self.post_process:
            # The head's input gradient is already complete on every rank (all-reduced by the column-
            # parallel head, or by copy_to in the tied head), so the gather's backward just splits.
            x = self.tp.gather_sequence(x)
        return x.transpose(0, 1)

    def use_flex(self, device: torch.device) -> bool:
        backend = self.cfg.attention_backend
        if backend == "auto":  # flex has no attention-probability dropout: SDPA keeps it when asked for
            return device.type == "cuda" and flex.available() and self.cfg.attention_dropout == 0
        return backend == "flex"

    def new_cache(self, batch: int, capacity: int, dtype=None, device=None, extra: int = 0,
                  positions: bool = False) -> KVCache:
        """KV cache of `batch` slots holding `capacity` committed tokens each (+ `extra` scratch entries
        for the uncommitted tokens of the widest decoding forward); `positions`: entries record their
        positions, so the oldest can be dropped when decoding outgrows max_seq_len."""
        cfg, tp = self.cfg, self.tp.size
        p = next(self.parameters())
        return KVCache(self.layer_range, batch, cfg.kv_heads // tp, cfg.dim_head, capacity,
                       dtype=dtype or p.dtype, device=device or p.device, extra=extra, positions=positions)


def full_logits(model: Transformer, logits: torch.Tensor) -> torch.Tensor:
    """Gather vocab-parallel logits into the full (unpadded) vocabulary."""
    return model.tp.gather_vocab(logits)[..., : model.cfg.vocab_size]

