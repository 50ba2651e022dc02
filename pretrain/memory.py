"""Memory per GPU and pipeline stage of a training layout: parameters per stage, bytes per parameter
under the precision and ZeRO stage, activations a block keeps for its backward and its backward's
working set, logits. The model these figures follow, and what was measured to check it, is in
docs/memory.md; `setdlm pretrain --dry-run` (pretrain/plan.py) prints them."""

from __future__ import annotations

from dataclasses import dataclass

from model.shapes import model_params

GIB = 1024**3
REDUCE_BUCKET = 500_000_000  # DeepSpeed's zero_optimization.reduce_bucket_size default (elements)
ZERO3_LIVE = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters default (elements)


# -- parameter counts per stage -----------------------------------------------------------------------
@dataclass
class StageParams:
    stage: int
    layers: range
    sharded: int = 0  # parameters split over TP ranks (count for the whole TP group)
    replicated: int = 0  # parameters every TP rank holds in full
    copies: int = 0  # a tied embedding's copy on the last stage (sharded over TP)
    lora: bool = False  # train.lora: only the adapters train
    adapter_sharded: int = 0  # LoRA adapters split over TP ranks
    adapter_replicated: int = 0  # LoRA adapters every TP rank holds in full

    def per_rank(self, tp: int) -> int:
        """Parameters one TP rank holds (adapters included)."""
        return (self.sharded + self.copies + self.adapter_sharded) // tp + self.replicated + self.adapter_replicated

    def trainable_per_rank(self, tp: int) -> int:
        """Parameters with gradients and optimizer states on one TP rank (under LoRA: the adapters)."""
        return self.adapter_sharded // tp + self.adapter_replicated if self.lora else self.per_rank(tp)


def stage_params(m, pp: int, lora=None) -> list[StageParams]:
    """Per pipeline stage, its parameters at TP=1 (model/shapes.py: read from the module), split into
    TP-sharded, replicated and the last stage's copy of a tied embedding; with `lora` (a train.lora
    section) the adapters of its blocks (model/lora.py, read from a block as well)."""
    from model.lora import block_adapter_params

    from .parallelize import stage_layers  # imports megatron (no process group)

    adapters = block_adapter_params(m, rank=lora.rank, targets=lora.targets) if lora is not None else {}
    out = []
    for s in range(pp):
        layers = stage_layers(m.n_layers, pp, s)
        sp = StageParams(s, layers, lora=lora is not None)
        for name, p in model_params(m, layers, pre_process=s == 0, post_process=s == pp - 1).items():
            if name == "embed.weight" and s != 0:
                sp.copies += p.numel
            elif p.sharded:
                sp.sharded += p.numel
            else:
                sp.replicated += p.numel
        for p in adapters.values():
            if p.sharded:
                sp.adapter_sharded += p.numel * len(layers)
            else:
                sp.adapter_replicated += p.numel * len(layers)
        out.append(sp)
    return out


# -- memory -------------------------------------------------------------------------------------------
def bytes_per_param(precision: str, zero: int, dp: int) -> dict:
    """Bytes per parameter on one rank: weights, gradients, optimizer states (docs/memory.md).

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
    `mode`, run eager or compiled (docs/memory.md lists the tensors). For `full`: the block input only
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
    count), plus what the backward recomputes (docs/memory.md). The CPU float mask: `estimate_memory`."""
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
    trainable: int
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
    lay = cfg.objective.family.layout(cfg.data.seq_len)
    return lay.tokens_in, lay.tokens_out


