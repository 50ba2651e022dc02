"""Prompt/answer data: examples -> token ids with a per-token context (prompt) mask -> padded or packed
rows -> webdataset shards with `context_mask` and `valid_mask` (data_pipeline/shards.py).

    setdlm data prepare --format prompt_answer --input train.jsonl --output DIR --tokenizer TOK \
        [--prompt-field question --answer-field answer] [--template chatml|plain] [--seq-len 1024] \
        [--packing padded|packed] [--overlong truncate|drop] [--val-docs N | --val-input FILE]

Formats (`--format`):
- ``prompt_answer``: JSONL with a prompt and an answer field (GSM8K: question / answer);
- ``chat``: JSONL with a ``messages`` list of {role, content}, the last one the assistant's answer;
- ``marker``: a Hugging Face dataset saved with ``save_to_disk`` holding ``input_ids``; the context is
  everything up to the last ``--marker`` token (default ``<|im_start|>``) plus ``--marker-offset``
  (default 2) more tokens, the layout of the reference implementation's distillation data.

Templates (``prompt_answer`` and ``chat``): ``chatml`` renders each message as
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` (the special tokens as ids, never parsed out of the
text), the context ending with ``<|im_start|>assistant\\n`` and the answer with ``<|im_end|>``; a
prompt/answer pair is the conversation [user: prompt, assistant: answer]. With a Qwen tokenizer
this is exactly what the marker rule finds in the same conversation's ids, so the three formats give
the same context masks. ``plain`` is ``--prompt-template`` (default ``Question: {prompt}\\nAnswer:``,
the prompt of `setdlm eval gsm8k`) followed by `` {answer}`` and EOS; it needs no chat tokens (GPT-2).
``auto`` is chatml when the tokenizer has the chat tokens, else plain.

Rows: ``padded`` puts one example per row, padded with the tokenizer's pad (else EOS) token;
``packed`` fills a row with whole examples (none is split across rows) and pads the rest. Examples
longer than the row are cut at the end of the answer (``--overlong truncate``) or left out
(``drop``). Examples with no marker, an empty answer, or a prompt that leaves no room for an answer
token are skipped with a message. Every count is printed and recorded in manifest.json.
"""
from __future__ import annotations

import os
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from common.errors import Error
from common.io import atomic_write_bytes
from common.jsonl import read_jsonl

from .packing import token_dtype
from .shards import FORMAT, MANIFEST, MASK_FIELDS, VERSION, encode_shard, sha256_bytes, write_json_atomic
from .tokenizers import load_tokenizer

FORMATS = ("prompt_answer", "chat", "marker")
TEMPLATES = ("auto", "chatml", "plain")
ROW_PACKINGS = ("padded", "packed")
OVERLONG = ("truncate", "drop")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
PLAIN_PROMPT = "Question: {prompt}\nAnswer:"
SKIPS = ("no_marker", "empty_answer", "no_room")


class ExampleError(Error):
    """An input file or option the prompt/answer preparation cannot use (message names it)."""


# -- reading ---------------------------------------------------------------------------------------
def read_examples(path: str, what: str = "--input") -> list[dict]:
    """The examples of a JSONL file (one JSON object per line)."""
    rows = read_jsonl(path, what, error=ExampleError)
    if not rows:
        raise ExampleError(f"{what}: {path} holds no examples")
    return rows


