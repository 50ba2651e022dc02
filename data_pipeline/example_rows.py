"""Encoded examples -> rows of ``seq_len`` tokens with a context and a valid mask -> shards, as a
stream (`RowBuilder` hands out each row as it fills, `ExampleShardWriter` writes a shard every
``samples_per_shard`` rows), so the memory used does not grow with the input.

An encoded example is ``(ids, context)``: `context` is the number of leading context tokens, or a
0/1 sequence per token (multi-turn chats, where context follows an answer); or a skip reason (a
string, prompt_answer.py's SKIPS). ``padded`` puts one example per row; ``packed`` fills a row with
whole examples; the rest of a row is padding. Examples longer than the row are cut at the end
(``truncate``) or left out (``drop``); an example with no answer token inside the row is skipped
(``no_room``).
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np

from common.io import atomic_write_bytes

from .shards import encode_shard, sha256_bytes

__all__ = ["ExampleShardWriter", "RowBuilder", "build_rows", "describe_counts"]


class RowBuilder:
    """Rows (ids, context mask, valid mask) of encoded examples, in order; `counts()` at the end."""

    def __init__(self, seq_len: int, packing: str, overlong: str, pad_id: int, dtype):
        self.seq_len, self.packing, self.overlong, self.pad_id, self.dtype = seq_len, packing, overlong, pad_id, dtype
        self._counts, self._row, self._used = Counter(), [], 0
        self.rows = self.answer_tokens = self.context_tokens = self.padding_tokens = 0

    def add(self, encoded) -> list:
        """The rows completed by one more encoded example (none, or one)."""
        if isinstance(encoded, str):
            self._counts[f"skipped_{encoded}"] += 1
            return []
        ids, ctx = encoded
        first_answer = ctx if isinstance(ctx, int) else next((i for i, c in enumerate(ctx) if not c), len(ctx))
        if first_answer >= self.seq_len:
            self._counts["skipped_no_room"] += 1
            return []
        if len(ids) > self.seq_len:
            if self.overlong == "drop":
                self._counts["dropped_overlong"] += 1
                return []
            ids = ids[: self.seq_len]
            ctx = ctx if isinstance(ctx, int) else ctx[: self.seq_len]
            self._counts["truncated"] += 1
        self._counts["examples"] += 1
        out = []
        if self.packing == "padded" or self._used + len(ids) > self.seq_len:
            out = self._flush()
        self._row.append((ids, ctx))
        self._used += len(ids)
        return out

    def finish(self) -> list:
        return self._flush()

    def _flush(self) -> list:
        if not self._row:
            return []
        L = self.seq_len
        x = np.full(L, self.pad_id, dtype=self.dtype)
        ctx = np.zeros(L, dtype=np.uint8)
        valid = np.zeros(L, dtype=np.uint8)
        pos = 0
        for ids, c in self._row:
            x[pos:pos + len(ids)] = ids
            if isinstance(c, int):
                ctx[pos:pos + c] = 1
            else:
                ctx[pos:pos + len(ids)] = c[: len(ids)]
            valid[pos:pos + len(ids)] = 1
            pos += len(ids)
        self._row, self._used = [], 0
        self.rows += 1
        self.answer_tokens += int((valid.astype(bool) & ~ctx.astype(bool)).sum())
        self.context_tokens += int(ctx.sum())
        self.padding_tokens += int((valid == 0).sum())
        return [(x, ctx, valid)]

    def counts(self) -> dict:
        return {**self._counts, "rows": self.rows, "answer_tokens": self.answer_tokens,
                "context_tokens": self.context_tokens, "padding_tokens": self.padding_tokens}


def build_rows(encoded, seq_len: int, packing: str, overlong: str, pad_id: int, dtype):
    """All rows of `encoded` at once: (ids [n, L], context mask [n, L], valid mask [n, L], counts)."""
    b = RowBuilder(seq_len, packing, overlong, pad_id, dtype)
    rows = [r for e in encoded for r in b.add(e)] + b.finish()
    stack = lambda k, t: np.stack([r[k] for r in rows]) if rows else np.zeros((0, seq_len), dtype=t)  # noqa: E731
    return stack(0, dtype), stack(1, np.uint8), stack(2, np.uint8), b.counts()


class ExampleShardWriter:
    """Writes rows of one split as ``SPLIT/shard-NNNNNN.tar`` of `spp` rows each; `entries` are the
    manifest's shard entries (the split's directory is emptied first). Rows are copied into one
    preallocated shard buffer as they come, so memory is one shard's whatever the input's size."""

    def __init__(self, out: str, split: str, spp: int):
        self.out, self.split, self.spp = out, split, spp
        self.entries, self._buf, self._n, self._first = [], None, 0, 0
        d = os.path.join(out, split)
        if os.path.isdir(d):
            for f in os.listdir(d):
                os.remove(os.path.join(d, f))

    def add(self, rows) -> None:
        for row in rows:
            if self._buf is None:
                self._buf = [np.empty((self.spp, len(a)), dtype=a.dtype) for a in row]
            for buf, a in zip(self._buf, row):
                buf[self._n] = a
            self._n += 1
            if self._n == self.spp:
                self._write()

    def finish(self) -> list:
        if self._n:
            self._write()
        return self.entries

    def _write(self) -> None:
        x, ctx, valid = (b[: self._n] for b in self._buf)
        os.makedirs(os.path.join(self.out, self.split), exist_ok=True)
        data = encode_shard(x, self._first, {"context_mask": ctx, "valid_mask": valid})
        rel = f"{self.split}/shard-{len(self.entries):06d}.tar"
        atomic_write_bytes(os.path.join(self.out, rel), data)
        self.entries.append({"path": rel, "num_samples": len(x), "first_sample": self._first, "bytes": len(data),
                             "sha256": sha256_bytes(data)})
        self._first += len(x)
        self._n = 0


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
    if c.get("skipped_special_text"):
        parts.append(f"{c['skipped_special_text']} skipped: a message holds a special token's text, which the chat "
                     "template's tokenization would turn into that token")
    if c.get("skipped_template_prefix"):
        parts.append(f"{c['skipped_template_prefix']} skipped: the template's context rendering is not a prefix of "
                     "the whole conversation's (mark the assistant's text with {% generation %} tags)")
    return "; ".join(parts)
