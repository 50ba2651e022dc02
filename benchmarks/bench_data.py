"""Data pipeline throughput: `prepare` tokens/s per process and loader tokens/s per rank.

    python benchmarks/bench_data.py              # ~1 minute on 2 cores
    python benchmarks/bench_data.py --repeat 20  # more text

Text: Python's pydoc topics (465k characters) repeated `--repeat` times as separate documents.
Prints a markdown table; record results with date and machine in docs/data.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data_pipeline.config import DataConfig  # noqa: E402
from data_pipeline.corpus import builtin_text  # noqa: E402
from data_pipeline.loader import build_loader  # noqa: E402
from data_pipeline.prepare import prepare  # noqa: E402
from data_pipeline.tokenizers import load_tokenizer  # noqa: E402


def pool_startup(tok_dir: str, packing: str, num_proc: int) -> float:
    """Seconds to start `num_proc` spawned tokenizer processes (paid once per `prepare`)."""
    from data_pipeline.tokenize_pool import init_pool_worker, mp_context

    t = time.perf_counter()
    with mp_context().Pool(num_proc, initializer=init_pool_worker, initargs=(tok_dir, packing)) as pool:
        pool.map(abs, range(num_proc))
    return time.perf_counter() - t


def bench_prepare(src: str, root: str, tokenizer: str, packing: str, seq_len: int, num_proc: int) -> dict:
    out = os.path.join(root, f"{tokenizer}-{num_proc}")
    t = time.perf_counter()
    m = prepare(src, out, tokenizer=tokenizer, seq_len=seq_len, packing=packing, samples_per_shard=64,
                num_proc=num_proc, docs_per_task=8, log=lambda s: None)
    dt = time.perf_counter() - t
    start = pool_startup(os.path.join(out, "tokenizer"), packing, num_proc) if num_proc > 1 else 0.0
    tokens = m["splits"]["train"]["num_tokens"] + m["splits"]["train"]["dropped_tail_tokens"]
    steady = tokens / max(dt - start, 1e-9)
    return {"dir": out, "seconds": dt, "startup_s": start, "tokens": tokens, "tok_s": tokens / dt,
            "tok_s_steady": steady, "tok_s_proc": steady / num_proc}


def bench_tokenize(docs: list[str], tok_dir: str, packing: str) -> dict:
    """Tokenize + frame in this process on one core: the work of one `prepare` worker."""
    from data_pipeline import tokenize_pool

    tokenize_pool.init_worker(tok_dir, packing)
    t = time.perf_counter()
    n = 0
    for i in range(0, len(docs), 8):
        n += len(tokenize_pool.tokenize(docs[i:i + 8])[0])
    dt = time.perf_counter() - t
    return {"tokens": n, "seconds": dt, "tok_s": n / dt}


def bench_loader(cfg: DataConfig, tok, micro_batch: int, batches: int) -> dict:
    ld = build_loader(cfg, split="train", tokenizer=tok, micro_batch=micro_batch, dp_rank=0, dp_size=1, seed=0)
    t0 = time.perf_counter()
    it = iter(ld)
    next(it)
    t1 = time.perf_counter()
    n = 0
    for _ in range(batches):
        n += next(it)["input_ids"].numel()
    dt = time.perf_counter() - t1
    del it
    return {"first_batch_s": t1 - t0, "tok_s": n / dt}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=6, help="copies of the pydoc corpus to tokenize")
    ap.add_argument("--batches", type=int, default=300, help="loader batches timed per configuration")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    docs = builtin_text("pydoc_topics") * args.repeat
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as root:
        src = os.path.join(root, "docs.jsonl")
        with open(src, "w") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
        chars = sum(map(len, docs))
        for tokenizer, packing, L in (("gpt2", "wrapped", 1024), ("bert-base-uncased", "wrapped_bos_eos", 128)):
            for p in sorted({1, min(2, os.cpu_count() or 1)}):
                if p == 1:
                    r = bench_prepare(src, root, tokenizer, packing, L, 1)  # warm-up (imports, caches)
                    t = bench_tokenize(docs, os.path.join(r["dir"], "tokenizer"), packing)
                    rows.append((f"tokenize+pack {tokenizer}", "1 process, 1 core", f"{t['tok_s']:,.0f}",
                                 "/process", f"{t['tokens']:,} tokens in {t['seconds']:.1f}s"))
                    import shutil

                    shutil.rmtree(r["dir"])
                r = bench_prepare(src, root, tokenizer, packing, L, p)
                results[f"prepare/{tokenizer}/{p}"] = r
                rows.append((f"prepare {tokenizer} L={L}", f"{p} proc", f"{r['tok_s']:,.0f}",
                             f"{r['tok_s_proc']:,.0f} /process", f"{r['tokens']:,} tokens ({chars / 1e6:.1f}M chars) "
                             f"in {r['seconds']:.1f}s" + (f", of which {r['startup_s']:.1f}s process start-up; "
                                                          f"/process excludes it" if p > 1 else "")))
        gpt2 = load_tokenizer("gpt2")
        shard_dir = results["prepare/gpt2/1"]["dir"]
        for name, cfg in (
            ("shards L=1024", lambda w: DataConfig(source=shard_dir, seq_len=1024, num_workers=w)),
            ("builtin L=1024", lambda w: DataConfig(seq_len=1024, num_workers=w, val_fraction=0.0)),
        ):
            for w in (0, 1, 4):
                r = bench_loader(cfg(w), gpt2, args.micro_batch, args.batches)
                results[f"loader/{name}/{w}"] = r
                rows.append((f"loader {name}, micro-batch {args.micro_batch}", f"{w} workers", f"{r['tok_s']:,.0f}",
                             "per rank", f"first batch after {r['first_batch_s']:.2f}s"))
    print(f"\n{time.strftime('%Y-%m-%d')} | {platform.node()} | {platform.processor() or platform.machine()} | "
          f"{os.cpu_count()} CPUs | load average {os.getloadavg()[0]:.1f} | Python {platform.python_version()}\n")
    print("| what | setting | tokens/s | | notes |\n|---|---|---:|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk != "dir"} for k, v in results.items()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