def read_saved_dataset(path: str, what: str = "--input") -> list[list[int]]:
    """`input_ids` of a dataset written by `datasets.Dataset.save_to_disk` (Arrow files, no code)."""
    if not Path(path).is_dir():
        raise ExampleError(f"{what}: {path!r} is not a directory saved with datasets' save_to_disk")
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - datasets raises several types
        raise ExampleError(f"{what}: {path} cannot be read with datasets.load_from_disk ({type(e).__name__}: {e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise ExampleError(f"{what}: {path} is a DatasetDict without a 'train' split (it has {list(ds)})")
        ds = ds["train"]
    if "input_ids" not in ds.column_names:
        raise ExampleError(f"{what}: {path} has no input_ids column (columns: {ds.column_names})")
    return [list(map(int, r)) for r in ds["input_ids"]]


# -- one example -> (ids, context length) ----------------------------------------------------------
class Encoder:
    """Turns examples into (token ids, number of leading context tokens) under one template."""

    def __init__(self, tok, fmt: str, template: str = "auto", *, prompt_field: str = "prompt",
                 answer_field: str = "answer", messages_field: str = "messages", prompt_template: str = PLAIN_PROMPT,
                 marker: str = IM_START, marker_offset: int = 2):
        if fmt not in FORMATS:
            raise ExampleError(f"--format: {fmt!r}; valid: text, {', '.join(FORMATS)}")
        if template not in TEMPLATES:
            raise ExampleError(f"--template: {template!r}; valid: {', '.join(TEMPLATES)}")
        self.tok, self.fmt = tok, fmt
        self.im_start, self.im_end = tok.token_to_id(IM_START), tok.token_to_id(IM_END)
        has_chat = self.im_start is not None and self.im_end is not None
        if template == "auto":
            template = "chatml" if has_chat else "plain"
        if template == "chatml" and not has_chat:
            raise ExampleError(f"--template chatml: tokenizer {tok.name!r} has no {IM_START} / {IM_END} tokens; use "
                               "--template plain or a tokenizer with chat tokens (e.g. Qwen's)")
        if fmt == "chat" and template != "chatml":
            raise ExampleError("--format chat: needs the chatml template (a tokenizer with <|im_start|>/<|im_end|>)")
        if template == "plain" and tok.eos_id is None:
            raise ExampleError(f"--template plain: tokenizer {tok.name!r} has no EOS token to end the answer with")
        if "{prompt}" not in prompt_template:
            raise ExampleError(f"--prompt-template: {prompt_template!r} has no {{prompt}} placeholder")
        self.template, self.prompt_template = template, prompt_template
        self.fields = (prompt_field, answer_field, messages_field)
        if fmt == "marker":
            self.marker = tok.token_to_id(marker)
            if self.marker is None:
                raise ExampleError(f"--marker: {marker!r} is not a token of tokenizer {tok.name!r}")
            if marker_offset < 0:
                raise ExampleError(f"--marker-offset: must be >= 0, got {marker_offset}")
            self.marker_offset = marker_offset

    def _chatml(self, messages: list[dict]) -> tuple[list[int], int, int]:
        ids = chatml_prompt(self.tok, messages[:-1], messages[-1]["role"])
        answer = self.tok.encode(messages[-1]["content"])
        return ids + answer + [self.im_end], len(ids), len(answer)

    def encode(self, ex) -> tuple[list[int], int] | str:
        """(ids, context length), or the name of the reason it is skipped (see SKIPS)."""
        if self.fmt == "marker":
            ids = list(ex)
            where = [i for i, t in enumerate(ids) if t == self.marker]
            if not where:
                return "no_marker"
            n_ctx = min(where[-1] + self.marker_offset + 1, len(ids))
            return (ids, n_ctx) if n_ctx < len(ids) else "empty_answer"
        pf, af, mf = self.fields
        if self.fmt == "chat":
            msgs = ex.get(mf)
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                    for m in msgs):
                raise ExampleError(f"--format chat: field {mf!r} must be a list of {{role, content}} strings")
            if msgs[-1]["role"] != "assistant":
                return "empty_answer"
        else:
            for f in (pf, af):
                if not isinstance(ex.get(f), str):
                    raise ExampleError(f"--format prompt_answer: field {f!r} missing or not a string (fields: "
                                       f"{sorted(ex)}); set --prompt-field / --answer-field")
            if self.template == "plain":
                ctx = self.tok.encode(self.prompt_template.format(prompt=ex[pf]))
                answer = self.tok.encode(" " + ex[af]) if ex[af].strip() else []
                return (ctx + answer + [self.tok.eos_id], len(ctx)) if answer else "empty_answer"
            msgs = [{"role": "user", "content": ex[pf]}, {"role": "assistant", "content": ex[af]}]
        ids, n_ctx, n_answer = self._chatml(msgs)
        return (ids, n_ctx) if n_answer and msgs[-1]["content"].strip() else "empty_answer"