def estimate_memory(cfg, world_size: int, *, precision: str | None = None, device: str = "cuda",
                    micro_batch: int | None = None, checkpointing: str | None = None,
                    compiled: bool | None = None, lora: bool = True) -> list[StageMemory]:
    """Per pipeline stage, the memory of one rank (bytes); `micro_batch` / `checkpointing` / `compiled`
    override the recipe's (`train.micro_batch`, `train.activation_checkpointing`, `train.compile`);
    `lora=False` plans the recipe as full fine-tuning. Under `train.lora` gradients and optimizer
    states (with DeepSpeed's fp32 masters) are held for the adapters only; the frozen base counts as
    weights; activations are those of full fine-tuning (the adapters' own are rank-sized)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    mode = checkpointing or getattr(t, "activation_checkpointing", "none")
    compiled = bool(getattr(t, "compile", False)) if compiled is None else compiled
    sp = getattr(p, "sequence_parallel", False)
    dp = world_size // (p.tp * p.pp)  # the dp x cp ranks ZeRO partitions over
    accum = cfg.grad_accum(world_size)
    precision = precision or (t.precision if t.precision != "auto" else ("bf16" if device == "cuda" else "fp32"))
    bpp = bytes_per_param(precision, p.zero_stage, dp)
    act_bytes = 2 if precision == "bf16" else 4
    T_seq, n_seq = tokens_in(cfg)
    cp = p.cp  # context parallelism: each rank holds 1/cp of every sequence's tokens (head-tail chunks)
    T, n_out = T_seq / cp, n_seq / cp
    b = micro_batch or t.micro_batch
    per_layer = activation_bytes_per_token_layer(m, p.tp, T, act_bytes, device, mode, sp, compiled) * T * b
    # one block's backward: its gradient buffers and what it recomputes (under `full`: the whole block)
    working = backward_working_set(m, p.tp, T, act_bytes, device, mode, sp, compiled) * T * b
    # under CP the attention keeps the K and V of the L exchanged keys it gathered (pretrain/comm.py)
    gathered = cfg.data.seq_len * b * 2 * (m.kv_heads / p.tp) * m.dim_head * act_bytes if cp > 1 else 0.0
    if mode == "full":
        working += gathered
    else:
        per_layer += gathered
    # torch's CPU SDPA saves the boolean mask as a float mask per layer call (queries x keys; under CP the
    # keys are the L gathered ones and this rank's other tokens): kept under none, rebuilt in one block's
    # backward when the attention core is recomputed (compiled selective, full)
    keys = T if cp == 1 else cfg.data.seq_len + (T_seq - cfg.data.seq_len) / cp
    cpu_mask = T * keys * 4 if device == "cpu" else 0.0
    if mode == "none":
        per_layer += cpu_mask
    elif mode == "full" or compiled:
        working += cpu_mask
    # DeepSpeed ZeRO-1/2's contiguous gradient bucket (reduce_bucket_size elements in the training dtype;
    # a second one with parallel.overlap_comm), allocated on the GPU whatever the model's size
    buckets = 0.0
    if device == "cuda" and p.zero_stage in (1, 2):
        buckets = REDUCE_BUCKET * act_bytes * (2 if getattr(p, "overlap_comm", False) else 1)
    out = []
    sp_on = sp and p.tp > 1
    for sp in stage_params(m, p.pp, getattr(t, "lora", None) if lora else None):
        n, n_train = sp.per_rank(p.tp), sp.trainable_per_rank(p.tp)
        in_flight = min(p.pp - sp.stage, accum) if p.pp > 1 else 1
        acts = per_layer * len(sp.layers) * in_flight + (working if len(sp.layers) else 0.0)
        if not len(sp.layers):  # the embedding output / received activations (else the first block's input)
            acts += T * b * m.hidden * act_bytes * in_flight / (p.tp if sp_on else 1)
        logits = 0.0
        if sp.stage == p.pp - 1:
            acts += (T + n_out) * b * m.hidden * act_bytes  # the final norm's input and the head's input
            # fp32 logits and the cross-entropy's saved softmax on the predicted tokens (one micro-batch)
            logits = 2 * n_out * b * m.padded_vocab_size / p.tp * 4
        # ZeRO-3 gathers full parameters while a module runs: at most DeepSpeed's stage3_max_live_parameters
        live = min(n, ZERO3_LIVE) * act_bytes if p.zero_stage == 3 else 0.0
        out.append(StageMemory(sp.stage, sp.layers, n, n_train, n * bpp["weights"] + live, n_train * bpp["grads"] + buckets,
                               n_train * bpp["optimizer"], acts, logits, in_flight))
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


__all__ = ["GIB", "REDUCE_BUCKET", "StageParams", "StageMemory", "stage_params", "bytes_per_param", "activation_bytes_per_token_layer",
           "recompute_working_set", "backward_working_set", "tokens_in", "estimate_memory", "micro_batch_fit"]
