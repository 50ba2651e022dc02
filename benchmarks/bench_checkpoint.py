"""Checkpoint save and load at a few hundred million parameters: blocking time, write time, load memory.

    .venv/bin/python benchmarks/bench_checkpoint.py [--layers 24] [--hidden 1024] [--vocab 8192]
                                                   [--nproc 2] [--load-layout zero3] [--markdown] [--keep DIR]

Two real torchrun launches (gloo, one thread per process), each rank running the trainer's own code
(`build_stage`, `build_engine`, the EMA, `pretrain/checkpoint/writer.py`, `resume.load_sharded`):

1. save: a model of `--layers` x `--hidden` (FFN 4x, vocabulary `--vocab`, fp32, an EMA) under ZeRO-1
   over `--nproc` data-parallel ranks, its AdamW states filled (random moments), is saved
   - in the step loop (`train.async_save: false`): the loop is blocked for the whole save;
   - in the background: the loop is blocked for the snapshot only (`ckpt/blocking_s`), and the write
     ends `ckpt/write_s` after the save began;
   first one background save (it allocates the staging buffers, reported on its own row), then two of
   each kind, alternately (the faster of the two is reported); per rank: seconds blocked, seconds
   until the write ended, the bytes it wrote.
2. load: fresh processes under another layout (`--load-layout`: zero3, the same ranks under ZeRO-3,
   or tp2, tensor parallelism over 2 ranks) resume from that checkpoint; per rank: the bytes of its own
   state, the increase of its peak resident memory over the load (Linux VmHWM, reset just before),
   and the load's seconds, against the whole checkpoint's bytes. A third row reads the whole model in
   one process (what `load_model` and a whole-model file loader do) for comparison.

A script, not a test: times depend on the disk and the machine's load (record `uptime` with the
numbers; tests/test_checkpoint_memory.py checks the memory bound, tests/test_checkpoint_background.py
the background write).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LAYOUTS = {"zero1": {"zero_stage": 1}, "zero3": {"zero_stage": 3}, "tp2": {"tp": 2, "zero_stage": 0}}


def recipe(args, layout: str, world: int) -> dict:
    p = LAYOUTS[layout]
    dp = world // p.get("tp", 1)
    return {"run": {"seed": 3, "name": "bench", "out_dir": args.work},
            "model": {"n_layers": args.layers, "hidden": args.hidden, "n_heads": max(1, args.hidden // 64),
                      "ffn_hidden": 4 * args.hidden, "dropout": 0.0, "max_seq_len": 64, "vocab_size": args.vocab,
                      "mask_id": args.vocab - 1, "tie_embeddings": True},
            "objective": {"name": "setdlm", "set_size": 4}, "data": {"seq_len": 32},
            "train": {"micro_batch": 1, "global_batch": dp, "precision": "fp32", "ema": 0.999,
                      "keep_last": 0},
            "parallel": p, "logging": {"wandb": "disabled"}}


def build(args, layout: str):
    import torch
    import torch.distributed as dist

    from pretrain.config import from_dict
    from pretrain.ema import EMA
    from pretrain.engine import build_engine, zero3_init
    from pretrain.parallel import ensure_model_parallel, ensure_process_group
    from pretrain.parallelize import build_stage

    ensure_process_group()
    world = dist.get_world_size()
    cfg = from_dict(recipe(args, layout, world))
    cfg.validate(world)
    p = cfg.parallel
    ensure_model_parallel(p.tp, p.pp, p.cp)
    torch.manual_seed(3)
    model = build_stage(cfg.model, p.tp, p.pp, zero_init=zero3_init(cfg, world, "fp32"))
    engine, _, _ = build_engine(model, cfg, world, "fp32")
    return cfg, engine, EMA(engine.module, 0.999)


def worker_save(args) -> dict:
    import torch
    import torch.distributed as dist

    from pretrain.checkpoint import train_state
    from pretrain.checkpoint.relayout import _init_flat_optimizer_states
    from pretrain.checkpoint.rng import rng_state
    from pretrain.checkpoint.writer import Saver

    cfg, engine, ema = build(args, "zero1")
    trainable = [q for q in engine.module.parameters() if q.requires_grad]
    _init_flat_optimizer_states(engine.optimizer, 1, trainable)
    base = engine.optimizer.optimizer
    g = torch.Generator().manual_seed(dist.get_rank())
    for st in base.state.values():  # moments as a trained run has them (not pages of zeros)
        for k in ("exp_avg", "exp_avg_sq"):
            st[k].copy_(torch.rand(st[k].shape, generator=g))
    rank = dist.get_rank()
    root = Path(args.work) / "bench" / "checkpoints"
    meta = {"step": 0, "tokens_seen": 0, "config": cfg.to_dict(),
            "layout": {"world": dist.get_world_size(), "tp": 1, "pp": 1, "dp": dist.get_world_size(), "cp": 1,
                       "zero_stage": 1}}
    out = {"rank": rank, "params": sum(q.numel() for q in engine.module.parameters())}
    saver = Saver(root, rank=rank, background=True, keep_last=0)
    # save 1 (background) allocates the staging buffers; then, alternately, in the step loop and in the
    # background, twice each, all reusing them
    for step, background in ((1, True), (2, False), (3, True), (4, False), (5, True)):
        saver.background = background
        dist.barrier()
        stats = saver.save(engine, ema, step, meta={**meta, "step": step}, extra={"step": step, "rng": rng_state()})
        done = saver.wait() if background else None
        kind = "first" if step == 1 else "async" if background else "sync"
        out.setdefault(f"{kind}_blocking_s", []).append(stats["ckpt/blocking_s"])
        out.setdefault(f"{kind}_write_s", []).append(done.write_s if background else stats["ckpt/write_s"])
    ckpt = root / "step_00000005"
    out["rank_bytes"] = (ckpt / f"__{rank}_0.distcp").stat().st_size
    out["own_state_bytes"] = train_state.total_bytes(train_state.save_state(engine, ema))
    return out


def worker_load(args) -> dict:
    import torch.distributed as dist

    from common.procmem import peak_rss_mib, reset_peak_rss, rss_mib
    from pretrain.checkpoint import resume, train_state

    cfg, engine, ema = build(args, args.load_layout)
    ckpt = Path(args.work) / "bench" / "checkpoints" / "step_00000005"
    targets = train_state.load_targets(engine, ema, set(_keys(ckpt)), step=1)
    own = train_state.total_bytes(targets.targets)
    dist.barrier()
    reset_peak_rss()
    before = rss_mib()
    t0 = time.perf_counter()
    resume.load_sharded(engine, ckpt, ema=ema, rank=dist.get_rank())
    seconds = time.perf_counter() - t0
    return {"rank": dist.get_rank(), "own_state_bytes": own, "load_peak_mib": peak_rss_mib() - before,
            "load_s": seconds}


def _keys(ckpt: Path):
    from pretrain.checkpoint.distcp import read_metadata

    return read_metadata(ckpt).state_dict_metadata.keys()


def whole_read(args) -> dict:
    from common.procmem import peak_rss_mib, reset_peak_rss, rss_mib
    from pretrain.checkpoint.distcp import whole_state

    ckpt = Path(args.work) / "bench" / "checkpoints" / "step_00000005"
    reset_peak_rss()
    before = rss_mib()
    t0 = time.perf_counter()
    state = whole_state(ckpt, optimizer=True)
    seconds = time.perf_counter() - t0
    n = sum(t.numel() * t.element_size() for part in (state["module"], state["ema"], *state["optimizer"].values())
            for t in part.values())
    return {"rank": 0, "own_state_bytes": n, "load_peak_mib": peak_rss_mib() - before, "load_s": seconds}


def launch(args, phase: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           __file__, "--worker", phase, *sys.argv[1:]]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{phase} launch failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return [json.loads((Path(args.work) / f"{phase}-{rank}.json").read_text()) for rank in range(args.nproc)]


def table(args, saves: list[dict], loads: list[dict], whole: dict, total: int) -> str:
    gib = 2**30
    lines = [f"model: {saves[0]['params'] / 1e6:.0f}M parameters ({args.layers} x {args.hidden}, vocab {args.vocab}, fp32, "
             f"EMA), ZeRO-1 over {args.nproc} ranks; checkpoint {total / gib:.2f} GiB "
             f"(weights + 2 moments + EMA: 16 bytes per parameter)", "",
             "| save | rank | step loop blocked s | write s (after the snapshot) | rank wrote GiB |", "|---|---|---|---|---|"]
    for kind, what in (("sync", "in the step loop (`train.async_save: false`)"), ("async", "in the background"),
                       ("first", "in the background, the first save (allocates the staging buffers)")):
        for s in saves:
            lines.append(f"| {what} | {s['rank']} | {min(s[f'{kind}_blocking_s']):.2f} | "
                         f"{min(s[f'{kind}_write_s']):.2f} | {s['rank_bytes'] / gib:.2f} |")
    lines += ["", f"| load under {args.load_layout} | rank | own state GiB | peak RSS increase GiB | whole checkpoint GiB | s |",
              "|---|---|---|---|---|---|"]
    for s in loads:
        lines.append(f"| every rank its own chunks | {s['rank']} | {s['own_state_bytes'] / gib:.2f} | "
                     f"{s['load_peak_mib'] / 1024:.2f} | {total / gib:.2f} | {s['load_s']:.1f} |")
    lines.append(f"| the whole model in one process (load_model's read) | - | {whole['own_state_bytes'] / gib:.2f} | "
                 f"{whole['load_peak_mib'] / 1024:.2f} | {total / gib:.2f} | {whole['load_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--load-layout", choices=("zero3", "tp2"), default="zero3")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one, removed)")
    ap.add_argument("--worker", choices=("save", "load"), help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import torch.distributed as dist

        result = worker_save(args) if args.worker == "save" else worker_load(args)
        (Path(args.work) / f"{args.worker}-{dist.get_rank()}.json").write_text(json.dumps(result))
        dist.barrier()
        return
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    work.mkdir(parents=True, exist_ok=True)
    args.work = str(work)
    sys.argv += ["--work", str(work)]
    try:
        load = os.getloadavg()
        saves = launch(args, "save")
        loads = launch(args, "load")
        whole = whole_read(args)
        ckpt = work / "bench" / "checkpoints" / "step_00000005"
        total = sum(p.stat().st_size for p in ckpt.glob("*.distcp"))
        after = os.getloadavg()
        print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, load average "
              f"{load[0]:.1f} before / {after[0]:.1f} after; torch {__import__('torch').__version__}")
        print(table(args, saves, loads, whole, total))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
