"""`setdlm pretrain --dry-run`: validate a layout and print its plan without starting anything.

    setdlm pretrain --config configs/qwen3-1.7b-setdlm.yaml --dry-run --world-size 64 parallel.tp=8 parallel.pp=4

prints the layout (TP x PP x DP, micro-batches, accumulation, pipeline bubble), the process groups of
every rank (megatron-core's own rank generator, order tp-cp-ep-dp-pp: TP peers are neighbours, so a TP
group stays inside a node when tp <= GPUs per node), the pipeline stages, a memory estimate per GPU and
pipeline stage (weights, gradients, optimizer states under the ZeRO stage, activations under 1F1B,
logits), FLOPs per step and the communication volume per step. No process group, model or tensor is
created; only the tokenizer is read when the recipe leaves the vocabulary size to it.

The memory model (bytes per parameter, `bytes_per_param`), per rank, with d = data-parallel size:

    precision ZeRO  weights  grads                     optimizer (AdamW m, v; fp32 masters)
    fp32      0     4        4                         8
    fp32      1     4        4 + 4/d (fp32 partition)  12/d
    bf16      0     2        2 + 4 (fp32 accumulator)  12
    bf16      1     2        2 + 4/d                   12/d
    ZeRO-2 also divides the parameters' gradients by d, ZeRO-3 the weights.

Activations: what each block keeps for its backward, per layer and token, times the micro-batches a
stage holds under 1F1B (pp - stage; the embedding output or received activations are the first
block's input), plus one block's backward working set and, on the last stage, the final norm's and
the head's inputs and the fp32 logits with the cross-entropy's softmax (computed in place) on the predicted
tokens. Summing the forward-end term (logits) and the backward term (working set) counts both
peaks at once: an upper bound of a step's peak by at most the smaller of the two. The saved
tensors, eager (model/transformer.py as autograd records it; checked per tensor on CPU):

* norm1 and norm2 inputs (the residual stream); torch's composite RMSNorm (eager on CPU) also keeps
  x * rstd; LayerNorm and CUDA's fused RMSNorm keep only per-token statistics beside the input;
* the inputs of the qkv, proj and fc1 linears (h, heads x d, h) and of fc2 (ffn);
* the whole qkv output: v is a view of it, so the attention's saved v keeps all of it alive; q and
  k after rotary are new tensors, also kept; with QK-norm, the q copied out of qkv (a view when a
  rank holds one kv head or attention is not grouped) and, composite, the normalised q and k;
* the attention output (kept by the kernel) besides its [B, T, heads x d] copy for proj, and the
  softmax log-sum-exp; on GPUs flash/flex keep only that O(T) state; torch's CPU SDPA (a flash kernel)
  also keeps the boolean mask converted to a float T x T mask per layer call (`device="cpu"`);
* the fc1 output (2 ffn for SwiGLU), SwiGLU's silu(gate), dropout masks when dropout is on, and the
  norms' fp32 statistics (mean and rstd per token, per head for QK-norm).

A block's backward allocates, beyond its saved tensors, its output gradient and the MLP's gradients:
eager autograd releases fc2's saved input before the fc1-output gradient exists, so one ffn-wide
(SwiGLU: two) gradient counts. Under `train.activation_checkpointing` (model/recompute.py):
`selective` drops the attention output, the log-sum-exp, the CPU float mask and silu(gate) (the
recomputed attention core and activation keep them only inside their backward: SwiGLU's silu(gate)
joins the working set); `full` keeps only
each block's input, and the working set adds the whole block being recomputed.

Compiled blocks (`train.compile`, model/recompute.py `apply_compile`): AOTAutograd traces each
block's forward and backward as one graph and its min-cut partitioner chooses what the forward
returns for the backward. It keeps the inputs of matmuls and of the attention kernel and the fc1
output, and recomputes cheap pointwise results from them instead of saving them: RMSNorm's x * rstd,
the QK-norm copies, SwiGLU's silu(gate). With `selective`, the checkpoint's tags make it also
recompute the attention output and the activation output (fc2's input, which eager keeps because
fc2 sits outside the checkpointed function), so one ffn-wide tensor less is saved per layer and
the backward rebuilds it with the attention output (and the CPU float mask) as working set. The
compiled backward holds its saved inputs until the graph returns, so both MLP gradients count in
its working set (one ffn-wide tensor more than eager); with `full` the recomputation runs inside
that compiled backward. Measured on CPU (benchmarks/bench_memory.py, GELU/LayerNorm and Qwen3-style
blocks); on CUDA the same partitioner runs with flex/flash attention and is modelled alike, but was
not measured, nor was CUDA's fused RMSNorm. Under `parallel.sequence_parallel` the tensors
outside the tensor-parallel regions (norm and residual inputs, linear inputs, dropout masks, a full
checkpoint's block inputs) hold T/tp tokens. The figure excludes the CUDA context, allocator
fragmentation, communication buffers (budget 10-20% on top), the compiler's own memory while it
compiles, and on CPU the runtime's resident code and thread pools; `micro_batch_fit` keeps 10% free.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

from .flops import PEAK_TFLOPS, step_flops

GIB = 1024**3


# -- parameter counts per stage -----------------------------------------------------------------------
@dataclass
class StageParams:
    stage: int
    layers: range
    sharded: int = 0  # parameters split over TP ranks (count for the whole TP group)
    replicated: int = 0  # parameters every TP rank holds in full
    copies: int = 0  # a tied embedding's copy on the last stage (sharded over TP)

    def per_rank(self, tp: int) -> int:
        return (self.sharded + self.copies) // tp + self.replicated


def _layer_params(m) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one block of model/transformer.py."""
    h, d, f = m.hidden, m.dim_head, m.ffn_hidden
    qkv_out = (m.n_heads + 2 * m.kv_heads) * d
    fc1_out = f * (2 if m.activation == "swiglu" else 1)
    sharded = h * qkv_out + m.n_heads * d * h + h * fc1_out + f * h
    replicated = 0
    if m.bias:
        sharded += qkv_out + fc1_out
        replicated += 2 * h  # proj and fc2 biases (added after the all-reduce)
    norm = h * (2 if m.norm == "layernorm" and m.bias else 1)
    replicated += 2 * norm + (2 * d if m.qk_norm else 0)
    return sharded, replicated


