"""Every collective one rank of a training layout runs in an optimizer step, with its payload: the
communication `setdlm pretrain --dry-run` counts (pretrain/plan.py) and times (pretrain/steptime.py).

A `Collective` is one kind of call on one group (TP, CP, the data-parallel replica group, a pipeline
neighbour, the tied-embedding group): its payload per call in the convention of tests/comm_counter.py
(an all-reduce's tensor, an all-gather's gathered result, a reduce-scatter's full input, a send's
tensor) and its calls per step. `sent` is what one rank sends under ring algorithms: 2 (n-1)/n of the
payload for an all-reduce over n ranks, (n-1)/n for an all-gather or reduce-scatter, all of it for a
send. tests/test_comm_plan.py counts the calls and payloads of real gloo runs (TP, TP + SP, full
recomputation, LoRA, ZeRO 0-3, PP; CP where the runtime has it) and compares them with these.

What each axis moves, per micro-batch of b sequences of T tokens through the model on this rank (T/cp
under context parallelism), hidden size h, activations in the training dtype (a bytes):

- tensor parallelism (megatron-core's layers, pretrain/tensor_parallel.py), per block:
  without sequence parallelism, 2 all-reduces of [T, b, h] forward (after the attention and MLP
  output projections) and 2 backward (the input gradients of QKV and fc1);
  with sequence parallelism, forward 2 all-gathers (the QKV and fc1 inputs) and 2 reduce-scatters (the
  projections' outputs), backward 2 all-gathers (the output gradients) + 2 reduce-scatters (the input
  gradients) + 2 all-gathers that re-gather the QKV and fc1 inputs for their weight gradients (megatron
  saves only this rank's slice): 10 half-collectives of [T, b, h], not the 8 of four all-reduces.
  Full activation checkpointing runs the forward's collectives again in the backward, up to the last
  tensor the backward needs (fc2's input: the MLP output's reduction is not run again). Plus the
  embedding's all-reduce (and under SP its scatter's backward all-gather and the final gather), the
  head's input-gradient all-reduce over the predicted tokens, the vocab-parallel cross-entropy's
  three fp32 all-reduces, and the all-reduced gradients of replicated weights used on split tensors
  (norms under SP, QK-norm). Under LoRA (model/lora.py) the adapters add rank-wide collectives, and the
  frozen base drops the weight-gradient re-gather, the replicated weights' gradients and, with the
  embedding frozen, the first block's input gradient;
- context parallelism (two-stream CP, docs/parallelism.md): per block, an all-gather of K and V over
  the L clean-stream tokens forward (the only keys that cross ranks under `set_causal` and
  `block_diffusion`; all L tokens for MDLM and AR), kv_heads / tp heads of head_dim each, and a
  reduce-scatter of their gradients backward; full checkpointing gathers again;
- pipeline parallelism: the stage boundary's activations forward and their gradients backward, one
  [T, b, h] tensor per micro-batch (T/tp under SP), plus the tied embedding's gradient all-reduce
  between the first and last stage once per step;
- data parallelism over the dp * cp ranks that hold the same weights, as DeepSpeed 0.19 does it:
  ZeRO-0 all-reduces the gradients once per step (fp32: under bf16 its BF16 optimizer reduces its fp32
  accumulators); ZeRO-1 all-reduces them once per step in the training dtype (DeepSpeed's default
  `use_multi_rank_bucket_allreduce` all-reduces each bucket, then keeps its partition) and all-gathers
  the updated weights after the optimizer step; ZeRO-2 does the same reduction on every micro-batch
  (gradients are partitioned as they are produced); ZeRO-3 all-gathers every parameter above
  DeepSpeed's persistence threshold (1e5 elements) when a module needs it, in the forward and again in
  the backward of every micro-batch unless it is reused within DeepSpeed's max reuse distance
  (`zero3_gathers`), reduce-scatters the gradients of every micro-batch, and all-gathers the persistent
  parameters once after the optimizer step.

Not counted: the step's scalar reductions (loss and token sums, the gradient norm, ZeRO's overflow
check; a few hundred bytes), which tests/test_comm_plan.py allows for.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.shapes import model_params

ZERO3_PERSISTENCE = 100_000  # DeepSpeed's stage3_param_persistence_threshold default (elements)


def ring_sent(op: str, n: int, nbytes: float) -> float:
    """Bytes one rank sends for one call with `nbytes` payload over `n` ranks (ring algorithms)."""
    if op == "send":
        return float(nbytes)
    if n <= 1:
        return 0.0
    return (2.0 if op == "all_reduce" else 1.0) * (n - 1) / n * nbytes


@dataclass(frozen=True)
class Collective:
    axis: str  # tp, cp, dp (the replica group: dp x cp ranks), pp, embedding
    op: str  # all_reduce, all_gather, reduce_scatter, send
    nbytes: float  # payload of one call (tests/comm_counter.py's convention)
    calls: float  # per optimizer step on this rank
    size: int  # ranks in the group
    what: str
    when: str = "forward"  # forward, backward, recompute (in the backward), step (once, after the backward)

    @property
    def payload(self) -> float:
        return self.nbytes * self.calls

    @property
    def sent(self) -> float:
        return ring_sent(self.op, self.size, self.nbytes) * self.calls


def dtype_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def stage_has(pp: int, stage: int) -> tuple[bool, bool]:
    """(first stage: embedding, last stage: head and loss)."""
    return stage == 0, stage == pp - 1


def tp_collectives(cfg, stage: int, precision: str, accum: int) -> list[Collective]:
    """Tensor-parallel traffic of one rank of pipeline stage `stage` per step."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    n = p.tp
    if n == 1:
        return []
    from .parallelize import stage_layers

    layers = len(stage_layers(m.n_layers, p.pp, stage))
    first, last = stage_has(p.pp, stage)
    a = dtype_bytes(precision)
    lay = cfg.objective.family.layout(cfg.data.seq_len, cfg.objective.block_size)
    b, cp = t.micro_batch, p.cp
    act = lay.tokens_in / cp * b * m.hidden * a  # one [T, b, h] activation of this CP rank
    out_tokens = lay.tokens_out / cp * b
    sp = bool(p.sequence_parallel)
    mode = getattr(t, "activation_checkpointing", "none")
    per_mb = accum
    out: list[Collective] = []

    def add(op, nbytes, calls, what, when):
        if calls:
            out.append(Collective("tp", op, nbytes, calls * per_mb, n, what, when))

    L = layers
    lora = getattr(t, "lora", None)
    targets = set(lora.targets) if lora is not None else set()
    # full recomputation (torch's non-reentrant checkpoint) stops at the last tensor the block's backward
    # needs: fc2's input, so the MLP output's reduction is not run again; with an adapter on fc2 its input
    # (after the adapter's own reduction) comes last, and the whole block's forward runs again
    whole = "fc2" in targets
    recompute = L if mode == "full" else 0
    # under LoRA the embedding is frozen: nothing before the first block needs a gradient, so the first
    # block's input gradient is not reduced (and under SP not gathered back to the embedding)
    skip = 1 if lora is not None and first else 0
    if sp:
        add("all_gather", act, 2 * L, "block inputs of QKV and fc1 (sequence parallel)", "forward")
        add("reduce_scatter", act, 2 * L, "block outputs of the projections (sequence parallel)", "forward")
        add("all_gather", act, 2 * L, "output gradients of the projections", "backward")
        add("reduce_scatter", act, 2 * L - skip, "input gradients of QKV and fc1", "backward")
        if lora is None:  # frozen weights (LoRA's base) need no weight gradient: no re-gather
            add("all_gather", act, 2 * L, "QKV and fc1 inputs re-gathered for their weight gradients", "backward")
        add("all_gather", act, 2 * recompute, "recomputed forward: QKV and fc1 inputs", "recompute")
        add("reduce_scatter", act, (2 if whole else 1) * recompute, "recomputed forward: projection outputs", "recompute")
    else:
        add("all_reduce", act, 2 * L, "outputs of the attention and MLP projections", "forward")
        add("all_reduce", act, 2 * L - skip, "input gradients of QKV and fc1", "backward")
        add("all_reduce", act, (2 if whole else 1) * recompute, "recomputed forward: projection outputs", "recompute")
    w = dtype_bytes(precision)
    if lora is not None:  # the adapters' own collectives (model/lora.py): [T, b, rank] per adapted linear
        h = lay.tokens_in / cp * b * lora.rank * a
        column, row = len(targets & {"qkv", "fc1"}), len(targets & {"proj", "fc2"})
        again_column = column if whole else len(targets & {"qkv", "fc1"})
        again_row = row if whole else len(targets & {"proj"})
        if sp:
            add("all_gather", h, column * L, "LoRA: A x of column-parallel linears gathered", "forward")
            add("reduce_scatter", h, column * L, "LoRA: its gradient", "backward")
            add("reduce_scatter", h, row * L, "LoRA: A x of row-parallel linears summed", "forward")
            add("all_gather", h, row * L, "LoRA: its gradient", "backward")
            add("all_reduce", lora.rank * m.hidden * w, (column + row) * L,
                "LoRA: gradients of A (column) and B (row) used on sequence slices", "backward")
            add("all_gather", h, again_column * recompute, "LoRA: recomputed gathers", "recompute")
            add("reduce_scatter", h, again_row * recompute, "LoRA: recomputed reductions", "recompute")
        else:
            add("all_reduce", h, column * L, "LoRA: gradient of A x (column-parallel linears)", "backward")
            add("all_reduce", h, row * L, "LoRA: A x of row-parallel linears summed", "forward")
            add("all_reduce", h, again_row * recompute, "LoRA: recomputed reductions", "recompute")
    else:
        # replicated weights applied to split tensors: their gradients are all-reduced in each backward
        what = "gradient of a replicated weight used on split tensors"
        if m.qk_norm:
            add("all_reduce", m.dim_head * w, 2 * L, what + " (QK-norm)", "backward")
        if sp:
            norms = 2 * (2 if m.norm == "layernorm" and m.bias else 1) + (2 if m.bias else 0)  # norm1/2 (+ biases)
            add("all_reduce", m.hidden * w, norms * L, what + " (norms, biases under SP)", "backward")
    if first:
        add("all_reduce", act, 1, "vocab-parallel embedding output", "forward")
        if sp and not skip:
            add("all_gather", act, 1, "embedding: gradient of the sequence scatter", "backward")
    if last:
        if sp:
            add("all_gather", act, 1, "final hidden states gathered for the head", "forward")
        add("all_reduce", out_tokens * m.hidden * a, 1, "head input gradient (predicted tokens)", "backward")
        add("all_reduce", out_tokens * 4, 3, "vocab-parallel cross-entropy: max, target logit, sum of exp", "forward")
    return _merge(out)


