"""Sources of packed sequences: in-memory builtin corpora (here) and prepared shards (`shards.py`).

A source exposes, per split, a list of *units* (a shard, or one sequence) with sample counts and a
`read_unit` that returns a unit's rows ``[n, seq_len]`` or raises `ShardError`.
"""
from __future__ import annotations

import functools
import hashlib

import numpy as np

from common.errors import Error
from common.schema import ConfigError

from .corpus import builtin_text
from .packing import frame_documents, token_dtype, wrap

SPLITS = ("train", "val")


class ShardError(RuntimeError, Error):
    """A shard cannot be read or does not match its manifest entry (message names the shard).

    Also a ValueError (bad input data): every command prints it as one line, as it does a bad recipe."""


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split: {split!r} is not a split; valid: {', '.join(SPLITS)}")
    return split


class BuiltinSource:
    """A builtin corpus tokenized in memory: documents framed, wrapped into rows, the last
    `val_fraction` of rows (at least one when val_fraction > 0) held out as the val split."""

    def __init__(self, corpus: str, tokenizer, seq_len: int, packing: str, val_fraction: float):
        rows, info = _tokenize_builtin(corpus, tokenizer, seq_len, packing)
        n = len(rows)
        n_val = int(n * val_fraction)
        if val_fraction > 0 and n_val == 0:
            n_val = 1
        if n - n_val < 1:
            raise ConfigError(f"data.source: builtin:{corpus} gives only {n} sequences of "
                              f"{seq_len} tokens; lower data.seq_len or data.val_fraction")
        self._rows = {"train": rows[: n - n_val], "val": rows[n - n_val:]}
        self.seq_len = seq_len
        self.packing = packing
        self.description = f"builtin:{corpus} ({info['documents']} documents, {n} sequences)"
        h = hashlib.sha256(f"builtin:{corpus}|{tokenizer.sha256}|{seq_len}|{packing}|{n_val}|".encode())
        h.update(np.ascontiguousarray(rows).tobytes())  # the text can change with the Python version
        self.fingerprint = h.hexdigest()
        self.tokenizer_sha256 = tokenizer.sha256

    def counts(self, split: str) -> np.ndarray:
        return np.ones(len(self._rows[check_split(split)]), dtype=np.int64)

    def first_ids(self, split: str) -> np.ndarray:
        return np.arange(len(self._rows[check_split(split)]), dtype=np.int64)

    def unit_name(self, split: str, u: int) -> str:
        return f"{split} sequence {u}"

    def read_unit(self, split: str, u: int) -> np.ndarray:
        return self._rows[split][u:u + 1]


@functools.lru_cache(maxsize=8)
def _tokenize_cached(corpus: str, tok_sha: str, seq_len: int, packing: str, _tok_ref):
    tok = _tok_ref.obj
    docs = builtin_text(corpus)
    flat, lengths = frame_documents(tok.encode_batch(docs), packing, tok.bos_id, tok.eos_id,
                                    token_dtype(tok.vocab_size))
    rows, _ = wrap(flat, seq_len)
    rows.setflags(write=False)
    return rows, {"documents": len(docs), "tokens": int(lengths.sum())}


class _Ref:
    """Hash/eq by tokenizer hash only, so the lru_cache key stays small and stable."""

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return hash(self.obj.sha256)

    def __eq__(self, other):
        return isinstance(other, _Ref) and other.obj.sha256 == self.obj.sha256


def _tokenize_builtin(corpus, tokenizer, seq_len, packing):
    return _tokenize_cached(corpus, tokenizer.sha256, seq_len, packing, _Ref(tokenizer))