def chatml_prompt(tok, messages: list[dict], next_role: str = "assistant") -> list[int]:
    """Ids of `messages` in the built-in ChatML template followed by the header of the next turn
    (``<|im_start|>assistant\n``): the context of training rows, and the prompt to decode from."""
    im_start, im_end = tok.token_to_id(IM_START), tok.token_to_id(IM_END)
    if im_start is None or im_end is None:
        raise ExampleError(f"the chatml template needs {IM_START} / {IM_END}, which tokenizer {tok.name!r} lacks")
    enc, ids = tok.encode, []
    for m in messages:
        ids += [im_start, *enc(f"{m['role']}\n"), *enc(m["content"]), im_end, *enc("\n")]
    return ids + [im_start, *enc(f"{next_role}\n")]


# -- examples -> rows ------------------------------------------------------------------------------
def build_rows(encoded, seq_len: int, packing: str, overlong: str, pad_id: int, dtype):
    """(ids [n, L], context mask [n, L], valid mask [n, L], counts)."""
    counts = Counter()
    items = []
    for e in encoded:
        if isinstance(e, str):
            counts[f"skipped_{e}"] += 1
            continue
        ids, n_ctx = e
        if n_ctx >= seq_len:
            counts["skipped_no_room"] += 1
            continue
        if len(ids) > seq_len:
            if overlong == "drop":
                counts["dropped_overlong"] += 1
                continue
            ids = ids[:seq_len]
            counts["truncated"] += 1
        items.append((ids, n_ctx))
        counts["examples"] += 1
    rows: list[list[tuple[list[int], int]]] = []
    used = seq_len
    for ids, n_ctx in items:
        if packing == "padded" or used + len(ids) > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, n_ctx))
        used += len(ids)
    n = len(rows)
    x = np.full((n, seq_len), pad_id, dtype=dtype)
    ctx = np.zeros((n, seq_len), dtype=np.uint8)
    valid = np.zeros((n, seq_len), dtype=np.uint8)
    for r, row in enumerate(rows):
        pos = 0
        for ids, n_ctx in row:
            x[r, pos:pos + len(ids)] = ids
            ctx[r, pos:pos + n_ctx] = 1
            valid[r, pos:pos + len(ids)] = 1
            pos += len(ids)
    counts["rows"] = n
    counts["answer_tokens"] = int((valid.astype(bool) & ~ctx.astype(bool)).sum())
    counts["context_tokens"] = int(ctx.sum())
    counts["padding_tokens"] = int((valid == 0).sum())
    return x, ctx, valid, dict(counts)


def describe_counts(split: str, c: dict, seq_len: int, overlong: str) -> str:
    parts = [f"{split}: {c.get('examples', 0)} examples in {c.get('rows', 0)} rows of {seq_len}"]
    if c.get("truncated"):
        parts.append(f"{c['truncated']} longer than {seq_len} tokens cut at the end of the answer (--overlong truncate)")
    if c.get("dropped_overlong"):
        parts.append(f"{c['dropped_overlong']} longer than {seq_len} tokens left out (--overlong drop)")
    if c.get("skipped_no_marker"):
        parts.append(f"{c['skipped_no_marker']} skipped: no marker token")
    if c.get("skipped_empty_answer"):
        parts.append(f"{c['skipped_empty_answer']} skipped: empty answer")
    if c.get("skipped_no_room"):
        parts.append(f"{c['skipped_no_room']} skipped: the prompt fills all {seq_len} tokens, no room for an answer")
    return "; ".join(parts)


# -- driver ----------------------------------------------------------------------------------------
def _load(fmt: str, path: str, what: str):
    return read_saved_dataset(path, what) if fmt == "marker" else read_examples(path, what)