def cp_collectives(cfg, stage: int, precision: str, accum: int) -> list[Collective]:
    """Context-parallel traffic of one rank per step: the clean stream's K/V (docs/parallelism.md)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.cp == 1:
        return []
    from .parallelize import stage_layers

    L = len(stage_layers(m.n_layers, p.pp, stage))
    a = dtype_bytes(precision)
    kv = cfg.data.seq_len * t.micro_batch * (m.kv_heads // p.tp) * m.dim_head * a * 2  # K and V, all L keys
    mode = getattr(t, "activation_checkpointing", "none")
    out = [Collective("cp", "all_gather", kv, L * accum, p.cp, "K and V of the L exchanged keys", "forward"),
           Collective("cp", "reduce_scatter", kv, L * accum, p.cp, "gradients of the exchanged K and V", "backward")]
    if mode == "full":
        out.append(Collective("cp", "all_gather", kv, L * accum, p.cp, "recomputed forward: K and V", "recompute"))
    return out


def pp_collectives(cfg, stage: int, precision: str, accum: int) -> list[Collective]:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if p.pp == 1:
        return []
    first, last = stage_has(p.pp, stage)
    a = dtype_bytes(precision)
    lay = cfg.objective.family.layout(cfg.data.seq_len, cfg.objective.block_size)
    tokens = lay.tokens_in / p.cp / (p.tp if p.sequence_parallel and p.tp > 1 else 1)
    act = tokens * t.micro_batch * m.hidden * a
    out = []
    if not last:
        out.append(Collective("pp", "send", act, accum, 2, "activations to the next stage", "forward"))
    if not first:
        out.append(Collective("pp", "send", act, accum, 2, "activation gradients to the previous stage", "backward"))
    if m.tie_embeddings and (first or last) and getattr(t, "lora", None) is None:  # LoRA: the embedding is frozen
        V = m.padded_vocab_size
        out.append(Collective("embedding", "all_reduce", V // p.tp * m.hidden * dtype_bytes(precision), 1, 2,
                              "tied embedding gradient (first and last stage)", "step"))
    return out


def dp_collectives(cfg, stage: int, precision: str, accum: int, replicas: int, params: int,
                   trainable: int) -> list[Collective]:
    """DeepSpeed's data-parallel traffic of one rank per step over `replicas` = dp * cp ranks."""
    p = cfg.parallel
    r = replicas
    if r == 1:
        return []
    w = dtype_bytes(precision)
    z = p.zero_stage
    if z == 0:
        return [Collective("dp", "all_reduce", 4 * trainable, 1, r, "gradients (fp32), once per step", "step")]
    g = w * trainable
    if z in (1, 2):
        calls = accum if z == 2 else 1
        return [Collective("dp", "all_reduce", g, calls, r,
                           "gradients, " + ("every micro-batch" if z == 2 else "once per step"),
                           "backward" if z == 2 else "step"),
                Collective("dp", "all_gather", trainable * w, 1, r, "updated weights after the optimizer step", "step")]
    once, gathered = zero3_gathers(cfg, stage)
    persistent = params - gathered
    return [Collective("dp", "all_gather", once * w, accum, r, "parameters gathered for the forward and backward", "forward"),
            Collective("dp", "reduce_scatter", g, accum, r, "gradients, every micro-batch", "backward"),
            Collective("dp", "all_gather", persistent * w, 1, r,
                       "persistent (small) parameters after the optimizer step", "step")]


