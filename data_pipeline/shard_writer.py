"""Shard files of one split of `setdlm data prepare`: `SplitWriter` packs framed documents into rows
and writes webdataset shards as they fill, `valid_prefix` keeps the shards of an interrupted run
whose bytes still match (resumption)."""

from __future__ import annotations

import os
from collections import deque

import numpy as np

from common.errors import StorageError
from common.io import atomic_write_bytes

from .packing import StreamPacker
from .shards import encode_shard, sha256_bytes

__all__ = ["SplitWriter", "valid_prefix"]


class SplitWriter:
    """Packs one split's framed documents into rows and writes them as shards, recording after each
    shard its entry and the document cursor where the next shard starts (`save_progress`)."""

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
        try:
            atomic_write_bytes(path, data)
        except StorageError as e:  # a full disk: the shards before this one and their progress stay
            raise StorageError(f"{e}; the {len(self.entries)} {self.split} shards written before it are kept: free "
                               "space and rerun the same command to resume") from None
        self.entries.append({"path": rel, "num_samples": int(len(rows)), "first_sample": int(first),
                             "bytes": len(data), "sha256": sha256_bytes(data), "next": cursor})
        self.save_progress()


def valid_prefix(out: str, entries: list, log) -> list:
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