def prepare_examples(input: str, output: str, *, fmt: str, tokenizer: str, seq_len: int = 1024,
                     packing: str = "padded", overlong: str = "truncate", template: str = "auto",
                     val_docs: int = 0, val_input: str | None = None, samples_per_shard: int = 4096,
                     max_docs: int | None = None, add_mask: bool = False, overwrite: bool = False, log=None,
                     **encoder_kw) -> dict:
    """Prepare prompt/answer shards in `output`; returns the manifest. Raises an ExampleError naming the option."""
    log = log or (lambda msg: print(f"[data prepare] {msg}", file=sys.stderr, flush=True))
    if packing not in ROW_PACKINGS:
        raise ExampleError(f"--packing: {packing!r} for --format {fmt}; valid: {', '.join(ROW_PACKINGS)}")
    if overlong not in OVERLONG:
        raise ExampleError(f"--overlong: {overlong!r}; valid: {', '.join(OVERLONG)}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ExampleError(f"--seq-len: must be an integer >= 2, got {seq_len!r}")
    if val_docs and val_input:
        raise ExampleError("--val-docs and --val-input: give at most one way to make the val split")
    try:
        tok = load_tokenizer(tokenizer, add_mask=add_mask)
    except ValueError as e:
        raise ExampleError(f"--tokenizer: {e}") from None
    enc = Encoder(tok, fmt, template, **encoder_kw)
    pad_id = tok.pad_id if tok.pad_id is not None else tok.eos_id
    if pad_id is None:
        raise ExampleError(f"--tokenizer: {tok.name!r} has neither a pad nor an EOS token to pad rows with")
    t0 = time.time()
    examples = {"train": _load(fmt, input, "--input")}
    if max_docs:
        examples["train"] = examples["train"][:max_docs]
    if val_input:
        examples["val"] = _load(fmt, val_input, "--val-input")[: max_docs or None]
    elif val_docs:
        n = len(examples["train"])
        if val_docs >= n:
            raise ExampleError(f"--val-docs: {val_docs} is not below the {n} examples of {input}")
        examples["val"] = examples["train"][n - val_docs:]
        examples["train"] = examples["train"][: n - val_docs]
    if os.path.exists(os.path.join(output, MANIFEST)) and not overwrite:
        raise ExampleError(f"--output: {output} already holds prepared shards; use another directory or --overwrite")
    dtype = token_dtype(tok.vocab_size)
    os.makedirs(output, exist_ok=True)
    tok.save(os.path.join(output, "tokenizer"))
    splits = {}
    for split, exs in examples.items():
        x, ctx, valid, counts = build_rows([enc.encode(e) for e in exs], seq_len, packing, overlong, pad_id, dtype)
        log(describe_counts(split, counts, seq_len, overlong))
        if len(x) == 0:
            raise ExampleError(f"--input: the {split} split gives no usable example (see the counts above)")
        d = os.path.join(output, split)
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(d):
            os.remove(os.path.join(d, f))
        entries = []
        for k, a in enumerate(range(0, len(x), samples_per_shard)):
            b = min(a + samples_per_shard, len(x))
            data = encode_shard(x[a:b], a, {"context_mask": ctx[a:b], "valid_mask": valid[a:b]})
            rel = f"{split}/shard-{k:06d}.tar"
            atomic_write_bytes(os.path.join(output, rel), data)
            entries.append({"path": rel, "num_samples": b - a, "first_sample": a, "bytes": len(data),
                            "sha256": sha256_bytes(data)})
        splits[split] = {"shards": entries, "complete": True, "num_shards": len(entries), "num_samples": len(x),
                         "num_tokens": int(len(x) * seq_len), "num_documents": len(exs), "examples": counts}
    manifest = {"format": FORMAT, "version": VERSION, "tokenizer": tok.meta(), "seq_len": seq_len, "packing": packing,
                "dtype": dtype.name, "samples_per_shard": samples_per_shard, "masks": list(MASK_FIELDS),
                "examples": {"format": fmt, "template": enc.template if fmt != "marker" else None, "overlong": overlong,
                             "marker": encoder_kw.get("marker", IM_START) if fmt == "marker" else None},
                "sources": {"train": {"description": f"{input} ({fmt})", "documents": len(examples["train"])},
                            **({"val": {"description": f"{val_input or input} ({fmt})",
                                        "documents": len(examples["val"])}} if "val" in examples else {})},
                "splits": splits, "complete": True, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "preparation_seconds": round(time.time() - t0, 2)}
    write_json_atomic(os.path.join(output, MANIFEST), manifest)
    return manifest


__all__ = ["FORMATS", "TEMPLATES", "ROW_PACKINGS", "Encoder", "build_rows", "chatml_prompt", "prepare_examples", "read_examples",
           "read_saved_dataset", "ExampleError"]
