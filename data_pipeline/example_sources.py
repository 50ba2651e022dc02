"""Where `setdlm data prepare --format prompt_answer|prompt_completion|chat|marker` reads examples
from, one at a time (never all in memory): a JSONL file (common/jsonl.py), a Parquet file, a
directory written by `datasets`' save_to_disk, or a Hugging Face dataset name (hf_inputs.py).

`open_examples` makes one pass over its input first: it counts the examples (``--val-docs`` holds
out the last N) and checks each one that will be used (`check`), so a bad file is refused before
any work, naming the file and line (or row). The examples are read again as they are tokenized.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from common.errors import Error
from common.jsonl import iter_jsonl

from .hf_inputs import is_saved_dataset, load_hub, load_saved, looks_like_hub_name

__all__ = ["ExampleError", "Examples", "open_examples"]

BATCH = 256  # rows per Arrow read


class ExampleError(Error):
    """An input file or option the prompt/answer preparation cannot use (message names it)."""


class Examples:
    """Examples ``[start, stop)`` of one input; `rows()` reads them in order. For ``--format marker``
    a row is its token ids (an array or a list), otherwise a dict of fields."""

    def __init__(self, read, start: int, stop: int, description: str):
        self._read, self.start, self.stop, self.description = read, start, stop, description

    def __len__(self) -> int:
        return self.stop - self.start

    def rows(self):
        return self._read(self.start, self.stop)

    def select(self, start: int, stop: int) -> "Examples":
        return Examples(self._read, self.start + start, self.start + stop, self.description)


def open_examples(spec: str, what: str, *, field: str | None = None, split: str | None = None,
                  name: str | None = None, check=None, limit: int | None = None) -> Examples:
    """The examples of `spec`. `field`: yield only that field of each row (marker: ``input_ids``);
    `check(row)`: what is wrong with a row, or None (run on the first `limit` rows, all without)."""
    path = os.path.expanduser(spec)
    if is_saved_dataset(path):
        return _dataset(load_saved(path, split, what, ExampleError), spec, what, field, check, limit)
    if os.path.isdir(path):
        raise ExampleError(f"{what}: {spec!r} is a directory but not one saved with datasets' save_to_disk "
                           "(give a JSONL or Parquet file, a save_to_disk directory or a hub dataset name)")
    if path.endswith(".parquet") and os.path.isfile(path):
        import datasets

        try:
            ds = datasets.load_dataset("parquet", data_files=[path], split="train")
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types
            raise ExampleError(f"{what}: {spec} cannot be read as Parquet ({type(e).__name__}: {e})") from None
        return _dataset(ds, spec, what, field, check, limit)
    if looks_like_hub_name(spec):
        return _dataset(load_hub(spec, name, split, what, ExampleError), spec, what, field, check, limit)
    return _jsonl(path, what, field, check, limit)


def _jsonl(path: str, what: str, field: str | None, check, limit: int | None) -> Examples:
    n = 0

    def counted(row):
        nonlocal n
        n += 1
        return check(row) if check is not None and (limit is None or n <= limit) else None

    for _ in iter_jsonl(path, what, error=ExampleError, check=counted):
        pass
    if n == 0:
        raise ExampleError(f"{what}: {path} holds no examples")

    def read(start, stop):
        rows = itertools.islice(iter_jsonl(path, what, error=ExampleError), start, stop)
        return (r[field] for r in rows) if field else rows

    return Examples(read, 0, n, str(Path(path)))


def _dataset(ds, spec: str, what: str, field: str | None, check, limit: int | None) -> Examples:
    if len(ds) == 0:
        raise ExampleError(f"{what}: {spec} holds no examples")
    if field is not None and field not in ds.column_names:
        raise ExampleError(f"{what}: {spec} has no {field} column (columns: {ds.column_names})")

    def read(start, stop):
        part = ds.select(range(start, stop)) if (start, stop) != (0, len(ds)) else ds
        if field is not None:  # token ids as arrays, no Python int per token
            for batch in part.with_format("numpy", columns=[field]).iter(batch_size=BATCH):
                yield from batch[field]
            return
        for batch in part.iter(batch_size=BATCH):
            keys = list(batch)
            for i in range(len(batch[keys[0]])):
                yield {k: batch[k][i] for k in keys}

    if check is not None:
        for i, row in enumerate(read(0, min(len(ds), limit or len(ds)))):
            problem = check(row)
            if problem:
                raise ExampleError(f"{what}: {spec} row {i}: {problem}")
    return Examples(read, 0, len(ds), spec)