def stage_params(m, pp: int) -> list[StageParams]:
    from .parallelize import stage_layers  # imports megatron (no process group)

    V, h = m.padded_vocab_size, m.hidden
    per_sharded, per_repl = _layer_params(m)
    out = []
    for s in range(pp):
        layers = stage_layers(m.n_layers, pp, s)
        sp = StageParams(s, layers, len(layers) * per_sharded, len(layers) * per_repl)
        if s == 0:
            sp.sharded += V * h
        if s == pp - 1:
            sp.replicated += h * (2 if m.norm == "layernorm" and m.bias else 1)
            if m.tie_embeddings:
                if s != 0:
                    sp.copies += V * h
            else:
                sp.sharded += V * h + (V if m.head_bias else 0)
        out.append(sp)
    return out


# -- memory -------------------------------------------------------------------------------------------
def bytes_per_param(precision: str, zero: int, dp: int) -> dict:
    """Bytes per parameter on one rank: weights, gradients, optimizer states (see the module doc).

    DeepSpeed keeps fp32 master weights and fp32 gradient partitions of its own whenever it partitions
    (ZeRO >= 1) or trains in bf16 (its BF16 optimizer at ZeRO-0), even when the weights are fp32."""
    bf16 = precision == "bf16"
    weights = 2.0 if bf16 else 4.0
    grads = 2.0 if bf16 else 4.0  # the parameters' .grad
    own = bf16 or zero >= 1  # DeepSpeed's fp32 master weights and gradient accumulators
    grads_fp32 = 4.0 if own else 0.0
    optim = 8.0 + (4.0 if own else 0.0)  # AdamW m and v (+ fp32 masters)
    if zero >= 1:
        optim /= dp
        grads_fp32 /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        weights /= dp
    return {"weights": weights, "grads": grads + grads_fp32, "optimizer": optim}


