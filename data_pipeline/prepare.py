"""`setdlm data prepare` (text): tokenize text in parallel, pack it, write webdataset shards + manifest.

Resumable: after every shard the progress (shard entries and the document cursor where the next
shard starts) is saved to ``manifest.partial.json``; a re-run with the same arguments keeps every
shard whose bytes still match, and tokenizes only from the first missing one. ``manifest.json``
appears (atomically) when every split is complete. The command line is data_pipeline/cli.py; the
workers tokenize_pool.py, the shard files shard_writer.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

from common.errors import InputFileError, UsageError

from .config import PACKINGS
from .ingest import open_text
from .packing import framing, token_dtype
from .shard_writer import SplitWriter, valid_prefix
from .shards import FORMAT, MANIFEST, PARTIAL, VERSION, read_manifest, write_json_atomic
from .tokenize_pool import init_pool_worker, init_worker, mp_context, tokenized
from .tokenizers import load_tokenizer

__all__ = ["prepare"]


def prepare(input: str, output: str, *, tokenizer: str = "gpt2", seq_len: int = 1024, packing: str = "wrapped",
            text_field: str = "text", split: str = "train", name: str | None = None, txt_unit: str = "line",
            val_docs: int = 0, val_split: str | None = None, val_input: str | None = None,
            samples_per_shard: int = 4096,
            num_proc: int | None = None, docs_per_task: int = 256, max_docs: int | None = None,
            add_mask: bool = False, overwrite: bool = False, log=None) -> dict:
    """Prepare shards in `output`; returns the manifest. Raises a UsageError naming the bad option
    (an InputFileError for unusable input text)."""
    log = log or (lambda msg: print(f"[data prepare] {msg}", file=sys.stderr, flush=True))
    num_proc = num_proc or os.cpu_count() or 1
    for opt, v, lo in (("--seq-len", seq_len, 2), ("--samples-per-shard", samples_per_shard, 1),
                       ("--num-proc", num_proc, 1), ("--docs-per-task", docs_per_task, 1), ("--val-docs", val_docs, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise UsageError(f"{opt}: must be an integer >= {lo}, got {v!r}")
    if packing not in PACKINGS:
        raise UsageError(f"--packing: {packing!r}; valid: {', '.join(PACKINGS)}")
    if val_docs and (val_split or val_input):
        raise UsageError("--val-docs and --val-split/--val-input: give at most one way to make the val split")
    if max_docs is not None and (not isinstance(max_docs, int) or max_docs < 1):
        raise UsageError(f"--max-docs: must be a positive integer, got {max_docs!r}")
    try:
        tok = load_tokenizer(tokenizer, add_mask=add_mask)
    except ValueError as e:
        raise UsageError(f"--tokenizer: {e}") from None
    try:
        framing(packing, tok.bos_id, tok.eos_id)
    except ValueError as e:
        raise UsageError(f"--packing: {e} ({tok.name!r} has eos_id={tok.eos_id}, bos_id={tok.bos_id})") from None

    sources = {"train": open_text(input, text_field=text_field, split=split, txt_unit=txt_unit, name=name)}
    if max_docs:
        sources["train"] = sources["train"].select(0, min(max_docs, len(sources["train"])), f"first {max_docs} docs")
    if val_split or val_input:
        sources["val"] = open_text(val_input or input, text_field=text_field, split=val_split or "train",
                                   txt_unit=txt_unit, name=name)
        if max_docs:
            sources["val"] = sources["val"].select(0, min(max_docs, len(sources["val"])), f"first {max_docs} docs")
    elif val_docs:
        n = len(sources["train"])
        if val_docs >= n:
            raise UsageError(f"--val-docs: {val_docs} is not below the {n} documents of {sources['train'].description}")
        sources["val"] = sources["train"].select(n - val_docs, n, f"last {val_docs} documents")
        sources["train"] = sources["train"].select(0, n - val_docs, f"all but the last {val_docs} documents")

    dtype = token_dtype(tok.vocab_size)
    settings = {"format": FORMAT, "version": VERSION, "tokenizer": tok.meta(), "seq_len": seq_len,
                "packing": packing, "dtype": dtype.name, "samples_per_shard": samples_per_shard,
                "sources": {s: {"description": src.description, "fingerprint": src.fingerprint, "documents": len(src)}
                            for s, src in sources.items()}}
    os.makedirs(output, exist_ok=True)
    progress = _load_progress(output, settings, overwrite, log)
    if progress.get("complete"):
        log(f"{output}: already complete and valid; nothing to do")
        return progress
    tok_dir = os.path.join(output, "tokenizer")
    tok.save(tok_dir)
    splits = progress.setdefault("splits", {})
    t0 = time.time()

    def save_progress():
        write_json_atomic(os.path.join(output, PARTIAL), {**settings, "splits": splits})

    pool = None
    try:
        for sname, src in sources.items():
            info = splits.get(sname) or {"shards": []}
            info["shards"] = valid_prefix(output, info.get("shards", []), log)
            if info.get("complete") and len(info["shards"]) == info.get("num_shards"):
                log(f"{sname}: complete ({len(info['shards'])} shards), skipped")
                continue
            info = {"shards": info["shards"]}
            splits[sname] = info
            doc, off = info["shards"][-1]["next"] if info["shards"] else (0, 0)
            if info["shards"]:
                log(f"{sname}: {len(info['shards'])} shards already complete; resuming at document {doc}")
            if pool is None and num_proc > 1 and doc < len(src):
                pool = mp_context().Pool(num_proc, initializer=init_pool_worker, initargs=(tok_dir, packing))
            if pool is None:
                init_worker(tok_dir, packing)
            w = SplitWriter(output, sname, seq_len, dtype, samples_per_shard, info["shards"], save_progress, log)
            n_tok, last_log = 0, time.time()
            for first, flat, lengths in tokenized(src, doc, pool, num_proc, docs_per_task):
                w.add(first, flat, lengths, off if first == doc else 0)
                n_tok += len(flat)
                if time.time() - last_log > 10:
                    last_log = time.time()
                    log(f"{sname}: document {first + len(lengths)}/{len(src)}, {len(info['shards'])} shards, "
                        f"{n_tok / (time.time() - t0):,.0f} tokens/s")
            dropped = w.finish(len(src))
            n = sum(e["num_samples"] for e in info["shards"])
            if n == 0:
                raise InputFileError(f"--input: the {sname} split ({src.description}) gives no full sequence of "
                                     f"{seq_len} tokens; it has too little text (or only empty documents)")
            info.update(complete=True, num_shards=len(info["shards"]), num_samples=n, num_tokens=n * seq_len,
                        num_documents=len(src), dropped_tail_tokens=int(dropped))
            save_progress()
            log(f"{sname}: {len(info['shards'])} shards, {n:,} sequences, {n * seq_len:,} tokens")
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    manifest = {**settings, "splits": splits, "complete": True,
                "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "preparation_seconds": round(time.time() - t0, 2)}
    write_json_atomic(os.path.join(output, MANIFEST), manifest)
    os.remove(os.path.join(output, PARTIAL))
    return manifest


def _same_settings(a: dict, b: dict) -> list[str]:
    keys = ("format", "version", "tokenizer", "seq_len", "packing", "dtype", "samples_per_shard", "sources")
    return [k for k in keys if a.get(k) != b.get(k)]


def _load_progress(output: str, settings: dict, overwrite: bool, log) -> dict:
    old = None
    for fname in (MANIFEST, PARTIAL):
        if os.path.exists(os.path.join(output, fname)):
            try:
                old = read_manifest(output) if fname == MANIFEST else _read_partial(output)
            except ValueError as e:
                if not overwrite:
                    raise UsageError(f"--output: {output} holds an unreadable {fname} ({e}); use --overwrite") from None
                old = {}
            break
    if old is None:
        return {}
    diff = _same_settings(old, settings)
    if diff and not overwrite:
        raise UsageError(f"--output: {output} holds shards prepared with other settings (differs in: "
                         f"{', '.join(diff)}); use another directory or --overwrite")
    if diff:
        log(f"--overwrite: removing the shards in {output}")
        for sub in ("train", "val", "tokenizer"):
            shutil.rmtree(os.path.join(output, sub), ignore_errors=True)
        for fname in (MANIFEST, PARTIAL):
            if os.path.exists(os.path.join(output, fname)):
                os.remove(os.path.join(output, fname))
        return {}
    if old.get("complete"):
        for info in old["splits"].values():
            if len(valid_prefix(output, info["shards"], log)) != len(info["shards"]):
                os.remove(os.path.join(output, MANIFEST))
                info["complete"] = False
                return {"splits": old["splits"]}
        return old
    return {"splits": old.get("splits", {})}


def _read_partial(output: str) -> dict:
    with open(os.path.join(output, PARTIAL)) as f:
        return json.load(f)
