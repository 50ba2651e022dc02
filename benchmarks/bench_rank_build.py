"""What one rank builds: its parameters, their bytes, and the host memory the build takes, for a
large preset under a TP x PP layout, in one CPU process and without the model's memory.

    python benchmarks/bench_rank_build.py --preset qwen3-8b --tp 8 --pp 1 2 4 [--json]

For each layout, rank (stage s, tensor-parallel rank r) joins a world of tp * pp ranks through
torch's fake process group (`torch.testing._internal.distributed.fake_pg`: real group bookkeeping,
no communication; the way torchtitan estimates memory), so megatron-core's parallel state is that
rank's, and `pretrain.parallelize.build_stage(device="meta")` builds its stage exactly as a GPU rank
does with `device="cuda"`: the same megatron layers, shard shapes and per-shard initialisation
(model/init.py draws each unit of the rank's own shards on the host and copies it to the device;
on `meta` the copy is free, so what the host holds is what a GPU build holds there too). Per rank it
prints the parameters (pretrain/memory.py's `stage_params(...).per_rank(tp)` beside them), their bf16 and fp32
bytes, the peak host-memory increase during the build (VmHWM, Linux) and the build time. Building
nothing beyond a rank's own units is what keeps the host peak near the largest unit (1/tp of the
embedding for a 150k vocabulary) instead of the full model's bytes.

The vocabulary is the recipe's tokenizer's (qwen3: 151,669 tokens + MASK, padded to 151,680).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.procmem import peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402

MIB = 2**20


def build_rank(model_cfg, tp: int, pp: int, stage: int, tp_rank: int) -> dict:
    """Build rank (stage, tp_rank)'s part of the model on `meta` in a fake tp * pp world; what it holds."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from pretrain.memory import stage_params
    from pretrain.parallelize import build_stage

    # megatron's order tp-cp-ep-dp-pp with dp = 1: global rank = stage * tp + tp_rank
    dist.init_process_group("fake", store=FakeStore(), rank=stage * tp + tp_rank, world_size=tp * pp)
    try:
        parallel_state.initialize_model_parallel(tp, pp, create_gloo_process_groups=False)
        assert parallel_state.get_tensor_model_parallel_rank() == tp_rank
        assert (parallel_state.get_pipeline_model_parallel_rank() if pp > 1 else 0) == stage
        torch.manual_seed(0)
        reset = reset_peak_rss()
        before = rss_mib()
        t0 = time.perf_counter()
        model = build_stage(model_cfg, tp, pp, device="meta")
        seconds = time.perf_counter() - t0
        peak = peak_rss_mib() - before if reset else float("nan")
        params = dict(model.named_parameters())
        devices = sorted({str(p.device) for p in params.values()})
        full = sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in params.values())
        n = sum(p.numel() for p in params.values())
        largest = max(p.numel() for p in params.values())
        del model
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return {"tp": tp, "pp": pp, "stage": stage, "tp_rank": tp_rank, "params": n,
            "plan_params": stage_params(model_cfg, pp)[stage].per_rank(tp), "full_params_covered": full,
            "bf16_gib": n * 2 / 2**30, "fp32_gib": n * 4 / 2**30, "largest_fp32_mib": largest * 4 / MIB,
            "host_peak_mib": peak, "build_s": seconds, "devices": devices,
            "names": sorted(params)}


def model_config(preset: str, vocab_size: int, n_layers: int | None = None):
    from model.config import ModelConfig, apply_preset

    section = {**apply_preset({"preset": preset}), "vocab_size": vocab_size, "mask_id": vocab_size - 1}
    if n_layers:
        section["n_layers"] = n_layers
    return ModelConfig(**section)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--vocab-size", type=int, default=151670, help="tokens with MASK (qwen3 tokenizer: 151670)")
    ap.add_argument("--n-layers", type=int, default=0, help="override the preset's depth (0: keep it)")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--ranks", default="first,last", help="which ranks per layout: first,last (stage 0 rank 0 and "
                                                          "the last stage's last TP rank) or all")
    ap.add_argument("--json", action="store_true", help="one JSON object per rank instead of the table")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import warnings

    warnings.filterwarnings("ignore")
    from model.shapes import parameter_count

    cfg = model_config(args.preset, args.vocab_size, args.n_layers or None)
    cfg.validate(tp=args.tp)
    total = parameter_count(cfg)
    rows = []
    for pp in args.pp:
        ranks = ([(s, r) for s in range(pp) for r in range(args.tp)] if args.ranks == "all"
                 else sorted({(0, 0), (pp - 1, args.tp - 1)}))
        for stage, tp_rank in ranks:
            rows.append(build_rank(cfg, args.tp, pp, stage, tp_rank))
    if args.json:
        for row in rows:
            print(json.dumps({**row, "model_params": total, "model_bf16_gib": total * 2 / 2**30}))
        return 0
    print(f"# {args.preset}: {total / 1e9:.3f}B parameters ({total * 2 / 2**30:.1f} GiB bf16, {total * 4 / 2**30:.1f} GiB "
          f"fp32), vocabulary {cfg.vocab_size} (padded {cfg.padded_vocab_size}); one rank built on `meta` in a fake "
          f"process group of tp x pp ranks")
    print("| TP | PP | stage | TP rank | params / rank | plan.py | bf16 GiB | fp32 GiB | largest fp32 weight MiB "
          "| host peak MiB | build s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['pp']} | {r['stage']} | {r['tp_rank']} | {r['params']:,} | {r['plan_params']:,} | "
              f"{r['bf16_gib']:.2f} | {r['fp32_gib']:.2f} | {r['largest_fp32_mib']:.0f} | {r['host_peak_mib']:.0f} | "
              f"{r['build_s']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