def activation_bytes_per_token_layer(m, tp: int, T: int, dtype_bytes: int, device: str, mode: str = "none",
                                     sp: bool = False, compiled: bool = False) -> float:
    """Bytes a block keeps for its backward, per token and layer (one micro-batch), under checkpointing
    `mode`, run eager or compiled (the module doc lists the tensors). For `full`: the block input only
    (`backward_working_set` adds the block being recomputed). The CPU float mask is per layer call,
    not per token: `estimate_memory` adds it."""
    h, d, f = m.hidden, m.dim_head, m.ffn_hidden
    a, kv = m.n_heads / tp, m.kv_heads / tp
    seq = tp if sp and tp > 1 else 1  # sequence parallelism splits the tensors outside the TP regions
    if mode == "full":
        return h / seq * dtype_bytes  # the block's input
    swiglu = m.activation == "swiglu"
    # eager RMSNorm on CPU runs torch's composite, which also keeps the normalised input (x * rstd);
    # CUDA's fused kernel and a compiled graph keep the input and rstd only, as LayerNorm does
    composite_rms = device == "cpu" and not compiled
    elems = 0.0
    elems += 2 * (h / seq) * (2 if m.norm == "rmsnorm" and composite_rms else 1)  # norm inputs (residual) [+ x*rstd]
    elems += 2 * h / seq  # qkv and fc1 inputs (the norms' outputs; under SP gathered again in backward)
    elems += (a + 2 * kv) * d  # the qkv output: v is a view of it, so the attention keeps all of it
    elems += (a + kv) * d  # q, k after rotary (new tensors), kept by the attention
    if mode != "selective":
        elems += a * d  # the attention output (kept by the attention kernel)
    elems += a * d  # its [B, T, heads*d] copy = the proj input
    if m.qk_norm and not compiled:  # q copied out of qkv (a view with one kv head per rank or one q per kv
        # head; k is a view) [+ composite: the normalised q, k]
        elems += (a * d if kv > 1 and a > kv else 0.0) + ((a + kv) * d if composite_rms else 0.0)
    elems += f / tp * (2 if swiglu else 1)  # fc1 output, kept by the activation's backward
    if swiglu and mode != "selective" and not compiled:
        elems += f / tp  # silu(gate), kept by the product (recomputed under selective or compile)
    if not (compiled and mode == "selective"):
        elems += f / tp  # activation output = fc2 input (compiled selective: recomputed in the backward)
    total = elems * dtype_bytes
    # fp32 per-token statistics: LayerNorm's mean and rstd, RMSNorm's rstd (two norms), QK-norm's rstd per head
    total += 2 * (2 if m.norm == "layernorm" else 1) * 4 / seq + ((a + kv) * 4 if m.qk_norm else 0.0)
    if mode != "selective":
        total += a * 4  # softmax statistics (log-sum-exp, fp32) per head
    if m.dropout > 0:
        total += 2 * h / seq  # dropout masks (1 byte each)
    return total


def recompute_working_set(m, tp: int, T: int, dtype_bytes: int, device: str, sp: bool = False,
                          compiled: bool = False) -> float:
    """Bytes per token of the one block whose activations a `full` recomputation rebuilds in the backward."""
    return activation_bytes_per_token_layer(m, tp, T, dtype_bytes, device, "none", sp, compiled)


def backward_working_set(m, tp: int, T: int, dtype_bytes: int, device: str, mode: str = "none", sp: bool = False,
                         compiled: bool = False) -> float:
    """Bytes per token that one block's backward allocates on top of what is saved (one micro-batch):
    the output gradient and the MLP's gradients (eager frees fc2's saved input before fc1's output
    gradient exists; a compiled backward graph holds its saved inputs to its end, so both MLP gradients
    count), plus what the backward recomputes (module doc). The CPU float mask: `estimate_memory`."""
    h, f = m.hidden, m.ffn_hidden
    seq = tp if sp and tp > 1 else 1
    fc1 = f / tp * (2 if m.activation == "swiglu" else 1)
    elems = h / seq + fc1 + (f / tp if compiled else 0.0)
    if m.activation == "swiglu" and mode == "selective" and not compiled:
        elems += f / tp  # the recomputed silu(gate), kept while the product's backward runs
    total = elems * dtype_bytes
    if compiled and mode == "selective":
        total += (f / tp + m.n_heads / tp * m.dim_head) * dtype_bytes  # recomputed activation and attention outputs
    if mode == "full":
        total += recompute_working_set(m, tp, T, dtype_bytes, device, sp, compiled)
    return total