ZERO3_MAX_REUSE = 1_000_000_000  # DeepSpeed's stage3_max_reuse_distance default (elements)


def zero3_gathers(cfg, stage: int) -> tuple[int, int]:
    """(elements ZeRO-3 all-gathers per micro-batch, elements of the parameters it gathers so) on one
    rank of `stage`, following DeepSpeed's rules: a parameter of at most 1e5 elements (its persistence
    threshold) stays gathered and is all-gathered once after the optimizer step; any other is gathered
    when a module needs it and released after the module unless the trace of modules shows it used again
    within 1e9 elements (its max reuse distance). The trace is the forward (embedding, blocks, final norm,
    head or the tied embedding) and the backward in reverse; TP is 1 under ZeRO-3."""
    from .parallelize import stage_layers

    m, p = cfg.model, cfg.parallel
    first, last = stage_has(p.pp, stage)
    layers = stage_layers(m.n_layers, p.pp, stage)
    shapes = dict(model_params(m, layers, pre_process=first, post_process=last))
    lora = getattr(cfg.train, "lora", None)
    if lora is not None:  # the adapters are parameters of their block
        from model.lora import block_adapter_params

        adapters = block_adapter_params(m, rank=lora.rank, targets=lora.targets)
        shapes.update({f"layers.{i}.{n}": s for i in layers for n, s in adapters.items()})
    modules: dict[str, list[int]] = {}
    for name, s in shapes.items():
        key = name if name.startswith(("embed.", "head.")) else ".".join(name.split(".")[:2])
        key = "head" if key.startswith("head.") else key
        modules.setdefault(key, []).append(s.numel)
    order = list(modules)
    if last and m.tie_embeddings:
        order.append("embed.weight")  # the tied head uses the embedding's weight
    trace = order + order[::-1]
    big = sum(n for ns in modules.values() for n in ns if n > ZERO3_PERSISTENCE)
    gathered: set[str] = set()
    once = 0
    for i, mod in enumerate(trace):
        if mod not in gathered:
            once += sum(n for n in modules[mod] if n > ZERO3_PERSISTENCE)
            gathered.add(mod)
        seen, reused = 0, False
        for nxt in trace[i + 1:]:
            if seen >= ZERO3_MAX_REUSE:
                break
            if nxt == mod:
                reused = True
                break
            seen += sum(modules[nxt])
        if not reused:
            gathered.discard(mod)
    return once, big


