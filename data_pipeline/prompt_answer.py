"""Prompt/answer data: examples -> token ids with a per-token context (prompt) mask -> padded or packed
rows -> webdataset shards with `context_mask` and `valid_mask` (data_pipeline/shards.py).

    setdlm data prepare --format prompt_answer --input train.jsonl --output DIR --tokenizer TOK \
        [--prompt-field question --answer-field answer] [--template chatml|plain|tokenizer] [--seq-len 1024] \
        [--packing padded|packed] [--overlong truncate|drop] [--val-docs N | --val-input FILE | --val-split S]

Input (``--input``, every format): a JSONL file, a Parquet file, a directory written by `datasets`'
``save_to_disk`` (``--split`` picks a DatasetDict's split) or a Hugging Face dataset name
(example_sources.py). Examples are read one at a time and long texts tokenized only as far as a row
reaches, so memory does not grow with the input or with a row's length.

Formats (`--format`):
- ``prompt_answer``: a prompt and an answer field (GSM8K: question / answer);
- ``prompt_completion``: TRL's columns ``prompt`` and ``completion``: strings (TRL's standard form:
  the text is prompt + completion, then EOS; no template), or lists of {role, content} messages
  (TRL's conversational form: the prompt messages are the context, the completion's the answer);
- ``chat``: a ``messages`` list of {role, content}, the last one the assistant's answer;
- ``marker``: ``input_ids`` (e.g. a dataset saved with ``save_to_disk``); the context is everything
  up to the last ``--marker`` token (default ``<|im_start|>``) plus ``--marker-offset`` (default 2)
  more tokens, the layout of the reference implementation's distillation data.

Templates (``--template``): ``chatml`` renders each message as
``<|im_start|>{role}\\n{content}<|im_end|>\\n`` (the special tokens as ids, never parsed out of the
text), the context ending with ``<|im_start|>assistant\\n`` and the answer with ``<|im_end|>``; a
prompt/answer pair is the conversation [user: prompt, assistant: answer]. With a Qwen tokenizer
this is exactly what the marker rule finds in the same conversation's ids, so the three formats give
the same context masks. ``plain`` is ``--prompt-template`` (default ``Question: {prompt}\\nAnswer:``,
the prompt of `setdlm eval gsm8k`) followed by `` {answer}`` and EOS; it needs no chat tokens (GPT-2).
``tokenizer`` renders with the tokenizer's own Jinja chat template (or ``--chat-template FILE``):
the loss mask comes from its ``{% generation %}`` tags where it has them (every assistant turn of
a multi-turn chat), else the context is the conversation before the last assistant turn rendered
with the generation prompt (data_pipeline/chat_template.py). ``auto`` is chatml when the tokenizer
has the chat tokens, else (chat, conversational prompt_completion) the tokenizer's template when it
has one, else plain; the choice and its reason are printed.

Rows (example_rows.py): ``padded`` puts one example per row, padded with the tokenizer's pad (else
EOS) token; ``packed`` fills a row with whole examples (none is split across rows) and pads the rest.
Examples longer than the row are cut at the end of the answer (``--overlong truncate``) or left out
(``drop``). Examples with no marker, an empty answer, or a prompt that leaves no room for an answer
token are skipped with a message. Every count is printed and recorded in manifest.json.
"""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

from .example_encoder import FORMATS, IM_END, IM_START, PLAIN_PROMPT, SKIPS, TEMPLATES, Encoder, chatml_prompt
from .example_rows import ExampleShardWriter, RowBuilder, build_rows, describe_counts
from .example_sources import ExampleError, open_examples
from .packing import token_dtype
from .shards import FORMAT, MANIFEST, MASK_FIELDS, VERSION, write_json_atomic
from .tokenizers import load_tokenizer

ROW_PACKINGS = ("padded", "packed")
OVERLONG = ("truncate", "drop")


