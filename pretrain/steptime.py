"""How long one optimizer step of a layout takes on a GPU (pretrain/hardware.py), and the MFU that
follows: `setdlm pretrain --dry-run` prints the split, and ranks layouts by it (pretrain/layouts.py).

Inputs are the recipe and the hardware's rates; MFU is an output (model FLOPs of pretrain/flops.py /
(step time x GPUs x peak)). Per micro-batch, on the pipeline stage that takes longest:

- compute: the stage's matrix products (forward + backward, what activation checkpointing recomputes,
  the head on the last stage) at `matmul_efficiency` x peak, and its attention on the pairs the mask
  allows at `attention_efficiency` x peak, split over the TP x CP ranks (pretrain/flops.py:sequence_flops);
- memory-bound work at HBM bandwidth: every activation a block saves is written in the forward and read
  in the backward, and its gradient is written and read, 4 passes over `activation_bytes_per_token_layer`
  (pretrain/memory.py; one more forward under full recomputation); the fp32 logits and their gradient
  (4 passes); the gradient accumulation (read and write of the rank's fp32 gradients);
- TP/SP, CP and pipeline-send communication (pretrain/comm.py: what each rank sends under ring
  algorithms) at NVLink bandwidth when the group sits inside a node, else at the network's, all exposed:
  megatron-core overlaps part of the backward's TP collectives with the weight-gradient matmuls and
  Transformer Engine's userbuffer overlap is not used, so this is the upper end.

Then the step: the 1F1B pipeline runs m micro-batches on pp stages in (m + pp - 1) slots of the slowest
stage's micro-batch, the (pp - 1) extra slots being the bubble; data-parallel/ZeRO communication follows
DeepSpeed: ZeRO-0 and ZeRO-1 reduce after the last backward (exposed), ZeRO-2 on every micro-batch's
backward (exposed); with `parallel.overlap_comm` their reductions run beside the backward (of the last
micro-batch, ZeRO-1; of each, ZeRO-2) and only what exceeds it (2/3 of the micro-batch, the backward's
share of the FLOPs) is exposed; ZeRO-3 prefetches and reduces beside each micro-batch (DeepSpeed's
default for stage 3), so only what exceeds the micro-batch counts. The weights' all-gather after the
optimizer step (ZeRO 1-3) is exposed, and the optimizer step reads and writes about 30 bytes per
parameter of the rank's partition (fp32 master, moments and gradient, the bf16 copy) at HBM bandwidth.

What it leaves out: kernel launch and Python overheads (small at these sizes on a GPU, large for tiny
models), NCCL's distance from link rate (override the bandwidths with measured ones), stragglers and
data loading. The GPU check (docs/gpu.md) compares it with measured steps on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .comm import dp_collectives, sent_by_axis, step_collectives
from .flops import sequence_flops, step_flops
from .hardware import Hardware
from .memory import activation_bytes_per_token_layer, stage_params
from .rank_groups import groups_of

OPTIMIZER_BYTES = 30.0  # per parameter of the rank's partition: fp32 master, m, v read and written, fp32 grad, bf16 copy
BACKWARD_SHARE = 2.0 / 3.0  # of a micro-batch's compute: the backward (twice the forward's FLOPs)


@dataclass
class StepTime:
    compute: float  # s per step: matmuls and attention (recomputation included), slowest stage
    matmul: float
    attention: float
    memory: float  # s per step: memory-bound work (pointwise, logits, gradient accumulation, optimizer)
    tp: float  # s per step: TP/SP collectives (exposed)
    cp: float  # s per step: CP K/V exchange (exposed)
    pp_send: float  # s per step: pipeline sends
    bubble: float  # s per step: the pipeline's idle slots
    dp: float  # s per step: exposed data-parallel/ZeRO communication
    dp_total: float  # s: the data-parallel communication before overlap
    total: float
    mfu: float
    hfu: float
    tokens_per_s: float
    sent: dict = field(default_factory=dict)  # bytes per rank and step by axis (tp, cp, pp, dp)
    inside: dict = field(default_factory=dict)  # axis -> whether its groups sit inside a node

    def split(self) -> list[tuple[str, float]]:
        return [("compute", self.compute), ("memory-bound", self.memory), ("TP/SP comm", self.tp),
                ("CP comm", self.cp), ("PP bubble + sends", self.bubble + self.pp_send), ("DP/ZeRO comm", self.dp)]


def group_inside_node(ranks, gpus_per_node: int) -> bool:
    ranks = list(ranks)
    return ranks[0] // gpus_per_node == ranks[-1] // gpus_per_node and max(ranks) // gpus_per_node == min(ranks) // gpus_per_node


def axes_inside(cfg, world_size: int, gpus_per_node: int) -> dict[str, bool]:
    """Whether each axis's groups sit inside one node (megatron's order tp-cp-ep-dp-pp: groups are
    translates of rank 0's and of the last rank's)."""
    p = cfg.parallel
    dp = cfg.dp_size(world_size)
    out = {}
    for axis in ("tp", "cp", "dp", "pp", "replica"):
        out[axis] = all(group_inside_node(groups_of(r, p.tp, p.pp, dp, p.cp)[axis], gpus_per_node)
                        for r in (0, world_size - 1))
    return out


def stage_micro_batch(cfg, stage, hw: Hardware, precision: str, device: str) -> tuple[float, float, float]:
    """(matmul s, attention s, memory-bound s) of one micro-batch on one rank of pipeline stage `stage`."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    mode = getattr(t, "activation_checkpointing", "none")
    last = stage.stage == p.pp - 1
    n = len(stage.layers)
    mm, at = sequence_flops(m, cfg.objective.name, cfg.data.seq_len, cfg.objective.block_size, mode, n_layers=n,
                            head=last)
    share = t.micro_batch / (p.tp * p.cp)
    matmul_s = mm * share / hw.matmul_flops
    attention_s = at * share / hw.attention_flops
    a = 2 if precision == "bf16" else 4
    lay = cfg.objective.family.layout(cfg.data.seq_len, cfg.objective.block_size)
    tokens = lay.tokens_in / p.cp * t.micro_batch
    saved = activation_bytes_per_token_layer(m, p.tp, lay.tokens_in, a, device, "none", bool(p.sequence_parallel),
                                             bool(getattr(t, "compile", False)))
    hbm = saved * tokens * n * (5 if mode == "full" else 4)
    if last:
        hbm += 4 * 4 * lay.tokens_out / p.cp * t.micro_batch * m.padded_vocab_size / p.tp
    hbm += 2 * 4 * stage.trainable_per_rank(p.tp)  # gradient accumulation: read and write fp32
    return matmul_s, attention_s, hbm / (hw.hbm_tbps * 1e12)