@dataclass
class StageMemory:
    stage: int
    layers: range
    params: int
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float
    in_flight: int

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations + self.logits


def tokens_in(cfg) -> tuple[int, int]:
    """(tokens per sequence through the model, predicted tokens per sequence) of the objective."""
    L = cfg.data.seq_len
    name = cfg.objective.name
    if name in ("setdlm", "bd3lm"):
        return 2 * L, L
    if name == "ar":
        return L, L - 1
    return L, L


def estimate_memory(cfg, world_size: int, *, precision: str | None = None, device: str = "cuda",
                    micro_batch: int | None = None, checkpointing: str | None = None,
                    compiled: bool | None = None) -> list[StageMemory]:
    """Per pipeline stage, the memory of one rank (bytes); `micro_batch` / `checkpointing` / `compiled`
    override the recipe's (`train.micro_batch`, `train.activation_checkpointing`, `train.compile`)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    mode = checkpointing or getattr(t, "activation_checkpointing", "none")
    compiled = bool(getattr(t, "compile", False)) if compiled is None else compiled
    sp = getattr(p, "sequence_parallel", False)
    dp = world_size // (p.tp * p.pp)
    accum = cfg.grad_accum(world_size)
    precision = precision or (t.precision if t.precision != "auto" else ("bf16" if device == "cuda" else "fp32"))
    bpp = bytes_per_param(precision, p.zero_stage, dp)
    act_bytes = 2 if precision == "bf16" else 4
    T, n_out = tokens_in(cfg)
    b = micro_batch or t.micro_batch
    per_layer = activation_bytes_per_token_layer(m, p.tp, T, act_bytes, device, mode, sp, compiled) * T * b
    # one block's backward: its gradient buffers and what it recomputes (under `full`: the whole block)
    working = backward_working_set(m, p.tp, T, act_bytes, device, mode, sp, compiled) * T * b
    # torch's CPU SDPA saves the boolean mask as a float T x T mask per layer call: kept under none,
    # rebuilt in one block's backward when the attention core is recomputed (compiled selective, full)
    cpu_mask = T * T * 4 if device == "cpu" else 0.0
    if mode == "none":
        per_layer += cpu_mask
    elif mode == "full" or compiled:
        working += cpu_mask
    out = []
    sp_on = sp and p.tp > 1
    for sp in stage_params(m, p.pp):
        n = sp.per_rank(p.tp)
        in_flight = min(p.pp - sp.stage, accum) if p.pp > 1 else 1
        acts = per_layer * len(sp.layers) * in_flight + (working if len(sp.layers) else 0.0)
        if not len(sp.layers):  # the embedding output / received activations (else the first block's input)
            acts += T * b * m.hidden * act_bytes * in_flight / (p.tp if sp_on else 1)
        logits = 0.0
        if sp.stage == p.pp - 1:
            acts += (T + n_out) * b * m.hidden * act_bytes  # the final norm's input and the head's input
            # fp32 logits and the cross-entropy's saved softmax on the predicted tokens (one micro-batch)
            logits = 2 * n_out * b * m.padded_vocab_size / p.tp * 4
        out.append(StageMemory(sp.stage, sp.layers, n, n * bpp["weights"], n * bpp["grads"], n * bpp["optimizer"],
                               acts, logits, in_flight))
    return out


def micro_batch_fit(cfg, world_size: int, gpu_gib: float, *, device: str = "cuda", usable: float = 0.9) -> dict:
    """For each checkpointing mode: the largest micro-batch (dividing the per-rank batch) whose peak
    stage memory fits in `usable` x `gpu_gib`, with its peak; (0, smallest peak) when none fits."""
    dp = cfg.dp_size(world_size)
    per_rank = cfg.train.global_batch // dp
    candidates = [b for b in range(1, per_rank + 1) if per_rank % b == 0]
    budget = usable * gpu_gib * GIB
    out = {}
    for mode in ("none", "selective", "full"):
        best = (0, None)
        for b in candidates:
            peak = max(sm.total for sm in estimate_memory(cfg, world_size, device=device, micro_batch=b, checkpointing=mode))
            if best[1] is None:
                best = (0, peak)
            if peak <= budget:
                best = (b, peak)
        out[mode] = best
    return out


# -- communication ------------------------------------------------------------------------------------
def comm_bytes_per_step(cfg, world_size: int, precision: str) -> dict:
    """Bytes each rank sends per optimizer step (ring collectives: 2 (n-1)/n of the buffer)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    dp = world_size // (p.tp * p.pp)
    accum = cfg.grad_accum(world_size)
    T, _ = tokens_in(cfg)
    act = 2 if precision == "bf16" else 4
    params = max(sp.per_rank(p.tp) for sp in stage_params(m, p.pp))
    layers = math.ceil(m.n_layers / p.pp)
    ring = lambda n: 2 * (n - 1) / n if n > 1 else 0.0  # noqa: E731
    grad_bytes = 2 if precision == "bf16" else 4
    dp_bytes = ring(dp) * params * grad_bytes * (1.5 if p.zero_stage == 3 else 1.0)
    tp_bytes = ring(p.tp) * 4 * layers * accum * T * t.micro_batch * m.hidden * act  # 2 fwd + 2 bwd all-reduces
    pp_bytes = (2 * accum * T * t.micro_batch * m.hidden * act) if p.pp > 1 else 0.0
    return {"data parallel": dp_bytes, "tensor parallel": tp_bytes, "pipeline": pp_bytes}