# -- driver ----------------------------------------------------------------------------------------
def prepare_examples(input: str, output: str, *, fmt: str, tokenizer: str, seq_len: int = 1024,
                     packing: str = "padded", overlong: str = "truncate", template: str = "auto",
                     val_docs: int = 0, val_input: str | None = None, val_split: str | None = None,
                     split: str | None = None, name: str | None = None, chat_template: str | None = None,
                     samples_per_shard: int = 4096, max_docs: int | None = None, add_mask: bool = False,
                     overwrite: bool = False, log=None, **encoder_kw) -> dict:
    """Prepare prompt/answer shards in `output`; returns the manifest. Raises an ExampleError naming
    the option. `split`/`name`: the split and config of a hub dataset or saved DatasetDict;
    `chat_template`: a Jinja file for --template tokenizer instead of the tokenizer's own."""
    log = log or (lambda msg: print(f"[data prepare] {msg}", file=sys.stderr, flush=True))
    if packing not in ROW_PACKINGS:
        raise ExampleError(f"--packing: {packing!r} for --format {fmt}; valid: {', '.join(ROW_PACKINGS)}")
    if overlong not in OVERLONG:
        raise ExampleError(f"--overlong: {overlong!r}; valid: {', '.join(OVERLONG)}")
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ExampleError(f"--seq-len: must be an integer >= 2, got {seq_len!r}")
    if sum(map(bool, (val_docs, val_input or val_split))) > 1:
        raise ExampleError("--val-docs and --val-input/--val-split: give at most one way to make the val split")
    try:
        tok = load_tokenizer(tokenizer, add_mask=add_mask)
    except ValueError as e:
        raise ExampleError(f"--tokenizer: {e}") from None
    jinja = _read_template(chat_template) if chat_template else None
    enc = Encoder(tok, fmt, template, chat_template=jinja, chat_template_name=f"--chat-template {chat_template}",
                  max_tokens=seq_len + 1, **encoder_kw)
    if fmt != "marker":  # on stderr whatever `log` is: which template, and why
        print(f"[data prepare] {enc.choice}", file=sys.stderr, flush=True)
    pad_id = tok.pad_id if tok.pad_id is not None else tok.eos_id
    if pad_id is None:
        raise ExampleError(f"--tokenizer: {tok.name!r} has neither a pad nor an EOS token to pad rows with")
    t0 = time.time()
    field = "input_ids" if fmt == "marker" else None

    def source(spec, what, sp):
        s = open_examples(spec, what, field=field, split=sp, name=name, check=enc.check, limit=max_docs)
        return s.select(0, min(max_docs, len(s))) if max_docs else s

    examples = {"train": source(input, "--input", split)}
    if val_input or val_split:
        examples["val"] = source(val_input or input, "--val-input" if val_input else "--val-split",
                                 val_split or (None if val_input else split))
    elif val_docs:
        n = len(examples["train"])
        if val_docs >= n:
            raise ExampleError(f"--val-docs: {val_docs} is not below the {n} examples of {input}")
        examples["val"] = examples["train"].select(n - val_docs, n)
        examples["train"] = examples["train"].select(0, n - val_docs)
    if os.path.exists(os.path.join(output, MANIFEST)) and not overwrite:
        raise ExampleError(f"--output: {output} already holds prepared shards; use another directory or --overwrite")
    dtype = token_dtype(tok.vocab_size)
    os.makedirs(output, exist_ok=True)
    used_template = enc.chat.template if enc.chat is not None else None
    tok.save(os.path.join(output, "tokenizer"), chat_template=used_template)
    splits = {}
    for sname, exs in examples.items():
        splits[sname] = _write_split(output, sname, exs, enc, seq_len, packing, overlong, pad_id, dtype,
                                     samples_per_shard, log)
    manifest = {"format": FORMAT, "version": VERSION, "tokenizer": tok.meta(), "seq_len": seq_len, "packing": packing,
                "dtype": dtype.name, "samples_per_shard": samples_per_shard, "masks": list(MASK_FIELDS),
                "examples": {"format": fmt, "template": enc.template if fmt != "marker" else None,
                             **({"template_choice": enc.choice} if fmt != "marker" else {}), "overlong": overlong,
                             "marker": encoder_kw.get("marker", IM_START) if fmt == "marker" else None,
                             **({"chat_template_sha256": hashlib.sha256(used_template.encode()).hexdigest()}
                                if used_template else {})},
                "sources": {"train": {"description": f"{input} ({fmt})", "documents": len(examples["train"])},
                            **({"val": {"description": f"{val_input or input} ({fmt})",
                                        "documents": len(examples["val"])}} if "val" in examples else {})},
                "splits": splits, "complete": True, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "preparation_seconds": round(time.time() - t0, 2)}
    write_json_atomic(os.path.join(output, MANIFEST), manifest)
    return manifest


def _write_split(output, split, exs, enc, seq_len, packing, overlong, pad_id, dtype, spp, log) -> dict:
    """Encode, pack and write one split as a stream; its manifest entry."""
    rows = RowBuilder(seq_len, packing, overlong, pad_id, dtype)
    writer = ExampleShardWriter(output, split, spp)
    last = time.time()
    for i, ex in enumerate(exs.rows()):
        writer.add(rows.add(enc.encode(ex)))
        if time.time() - last > 10:
            last = time.time()
            log(f"{split}: example {i + 1}/{len(exs)}, {rows.rows} rows, {len(writer.entries)} shards")
    writer.add(rows.finish())
    counts = rows.counts()
    log(describe_counts(split, counts, seq_len, overlong))
    if rows.rows == 0:
        raise ExampleError(f"--input: the {split} split gives no usable example (see the counts above)")
    entries = writer.finish()
    return {"shards": entries, "complete": True, "num_shards": len(entries), "num_samples": rows.rows,
            "num_tokens": int(rows.rows * seq_len), "num_documents": len(exs), "examples": counts}


def _read_template(path: str) -> str:
    p = Path(os.path.expanduser(path))
    if not p.is_file():
        raise ExampleError(f"--chat-template: no such file {path!r} (a Jinja chat template)")
    try:
        return p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ExampleError(f"--chat-template: {path} cannot be read ({type(e).__name__}: {e})") from None


__all__ = ["FORMATS", "TEMPLATES", "ROW_PACKINGS", "OVERLONG", "SKIPS", "IM_START", "IM_END", "PLAIN_PROMPT",
           "Encoder", "build_rows", "chatml_prompt", "describe_counts", "prepare_examples", "ExampleError"]
