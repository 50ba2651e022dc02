"""Activation checkpointing and torch.compile on CPU: step time and peak memory, predicted vs measured;
and the dry-run memory table of the GPU recipes.

    .venv/bin/python benchmarks/bench_memory.py [--steps 3] [--markdown]     # both tables
    .venv/bin/python benchmarks/bench_memory.py --plan-only
    .venv/bin/python benchmarks/bench_memory.py --cpu-only --block qwen3 [--seq-len 256]

CPU table: the `small-cpu` preset (4 x 256, GELU, LayerNorm) as a SW-SetDLM at L = 512 (1,024 tokens
through the two-stream model), vocabulary 8,192, micro-batch 2, fp32, one process and one thread,
trained with the trainer's code (build_stage, prepare_model, build_engine, StepRunner) on synthetic
tokens, for train.activation_checkpointing none / selective / full with train.compile off and on.
Each configuration is a fresh process: the median step time after warm-up (compilation excluded)
and the peak RSS of the timed steps over the RSS just before the model is built (glibc's mmap
threshold fixed at 64 KiB so freed buffers leave the RSS; the kernel's peak-RSS mark is reset after
the warm-up through /proc/self/clear_refs), next to pretrain/memory.py's estimate for the same recipe
(device="cpu": weights, gradients, AdamW states, activations, logits). With compile, inductor is
imported and its one-line probe compiled before that baseline (a fixed cost of the library, like
importing torch); the peak of the warm-up steps, which includes compiling the blocks, is shown
separately. `--block qwen3` swaps in Qwen3's block at the same width (RMSNorm, SwiGLU with ffn 768,
QK-norm, 4 query / 2 key-value heads, no biases); `--seq-len` changes L.

Plan table: `setdlm pretrain --dry-run` figures per GPU (bf16) for paper-12x768 (configs/owt-setdlm.yaml:
TP 1, ZeRO-1, micro-batch 16) and qwen3-1.7b (configs/qwen3-1.7b-setdlm.yaml: TP 2, ZeRO-1,
micro-batch 4) on 8 GPUs at L = 1024 and 4096, per checkpointing mode (eager, and the total with
compiled blocks), and the largest micro-batch that fits in 90% of 80 GiB (eager).

A script, not a test: times depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.procmem import peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402

SEQ, MICRO, VOCAB = 512, 2, 8192
QWEN3_BLOCK = {"norm": "rmsnorm", "activation": "swiglu", "ffn_hidden": 768, "qk_norm": True, "n_kv_heads": 2,
               "bias": False}
RECIPE = {
    "run": {"seed": 3, "name": "bench"},
    "model": {"preset": "small-cpu", "dropout": 0.0, "max_seq_len": SEQ, "vocab_size": VOCAB, "mask_id": VOCAB - 1,
              "tie_embeddings": True},
    "objective": {"name": "setdlm", "set_size": 4},
    "data": {"seq_len": SEQ},
    "train": {"micro_batch": MICRO, "global_batch": MICRO, "lr": 1e-3, "warmup_steps": 0, "precision": "fp32"},
    "logging": {"wandb": "disabled"},
}


def recipe_for(mode: str, compile: bool, block: str = "small-cpu", seq: int = SEQ) -> dict:
    recipe = json.loads(json.dumps(RECIPE))
    recipe["model"]["max_seq_len"] = seq
    recipe["data"]["seq_len"] = seq
    if block == "qwen3":
        recipe["model"].update(QWEN3_BLOCK)
    recipe["train"].update(activation_checkpointing=mode, compile=compile)
    return recipe


def worker(mode: str, compile: bool, steps: int, block: str = "small-cpu", seq: int = SEQ) -> dict:
    import torch

    from model.objectives import build_objective
    from pretrain.parallel import ensure_model_parallel
    from pretrain.config import from_dict
    from pretrain.engine import build_engine
    from pretrain.memory import GIB, estimate_memory
    from pretrain.parallelize import build_stage, prepare_model
    from pretrain.pipeline import StepRunner

    torch.set_num_threads(1)
    cfg = from_dict(recipe_for(mode, compile, block, seq))
    cfg.validate(1)
    ensure_model_parallel(1, 1)
    objective = build_objective(cfg.objective, cfg.model, seq)
    g = torch.Generator().manual_seed(0)
    batches = [objective.prepare({"input_ids": torch.randint(0, VOCAB - 1, (MICRO, seq), generator=g)}, g)
               for _ in range(2)]
    if compile:  # inductor's import and first compile: the library's fixed cost, outside the baseline
        from pretrain.block_compile import compile_unavailable

        compile_unavailable(torch.device("cpu"))
    base = rss_mib()
    torch.manual_seed(cfg.run.seed)
    model = build_stage(cfg.model, 1, 1)
    notes = prepare_model(model, cfg)
    engine, _, _ = build_engine(model, cfg, 1, "fp32")
    stepper = StepRunner(engine, objective, cfg)
    times = []
    warmup_peak = None
    for i in range(steps + 2):
        if i == 2:  # warm-up done (compiled, optimizer states allocated): measure the steps from here
            warmup_peak = peak_rss_mib() - base
            level = rss_mib() - base  # resident between steps: weights, AdamW states, runtime (+ compiler)
            if not reset_peak_rss():
                warmup_peak = None  # the lifetime peak below then includes the warm-up
        t = time.perf_counter()
        stepper.train_step([batches[i % 2]])
        times.append(time.perf_counter() - t)
    peak = peak_rss_mib() - base
    predicted = max(sm.total for sm in estimate_memory(cfg, 1, precision="fp32", device="cpu")) / 2**20
    acts = estimate_memory(cfg, 1, precision="fp32", device="cpu")[0]
    return {"mode": mode, "compile": compile, "step_s": statistics.median(times[2:]), "first_s": times[0],
            "peak_mib": peak, "warmup_peak_mib": warmup_peak, "level_mib": level, "predicted_mib": predicted, "predicted_act_mib": (acts.activations + acts.logits) / 2**20,
            "notes": notes, "gib": GIB}


def cpu_table(steps: int, block: str = "small-cpu", seq: int = SEQ) -> list[dict]:
    rows = []
    for compile in (False, True):
        for mode in ("none", "selective", "full"):
            # a fixed mmap threshold: glibc returns freed large buffers to the OS, so the peak RSS measures
            # live memory (its default threshold grows after the first large free and keeps freed blocks)
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), WANDB_MODE="disabled",
                       MALLOC_MMAP_THRESHOLD_="65536")
            cmd = [sys.executable, __file__, "--worker", mode, str(int(compile)), "--steps", str(steps),
                   "--block", block, "--seq-len", str(seq)]
            r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(r.stdout[-2000:], r.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"worker {mode} compile={compile} failed")
            rows.append(json.loads(line[7:]))
            print(f"# {mode} compile={compile}: {rows[-1]['step_s']:.2f} s/step", file=sys.stderr, flush=True)
    return rows


def plan_rows() -> list[dict]:
    from pretrain.config import load_config
    from pretrain.memory import GIB, estimate_memory, micro_batch_fit

    rows = []
    for name, config in (("paper-12x768", "configs/owt-setdlm.yaml"), ("qwen3-1.7b", "configs/qwen3-1.7b-setdlm.yaml")):
        for L in (1024, 4096):
            cfg = load_config(REPO / config, ["model.vocab_size=50258", "model.mask_id=50257", f"data.seq_len={L}",
                                              "model.max_seq_len=4096"])
            cfg.train.compile = False
            fit = micro_batch_fit(cfg, 8, 80.0)
            for mode in ("none", "selective", "full"):
                sm = max(estimate_memory(cfg, 8, checkpointing=mode, compiled=False), key=lambda s: s.total)
                compiled = max(s.total for s in estimate_memory(cfg, 8, checkpointing=mode, compiled=True))
                rows.append({"model": name, "L": L, "tp": cfg.parallel.tp, "micro": cfg.train.micro_batch, "mode": mode,
                             "params": (sm.weights + sm.grads) / GIB, "optim": sm.optimizer / GIB,
                             "acts": (sm.activations + sm.logits) / GIB, "total": sm.total / GIB,
                             "compiled": compiled / GIB, "fit": fit[mode][0]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--plan-only", action="store_true")
    ap.add_argument("--cpu-only", action="store_true", help="only the CPU table")
    ap.add_argument("--block", choices=("small-cpu", "qwen3"), default="small-cpu",
                    help="CPU table: small-cpu's GELU/LayerNorm block or Qwen3's at the same width")
    ap.add_argument("--seq-len", type=int, default=SEQ, help="CPU table: L (default 512)")
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "COMPILE"))
    args = ap.parse_args()
    if args.worker:
        # a fresh inductor cache per configuration, so the warm-up peak includes a real compilation
        # (set TORCHINDUCTOR_CACHE_DIR to reuse one)
        cache = None if "TORCHINDUCTOR_CACHE_DIR" in os.environ else tempfile.TemporaryDirectory(prefix="setdlm-inductor-")
        if cache is not None:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
        result = worker(args.worker[0], bool(int(args.worker[1])), args.steps, args.block, args.seq_len)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    sep = "|" if args.markdown else " "
    if not args.plan_only:
        rows = cpu_table(args.steps, args.block, args.seq_len)
        base = next(r for r in rows if r["mode"] == "none" and not r["compile"])
        print(f"{sep} checkpointing {sep} compile {sep} step (s) {sep} vs plain {sep} peak MiB measured {sep} "
              f"predicted {sep} error {sep} warm-up peak MiB {sep} between steps MiB {sep} compiler state MiB {sep} "
              f"error without it {sep}")
        if args.markdown:
            print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            err = (r["predicted_mib"] - r["peak_mib"]) / r["peak_mib"]
            warm = "-" if r["warmup_peak_mib"] is None else f"{r['warmup_peak_mib']:.0f}"
            # the compiler's resident state: what a compiled run keeps between steps beyond the eager run
            eager = next(e for e in rows if e["mode"] == r["mode"] and not e["compile"])
            state = r["level_mib"] - eager["level_mib"] if r["compile"] else 0.0
            err_wo = (r["predicted_mib"] - (r["peak_mib"] - state)) / (r["peak_mib"] - state)
            print(f"{sep} {r['mode']} {sep} {'on' if r['compile'] else 'off'} {sep} {r['step_s']:.2f} {sep} "
                  f"{r['step_s'] / base['step_s']:.2f}x {sep} {r['peak_mib']:.0f} {sep} {r['predicted_mib']:.0f} {sep} "
                  f"{err:+.0%} {sep} {warm} {sep} {r['level_mib']:.0f} {sep} "
                  f"{f'{state:.0f}' if r['compile'] else '-'} {sep} {f'{err_wo:+.0%}' if r['compile'] else '-'} {sep}")
        print()
        if args.cpu_only:
            return 0
    print(f"{sep} model {sep} L {sep} TP {sep} micro-batch {sep} checkpointing {sep} weights+grads GiB {sep} optimizer GiB "
          f"{sep} activations+logits GiB {sep} total GiB {sep} total with train.compile GiB {sep} "
          f"largest micro-batch in 80 GiB {sep}")
    if args.markdown:
        print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in plan_rows():
        print(f"{sep} {r['model']} {sep} {r['L']} {sep} {r['tp']} {sep} {r['micro']} {sep} {r['mode']} {sep} "
              f"{r['params']:.2f} {sep} {r['optim']:.2f} {sep} {r['acts']:.2f} {sep} {r['total']:.2f} {sep} "
              f"{r['compiled']:.2f} {sep} {r['fit']} {sep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