# -- groups -------------------------------------------------------------------------------------------
def rank_groups(tp: int, pp: int, dp: int) -> dict[str, list[list[int]]]:
    """megatron-core's groups for (tp, pp, dp) without creating any (its RankGenerator)."""
    from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    groups = {name: gen.get_ranks(token) for name, token in
              (("tp", "tp"), ("pp", "pp"), ("dp", "dp"), ("mp", "tp-pp"))}
    groups["embedding"] = [[g[0], g[-1]] for g in groups["pp"]] if pp > 1 else []
    return groups


def _member(groups: list[list[int]], rank: int) -> list[int]:
    return next(g for g in groups if rank in g)


# -- the plan -----------------------------------------------------------------------------------------
def resolve_for_plan(cfg) -> None:
    """Fill model.vocab_size / mask_id from the tokenizer when the recipe leaves them to it."""
    if cfg.model.vocab_size > 0 and cfg.model.mask_id >= 0:
        return
    from data_pipeline.tokenizers import load_tokenizer

    try:
        tok = load_tokenizer(cfg.data.tokenizer, add_mask=cfg.data.add_mask_token)  # as the run loads it
    except Exception as e:  # noqa: BLE001 - any tokenizer problem: say how to plan without it
        raise ValueError(f"data.tokenizer: cannot load {cfg.data.tokenizer!r} here ({e}); set model.vocab_size and "
                         "model.mask_id to plan without it") from None
    cfg.resolve_vocab(tok)


