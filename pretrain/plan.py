"""`setdlm pretrain --dry-run`: validate a layout and print its plan without starting anything.

    setdlm pretrain --config configs/qwen3-1.7b-setdlm.yaml --dry-run --world-size 64 parallel.tp=8 parallel.pp=4

prints the layout (TP x CP x PP x DP, micro-batches, accumulation, pipeline bubble), the process groups
of every rank (megatron-core's own rank generator, order tp-cp-ep-dp-pp: TP peers are neighbours, so a
TP group stays inside a node when tp <= GPUs per node), the pipeline stages, a memory estimate per GPU
and pipeline stage (pretrain/memory.py; its model: docs/memory.md), FLOPs per step (pretrain/flops.py),
the bytes each GPU sends per step by axis (pretrain/comm.py) and the predicted step time with its split
and MFU on the chosen GPU (pretrain/steptime.py, pretrain/hardware.py: `--hardware h100|h200` and the
SETDLM_ overrides); `--compare-layouts` ranks the recipe's other layouts (pretrain/layouts.py). No
process group, model or tensor is created; only the tokenizer is read when the recipe leaves the
vocabulary size to it.
"""

from __future__ import annotations

import math
import sys

import dataclasses

from common.errors import UsageError
from common.schema import ConfigError
from model.shapes import parameter_count

from .comm import sent_by_axis, step_collectives
from .flops import step_flops
from .hardware import Hardware, resolve_hardware
from .memory import GIB, bytes_per_param, estimate_memory, micro_batch_fit
from .rank_groups import groups_of, rank_groups
from .steptime import step_time


# -- communication ------------------------------------------------------------------------------------
AXES = {"tp": "tensor parallel", "cp": "context parallel", "pp": "pipeline", "dp": "data parallel"}


def comm_bytes_per_step(cfg, world_size: int, precision: str) -> dict:
    """Bytes one rank sends per optimizer step by axis (ring algorithms; pretrain/comm.py), on the
    pipeline stage that sends the most."""
    sent = sent_by_axis(step_collectives(cfg, world_size, precision))
    return {name: sent.get(axis, 0.0) for axis, name in AXES.items()}


# -- the plan -----------------------------------------------------------------------------------------
MAX_WORLD = 1 << 20  # GPUs a dry run plans for (1,048,576: beyond the largest clusters)


def check_world_size(world_size) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or not 1 <= world_size <= MAX_WORLD:
        raise UsageError(f"--world-size: must be an integer in [1, {MAX_WORLD}], got {world_size!r}")
    return world_size


def resolve_for_plan(cfg) -> None:
    """Fill model.vocab_size / mask_id from the tokenizer when the recipe leaves them to it."""
    if cfg.model.vocab_size > 0 and cfg.model.mask_id >= 0:
        return
    from data_pipeline.tokenizers import load_tokenizer

    try:
        tok = load_tokenizer(cfg.data.tokenizer, add_mask=cfg.data.add_mask_token)  # as the run loads it
    except Exception as e:  # noqa: BLE001 - any tokenizer problem: say how to plan without it
        raise ConfigError(f"data.tokenizer: cannot load {cfg.data.tokenizer!r} here ({e}); set model.vocab_size and "
                          "model.mask_id to plan without it") from None
    cfg.resolve_vocab(tok)


def plan(cfg, world_size: int, *, device: str = "cuda", gpus_per_node: int | None = None,
         hardware: Hardware | str | None = None) -> dict:
    """Validate `cfg` for `world_size` ranks and compute the plan (what print_plan shows) on `hardware`
    (a pretrain/hardware.py preset name or Hardware; default h100 with the SETDLM_ overrides)."""
    check_world_size(world_size)
    hw = hardware if isinstance(hardware, Hardware) else resolve_hardware(hardware)
    if gpus_per_node:
        hw = dataclasses.replace(hw, gpus_per_node=gpus_per_node)
    resolve_for_plan(cfg)
    cfg.validate(world_size)
    p, t, m = cfg.parallel, cfg.train, cfg.model
    dp = cfg.dp_size(world_size)
    accum = cfg.grad_accum(world_size)
    gpn = hw.gpus_per_node
    precision = t.precision if t.precision != "auto" else ("bf16" if device == "cuda" else "fp32")
    memory = estimate_memory(cfg, world_size, precision=precision, device=device)
    full_ft = estimate_memory(cfg, world_size, precision=precision, device=device, lora=False) if t.lora else None
    gpu_gib = hw.memory_gib
    fit = micro_batch_fit(cfg, world_size, gpu_gib, device=device)
    flops = step_flops(cfg)
    bubble = (p.pp - 1) / (accum + p.pp - 1) if p.pp > 1 else 0.0
    time = step_time(cfg, world_size, hw, precision=precision, device=device)
    warnings = []
    if p.tp > gpn:
        warnings.append(f"parallel.tp={p.tp} exceeds {gpn} GPUs per node: tensor-parallel all-reduces cross nodes")
    elif p.cp > 1 and p.tp * p.cp > gpn:
        warnings.append(f"parallel.tp * parallel.cp = {p.tp * p.cp} exceeds {gpn} GPUs per node: the K/V exchange "
                        "crosses nodes")
    if p.pp > 1 and accum < p.pp:
        warnings.append(f"{accum} micro-batches per step for {p.pp} stages: the pipeline bubble is {bubble:.0%}; "
                        f"raise train.global_batch or lower train.micro_batch")
    if m.n_layers % p.pp:
        warnings.append(f"{m.n_layers} layers over {p.pp} stages: stages differ by one layer")
    peak = max(sm.total for sm in memory)
    if peak > 0.9 * gpu_gib * GIB:
        warnings.append(f"the estimated peak {peak / GIB:.1f} GiB exceeds 90% of {gpu_gib:g} GiB per GPU: lower "
                        "train.micro_batch, raise train.activation_checkpointing or shard more (--compare-layouts)")
    return {"world": world_size, "tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": dp, "zero": p.zero_stage, "accum": accum,
            "micro_batch": t.micro_batch, "global_batch": t.global_batch, "precision": precision,
            "fit": fit, "gpu_gib": gpu_gib, "checkpointing": getattr(t, "activation_checkpointing", "none"),
            "compile": bool(getattr(t, "compile", False)),
            "sequence_parallel": getattr(p, "sequence_parallel", False),
            "gpus_per_node": gpn, "memory": memory, "flops": flops, "hardware": hw, "time": time,
            "bubble": bubble, "comm": comm_bytes_per_step(cfg, world_size, precision), "warnings": warnings,
            "full_finetune": full_ft,
            "params_total": parameter_count(m)}


