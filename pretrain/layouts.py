"""Rank the training layouts of a recipe on a cluster by predicted step time: `setdlm pretrain --dry-run
--world-size N --compare-layouts`.

Every layout the recipe's model and batch allow is a candidate: TP in 1, 2, 4, 8 (at most a node; with
and without sequence parallelism), CP in 1, 2, 4, PP in 1, 2, 4, ZeRO 1, 2, 3 (with and without
`parallel.overlap_comm` where it applies), micro-batches 1, 2, 4, 8 dividing the per-rank batch. Each
takes the least activation checkpointing whose memory estimate (pretrain/memory.py) fits in 90% of
the GPU (none, then selective, then full), and is timed by pretrain/steptime.py. A layout the recipe
checks refuse (pretrain/config.py: divisibility, ZeRO-2/3 with PP, ZeRO-3 with TP, ...) is not a
candidate. The global batch, sequence length, model and precision stay the recipe's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from common.schema import ConfigError

from .hardware import Hardware
from .memory import GIB, estimate_memory
from .steptime import StepTime, step_time

TPS, CPS, PPS, ZEROS, MICRO = (1, 2, 4, 8), (1, 2, 4), (1, 2, 4), (1, 2, 3), (1, 2, 4, 8)
MODES = ("none", "selective", "full")


@dataclass
class Candidate:
    tp: int
    cp: int
    pp: int
    dp: int
    zero: int
    sp: bool
    overlap: bool
    micro: int
    mode: str
    peak_gib: float
    time: StepTime

    def overrides(self) -> list[str]:
        return [f"parallel.tp={self.tp}", f"parallel.cp={self.cp}", f"parallel.pp={self.pp}",
                f"parallel.zero_stage={self.zero}", f"parallel.sequence_parallel={str(self.sp).lower()}",
                f"parallel.overlap_comm={str(self.overlap).lower()}", f"train.micro_batch={self.micro}",
                f"train.activation_checkpointing={self.mode}"]

    def label(self) -> str:
        parts = [f"TP {self.tp}" + (" + SP" if self.sp else "")]
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.pp > 1:
            parts.append(f"PP {self.pp}")
        parts.append(f"DP {self.dp}")
        return " x ".join(parts) + f", ZeRO-{self.zero}" + (" + overlap" if self.overlap else "")


def layout_of(cfg, tp, cp, pp, zero, sp, overlap, micro, mode):
    out = copy.deepcopy(cfg)
    p, t = out.parallel, out.train
    p.tp, p.cp, p.pp, p.zero_stage, p.sequence_parallel, p.overlap_comm = tp, cp, pp, zero, sp, overlap
    t.micro_batch, t.activation_checkpointing = micro, mode
    return out


def candidates(cfg, world_size: int, hw: Hardware, *, precision: str = "bf16", usable: float = 0.9, tps=TPS,
               cps=CPS, pps=PPS, zeros=ZEROS, micro_batches=MICRO) -> list[Candidate]:
    """Every layout of `cfg` on `world_size` GPUs that fits, fastest first (the grid: module docstring)."""
    out = []
    budget = usable * hw.memory_gib * GIB
    for tp in tps:
        if tp > hw.gpus_per_node:
            continue
        for cp in cps:
            for pp in pps:
                if world_size % (tp * cp * pp):
                    continue
                for zero in zeros:
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for overlap in ((False, True) if zero in (1, 2) and pp == 1 else (False,)):
                            for micro in micro_batches:
                                c = _fit(cfg, world_size, hw, precision, budget, tp, cp, pp, zero, sp, overlap, micro)
                                if c is not None:
                                    out.append(c)
    return sorted(out, key=lambda c: c.time.total)


def _fit(cfg, world_size, hw, precision, budget, tp, cp, pp, zero, sp, overlap, micro) -> Candidate | None:
    for mode in MODES:
        c = layout_of(cfg, tp, cp, pp, zero, sp, overlap, micro, mode)
        try:
            c.validate(world_size)
        except ConfigError:
            return None
        peak = max(s.total for s in estimate_memory(c, world_size, precision=precision))
        if peak <= budget:
            return Candidate(tp, cp, pp, c.dp_size(world_size), zero, sp, overlap, micro, mode, peak / GIB,
                             step_time(c, world_size, hw, precision=precision))
    return None


def format_candidates(cands: list[Candidate], hw: Hardware, *, top: int = 15, mark=None) -> str:
    """A markdown table of the `top` fastest candidates (and `mark`, the recipe's own layout, if slower)."""
    head = ("| rank | layout | micro-batch | act. ckpt | memory GiB | step s | compute | TP/SP | CP | PP | DP/ZeRO "
            "| memory-bound | MFU | tokens/s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    shown = list(enumerate(cands[:top], 1))
    if mark is not None:
        for i, c in enumerate(cands, 1):
            if _same(c, mark) and i > top:
                shown.append((i, c))
    for i, c in shown:
        t = c.time
        lines.append(f"| {i}{' (recipe)' if mark is not None and _same(c, mark) else ''} | {c.label()} | {c.micro} | "
                     f"{c.mode} | {c.peak_gib:.1f} | {t.total:.2f} | {t.compute:.2f} | {t.tp:.2f} | {t.cp:.2f} | "
                     f"{t.bubble + t.pp_send:.2f} | {t.dp:.2f} | {t.memory:.2f} | {t.mfu:.1%} | {t.tokens_per_s:,.0f} |")
    return "\n".join(lines)


def _same(c: Candidate, cfg) -> bool:
    p, t = cfg.parallel, cfg.train
    return (c.tp, c.cp, c.pp, c.zero, c.sp, c.overlap, c.micro, c.mode) == (
        p.tp, p.cp, p.pp, p.zero_stage, bool(p.sequence_parallel), bool(p.overlap_comm), t.micro_batch,
        t.activation_checkpointing)


__all__ = ["Candidate", "candidates", "format_candidates", "layout_of", "TPS", "CPS", "PPS", "ZEROS", "MICRO"]
