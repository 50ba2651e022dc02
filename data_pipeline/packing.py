"""Packing conventions: how tokenized documents become fixed-length sequences."""
from __future__ import annotations

import numpy as np

from common.schema import ConfigError

from .config import PACKINGS


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id (uint16 for GPT-2 and BERT)."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def framing(packing: str, bos_id, eos_id) -> tuple[list[int], list[int]]:
    """Tokens put before and after every document by `packing`."""
    if packing not in PACKINGS:
        raise ConfigError(f"packing: unknown {packing!r}; valid: {', '.join(PACKINGS)}")
    if eos_id is None:
        raise ConfigError(f"packing {packing!r} needs a tokenizer with an EOS (or [SEP]) token")
    if packing == "wrapped":
        return [], [eos_id]
    if bos_id is None:
        raise ConfigError(f"packing {packing!r} needs a tokenizer with a BOS (or [CLS]) token")
    return [bos_id], [eos_id]


def frame_documents(docs_ids, packing: str, bos_id, eos_id, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate framed documents: (flat token array, per-document framed lengths).

    Documents without tokens (empty text) are left out entirely (framed length 0)."""
    pre, post = framing(packing, bos_id, eos_id)
    extra = len(pre) + len(post)
    lengths = np.fromiter((len(d) + extra if len(d) else 0 for d in docs_ids), dtype=np.int64,
                          count=len(docs_ids))
    flat = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for d in docs_ids:
        if not len(d):
            continue
        if pre:
            flat[pos:pos + len(pre)] = pre
            pos += len(pre)
        flat[pos:pos + len(d)] = d
        pos += len(d)
        if post:
            flat[pos:pos + len(post)] = post
            pos += len(post)
    return flat, lengths


def wrap(flat: np.ndarray, seq_len: int) -> tuple[np.ndarray, int]:
    """Cut a token stream into rows of `seq_len`; returns (rows, dropped tail length)."""
    n = len(flat) // seq_len
    return flat[: n * seq_len].reshape(n, seq_len), len(flat) - n * seq_len


class StreamPacker:
    """Incremental `wrap`: feed framed token arrays, take full rows out; the tail carries over."""

    def __init__(self, seq_len: int, dtype):
        self.seq_len = seq_len
        self.dtype = np.dtype(dtype)
        self._parts: list[np.ndarray] = []
        self._buffered = 0

    def add(self, tokens: np.ndarray) -> None:
        if len(tokens):
            self._parts.append(np.asarray(tokens, dtype=self.dtype))
            self._buffered += len(tokens)

    @property
    def buffered(self) -> int:
        return self._buffered

    def take(self, max_rows: int | None = None) -> np.ndarray:
        """Up to `max_rows` full rows (all full rows when None) as an array [k, seq_len]."""
        k = self._buffered // self.seq_len
        if max_rows is not None:
            k = min(k, max_rows)
        if k == 0:
            return np.empty((0, self.seq_len), dtype=self.dtype)
        flat = np.concatenate(self._parts) if len(self._parts) > 1 else self._parts[0]
        rows = flat[: k * self.seq_len].reshape(k, self.seq_len)
        rest = flat[k * self.seq_len:]
        self._parts = [rest] if len(rest) else []
        self._buffered = len(rest)
        return rows
