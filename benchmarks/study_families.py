"""Ordering study: AR, SW-SetDLM (D = 4, 16), BD3-LM (B = 4) and MDLM at one small CPU budget, over seeds.

    .venv/bin/python benchmarks/study_families.py            # the recorded run (docs/study_families.md)
    .venv/bin/python benchmarks/study_families.py --seeds 2 --steps 2 --hidden 16 --orders 2 --batches 1 \
        --out /tmp/study --doc /tmp/study/doc.md   # a smoke run (seconds)

Every family trains the same model (2 layers x `--hidden`, tied GPT-2 embeddings) on the same corpus
(the built-in pydoc topics, GPT-2 tokenizer, L = 64) for the same number of steps and sequences, once
per seed (`--seeds N`: run seeds 1234, 1235, ...; the seed sets the initialisation, the data order and
the training noise). Then:

1. the likelihood bound of every trained model on the same validation rows (`eval likelihood`: every
   row of the val split unless `--batches` limits it, `--orders K` draws of the bound's randomness per
   row; AR is exact). Per family: the mean over seeds, the seed standard deviation, the Monte-Carlo
   s.e. and their combination, and each ordering of the paper stated as held / not resolved at the
   combined error (benchmarks/study_stats.py says how it is formed). For BD3-LM the old estimator
   (forced MASK per block, 1/t weights) is printed next to it;
2. a markdown table (`--doc`) whose header records the command with every option, the commit, the
   machine and the date (benchmarks/study_doc.py), and the JSON next to it.

Speed against quality is measured by benchmarks/paper_miniature.py (docs/paper_miniature.md), on models
that learn their task: models this small trained on pydoc text only repeat themselves when decoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.study_stats import family_summary, ordering  # noqa: E402
from model import families  # noqa: E402

AR, SETDLM, BD3LM, MDLM = (f.name for f in (families.AR, families.SETDLM, families.BD3LM, families.MDLM))

FAMILIES = [("AR", {"name": AR}), ("SetDLM D=4", {"name": SETDLM, "set_size": 4}),
            ("SetDLM D=16", {"name": SETDLM, "set_size": 16}), ("BD3-LM B=4", {"name": BD3LM, "block_size": 4}),
            ("MDLM", {"name": MDLM})]
# the paper's orderings, each as "first < second" (the last: the paper finds them about equal)
ORDERINGS = [("AR", "SetDLM D=4"), ("SetDLM D=4", "SetDLM D=16"), ("BD3-LM B=4", "MDLM"), ("SetDLM D=4", "BD3-LM B=4")]
BASE_SEED = 1234


def recipe(objective: dict, steps: int, out_dir: str, name: str, hidden: int = 128, seed: int = BASE_SEED) -> dict:
    return {
        "run": {"name": name, "out_dir": out_dir, "seed": seed},
        "model": {"n_layers": 2, "hidden": hidden, "n_heads": 4, "ffn_hidden": 4 * hidden, "norm": "layernorm",
                  "activation": "gelu", "dropout": 0.0, "tie_embeddings": True, "max_seq_len": 64},
        "objective": objective,
        "data": {"source": "builtin:pydoc_topics", "tokenizer": "gpt2", "seq_len": 64, "val_fraction": 0.05},
        "train": {"max_steps": steps, "micro_batch": 8, "global_batch": 8, "lr": 3.0e-3,
                  "warmup_steps": max(1, steps // 10), "lr_schedule": "cosine", "min_lr": 2.0e-4, "grad_clip": 1.0,
                  "log_every": max(1, steps // 4), "eval_every": 0, "save_every": steps,
                  "keep_last": 1, "sample_at_end": False},
        "logging": {"wandb": "disabled", "progress": False},
    }


def slug_of(name: str) -> str:
    return name.lower().replace(" ", "").replace("=", "").replace("-", "")


def run_name(name: str, seed: int) -> str:
    return f"{slug_of(name)}-seed{seed}"


def seeds_of(args) -> list[int]:
    return [BASE_SEED + i for i in range(args.seeds)]


def train(name: str, seed: int, args, retrain: bool | None = None) -> tuple[Path, float]:
    import yaml

    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    slug = run_name(name, seed)
    run_dir = Path(args.out) / slug
    path = Path(args.out) / f"{slug}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(recipe(dict(FAMILIES)[name], args.steps, args.out, slug, args.hidden, seed)))
    t0 = time.perf_counter()
    if not (run_dir / "checkpoints").is_dir() or (args.retrain if retrain is None else retrain):
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)  # a run directory with checkpoints would resume, not retrain
        Trainer(load_config(str(path), [])).train()
        Path(args.out, f"{slug}.seconds").write_text(f"{time.perf_counter() - t0:.1f}\n")  # for the doc's header
    return run_dir, time.perf_counter() - t0


def training_seconds(args) -> list[float | None]:
    """Wall seconds each run's training took (None: trained by a version that did not record it)."""
    out = []
    for name, _ in FAMILIES:
        for seed in seeds_of(args):
            f = Path(args.out, f"{run_name(name, seed)}.seconds")
            out.append(float(f.read_text()) if f.is_file() else None)
    return out


def train_parallel(args, argv: list[str]) -> None:
    """Train the (family, seed) runs without a checkpoint in up to `--jobs` subprocesses."""
    import subprocess

    todo = [(n, s) for n, _ in FAMILIES for s in seeds_of(args)
            if args.retrain or not (Path(args.out) / run_name(n, s) / "checkpoints").is_dir()]
    procs: list = []
    for name, seed in todo:
        while len([p for p in procs if p.poll() is None]) >= args.jobs:
            time.sleep(5)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.out) / f"{run_name(name, seed)}.log", "w")
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--train-only", f"{name}@{seed}",
                                       "--threads", "1"], stdout=log, stderr=subprocess.STDOUT))
        print(f"[study] training {name} seed {seed} in process {procs[-1].pid}", flush=True)
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"study: a training subprocess failed (exit {p.returncode}); see {args.out}/*.log")


