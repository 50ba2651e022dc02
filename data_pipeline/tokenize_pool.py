"""The tokenization workers of `setdlm data prepare`: a process pool (fork on Linux) whose workers
each load the prepared tokenizer once and tokenize + frame documents one core each (a long document
in bounded memory, long_text.py), and the ordered stream of their results with a bounded number of
tasks in flight."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections import deque

from .long_text import encode_array
from .packing import frame_documents, token_dtype
from .tokenizers import load_tokenizer

__all__ = ["init_pool_worker", "init_worker", "mp_context", "tokenize", "tokenized"]

_WORKER = {}


def init_pool_worker(tok_dir: str, packing: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    init_worker(tok_dir, packing)


def init_worker(tok_dir: str, packing: str) -> None:
    tok = load_tokenizer(tok_dir)
    _WORKER.update(tok=tok, packing=packing, dtype=token_dtype(tok.vocab_size))


def mp_context():
    """fork on Linux: workers start in milliseconds instead of re-importing the program (the children
    only tokenize; `tokenizers` is fork-aware); spawn elsewhere."""
    return mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def tokenize(texts: list[str]):
    w = _WORKER
    backend, dtype = w["tok"].backend, w["dtype"]  # one document at a time: one core per process (no Rust pool)
    docs = [encode_array(backend, t, dtype) for t in texts]  # a long document in pieces (long_text.py)
    return frame_documents(docs, w["packing"], w["tok"].bos_id, w["tok"].eos_id, dtype)


def tokenized(src, start: int, pool, num_proc: int, docs_per_task: int):
    """(first doc, flat tokens, framed lengths) per task, in order, with a bounded number in flight."""
    ranges = ((s, min(s + docs_per_task, len(src))) for s in range(start, len(src), docs_per_task))
    if pool is None:
        for s, e in ranges:
            yield (s, *tokenize(src.texts(s, e)))
        return
    inflight = deque()
    for s, e in ranges:
        inflight.append((s, pool.apply_async(tokenize, (src.texts(s, e),))))
        if len(inflight) >= 2 * num_proc:
            s0, r = inflight.popleft()
            yield (s0, *r.get())
    while inflight:
        s0, r = inflight.popleft()
        yield (s0, *r.get())
