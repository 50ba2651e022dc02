"""Real prepared shards of small corpora for the mixture tests, made with `setdlm data prepare`.

    dirs = prepare_corpora(tmp, {"a": (0, 30), "b": (30, 60)})   # name -> (first, end) pydoc topics
    dirs["a"]  # a directory with manifest.json, train/ and val/ shards (GPT-2, L=32 by default)

Each corpus is a disjoint slice of Python's pydoc topics written as JSONL; its last `val_docs`
documents are its validation split.
"""

from __future__ import annotations

import json
from pathlib import Path

from data_pipeline.cli import main as data_cli
from data_pipeline.corpus import builtin_text


def prepare_corpora(root: Path, slices: dict[str, tuple[int, int]], *, tokenizer: str = "gpt2", seq_len: int = 32,
                    val_docs: int = 3, samples_per_shard: int = 16) -> dict[str, Path]:
    docs = builtin_text("pydoc_topics")
    out = {}
    for name, (lo, hi) in slices.items():
        src = Path(root) / f"{name}.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[lo:hi]))
        out[name] = Path(root) / name
        rc = data_cli(["prepare", "--input", str(src), "--out", str(out[name]), "--tokenizer", tokenizer,
                       "--seq-len", str(seq_len), "--val-docs", str(val_docs), "--samples-per-shard",
                       str(samples_per_shard), "--num-proc", "1", "--docs-per-task", "8"])
        assert rc == 0 and (out[name] / "manifest.json").is_file(), f"prepare {name} failed ({rc})"
    return out


def mixture(dirs: dict[str, Path], weights: dict[str, float]) -> list[dict]:
    """`data.mixture` entries naming each corpus by its key."""
    return [{"source": str(dirs[n]), "weight": w, "name": n} for n, w in weights.items()]