def forced_mask_bound(run_dir: Path, batches: int, orders: int) -> tuple[float, float]:
    """The old BD3-LM estimator: training draws (>= 1 MASK per block, t ~ U[eps, 1]) with 1/t weights,
    on the validation rows `eval likelihood` scores (every row; filler rows of the last batch weigh 0)."""
    import torch

    from data_pipeline.loader import build_loader
    from eval.models import Checkpoint
    from model.layers import vocab_cross_entropy
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
            loader = build_loader(data, split="val", tokenizer=ck.tokenizer, micro_batch=16, seed=cfg.run.seed,
                                  pad_last=True)
            for i, b in enumerate(loader):
                if batches and i >= batches:
                    break
                inp = obj.prepare(b, gen, bound=False)
                logits = model(inp.input_ids, inp.position_ids, inp.attn_mask, logits_slice=inp.logits_slice)
                ce = vocab_cross_entropy(logits.float().clone(), inp.targets)  # no megatron state needed at TP = 1
                t_tok = inp.extra["t"].repeat_interleave(cfg.objective.block_size, dim=1)
                tot += float((ce * inp.loss_weight / t_tok).sum())
                cnt += float(inp.num_tokens)
            per.append(tot / cnt)
    mu = sum(per) / len(per)
    sd = math.sqrt(sum((p - mu) ** 2 for p in per) / max(1, len(per) - 1))
    return mu, sd / math.sqrt(len(per))


def bounds(args, runs: dict) -> tuple[list[dict], dict]:
    """Per (family, seed) the bound and its Monte-Carlo s.e.; per family their summary (study_stats)."""
    from eval import api

    per_seed, fams = [], {}
    path = Path(args.out, "bounds.json")
    for name, _ in FAMILIES:
        vals, ses, forced = [], [], []
        for seed in seeds_of(args):
            run_dir = runs[name, seed]
            m = api.likelihood(checkpoint=str(run_dir), out=str(Path(args.out) / "eval" / f"lik-{run_dir.name}"),
                               orders=args.orders if name != "AR" else 1, max_batches=args.batches, batch_size=16,
                               overwrite=True)
            se = m.get("nll_std_over_orders", 0.0) / math.sqrt(m["orders"]) if m["orders"] > 1 else 0.0
            row = {"family": name, "seed": seed, "nll": m["nll"], "mc_se": se, "ppl": m["ppl"], "tokens": m["tokens"],
                   "rows": m["sequences"], "orders": m["orders"]}
            if name.startswith("BD3"):
                row["forced_mask_nll"], row["forced_mask_se"] = forced_mask_bound(run_dir, args.batches,
                                                                                  min(args.orders, 8))
                forced.append((row["forced_mask_nll"], row["forced_mask_se"]))
            per_seed.append(row)
            vals.append(m["nll"])
            ses.append(se)
            path.write_text(json.dumps(per_seed, indent=1))
            print(f"[study] {name} seed {seed}: bound {m['nll']:.4f} +- {se:.4f} (MC) nats/token", flush=True)
        fams[name] = family_summary(vals, ses)
        if forced:
            fams[name]["forced_mask"] = family_summary([f[0] for f in forced], [f[1] for f in forced])
    return per_seed, fams


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=3, help="training seeds per family (1234, 1235, ...)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run (8 sequences of 64 tokens each)")
    p.add_argument("--hidden", type=int, default=64, help="model width (2 layers, 4 heads, MLP 4x)")
    p.add_argument("--orders", type=int, default=4, help="Monte-Carlo draws of each bound per sequence")
    p.add_argument("--batches", type=int, default=0, help="validation batches of 16 sequences (0: the whole val split)")
    p.add_argument("--out", default="runs/study")
    p.add_argument("--doc", default="docs/study_families.md", help="markdown table written here (PNG, JSON next to it)")
    p.add_argument("--retrain", action="store_true", help="train again even when a run exists")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jobs", type=int, default=2, help="runs trained at once in subprocesses (1: in this process)")
    p.add_argument("--train-only", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.seeds < 1 or args.steps < 1 or args.orders < 1 or args.jobs < 1:
        p.error("--seeds, --steps, --orders and --jobs must be at least 1")
    if args.train_only:
        import torch

        torch.set_num_threads(args.threads)
        name, seed = args.train_only.rsplit("@", 1)
        train(name, int(seed), args)
        return 0
    started, load0 = time.perf_counter(), os.getloadavg()  # the whole invocation, training included
    trained_apart = args.jobs > 1  # then every run is trained (or retrained) by train_parallel's subprocesses
    if trained_apart:
        train_parallel(args, argv if argv is not None else sys.argv[1:])

    import torch

    from benchmarks.study_doc import write_doc

    torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "disabled")
    runs = {}
    for name, _ in FAMILIES:
        for seed in seeds_of(args):
            runs[name, seed], secs = train(name, seed, args, retrain=False if trained_apart else None)
            print(f"[study] trained {name} seed {seed} in {secs:.0f} s", flush=True)
    per_seed, fams = bounds(args, runs)
    orders = [ordering(a, b, fams) for a, b in ORDERINGS]
    write_doc(Path(args.doc), {"per_seed": per_seed, "families": fams, "orderings": orders,
                               "train_seconds": training_seconds(args)},
              args, p, time.perf_counter() - started, (load0, os.getloadavg()))
    print(Path(args.doc).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
