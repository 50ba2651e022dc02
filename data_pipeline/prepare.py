"""`setdlm data prepare`: tokenize text in parallel, pack it, write webdataset shards + manifest.

Resumable: after every shard the progress (shard entries and the document cursor where the next
shard starts) is saved to ``manifest.partial.json``; a re-run with the same arguments keeps every
shard whose bytes still match, and tokenizes only from the first missing one. ``manifest.json``
appears (atomically) when every split is complete.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import deque

from common.cli import ArgumentParser as CLIParser

import numpy as np

from common.io import atomic_write_bytes

from .config import PACKINGS
from .ingest import TXT_UNITS, open_text
from .packing import StreamPacker, frame_documents, framing, token_dtype
from .shards import FORMAT, MANIFEST, PARTIAL, VERSION, encode_shard, read_manifest, sha256_bytes, \
    write_json_atomic
from .tokenizers import load_tokenizer

PRESETS = {
    "owt": {"tokenizer": "gpt2", "seq_len": 1024, "packing": "wrapped", "val_docs": 100_000,
            "input": "Skylion007/openwebtext",
            "help": "OpenWebText: GPT-2 BPE, L=1024, documents joined with EOS and wrapped; val = the last "
                    "100,000 documents of the train split; --input defaults to Skylion007/openwebtext"},
    "lm1b": {"tokenizer": "bert-base-uncased", "seq_len": 128, "packing": "wrapped_bos_eos", "val_split": "test",
             "help": "LM1B: bert-base-uncased, L=128, sentences as [CLS] ... [SEP] concatenated and wrapped; "
                     "val = the dataset's own test split (--val-split test), or --val-input FILES for local "
                     "files; --input is required"},
}
DEFAULTS = {"tokenizer": "gpt2", "seq_len": 1024, "packing": "wrapped", "val_docs": 0, "val_split": None,
            "input": None}

# -- tokenization workers -----------------------------------------------------------------------------
_WORKER = {}


def _init_pool_worker(tok_dir: str, packing: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _init_worker(tok_dir, packing)


def _init_worker(tok_dir: str, packing: str) -> None:
    tok = load_tokenizer(tok_dir)
    _WORKER.update(tok=tok, packing=packing, dtype=token_dtype(tok.vocab_size))


def _mp_context():
    """fork on Linux: workers start in milliseconds instead of re-importing the program (the children
    only tokenize; `tokenizers` is fork-aware); spawn elsewhere."""
    return mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def _tokenize(texts: list[str]):
    w = _WORKER
    encode = w["tok"].encode  # one document at a time: one core per process (no Rust thread pool)
    return frame_documents([encode(t) for t in texts], w["packing"], w["tok"].bos_id, w["tok"].eos_id, w["dtype"])


def _tokenized(src, start: int, pool, num_proc: int, docs_per_task: int):
    """(first doc, flat tokens, framed lengths) per task, in order, with a bounded number in flight."""
    ranges = ((s, min(s + docs_per_task, len(src))) for s in range(start, len(src), docs_per_task))
    if pool is None:
        for s, e in ranges:
            yield (s, *_tokenize(src.texts(s, e)))
        return
    inflight = deque()
    for s, e in ranges:
        inflight.append((s, pool.apply_async(_tokenize, (src.texts(s, e),))))
        if len(inflight) >= 2 * num_proc:
            s0, r = inflight.popleft()
            yield (s0, *r.get())
    while inflight:
        s0, r = inflight.popleft()
        yield (s0, *r.get())


# -- one split --------------------------------------------------------------------------------------------
class _SplitWriter:
    def __init__(self, out: str, split: str, seq_len: int, dtype, spp: int, entries: list, save_progress, log):
        self.out, self.split, self.seq_len, self.spp = out, split, seq_len, spp
        self.entries, self.save_progress, self.log = entries, save_progress, log
        self.packer = StreamPacker(seq_len, dtype)
        self.pending = deque()  # [doc, remaining framed tokens, total framed tokens] of buffered docs
        os.makedirs(os.path.join(out, split), exist_ok=True)

    def add(self, first_doc: int, flat: np.ndarray, lengths: np.ndarray, skip_tokens: int) -> None:
        for i, n in enumerate(lengths.tolist()):
            if n == 0:
                continue
            drop = skip_tokens if i == 0 else 0
            if n - drop > 0:
                self.pending.append([first_doc + i, n - drop, n])
        self.packer.add(flat[skip_tokens:])
        while self.packer.buffered >= self.spp * self.seq_len:
            self._write(self.packer.take(self.spp), next_doc=first_doc + len(lengths))

    def finish(self, n_docs: int) -> int:
        rows = self.packer.take()
        if len(rows):
            self._write(rows, next_doc=n_docs)
        return self.packer.buffered

    def _write(self, rows: np.ndarray, next_doc: int) -> None:
        need = rows.size
        while need:
            d = self.pending[0]
            if d[1] <= need:
                need -= d[1]
                self.pending.popleft()
            else:
                d[1] -= need
                need = 0
        cursor = [self.pending[0][0], self.pending[0][2] - self.pending[0][1]] if self.pending else [next_doc, 0]
        k = len(self.entries)
        first = sum(e["num_samples"] for e in self.entries)
        rel = f"{self.split}/shard-{k:06d}.tar"
        data = encode_shard(rows, first)
        path = os.path.join(self.out, rel)
        atomic_write_bytes(path, data)
        self.entries.append({"path": rel, "num_samples": int(len(rows)), "first_sample": int(first),
                             "bytes": len(data), "sha256": sha256_bytes(data), "next": cursor})
        self.save_progress()


def _valid_prefix(out: str, entries: list, log) -> list:
    """The leading entries whose shard files still match; files of the others are removed."""
    keep = []
    for e in entries:
        p = os.path.join(out, e["path"])
        try:
            with open(p, "rb") as f:
                data = f.read()
        except OSError:
            data = None
        if data is None or len(data) != e["bytes"] or sha256_bytes(data) != e["sha256"]:
            log(f"{e['path']}: missing or changed; re-making it and the shards after it")
            break
        keep.append(e)
    for e in entries[len(keep):]:
        try:
            os.remove(os.path.join(out, e["path"]))
        except OSError:
            pass
    return keep


# -- driver -----------------------------------------------------------------------------------------------
def prepare(input: str, output: str, *, tokenizer: str = "gpt2", seq_len: int = 1024, packing: str = "wrapped",
            text_field: str = "text", split: str = "train", name: str | None = None, txt_unit: str = "line",
            val_docs: int = 0, val_split: str | None = None, val_input: str | None = None,
            samples_per_shard: int = 4096,
            num_proc: int | None = None, docs_per_task: int = 256, max_docs: int | None = None,
            add_mask: bool = False, overwrite: bool = False, log=None) -> dict:
    """Prepare shards in `output`; returns the manifest. Raises ValueError naming the bad option."""
    log = log or (lambda msg: print(f"[data prepare] {msg}", file=sys.stderr, flush=True))
    num_proc = num_proc or os.cpu_count() or 1
    for opt, v, lo in (("--seq-len", seq_len, 2), ("--samples-per-shard", samples_per_shard, 1),
                       ("--num-proc", num_proc, 1), ("--docs-per-task", docs_per_task, 1), ("--val-docs", val_docs, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{opt}: must be an integer >= {lo}, got {v!r}")
    if packing not in PACKINGS:
        raise ValueError(f"--packing: {packing!r}; valid: {', '.join(PACKINGS)}")
    if val_docs and (val_split or val_input):
        raise ValueError("--val-docs and --val-split/--val-input: give at most one way to make the val split")
    if max_docs is not None and (not isinstance(max_docs, int) or max_docs < 1):
        raise ValueError(f"--max-docs: must be a positive integer, got {max_docs!r}")
    try:
        tok = load_tokenizer(tokenizer, add_mask=add_mask)
    except ValueError as e:
        raise ValueError(f"--tokenizer: {e}") from None
    try:
        framing(packing, tok.bos_id, tok.eos_id)
    except ValueError as e:
        raise ValueError(f"--packing: {e} ({tok.name!r} has eos_id={tok.eos_id}, bos_id={tok.bos_id})") from None

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
            raise ValueError(f"--val-docs: {val_docs} is not below the {n} documents of {sources['train'].description}")
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
            info["shards"] = _valid_prefix(output, info.get("shards", []), log)
            if info.get("complete") and len(info["shards"]) == info.get("num_shards"):
                log(f"{sname}: complete ({len(info['shards'])} shards), skipped")
                continue
            info = {"shards": info["shards"]}
            splits[sname] = info
            doc, off = info["shards"][-1]["next"] if info["shards"] else (0, 0)
            if info["shards"]:
                log(f"{sname}: {len(info['shards'])} shards already complete; resuming at document {doc}")
            if pool is None and num_proc > 1 and doc < len(src):
                pool = _mp_context().Pool(num_proc, initializer=_init_pool_worker, initargs=(tok_dir, packing))
            if pool is None:
                _init_worker(tok_dir, packing)
            w = _SplitWriter(output, sname, seq_len, dtype, samples_per_shard, info["shards"], save_progress, log)
            n_tok, last_log = 0, time.time()
            for first, flat, lengths in _tokenized(src, doc, pool, num_proc, docs_per_task):
                w.add(first, flat, lengths, off if first == doc else 0)
                n_tok += len(flat)
                if time.time() - last_log > 10:
                    last_log = time.time()
                    log(f"{sname}: document {first + len(lengths)}/{len(src)}, {len(info['shards'])} shards, "
                        f"{n_tok / (time.time() - t0):,.0f} tokens/s")
            dropped = w.finish(len(src))
            n = sum(e["num_samples"] for e in info["shards"])
            if n == 0:
                raise ValueError(f"--input: the {sname} split ({src.description}) gives no full sequence of "
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
                    raise ValueError(f"--output: {output} holds an unreadable {fname} ({e}); use --overwrite") from None
                old = {}
            break
    if old is None:
        return {}
    diff = _same_settings(old, settings)
    if diff and not overwrite:
        raise ValueError(f"--output: {output} holds shards prepared with other settings (differs in: "
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
            if len(_valid_prefix(output, info["shards"], log)) != len(info["shards"]):
                os.remove(os.path.join(output, MANIFEST))
                info["complete"] = False
                return {"splits": old["splits"]}
        return old
    return {"splits": old.get("splits", {})}


def _read_partial(output: str) -> dict:
    import json

    with open(os.path.join(output, PARTIAL)) as f:
        return json.load(f)


def build_parser() -> argparse.ArgumentParser:
    p = CLIParser(prog="setdlm data prepare", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="presets:\n" + "\n".join(f"  {k}: {v['help']}" for k, v in PRESETS.items()))
    p.add_argument("--input", help="Hugging Face dataset name, local parquet/json/jsonl/txt file(s) "
                   "or glob, a directory of them, or builtin:pydoc_topics (required unless the preset names one)")
    p.add_argument("--output", "--out", required=True, help="directory for shards and manifest.json (local)")
    p.add_argument("--preset", choices=sorted(PRESETS), help="field conventions (set tokenizer, L, packing, val split)")
    p.add_argument("--tokenizer", help=f"tokenizer name or directory (default {DEFAULTS['tokenizer']})")
    p.add_argument("--add-mask", action="store_true", help="append <|mask|> if the tokenizer has no mask token")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence L (default {DEFAULTS['seq_len']})")
    p.add_argument("--packing", choices=sorted(PACKINGS), help=f"default {DEFAULTS['packing']}")
    p.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    p.add_argument("--split", default="train", help="dataset split to read as train (default: train)")
    p.add_argument("--name", help="Hugging Face dataset config name")
    p.add_argument("--txt-unit", default="line", choices=TXT_UNITS, help="what a document is in .txt files")
    p.add_argument("--val-docs", type=int, help="hold out the last N documents of the train split as val")
    p.add_argument("--val-split", help="dataset split to use as val (e.g. test)")
    p.add_argument("--val-input", help="val documents from another input (files, directory or dataset name; "
                   "its --val-split split if given)")
    p.add_argument("--samples-per-shard", type=int, default=4096, help="sequences per shard (default 4096)")
    p.add_argument("--num-proc", type=int, default=None, help="tokenizer processes (default: all CPUs)")
    p.add_argument("--docs-per-task", type=int, default=256, help="documents per tokenization task")
    p.add_argument("--max-docs", type=int, help="read only the first N documents of each split (tests, trials)")
    p.add_argument("--overwrite", action="store_true", help="replace shards prepared with other settings")
    from .prompt_answer import add_args

    add_args(p)  # --format prompt_answer | chat | marker (data_pipeline/prompt_answer.py)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.format != "text" or args.packing in ("padded", "packed"):
        if args.format == "text":
            print(f"setdlm data prepare: error: --packing {args.packing}: rows of whole examples need a prompt/answer "
                  "--format (prompt_answer, chat, marker)", file=sys.stderr)
            return 2
        from .prompt_answer import main_from_args

        if not args.input:
            print("setdlm data prepare: error: --input: required (a JSONL file, or a save_to_disk directory for "
                  "--format marker)", file=sys.stderr)
            return 2
        return main_from_args(args)
    preset = {**DEFAULTS, **{k: v for k, v in PRESETS.get(args.preset, {}).items() if k != "help"}}
    for k in ("tokenizer", "seq_len", "packing", "val_docs", "val_split"):
        if getattr(args, k) is not None:
            preset[k] = getattr(args, k)
    if (args.val_split or args.val_input) and args.val_docs is None:
        preset["val_docs"] = 0
    if args.val_docs is not None and args.val_split is None:
        preset["val_split"] = None
    if args.val_input and args.val_split is None:
        preset["val_split"] = None
    source = args.input or preset.get("input")
    if not source:
        print("setdlm data prepare: error: --input: required" + (f" for preset {args.preset!r}" if args.preset
              else "") + " (a dataset name, files, a directory or builtin:NAME)", file=sys.stderr)
        return 2
    try:
        m = prepare(source, args.output, tokenizer=preset["tokenizer"], seq_len=preset["seq_len"],
                    packing=preset["packing"], text_field=args.text_field, split=args.split, name=args.name,
                    txt_unit=args.txt_unit, val_docs=preset["val_docs"] or 0, val_split=preset["val_split"],
                    val_input=args.val_input,
                    samples_per_shard=args.samples_per_shard, num_proc=args.num_proc,
                    docs_per_task=args.docs_per_task, max_docs=args.max_docs, add_mask=args.add_mask,
                    overwrite=args.overwrite)
    except ValueError as e:
        print(f"setdlm data prepare: error: {e}", file=sys.stderr)
        return 2
    for s, info in m["splits"].items():
        print(f"{s}: {info['num_shards']} shards, {info['num_samples']} sequences of {m['seq_len']} tokens "
              f"({info['num_documents']} documents)")
    print(f"wrote {os.path.join(args.output, MANIFEST)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
