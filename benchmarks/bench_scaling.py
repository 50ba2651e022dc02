"""CPU scaling of the parallel layouts: tokens/s, communication share, predicted vs measured memory.

    .venv/bin/python benchmarks/bench_scaling.py [--steps 6] [--markdown]

Trains one fixed small SW-SetDLM (4 layers, hidden 256, 4 heads, vocab 8192, L=128, so 256 tokens
through the two-stream model per sequence; global batch 16 sequences in micro-batches of 4, fp32)
for a few steps under DP=1, DP=2 (ZeRO-0 and ZeRO-1), TP=2 and PP=2, each a real torchrun launch
(gloo, one thread per process), with the training code of `setdlm pretrain` (build_stage,
build_engine, StepRunner) on synthetic tokens. Per layout it prints

- tokens/s over the timed steps (after warm-up) and the speed-up over DP=1;
- the communication share: time inside torch.distributed collectives and point-to-point waits over
  step time, per rank, averaged (under PP a wait includes idling for the other stage: the bubble);
- the dry-run estimate of memory per process (pretrain/memory.py, device="cpu") next to the measured
  peak RSS increase of the process from just before the model is built to the end of training.

A script, not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RECIPE = {
    "run": {"seed": 3, "name": "bench"},
    "model": {"n_layers": 4, "hidden": 256, "n_heads": 4, "ffn_hidden": 1024, "dropout": 0.0, "max_seq_len": 128,
              "vocab_size": 8192, "mask_id": 8191, "tie_embeddings": True, "norm": "layernorm", "activation": "gelu"},
    "objective": {"name": "setdlm", "set_size": 4},
    "data": {"seq_len": 128},
    "train": {"micro_batch": 4, "global_batch": 16, "lr": 1e-3, "warmup_steps": 0, "precision": "fp32"},
    "logging": {"wandb": "disabled"},
}
LAYOUTS = [  # name, processes, tp, pp, zero, threads per process
    ("DP=1", 1, 1, 1, 0, 1),
    ("DP=1 (2 threads)", 1, 1, 1, 0, 2),
    ("DP=2", 2, 1, 1, 0, 1),
    ("DP=2 ZeRO-1", 2, 1, 1, 1, 1),
    ("TP=2", 2, 2, 1, 0, 1),
    ("PP=2", 2, 1, 2, 0, 1),
]


# -- worker (one process of a launch) ---------------------------------------------------------------
class CommTimer:
    """Wall time spent inside torch.distributed collectives and p2p waits of this process."""

    NAMES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "broadcast",
             "reduce_scatter", "barrier", "all_to_all_single")

    def __init__(self):
        import torch.distributed as dist

        self.total = 0.0
        self.enabled = False
        for name in self.NAMES:
            if hasattr(dist, name):
                setattr(dist, name, self._timed(getattr(dist, name)))
        for name in ("isend", "irecv"):
            setattr(dist, name, self._p2p(getattr(dist, name)))

    def _timed(self, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
                if kwargs.get("async_op") and out is not None:
                    out.wait()
                return out
            finally:
                if self.enabled:
                    self.total += time.perf_counter() - t
        return wrapper

    def _p2p(self, fn):
        timer = self

        class Req:
            def __init__(self, req):
                self.req = req

            def wait(self, *a, **k):
                t = time.perf_counter()
                try:
                    return self.req.wait(*a, **k)
                finally:
                    if timer.enabled:
                        timer.total += time.perf_counter() - t

            def __getattr__(self, name):
                return getattr(self.req, name)

        def wrapper(*args, **kwargs):
            return Req(fn(*args, **kwargs))
        return wrapper


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from model.objectives import build_objective
    from pretrain.parallel import ensure_model_parallel, ensure_process_group
    from pretrain.config import from_dict
    from pretrain.engine import _skip_cpu_shm_op, build_engine
    from pretrain.memory import estimate_memory
    from pretrain.parallelize import build_stage
    from pretrain.pipeline import StepRunner

    torch.set_num_threads(args.threads)
    ensure_process_group()
    _skip_cpu_shm_op()
    timer = CommTimer()
    world = dist.get_world_size()
    cfg = from_dict({**RECIPE, "parallel": {"tp": args.tp, "pp": args.pp, "zero_stage": args.zero}})
    cfg.validate(world)
    ensure_model_parallel(args.tp, args.pp)
    dp_rank = parallel_state.get_data_parallel_rank()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    # Modules imported on first use would count as training memory: import them before the baseline.
    import deepspeed.runtime.engine  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    import megatron.core.pipeline_parallel.schedules  # noqa: F401
    from megatron.core.transformer import TransformerConfig  # noqa: F401
    base_rss = _rss()
    torch.manual_seed(cfg.run.seed)
    model = build_stage(cfg.model, args.tp, args.pp)
    engine, _, _ = build_engine(model, cfg, world, "fp32")
    objective = build_objective(cfg.objective, cfg.model, cfg.data.seq_len, cross_entropy=model.tp.cross_entropy)
    stepper = StepRunner(engine, objective, cfg)
    accum = cfg.grad_accum(world)
    g = torch.Generator().manual_seed(100 + dp_rank)

    def micro():
        x = torch.randint(0, cfg.model.vocab_size - 1, (cfg.train.micro_batch, cfg.data.seq_len), generator=g)
        return objective.prepare({"input_ids": x}, g)

    for _ in range(args.warmup):
        stepper.train_step([micro() for _ in range(accum)])
    dist.barrier()
    timer.enabled, timer.total = True, 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        stepper.train_step([micro() for _ in range(accum)])
    dist.barrier()
    elapsed = time.perf_counter() - t0
    timer.enabled = False
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    predicted = estimate_memory(cfg, world, precision="fp32", device="cpu")[stage].total
    row = {"rank": dist.get_rank(), "elapsed": elapsed, "comm": timer.total, "peak_increase": peak - base_rss,
           "predicted": predicted, "stage": stage}
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        tokens = args.steps * cfg.train.global_batch * cfg.data.seq_len
        Path(args.json).write_text(json.dumps({"tokens_per_s": tokens / elapsed, "ranks": rows}))
    dist.destroy_process_group()


# -- driver ---------------------------------------------------------------------------------------------
def run_layout(name, nproc, tp, pp, zero, threads, steps, warmup) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        work = [str(Path(__file__).resolve()), "--worker", "--tp", str(tp), "--pp", str(pp), "--zero", str(zero),
                "--threads", str(threads), "--steps", str(steps), "--warmup", str(warmup), "--json", str(out)]
        cmd = [sys.executable, *work] if nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *work]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            raise RuntimeError(f"{name}: failed\n{(r.stdout + r.stderr)[-3000:]}")
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--pp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--zero", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per layout (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--repeats", type=int, default=2, help="launches per layout, the fastest is reported (default 2)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    results = []
    for name, nproc, tp, pp, zero, threads in LAYOUTS:
        # best of `--repeats` launches: other processes on a shared machine only ever slow a run down
        runs = [run_layout(name, nproc, tp, pp, zero, threads, args.steps, args.warmup) for _ in range(args.repeats)]
        res = max(runs, key=lambda r: r["tokens_per_s"])
        results.append((name, nproc, res))
        print(f"[{name}] {res['tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
    base = results[0][2]["tokens_per_s"]
    mib = 1024**2
    header = ["layout", "procs", "tokens/s", "speed-up", "comm share", "predicted MiB/proc", "measured MiB/proc"]
    rows = []
    for name, nproc, res in results:
        ranks = res["ranks"]
        comm = sum(r["comm"] / r["elapsed"] for r in ranks) / len(ranks)
        pred = " / ".join(f"{r['predicted'] / mib:.0f}" for r in ranks)
        meas = " / ".join(f"{r['peak_increase'] / mib:.0f}" for r in ranks)
        rows.append([name, str(nproc), f"{res['tokens_per_s']:.0f}", f"{res['tokens_per_s'] / base:.2f}x",
                     f"{100 * comm:.0f}%" if nproc > 1 else "-", pred, meas])
    info = (f"{time.strftime('%Y-%m-%d')} | {platform.machine()} {os.cpu_count()} CPUs | "
            f"{platform.processor() or platform.platform()} | torch {__import__('torch').__version__} | "
            f"best of {args.repeats} launches of {args.steps} timed steps after {args.warmup} warm-up | load average {os.getloadavg()[0]:.1f}")
    if args.markdown:
        print(info + "\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        print(info)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
        print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