def _bytes(x: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f}"


def format_plan(cfg, info: dict, *, max_ranks: int = 128) -> str:
    m, t = cfg.model, cfg.train
    lines = []
    w = lines.append
    tp, pp, dp, cp = info["tp"], info["pp"], info["dp"], info.get("cp", 1)
    w(f"setdlm dry run: {cfg.run.name} | {info['params_total'] / 1e9:.3f}B parameters | objective {cfg.objective.name} "
      f"| L={cfg.data.seq_len} | {info['precision']}")
    w(f"layout: world {info['world']} = TP {tp} x " + (f"CP {cp} x " if cp > 1 else "") + f"PP {pp} x DP {dp} | "
      f"ZeRO-{info['zero']}" + (f" over DP x CP = {dp * cp} ranks" if cp > 1 else "")
      + (" + overlap_comm" if getattr(cfg.parallel, "overlap_comm", False) else "") + " | "
      f"{info['gpus_per_node']} GPUs per node -> {math.ceil(info['world'] / info['gpus_per_node'])} node(s)")
    if cp > 1:
        fam = cfg.objective.family
        L = cfg.data.seq_len
        streams = "both streams'" if fam.two_stream else "the sequence's"
        w(f"context parallel: {streams} {L} positions cut into {2 * cp} chunks of {L // (2 * cp)}, rank r of a CP "
          f"group holding chunks r and {2 * cp - 1}-r; the K/V of the {L} "
          + ("clean-stream keys" if fam.two_stream else "keys") + " are all-gathered forward and their gradients "
          "reduce-scattered backward")
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
    world = info["world"]
    w(f"process groups (megatron order tp-cp-ep-dp-pp): {world // tp} TP groups of {tp}, "
      + (f"{world // cp} CP groups of {cp}, " if cp > 1 else "") + f"{world // pp} PP groups "
      f"of {pp}, {world // dp} DP groups of {dp}" + (f", {world // pp} embedding groups" if pp > 1 else "")
      + (f"; gradients and ZeRO over the {world // (dp * cp)} replica groups of DP x CP = {dp * cp}" if cp > 1 else ""))
    n = min(world, max_ranks)
    w(f"  {'rank':>5} {'node':>4} {'stage':>5}  {'TP group':<20} " + (f"{'CP group':<20} " if cp > 1 else "")
      + f"{'PP group':<20} {'DP group':<20}")
    for r in range(n):
        g = groups_of(r, tp, pp, dp, cp)
        w(f"  {r:>5} {r // info['gpus_per_node']:>4} {g['pp'].index(r):>5}  {_fmt_group(g['tp']):<20} "
          + (f"{_fmt_group(g['cp']):<20} " if cp > 1 else "")
          + f"{_fmt_group(g['pp']):<20} {_fmt_group(g['dp']):<20}")
    if n < info["world"]:
        w(f"  ... {info['world'] - n} more ranks")
    w("")
    bpp = bytes_per_param(info["precision"], info["zero"], dp * cp)
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
    if info.get("full_finetune"):
        lo, full = t.lora, max(sm.total for sm in info["full_finetune"])
        sm = max(info["memory"], key=lambda x: x.total)
        w(f"  LoRA rank {lo.rank} on {', '.join(lo.targets)}: {sm.trainable:,} of {sm.params:,} parameters per rank "
          f"train (gradients and optimizer states for them only): peak {peak / GIB:.2f} GiB against "
          f"{full / GIB:.2f} GiB for full fine-tuning, {(full - peak) / GIB:.2f} GiB saved per GPU")
    fit = ", ".join(f"{mode} {b if b else 'none fits'} ({pk / GIB:.1f} GiB)" for mode, (b, pk) in info["fit"].items())
    w(f"largest micro-batch within 90% of {info['gpu_gib']:g} GiB per GPU ({info['hardware'].name}; SETDLM_GPU_MEMORY_GIB), by "
      f"train.activation_checkpointing: {fit}")
    w("")
    sf = info["flops"]
    f = sf.model
    w(f"FLOPs per step: {f:.3e} total (fwd + bwd matmuls, attention on the pairs the mask allows), "
      f"{f / info['world']:.3e} per GPU" + (f"; with recomputation {sf.hardware:.3e}" if sf.hardware != f else ""))
    st, hw = info["time"], info["hardware"]
    c = info["comm"]
    where = {"tp": st.inside["tp"], "cp": st.inside["cp"], "pp": st.inside["pp"], "dp": st.inside["replica"]}
    w("communication per step and GPU (bytes sent under ring algorithms, pretrain/comm.py): " + ", ".join(
        f"{name} {_bytes(v)} ({'NVLink' if where[axis] else 'network'})"
        for (axis, name), v in zip(AXES.items(), c.values()) if v or axis in ("tp", "dp")))
    w("")
    w(f"step time on {info['world']} x {hw.name} (pretrain/steptime.py; --hardware, SETDLM_ overrides): "
      f"{hw.peak_tflops:g} TFLOP/s bf16 peak x {hw.matmul_efficiency:g} for matmuls, x {hw.attention_efficiency:g} "
      f"for attention; NVLink {hw.nvlink_gbps:g} GB/s, network {hw.internode_gbps:g} GB/s per GPU; HBM {hw.hbm_tbps:g} TB/s")
    unit, scale = ("s", 1.0) if st.total >= 1 else ("ms", 1e3)
    notes = {"compute": f"matmuls {st.matmul * scale:.2f} {unit} + attention {st.attention * scale:.2f} {unit}"
                        + (", recomputation included" if info["checkpointing"] != "none" else ""),
             "memory-bound": "pointwise ops, logits, gradient accumulation, optimizer step",
             "TP/SP comm": "exposed; the backward re-gather counted" if info["sequence_parallel"] else "exposed",
             "CP comm": "K/V all-gather forward, gradient reduce-scatter backward",
             "PP bubble + sends": f"(pp-1)/(m+pp-1) = {info['bubble']:.1%} of the pipeline",
             "DP/ZeRO comm": f"exposed, of {st.dp_total * scale:.2f} {unit}"}
    for name, secs in st.split():
        w(f"  {name:<18} {secs * scale:8.3f} {unit:<2} {100 * secs / st.total:5.1f}%  {notes[name]}")
    w(f"  {'step':<18} {st.total * scale:8.3f} {unit:<2}        {st.tokens_per_s:,.0f} tokens/s | MFU {st.mfu:.1%} (model FLOPs / "
      f"(step x GPUs x peak))" + (f", HFU {st.hfu:.1%}" if st.hfu != st.mfu else ""))
    if st.total < 0.05:
        w("  (kernel launches and Python time are not in the model: a step this short is bound by them)")
    for warning in info["warnings"]:
        w(f"warning: {warning}")
    w("dry run: nothing was started")
    return "\n".join(lines)


