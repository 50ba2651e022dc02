"""Ordering study: AR, SW-SetDLM (D = 4, 16), BD3-LM (B = 4) and MDLM at one small CPU budget.

    .venv/bin/python benchmarks/study_families.py [--steps 200] [--orders 16] [--out runs/study] [--doc docs/study_families.md]

Every family trains the same model (the quickstart shape: 2 layers x 128, tied embeddings) on the
same corpus (the built-in pydoc topics, GPT-2 tokenizer, L = 64) for the same number of steps and
sequences, with the same seed. Then:

1. the likelihood bound of each on the same validation batches (`eval likelihood`, `--orders K` draws
   of the bound's randomness per sequence; AR is exact): mean +- standard error over the K draws
   (the Monte-Carlo error of the estimator on these sequences, not the sampling error of the data).
   For BD3-LM the old estimator (forced MASK per block, 1/t weights) is printed next to it;
2. decoding speed and quality of each diffusion family at a few confidence thresholds (`eval
   throughput`, batch 1, prompts of 16 validation tokens, 32 new tokens, greedy): tokens/s, tokens per
   forward, and as a quality proxy the generative perplexity of the outputs under the study's own AR
   model (exact NLL) with their unigram entropy (greedy decoding of small models repeats itself, which
   lowers perplexity; the entropy shows it);
3. the speed-quality frontier as a PNG, and a markdown table with date and machine (`--doc`).

Timings on a shared 2-core CPU are noisy; compare families within one run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

FAMILIES = [("AR", {"name": "ar"}), ("SetDLM D=4", {"name": "setdlm", "set_size": 4}),
            ("SetDLM D=16", {"name": "setdlm", "set_size": 16}), ("BD3-LM B=4", {"name": "bd3lm", "block_size": 4}),
            ("MDLM", {"name": "mdlm"})]
THRESHOLDS = (0.5, 0.7, 0.9, 1.0)


def recipe(objective: dict, steps: int, out_dir: str, name: str, hidden: int = 128) -> dict:
    return {
        "run": {"name": name, "out_dir": out_dir, "seed": 1234},
        "model": {"n_layers": 2, "hidden": hidden, "n_heads": 4, "ffn_hidden": 4 * hidden, "norm": "layernorm",
                  "activation": "gelu", "dropout": 0.0, "tie_embeddings": True, "max_seq_len": 64},
        "objective": objective,
        "data": {"source": "builtin:pydoc_topics", "tokenizer": "gpt2", "seq_len": 64, "val_fraction": 0.05},
        "train": {"max_steps": steps, "micro_batch": 8, "global_batch": 8, "lr": 3.0e-3,
                  "warmup_steps": max(1, steps // 10), "lr_schedule": "cosine", "min_lr": 2.0e-4, "grad_clip": 1.0,
                  "log_every": max(1, steps // 4), "eval_every": steps, "eval_batches": 8, "save_every": steps,
                  "keep_last": 1, "sample_at_end": False},
        "logging": {"wandb": "disabled", "progress": False},
    }


def train(name: str, objective: dict, args) -> tuple[Path, float]:
    import yaml

    from pretrain.checkpoint.rundir import checkpoints_dir
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    slug = slug_of(name)
    run_dir = Path(args.out) / slug
    path = Path(args.out) / f"{slug}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe(objective, args.steps, args.out, slug, args.hidden)))
    t0 = time.perf_counter()
    if not checkpoints_dir(run_dir).is_dir() or args.retrain:
        Trainer(load_config(str(path), [])).train()
    return run_dir, time.perf_counter() - t0


def train_parallel(args, argv: list[str]) -> None:
    """Train the families without a checkpoint in up to `--jobs` subprocesses (same recipes, same seeds)."""
    import subprocess

    from pretrain.checkpoint.rundir import checkpoints_dir

    todo = [n for n, _ in FAMILIES if args.retrain or not checkpoints_dir(Path(args.out) / slug_of(n)).is_dir()]
    procs: list = []
    for name in todo:
        while len([p for p in procs if p.poll() is None]) >= args.jobs:
            time.sleep(5)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.out) / f"{slug_of(name)}.log", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--train-only", name, "--threads", "1"],
                                      stdout=log, stderr=subprocess.STDOUT))
        print(f"[study] training {name} in process {procs[-1].pid}", flush=True)
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"study: a training subprocess failed (exit {p.returncode}); see {args.out}/*.log")


def slug_of(name: str) -> str:
    return name.lower().replace(" ", "").replace("=", "").replace("-", "")


def forced_mask_bound(run_dir: Path, batches: int, orders: int) -> tuple[float, float]:
    """The old BD3-LM estimator: training draws (>= 1 MASK per block, t ~ U[eps, 1]) with 1/t weights."""
    import torch
    from megatron.core import tensor_parallel

    from data_pipeline.loader import build_loader
    from eval.models import Checkpoint
    from model.objectives import build_objective

    ck = Checkpoint(str(run_dir))
    cfg, model = ck.cfg, ck.model
    obj = build_objective(cfg.objective, cfg.model, cfg.data.seq_len)
    data = dataclasses.replace(cfg.data, num_workers=0)
    per = []
    with torch.no_grad():
        for o in range(orders):
            gen = torch.Generator().manual_seed(1000 + o)
            tot = cnt = 0.0
            for i, b in enumerate(build_loader(data, split="val", tokenizer=ck.tokenizer, micro_batch=16, seed=cfg.run.seed)):
                if i >= batches:
                    break
                inp = obj.prepare(b, gen, bound=False)
                logits = model(inp.input_ids, inp.position_ids, inp.attn_mask, logits_slice=inp.logits_slice)
                ce = tensor_parallel.vocab_parallel_cross_entropy(logits.float().clone(), inp.targets)
                t_tok = inp.extra["t"].repeat_interleave(cfg.objective.block_size, dim=1)
                tot += float((ce * inp.loss_weight / t_tok).sum())
                cnt += float(inp.num_tokens)
            per.append(tot / cnt)
    mu = sum(per) / len(per)
    sd = math.sqrt(sum((p - mu) ** 2 for p in per) / max(1, len(per) - 1))
    return mu, sd / math.sqrt(len(per))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="optimizer steps per family (8 sequences of 64 tokens each)")
    p.add_argument("--hidden", type=int, default=128, help="model width (2 layers, 4 heads, MLP 4x)")
    p.add_argument("--orders", type=int, default=16, help="Monte-Carlo draws of each bound per sequence")
    p.add_argument("--batches", type=int, default=6, help="validation batches of 16 sequences")
    p.add_argument("--examples", type=int, default=6, help="prompts per threshold in the speed sweep")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default="runs/study")
    p.add_argument("--doc", default="docs/study_families.md", help="markdown table written here (PNG next to it)")
    p.add_argument("--retrain", action="store_true", help="train again even when a run exists")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jobs", type=int, default=1, help="families trained at once in subprocesses (default 1)")
    p.add_argument("--train-only", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.train_only:
        import torch

        torch.set_num_threads(args.threads)
        train(args.train_only, dict(FAMILIES)[args.train_only], args)
        return 0
    if args.jobs > 1:
        train_parallel(args, argv if argv is not None else sys.argv[1:])

    import torch

    from eval import api

    torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")
    started = time.perf_counter()
    runs, rows = {}, []
    for name, obj in FAMILIES:
        run_dir, secs = train(name, obj, args)
        runs[name] = run_dir
        print(f"[study] trained {name} in {secs:.0f} s", flush=True)
    for name, _ in FAMILIES:
        m = api.likelihood(checkpoint=str(runs[name]), out=str(Path(args.out) / "eval" / f"lik-{runs[name].name}"),
                           orders=args.orders if name != "AR" else 1, max_batches=args.batches, batch_size=16,
                           overwrite=True)
        se = m.get("nll_std_over_orders", 0.0) / math.sqrt(m["orders"]) if m["orders"] > 1 else 0.0
        row = {"family": name, "nll": m["nll"], "se": se, "ppl": m["ppl"], "tokens": m["tokens"], "orders": m["orders"]}
        if name.startswith("BD3"):
            row["forced_mask_nll"], row["forced_mask_se"] = forced_mask_bound(runs[name], args.batches, min(args.orders, 8))
        rows.append(row)
        Path(args.out, "bounds.json").write_text(json.dumps(rows, indent=1))
        print(f"[study] {name}: bound {m['nll']:.4f} +- {se:.4f} nats/token", flush=True)

    speed = []
    for name, _ in FAMILIES[1:]:
        m = api.throughput(checkpoint=str(runs[name]), out=str(Path(args.out) / "eval" / f"thr-{runs[name].name}"),
                           num_examples=args.examples, prompt_tokens=16, max_new_tokens=args.new_tokens, warmup=1,
                           threshold=THRESHOLDS[0], sweep=("threshold=" + ",".join(map(str, THRESHOLDS[1:])),),
                           scorer=str(runs["AR"]), no_eos_stop=True, overwrite=True)
        for r in m["rows"]:
            th = THRESHOLDS[0] if r["setting"] == "base" else float(r["setting"].split("=")[1])
            speed.append({"family": name, "threshold": th, "tokens_per_s": r["tokens_per_s"],
                          "tokens_per_step": r["tokens_per_step"], "gen_ppl": r.get("gen_ppl"), "entropy": r["entropy"]})
        Path(args.out, "speed.json").write_text(json.dumps(speed, indent=1))
        print(f"[study] {name}: speed sweep done", flush=True)
    total = time.perf_counter() - started
    write_doc(Path(args.doc), rows, speed, args, total)
    print(Path(args.doc).read_text())
    return 0


def frontier_png(speed: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for fam in dict.fromkeys(r["family"] for r in speed):
        pts = sorted((r for r in speed if r["family"] == fam), key=lambda r: r["tokens_per_s"])
        ax.plot([r["tokens_per_s"] for r in pts], [r["gen_ppl"] for r in pts], marker="o", label=fam)
        for r in pts:
            ax.annotate(f"{r['threshold']:g}", (r["tokens_per_s"], r["gen_ppl"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("tokens/s per example (batch 1, CPU)")
    ax.set_ylabel("gen. perplexity under the study's AR model")
    ax.set_yscale("log")
    ax.set_title("speed-quality frontier (labels: confidence threshold)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_doc(doc: Path, rows, speed, args, total: float) -> None:
    doc.parent.mkdir(parents=True, exist_ok=True)
    png = doc.with_suffix(".png")
    frontier_png(speed, png)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    machine = f"{platform.machine()} CPU, {os.cpu_count()} cores ({platform.processor() or 'unknown'}), no GPU"
    lines = [f"# Family ordering study ({when})", "",
             f"Machine: {machine}; shared with other jobs while it ran. Written by `benchmarks/study_families.py "
             f"--steps {args.steps} --hidden {args.hidden} --orders {args.orders} --batches {args.batches}` in {total / 60:.1f} minutes.",
             "", f"Every family: the same 2 x {args.hidden} model (tied GPT-2 embeddings), {args.steps} steps of 8 x 64 tokens of the pydoc corpus "
             "(GPT-2 tokenizer), the same seed. Bounds on the same "
             f"{args.batches} x 16 validation sequences; s.e. = std over the {args.orders} Monte-Carlo draws / sqrt(draws).",
             "", "| family | bound (nats/token) | s.e. | perplexity bound | tokens | draws |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['nll']:.4f} | {r['se']:.4f} | {r['ppl']:.1f} | {r['tokens']} | {r['orders']} |")
    bd = next((r for r in rows if "forced_mask_nll" in r), None)
    if bd:
        lines += ["", f"BD3-LM with the old estimator (forced MASK per block, t ~ U[eps, 1], 1/t weights): "
                      f"{bd['forced_mask_nll']:.4f} +- {bd['forced_mask_se']:.4f} nats/token, against the NELBO "
                      f"{bd['nll']:.4f} +- {bd['se']:.4f}."]
    lines += ["", "## Speed and quality (batch 1, 16 prompt tokens, "
              f"{args.new_tokens} new tokens, greedy, {args.examples} prompts per point)", "",
              "| family | threshold | tokens/s | tokens per forward | gen. ppl (AR scorer) | unigram entropy |",
              "|---|---|---|---|---|---|"]
    for r in speed:
        gp = f"{r['gen_ppl']:.1f}" if r["gen_ppl"] is not None else "n/a"
        lines.append(f"| {r['family']} | {r['threshold']:g} | {r['tokens_per_s']:.1f} | {r['tokens_per_step']:.2f} | "
                     f"{gp} | {r['entropy']:.3f} |")
    lines += ["", f"![speed-quality frontier]({png.name})", ""]
    doc.write_text("\n".join(lines))
    (doc.with_suffix(".json")).write_text(json.dumps({"bounds": rows, "speed": speed, "when": when,
                                                      "machine": machine, "steps": args.steps}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