def step_collectives(cfg, world_size: int, precision: str, stage: int | None = None) -> list[Collective]:
    """Every collective one rank of `stage` (default: the stage that sends the most) runs per step."""
    from .memory import stage_params

    p, t = cfg.parallel, cfg.train
    accum = cfg.grad_accum(world_size)
    replicas = world_size // (p.tp * p.pp)  # dp * cp: the ranks that hold the same weights
    stages = stage_params(cfg.model, p.pp, getattr(t, "lora", None))

    def of(s: int) -> list[Collective]:
        sp = stages[s]
        return (tp_collectives(cfg, s, precision, accum) + cp_collectives(cfg, s, precision, accum)
                + pp_collectives(cfg, s, precision, accum)
                + dp_collectives(cfg, s, precision, accum, replicas, sp.per_rank(p.tp), sp.trainable_per_rank(p.tp)))

    if stage is not None:
        return of(stage)
    return max((of(s) for s in range(p.pp)), key=lambda cs: sum(c.sent for c in cs))


def sent_by_axis(collectives: list[Collective]) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in collectives:
        key = "dp" if c.axis == "dp" else ("pp" if c.axis in ("pp", "embedding") else c.axis)
        out[key] = out.get(key, 0.0) + c.sent
    return out


def _merge(cs: list[Collective]) -> list[Collective]:
    """Collectives of the same axis, op, payload and phase summed into one entry (calls added)."""
    out: dict[tuple, Collective] = {}
    for c in cs:
        key = (c.axis, c.op, c.nbytes, c.when, c.what)
        if key in out:
            o = out[key]
            out[key] = Collective(o.axis, o.op, o.nbytes, o.calls + c.calls, o.size, o.what, o.when)
        else:
            out[key] = c
    return list(out.values())


__all__ = ["Collective", "ring_sent", "tp_collectives", "cp_collectives", "pp_collectives", "dp_collectives",
           "step_collectives", "sent_by_axis", "zero3_gathers", "ZERO3_PERSISTENCE", "ZERO3_MAX_REUSE", "dtype_bytes"]
