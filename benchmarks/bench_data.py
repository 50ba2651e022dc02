"""Data pipeline throughput: `prepare` tokens/s per process and loader tokens/s per rank.

    python benchmarks/bench_data.py              # ~1 minute on 2 cores
    python benchmarks/bench_data.py --repeat 20  # more text
    python benchmarks/bench_data.py --mixture-only  # mixture loader vs one source (docs/benchmarks.md)

Text: Python's pydoc topics (465k characters) repeated `--repeat` times as separate documents.
Prints a markdown table; record results with date and machine in docs/data.md (the mixture rows in
docs/benchmarks.md). Mixture rows: three corpora (the documents dealt round-robin), GPT-2 L=1024
shards; the same loader reads one of them alone and the weighted mixture of all three (0.5 / 0.3 / 0.2,
and 0.7 / 0.3 of two), best of `--trials` alternating runs each.
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


def bench_loader(cfg: DataConfig, tok, micro_batch: int, batches: int, global_batch: int | None = None) -> dict:
    ld = build_loader(cfg, split="train", tokenizer=tok, micro_batch=micro_batch, dp_rank=0, dp_size=1, seed=0,
                      global_batch=global_batch)
    import gc
    import resource

    def children_cpu() -> float:  # DataLoader workers, once they have exited
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    k0 = children_cpu()
    t0 = time.perf_counter()
    it = iter(ld)
    next(it)
    t1, c1 = time.perf_counter(), time.process_time()
    n = 0
    for _ in range(batches):
        n += next(it)["input_ids"].numel()
    dt, cpu = time.perf_counter() - t1, time.process_time() - c1
    del it
    gc.collect()  # shuts the workers down (persistent_workers=False): their CPU time is then counted
    cpu += children_cpu() - k0  # workers: all of theirs, start-up and first batch included
    return {"first_batch_s": t1 - t0, "tok_s": n / dt, "cpu_tok_s": n / max(cpu, 1e-9)}


def bench_mixture(docs: list[str], root: str, tok, micro_batch: int, batches: int, trials: int) -> list[tuple]:
    """Loader tokens/s per rank: one source vs mixtures of two and three sources.

    Each corpus is a third of the documents (dealt round-robin), in shards of 16 sequences so that every
    source is larger than the loader's shard cache (as any real corpus is): one source and a mixture
    then both decode every shard once per pass, and the difference is the mixture's own work. The
    figure is tokens per second of CPU time, of this process and of its DataLoader workers (steady under
    other load on shared cores, where wall-clock is not; wall-clock alongside); best of `trials`
    alternating runs."""
    dirs = []
    for i in range(3):
        src = os.path.join(root, f"mix{i}.jsonl")
        with open(src, "w") as f:
            for d in docs[i::3]:
                f.write(json.dumps({"text": d}) + "\n")
        out = os.path.join(root, f"mix{i}")
        prepare(src, out, tokenizer="gpt2", seq_len=1024, packing="wrapped", samples_per_shard=16, num_proc=1,
                docs_per_task=8, log=lambda s: None)
        dirs.append(out)
    gb = 8 * micro_batch  # 8 micro-batches per step, as accumulation or data parallelism would read them
    configs = {
        "one source": lambda w: DataConfig(source=dirs[0], seq_len=1024, num_workers=w),
        "mixture 0.7 / 0.3": lambda w: DataConfig(mixture=[{"source": dirs[0], "weight": 0.7},
                                                           {"source": dirs[1], "weight": 0.3}], seq_len=1024,
                                                  num_workers=w),
        "mixture 0.5 / 0.3 / 0.2": lambda w: DataConfig(mixture=[{"source": d, "weight": x} for d, x in
                                                                 zip(dirs, (0.5, 0.3, 0.2))], seq_len=1024,
                                                        num_workers=w),
    }
    rows = []
    for w in (0, 2):
        key = "cpu_tok_s"
        best = {name: {"tok_s": 0.0, "cpu_tok_s": 0.0} for name in configs}
        for _ in range(trials):  # alternate, so a busy moment on shared cores hits every configuration
            for name, cfg in configs.items():
                r = bench_loader(cfg(w), tok, micro_batch, batches, global_batch=gb)
                best[name] = {k: max(best[name][k], r[k]) for k in best[name]}
        for name, v in best.items():
            rel = v[key] / best["one source"][key] - 1.0
            note = f"wall-clock {v['tok_s']:,.0f} /s"
            if name != "one source":
                note = f"{rel:+.1%} vs one source; {note}"
            rows.append((f"loader {name}, L=1024, micro-batch {micro_batch}, global batch {gb}",
                         f"{w} workers", f"{v[key]:,.0f}", "per CPU-second", note))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=6, help="copies of the pydoc corpus to tokenize")
    ap.add_argument("--batches", type=int, default=300, help="loader batches timed per configuration")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--mixture-only", action="store_true", help="only the mixture vs one-source loader rows")
    ap.add_argument("--trials", type=int, default=3, help="mixture rows: best of this many alternating runs")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
    docs = builtin_text("pydoc_topics") * args.repeat
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as root:
        rows += bench_mixture(docs, root, load_tokenizer("gpt2"), args.micro_batch, args.batches, args.trials)
        if args.mixture_only:
            _print(rows)
            return 0
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
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk != "dir"} for k, v in results.items()}, f, indent=1)
    return 0


def _print(rows: list[tuple]) -> None:
    print(f"\n{time.strftime('%Y-%m-%d')} | {platform.node()} | {platform.processor() or platform.machine()} | "
          f"{os.cpu_count()} CPUs | load average {os.getloadavg()[0]:.1f} | Python {platform.python_version()}\n")
    print("| what | setting | tokens/s | | notes |\n|---|---|---:|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    sys.exit(main())