def plan(cfg, world_size: int, *, device: str = "cuda", gpus_per_node: int | None = None) -> dict:
    """Validate `cfg` for `world_size` ranks and compute the plan (what print_plan shows)."""
    if world_size < 1:
        raise ValueError(f"--world-size: must be >= 1, got {world_size}")
    resolve_for_plan(cfg)
    cfg.validate(world_size)
    p, t, m = cfg.parallel, cfg.train, cfg.model
    dp = cfg.dp_size(world_size)
    accum = cfg.grad_accum(world_size)
    gpn = gpus_per_node or int(os.environ.get("SETDLM_GPUS_PER_NODE", "8"))
    precision = t.precision if t.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
    memory = estimate_memory(cfg, world_size, precision=precision, device=device)
    gpu_gib = float(os.environ.get("SETDLM_GPU_MEMORY_GIB", "80"))
    fit = micro_batch_fit(cfg, world_size, gpu_gib, device=device)
    flops = step_flops(cfg)
    bubble = (p.pp - 1) / (accum + p.pp - 1) if p.pp > 1 else 0.0
    warnings = []
    if p.tp > gpn:
        warnings.append(f"parallel.tp={p.tp} exceeds {gpn} GPUs per node: tensor-parallel all-reduces cross nodes")
    if p.pp > 1 and accum < p.pp:
        warnings.append(f"{accum} micro-batches per step for {p.pp} stages: the pipeline bubble is {bubble:.0%}; "
                        f"raise train.global_batch or lower train.micro_batch")
    if m.n_layers % p.pp:
        warnings.append(f"{m.n_layers} layers over {p.pp} stages: stages differ by one layer")
    return {"world": world_size, "tp": p.tp, "pp": p.pp, "dp": dp, "zero": p.zero_stage, "accum": accum,
            "micro_batch": t.micro_batch, "global_batch": t.global_batch, "precision": precision,
            "fit": fit, "gpu_gib": gpu_gib, "checkpointing": getattr(t, "activation_checkpointing", "none"),
            "compile": bool(getattr(t, "compile", False)),
            "sequence_parallel": getattr(p, "sequence_parallel", False),
            "gpus_per_node": gpn, "groups": rank_groups(p.tp, p.pp, dp), "memory": memory, "flops": flops,
            "bubble": bubble, "comm": comm_bytes_per_step(cfg, world_size, precision), "warnings": warnings,
            "params_total": _total_params(m)}


