"""Trainer overhead: a `setdlm pretrain` optimizer step against the bare step of the same model.

    python benchmarks/bench_trainer_overhead.py [--preset tiny] [--seq-len 128] [--micro-batch 8] [--accum 1]
                                                [--objective setdlm] [--ema 0] [--steps 10] [--rounds 3]

"trainer" is what the training loop runs per step (pretrain/trainer.py): the next micro-batches from the
data loader, `prepare` with its per-sample noise, the StepRunner step (DeepSpeed engine: forward,
`engine.backward`, global token normalisation, gradient norm and clipping, `engine.step` with AdamW and
the LR schedule) and the EMA update when `--ema` > 0. "bare" is the same model, the same prepared
inputs and a plain loop: forward, loss, backward, `torch.optim.AdamW(fused=True).step()`, zero_grad. Both
run in one process, alternating step by step (a shared machine's load hits both alike); each round
reports the median of its trainer and bare steps and the median of the per-pair ratios, and the last
line the median ratio over all pairs. The script imports whatever
setdlm is on PYTHONPATH, so pointing it at an older checkout measures that version's trainer.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402


def trainer_step(trainer, it, accum):
    if hasattr(trainer, "_prepare"):  # this version: noise keyed by the samples' global positions
        from model.noise import TRAIN

        micro = [trainer._prepare(next(it), TRAIN) for _ in range(accum)]
    else:  # older versions: one generator per rank
        micro = [trainer.objective.prepare(trainer._to_device(next(it)), trainer.generator) for _ in range(accum)]
    m, gnorm = trainer.stepper.train_step(micro)
    if trainer.ema is not None:
        trainer.ema.update()
    return float(m["loss_sum"]), gnorm


def bare_setup(trainer, cfg):
    from pretrain.parallelize import build_stage

    torch.manual_seed(cfg.run.seed)
    model = build_stage(cfg.model, 1, 1).to(trainer.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, betas=(cfg.train.beta1, cfg.train.beta2),
                            weight_decay=cfg.train.weight_decay, fused=True)
    return model, opt


def bare_step(model, opt, objective, micro):
    for inputs in micro:
        logits = model(inputs.input_ids, inputs.position_ids, **inputs.model_kwargs())
        loss, _ = objective.loss(logits, inputs)
        (loss / len(micro)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--objective", default="setdlm")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--ema", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from data_pipeline.tokenizers import load_tokenizer  # noqa: F401  (the trainer loads gpt2)
    from pretrain.config import from_dict
    from pretrain.trainer import Trainer

    gb = args.micro_batch * args.accum
    cfg = from_dict({
        "run": {"name": "bench", "out_dir": "/tmp/setdlm-bench-overhead", "seed": 0},
        "model": {"preset": args.preset, "dropout": 0.0, "max_seq_len": max(args.seq_len, 64)},
        "objective": {"name": args.objective, "set_size": 4, "block_size": 4},
        "data": {"source": "builtin:pydoc_topics", "tokenizer": "gpt2", "seq_len": args.seq_len},
        "train": {"micro_batch": args.micro_batch, "global_batch": gb, "lr": 1e-4, "warmup_steps": 0,
                  "grad_clip": 1.0, "ema": args.ema, "precision": "fp32"},
        "logging": {"wandb": "disabled", "progress": False},
    })
    trainer = Trainer(cfg)
    it = iter(trainer.train_loader)
    model, opt = bare_setup(trainer, cfg)
    batches = [trainer._to_device(next(iter(trainer.train_loader))) for _ in range(args.accum)]
    gen = torch.Generator(device=trainer.device).manual_seed(0)

    def bare():
        bare_step(model, opt, trainer.objective, [trainer.objective.prepare(b, gen) for b in batches])

    for _ in range(args.warmup):
        trainer_step(trainer, it, args.accum)
        bare()
    rounds = []
    for _ in range(args.rounds):
        pairs = [(timed(lambda: trainer_step(trainer, it, args.accum)), timed(bare)) for _ in range(args.steps)]
        rounds.append(pairs)
    machine = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    print(f"# trainer overhead, {datetime.date.today()}, {machine}, torch {torch.__version__}")
    print(f"# {args.objective}, preset {args.preset}, L={args.seq_len}, micro-batch {args.micro_batch} x accumulation "
          f"{args.accum}, EMA {args.ema}, fp32, ZeRO-0, 1 process; median of {args.steps} steps per round")
    print("| round | trainer step (ms) | bare step (ms) | overhead (median of pairs) |")
    print("|---|---|---|---|")
    for i, pairs in enumerate(rounds):
        a, b = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
        r = statistics.median(p[0] / p[1] for p in pairs)
        print(f"| {i + 1} | {1000 * a:.1f} | {1000 * b:.1f} | {100 * (r - 1):+.1f}% |")
    allp = [p for pairs in rounds for p in pairs]
    a, b = statistics.median(p[0] for p in allp), statistics.median(p[1] for p in allp)
    r = statistics.median(p[0] / p[1] for p in allp)
    print(f"| all | {1000 * a:.1f} | {1000 * b:.1f} | {100 * (r - 1):+.1f}% |")


if __name__ == "__main__":
    main()
