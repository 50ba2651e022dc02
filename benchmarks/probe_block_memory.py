"""What one block keeps for its backward and what its backward allocates, measured on CPU, next to
pretrain/memory.py's per-layer terms (the model behind `setdlm pretrain --dry-run`'s activations).

    .venv/bin/python benchmarks/probe_block_memory.py [--mode none|selective|full] [--compile]
                                                      [--block small-cpu|qwen3] [--seq-len 512]

Same recipe as benchmarks/bench_memory.py (SW-SetDLM, micro-batch 2, fp32, one thread, run with a
fixed glibc mmap threshold so freed buffers leave the RSS). After two warm-up steps (compilation,
optimizer states), one step is instrumented: the RSS growth over each block's forward is what it
keeps for the backward; during each block's backward (between the gradient hooks on its output and
its input), the peak RSS over the level when it started is its working set, including the first
allocation of the block's parameter gradients, which the plan counts with the weights (the peak mark,
VmHWM, is reset at every hook). Re-executes itself with MALLOC_MMAP_THRESHOLD_ set when it is not.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_memory import MICRO, SEQ, VOCAB, recipe_for  # noqa: E402
from common.procmem import peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("none", "selective", "full"), default="none")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--block", choices=("small-cpu", "qwen3"), default="small-cpu")
    ap.add_argument("--seq-len", type=int, default=SEQ)
    args = ap.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    import torch

    from model.objectives import build_objective
    from pretrain.config import from_dict
    from pretrain.engine import build_engine
    from pretrain.parallel import ensure_model_parallel
    from pretrain.memory import activation_bytes_per_token_layer, backward_working_set, tokens_in
    from pretrain.parallelize import build_stage, prepare_model
    from pretrain.pipeline import StepRunner

    torch.set_num_threads(1)
    cfg = from_dict(recipe_for(args.mode, args.compile, args.block, args.seq_len))
    cfg.validate(1)
    ensure_model_parallel(1, 1)
    objective = build_objective(cfg.objective, cfg.model, args.seq_len)
    g = torch.Generator().manual_seed(0)
    batches = [objective.prepare({"input_ids": torch.randint(0, VOCAB - 1, (MICRO, args.seq_len), generator=g)}, g)
               for _ in range(2)]
    torch.manual_seed(cfg.run.seed)
    model = build_stage(cfg.model, 1, 1)
    notes = prepare_model(model, cfg)
    engine, _, _ = build_engine(model, cfg, 1, "fp32")
    stepper = StepRunner(engine, objective, cfg)
    for i in range(2):
        stepper.train_step([batches[i]])
    if not reset_peak_rss():
        raise SystemExit("probe_block_memory: /proc/self/clear_refs is not writable here (needs Linux)")

    kept, working, open_block = [], [], []

    def boundary(grad):
        """A block boundary in the backward: the block whose backward just ended is closed (its peak
        over the level when it began), the next one (if any) opens at the current level."""
        if open_block:
            working.append(peak_rss_mib() - open_block.pop())
        reset_peak_rss()

    def starts(grad):
        boundary(grad)
        open_block.append(rss_mib())

    class Probe(torch.nn.Module):  # wraps a (compiled) block from outside: the block itself is unchanged
        def __init__(self, block, first):
            super().__init__()
            self.block, self.first = block, first

        def forward(self, x, *a, **k):
            before = rss_mib()
            if self.first and x.requires_grad:
                x.register_hook(boundary)  # the first block's input: its backward ends here
            y = self.block(x, *a, **k)
            y.register_hook(starts)  # this block's backward starts (and the next one's ended)
            kept.append(rss_mib() - before)
            return y

    for n, (key, block) in enumerate(list(model.layers.items())):
        model.layers[key] = Probe(block, n == 0)
    stepper.train_step([batches[0]])

    T, _ = tokens_in(cfg)
    tokens = T * MICRO
    mib = 2**20
    m = cfg.model
    mask = T * T * 4  # torch's CPU SDPA: the float mask per layer call
    plan_kept = activation_bytes_per_token_layer(m, 1, T, 4, "cpu", args.mode, compiled=args.compile) * tokens
    plan_kept += mask if args.mode == "none" else 0
    plan_work = backward_working_set(m, 1, T, 4, "cpu", args.mode, compiled=args.compile) * tokens
    plan_work += mask if args.mode == "full" or (args.compile and args.mode == "selective") else 0
    print("; ".join(notes))
    print(f"{args.block} block, L={args.seq_len} ({tokens} tokens per micro-batch), checkpointing {args.mode}, "
          f"compile {'on' if args.compile else 'off'}")
    print(f"  kept for the backward per block (MiB): measured {statistics.median(kept):.1f} "
          f"(blocks: {', '.join(f'{x:.1f}' for x in kept)}), plan {plan_kept / mib:.1f}")
    print(f"  backward working set per block (MiB): measured {statistics.median(working):.1f} "
          f"(blocks, last first: {', '.join(f'{x:.1f}' for x in working)}), plan {plan_work / mib:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