def _total_params(m) -> int:
    from model.transformer import parameter_count

    return parameter_count(m)


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def format_plan(cfg, info: dict, *, max_ranks: int = 128) -> str:
    m, t = cfg.model, cfg.train
    lines = []
    w = lines.append
    tp, pp, dp = info["tp"], info["pp"], info["dp"]
    w(f"setdlm dry run: {cfg.run.name} | {info['params_total'] / 1e9:.3f}B parameters | objective {cfg.objective.name} "
      f"| L={cfg.data.seq_len} | {info['precision']}")
    w(f"layout: world {info['world']} = TP {tp} x PP {pp} x DP {dp} | ZeRO-{info['zero']} | "
      f"{info['gpus_per_node']} GPUs per node -> {math.ceil(info['world'] / info['gpus_per_node'])} node(s)")
    w(f"batch: global {t.global_batch} sequences = micro-batch {t.micro_batch} x accumulation {info['accum']} x DP {dp}"
      + (f" | pipeline bubble (pp-1)/(m+pp-1) = {info['bubble']:.1%}" if pp > 1 else ""))
    w("")
    w("pipeline stages:")
    for sm in info["memory"]:
        parts = []
        if sm.stage == 0:
            parts.append("embedding")
        parts.append(f"layers {sm.layers.start}-{sm.layers.stop - 1}" if len(sm.layers) else "no layers")
        if sm.stage == pp - 1:
            parts.append("final norm + head + loss" + (" (tied embedding copy)" if m.tie_embeddings and pp > 1 else ""))
        w(f"  stage {sm.stage}: {', '.join(parts)} | {sm.params / 1e6:.1f}M parameters per rank")
    w("")
    g = info["groups"]
    w(f"process groups (megatron order tp-cp-ep-dp-pp): {len(g['tp'])} TP groups of {tp}, {len(g['pp'])} PP groups "
      f"of {pp}, {len(g['dp'])} DP groups of {dp}" + (f", {len(g['embedding'])} embedding groups" if pp > 1 else ""))
    n = min(info["world"], max_ranks)
    w(f"  {'rank':>5} {'node':>4} {'stage':>5}  {'TP group':<20} {'PP group':<20} {'DP group':<20}")
    for r in range(n):
        stage = _member(g["pp"], r).index(r)
        w(f"  {r:>5} {r // info['gpus_per_node']:>4} {stage:>5}  {_fmt_group(_member(g['tp'], r)):<20} "
          f"{_fmt_group(_member(g['pp'], r)):<20} {_fmt_group(_member(g['dp'], r)):<20}")
    if n < info["world"]:
        w(f"  ... {info['world'] - n} more ranks")
    w("")
    bpp = bytes_per_param(info["precision"], info["zero"], dp)
    w(f"memory per GPU (GiB; {info['precision']}, ZeRO-{info['zero']}: {bpp['weights']:.2f} + {bpp['grads']:.2f} + "
      f"{bpp['optimizer']:.2f} bytes/parameter for weights + grads + optimizer; activations for micro-batch "
      f"{t.micro_batch} under 1F1B, checkpointing {info['checkpointing']}"
      + (", compiled blocks" if info.get("compile") else "")
      + (", sequence parallel" if info["sequence_parallel"] and tp > 1 else "") + "):")
    w(f"  {'stage':>5} {'weights':>8} {'grads':>8} {'optim':>8} {'activ.':>8} {'logits':>8} {'total':>8}  in flight")
    for sm in info["memory"]:
        w(f"  {sm.stage:>5} {_gib(sm.weights)} {_gib(sm.grads)} {_gib(sm.optimizer)} {_gib(sm.activations)} "
          f"{_gib(sm.logits)} {_gib(sm.total)}  {sm.in_flight} micro-batch(es)")
    peak = max(sm.total for sm in info["memory"])
    w(f"  peak {peak / GIB:.2f} GiB (plus CUDA context, allocator fragmentation and communication buffers: budget 10-20%)")
    fit = ", ".join(f"{mode} {b if b else 'none fits'} ({pk / GIB:.1f} GiB)" for mode, (b, pk) in info["fit"].items())
    w(f"largest micro-batch within 90% of {info['gpu_gib']:.0f} GiB per GPU (SETDLM_GPU_MEMORY_GIB), by "
      f"train.activation_checkpointing: {fit}")
    w("")
    sf = info["flops"]
    f = sf.model
    w(f"FLOPs per step: {f:.3e} total (fwd + bwd matmuls, attention on the pairs the mask allows), "
      f"{f / info['world']:.3e} per GPU" + (f"; with recomputation {sf.hardware:.3e}" if sf.hardware != f else ""))
    for gpu in ("H100", "A100"):
        peak_flops = PEAK_TFLOPS[gpu] * 1e12
        step_s = f / (info["world"] * peak_flops * 0.4)
        w(f"  at 40% MFU on {gpu} ({PEAK_TFLOPS[gpu]:.0f} TFLOP/s bf16): {step_s:.2f} s/step, "
          f"{t.global_batch * cfg.data.seq_len / step_s:,.0f} tokens/s")
    c = info["comm"]
    w("communication per step and GPU (ring volumes): " + ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in c.items()))
    for warning in info["warnings"]:
        w(f"warning: {warning}")
    w("dry run: nothing was started")
    return "\n".join(lines)


def _fmt_group(ranks: list[int]) -> str:
    if len(ranks) > 2 and all(b - a == ranks[1] - ranks[0] for a, b in zip(ranks, ranks[1:])):
        step = ranks[1] - ranks[0]
        return f"{ranks[0]}..{ranks[-1]}" + (f" step {step}" if step != 1 else "")
    return ",".join(map(str, ranks))


def print_plan(cfg, world_size: int, *, file=None) -> dict:
    """Validate and print the plan of `cfg` on `world_size` GPUs (the `--dry-run` of setdlm pretrain)."""
    info = plan(cfg, world_size)
    print(format_plan(cfg, info), file=file or sys.stdout, flush=True)
    return info


__all__ = ["plan", "print_plan", "format_plan", "estimate_memory", "micro_batch_fit", "bytes_per_param", "stage_params", "rank_groups",
           "comm_bytes_per_step"]