def _fmt_group(ranks) -> str:
    if isinstance(ranks, range) and len(ranks) > 2:
        return f"{ranks[0]}..{ranks[-1]}" + (f" step {ranks.step}" if ranks.step != 1 else "")
    if len(ranks) > 2 and all(b - a == ranks[1] - ranks[0] for a, b in zip(ranks, ranks[1:])):
        step = ranks[1] - ranks[0]
        return f"{ranks[0]}..{ranks[-1]}" + (f" step {step}" if step != 1 else "")
    return ",".join(map(str, ranks))


def print_plan(cfg, world_size: int, *, file=None, hardware: str | None = None, compare: bool = False) -> dict:
    """Validate and print the plan of `cfg` on `world_size` GPUs (the `--dry-run` of setdlm pretrain);
    `compare`: then the ranked table of the recipe's layouts (pretrain/layouts.py)."""
    info = plan(cfg, world_size, hardware=hardware)
    out = file or sys.stdout
    print(format_plan(cfg, info), file=out, flush=True)
    if compare:
        from .layouts import candidates, format_candidates

        cands = candidates(cfg, world_size, info["hardware"], precision=info["precision"])
        print(f"\nlayouts of this recipe on {world_size} x {info['hardware'].name}, fastest first ({len(cands)} fit in "
              f"90% of {info['gpu_gib']:g} GiB; pretrain/layouts.py):", file=out)
        print(format_candidates(cands, info["hardware"], mark=cfg), file=out, flush=True)
        if cands:
            print("the fastest as overrides: " + " ".join(cands[0].overrides()), file=out, flush=True)
    return info


__all__ = ["plan", "print_plan", "format_plan", "rank_groups", "groups_of", "check_world_size", "comm_bytes_per_step",
           "resolve_for_plan", "MAX_WORLD"]
