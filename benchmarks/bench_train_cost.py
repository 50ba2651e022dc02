"""Training-step cost of each objective on the same model, sequence length and batch (CPU or GPU).

The SetDLM two-stream layout forwards 2L tokens but runs the output head and the loss on the L query
tokens only, so a step should cost about 2x an AR step; much more than 2.3x is waste.

    python benchmarks/bench_train_cost.py [--preset small-cpu] [--seq-len 128] [--batch 8] [--steps 10]
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

from model import families  # noqa: E402
from model.config import ModelConfig, ObjectiveConfig, apply_preset  # noqa: E402
from model.objectives import build_objective  # noqa: E402
from model.shapes import parameter_count  # noqa: E402
from model.transformer import Transformer  # noqa: E402


def time_objective(name: str, model: Transformer, seq_len: int, batch: int, steps: int, warmup: int, device) -> float:
    cfg = model.cfg
    obj = build_objective(ObjectiveConfig(name=name, set_size=4, block_size=4), cfg, seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randint(0, cfg.vocab_size - 1, (batch, seq_len), device=device)
    times = []
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        inputs = obj.prepare({"input_ids": x}, gen)
        logits = model(inputs.input_ids, inputs.position_ids, inputs.attn_mask, logits_slice=inputs.logits_slice)
        loss, _ = obj.loss(logits, inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-cpu")
    ap.add_argument("--vocab", type=int, default=50258, help="vocabulary size (GPT-2 + MASK by default)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the objectives; the minimum is kept")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig(**{**apply_preset({"preset": args.preset}), "vocab_size": args.vocab, "mask_id": args.vocab - 1,
                         "dropout": 0.0, "max_seq_len": max(args.seq_len, 64)})
    torch.manual_seed(0)
    model = Transformer(cfg).to(device)
    machine = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"# training-step cost, {datetime.date.today()}, {machine}, torch {torch.__version__}")
    print(f"# model {args.preset}: {parameter_count(cfg) / 1e6:.1f}M params, vocab {cfg.vocab_size}, L={args.seq_len}, batch {args.batch}, fp32")
    print("| objective | tokens forwarded | step (ms) | tokens/s | cost vs AR |")
    print("|---|---|---|---|---|")
    names = tuple(s.name for s in (families.AR, families.SETDLM, families.BD3LM, families.MDLM))
    best = {n: float("inf") for n in names}
    for _ in range(args.rounds):  # interleaved, so load changes on a shared machine hit every objective alike
        for name in names:
            best[name] = min(best[name], time_objective(name, model, args.seq_len, args.batch, args.steps, args.warmup, device))
    base = best[families.AR.name]
    for name in names:
        t = best[name]
        fwd = families.get(name).layout(args.seq_len).tokens_in
        print(f"| {name} | {fwd} | {1000 * t:.1f} | {args.batch * args.seq_len / t:,.0f} | {t / base:.2f}x |")


if __name__ == "__main__":
    main()