def step_time(cfg, world_size: int, hw: Hardware, *, precision: str = "bf16", device: str = "cuda") -> StepTime:
    """The step time of `cfg` on `world_size` GPUs of kind `hw` (module docstring)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    accum = cfg.grad_accum(world_size)
    replicas = world_size // (p.tp * p.pp)
    inside = axes_inside(cfg, world_size, hw.gpus_per_node)
    link = {axis: hw.link_bytes_per_s(inside[axis]) for axis in ("tp", "cp", "pp")}
    link["dp"] = hw.link_bytes_per_s(inside["replica"])
    stages = stage_params(m, p.pp, getattr(t, "lora", None))
    rows = []
    for sp in stages:
        mm, at, hbm = stage_micro_batch(cfg, sp, hw, precision, device)
        sent = sent_by_axis(step_collectives(cfg, world_size, precision, stage=sp.stage))
        comm = {axis: sent.get(axis, 0.0) / link[axis] / accum for axis in ("tp", "cp", "pp")}
        dp_cs = dp_collectives(cfg, sp.stage, precision, accum, replicas, sp.per_rank(p.tp), sp.trainable_per_rank(p.tp))
        mb = mm + at + hbm + sum(comm.values())
        rows.append((mb, mm, at, hbm, comm, dp_cs, sent, sp))
    mb, mm, at, hbm, comm, dp_cs, sent, sp = max(rows, key=lambda r: r[0])
    slots = accum + p.pp - 1
    bubble = (p.pp - 1) * mb
    overlap = bool(getattr(p, "overlap_comm", False))
    dp_total, dp_exposed, beside = 0.0, 0.0, 0.0
    for c in dp_cs:
        s = c.sent / link["dp"]
        dp_total += s
        if c.op == "all_reduce" and overlap and p.zero_stage == 1:  # beside the last micro-batch's backward
            dp_exposed += max(0.0, s - BACKWARD_SHARE * mb)
        elif c.op == "all_reduce" and overlap and p.zero_stage == 2:  # beside every micro-batch's backward
            dp_exposed += accum * max(0.0, s / accum - BACKWARD_SHARE * mb)
        elif p.zero_stage == 3 and c.when != "step":
            beside += s  # gathers and reductions beside each micro-batch
        else:
            dp_exposed += s  # ZeRO-0/1's reduction after the backward, ZeRO-2's inside it, gathers after the step
    dp_exposed += accum * max(0.0, beside / accum - mb)
    partition = sp.trainable_per_rank(p.tp) / (replicas if p.zero_stage >= 1 else 1)
    optimizer = OPTIMIZER_BYTES * partition / (hw.hbm_tbps * 1e12)
    total = slots * mb + dp_exposed + optimizer
    flops = step_flops(cfg)
    peak = world_size * hw.peak_tflops * 1e12
    return StepTime(compute=accum * (mm + at), matmul=accum * mm, attention=accum * at,
                    memory=accum * hbm + optimizer, tp=accum * comm["tp"], cp=accum * comm["cp"],
                    pp_send=accum * comm["pp"], bubble=bubble, dp=dp_exposed, dp_total=dp_total, total=total,
                    mfu=flops.model / (total * peak), hfu=flops.hardware / (total * peak),
                    tokens_per_s=t.global_batch * cfg.data.seq_len / total,
                    sent={**{k: v for k, v in sent.items() if k != "dp"},
                          "dp": sum(c.sent for c in dp_cs)}, inside=inside)


__all__ = ["StepTime", "step_time", "axes_inside", "OPTIMIZER_BYTES", "BACKWARD_SHARE"]
