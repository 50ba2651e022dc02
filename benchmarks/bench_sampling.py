"""Sampling throughput on a small random model: tokens/s and tokens/step per sampler.

    .venv/bin/python benchmarks/bench_sampling.py [--quick] [--device cpu|cuda] [--threads 1]

Rows: SW-SetDLM (w = D for D = 4, 8, 16; threshold 1.0 = one token per step, and 0.9), BD3-LM (block
size B = 4, 8, 16; B steps per block, and threshold 0.9), MDLM (one token per step) and AR. Columns:
batch 1 (tokens/s of one sequence, prefill included, averaged over prompts after a warm-up) and
batch 16 (aggregate tokens/s over the batch, one timed run; prompts of mixed lengths, ragged progress), with tokens
per step; for the cached samplers with a reference, the recomputing reference's batch-1 tokens/s and
the speedup of the cached sampler over it (same tokens, greedy). The model is random, so
tokens/step under a threshold says nothing about a trained model; it is reported for completeness.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192, help="small, so that the transformer body (what the "
                   "cache saves) is not hidden behind the output head; 50258 is GPT-2 + MASK")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="batch-1 prompts timed per row")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--repeat", type=int, default=2, help="times each batch-1 prompt is run (the fastest is kept)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable on shared machines)")
    p.add_argument("--clock", choices=["auto", "wall", "cpu"], default="auto",
                   help="cpu: process CPU time (auto on CPU with 1 thread: immune to other processes on a shared "
                        "machine; equals wall time on an idle one); wall: elapsed time (auto on GPU)")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    p.add_argument("--no-reference", action="store_true", help="skip the recomputing reference")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.vocab, args.prompt_len, args.new_tokens, args.reps, args.batch = 1, 64, 512, 8, 16, 1, 4
    return args


def build_model(args):
    from model.config import ModelConfig
    from model.transformer import Transformer

    torch.manual_seed(0)  # a TP=1 model: no process group needed
    cfg = ModelConfig(n_layers=args.layers, hidden=args.hidden, n_heads=args.heads, ffn_hidden=4 * args.hidden,
                      vocab_size=args.vocab, mask_id=args.vocab - 1, dropout=0.0,
                      max_seq_len=args.prompt_len * 2 + args.new_tokens, init_std=0.5)
    model = Transformer(cfg).eval().to(args.device)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    return model


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


CLOCK = time.perf_counter


def timed(fn, model, prompts, cfg, device):
    sync(device)
    t = CLOCK()
    outs = fn(model, prompts, cfg)
    sync(device)
    return CLOCK() - t, outs


def measure(fn, model, batches, cfg, device, repeat=1, warmup=True):
    """(tokens/s, tokens/step) over the given batches after one warm-up batch: each batch is timed
    `repeat` times and its fastest time kept (shared machines are noisy), then tokens/s = all tokens /
    the sum of those times."""
    if warmup:
        timed(fn, model, batches[0], cfg, device)
    secs = toks = steps = 0
    for b in batches:
        best = float("inf")
        for _ in range(repeat):
            dt, outs = timed(fn, model, b, cfg, device)
            best = min(best, dt)
        secs += best
        toks += sum(len(o.tokens) for o in outs)
        steps += sum(o.steps for o in outs)
    return toks / secs, toks / max(steps, 1)


def main(argv=None) -> int:
    global CLOCK
    args = parse(argv)
    torch.set_num_threads(args.threads)
    cpu_clock = args.clock == "cpu" or (args.clock == "auto" and args.device == "cpu" and args.threads == 1)
    CLOCK = time.process_time if cpu_clock else time.perf_counter
    from model.sampling import SamplingConfig, generate
    from model.sampling.reference import generate_reference

    model = build_model(args)
    g = torch.Generator().manual_seed(1)
    V = args.vocab - 1
    one = [[torch.randint(0, V, (args.prompt_len,), generator=g).tolist()] for _ in range(args.reps)]
    lens = torch.randint(args.prompt_len // 2, args.prompt_len * 3 // 2 + 1, (args.batch,), generator=g).tolist()
    many = [[torch.randint(0, V, (n,), generator=g).tolist() for n in lens]]
    base = dict(max_new_tokens=args.new_tokens, stop_on_eos=False)
    rows = []
    for D in (4, 8, 16):
        for thr in (1.0, 0.9):
            rows.append((f"SetDLM D={D} thr={thr}", SamplingConfig(family="setdlm", window=D, threshold=thr, **base), True))
    for B in (4, 8, 16):
        for thr in (None, 0.9):
            rows.append((f"BD3-LM B={B} thr={thr or '-'}", SamplingConfig(family="bd3lm", block_size=B, threshold=thr, **base), True))
    rows.append(("MDLM steps=N", SamplingConfig(family="mdlm", **base), False))
    rows.append(("AR", SamplingConfig(family="ar", **base), True))

    dev_name = torch.cuda.get_device_name() if str(args.device).startswith("cuda") else platform.processor() or platform.machine()
    print(f"# bench_sampling {datetime.datetime.now().isoformat(timespec='seconds')} | {platform.node()} | "
          f"{args.device} ({dev_name}), torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} cores, "
          f"{'process CPU' if cpu_clock else 'wall'} clock, load average {os.getloadavg()[0]:.1f}")
    print(f"# model: {args.layers} layers x {args.hidden}, vocab {args.vocab}, {args.dtype}, random weights; "
          f"prompt {args.prompt_len} tokens (batch {args.batch}: {min(lens)}-{max(lens)}), {args.new_tokens} new tokens, greedy")
    head = ["sampler", "b1 tok/s", "b1 tok/step", f"b{args.batch} tok/s", f"b{args.batch} tok/step",
            "recompute b1 tok/s", "cached speedup"]
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" for _ in head) + "|")
    else:
        print("{:<24}{:>10}{:>13}{:>11}{:>13}{:>20}{:>16}".format(*head))
    for name, cfg, has_ref in rows:
        gen = lambda m, p, c: generate(m, p, c)  # noqa: E731
        r1 = measure(gen, model, one, cfg, args.device, args.repeat)
        rb = measure(gen, model, many, cfg, args.device, 1, warmup=False)  # warm after batch 1
        ref, speed = "-", "-"
        if has_ref and not args.no_reference:
            rr = measure(lambda m, p, c: generate_reference(m, p, c), model, one[:1], cfg, args.device, args.repeat)
            ref, speed = f"{rr[0]:.1f}", f"{r1[0] / rr[0]:.2f}x"
        cells = [name, f"{r1[0]:.1f}", f"{r1[1]:.2f}", f"{rb[0]:.1f}", f"{rb[1]:.2f}", ref, speed]
        if args.markdown:
            print("| " + " | ".join(cells) + " |")
        else:
            print("{:<24}{:>10}{:>13}{:>11}{:>13}{:>20}{:>16}".format(*cells))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
