"""The files of an evaluation's output directory: atomic JSON, and the per-rank append-only records.

Each rank appends the records of every unit it finishes to its own JSONL file
(``OUT/records.rankNNNNN.jsonl``), in one write that is flushed and fsynced, so a killed job loses at
most the unit in flight; a reader takes complete lines only. A write that fails (a full disk) is cut
off again and reported as one line naming the file and the bytes it needed (common/io.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from common.io import AppendFile, atomic_write_text


def atomic_write(path: Path, text: str) -> None:
    atomic_write_text(path, text)  # common/io.py: temp file, fsync, rename, fsync of the directory


def write_json(path: Path, obj) -> None:
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=False, default=str) + "\n")


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def records_path(out: Path, rank: int) -> Path:
    return Path(out) / f"records.rank{rank:05d}.jsonl"


class RecordReader:
    """Reads every rank's records file incrementally (only complete lines; a line cut by a kill is
    ignored until it is completed or truncated by its owner)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.offsets: dict[Path, int] = {}
        self.records: dict[str, dict] = {}

    def refresh(self) -> dict[str, dict]:
        for path in sorted(self.out.glob("records.rank*.jsonl")):
            start = self.offsets.get(path, 0)
            size = path.stat().st_size
            if size < start:  # truncated by its owner after a kill: read again
                start = 0
            if size == start:
                continue
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(size - start)
            end = data.rfind(b"\n") + 1
            for line in data[:end].splitlines():
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a torn line followed by later writes (kill, then an older writer)
                key = rec.get("key")
                if key is not None and key not in self.records:
                    self.records[key] = rec
            self.offsets[path] = start + end
        return self.records


class RecordWriter:
    """Append-only records file of one rank; cuts a torn last line left by a kill before appending."""

    def __init__(self, out: Path, rank: int):
        self.path = records_path(out, rank)
        if self.path.exists():
            data = self.path.read_bytes()
            end = data.rfind(b"\n") + 1
            if end != len(data):
                with open(self.path, "r+b") as f:
                    f.truncate(end)
        self.f = AppendFile(self.path)

    def append(self, records: list[dict]) -> None:
        self.f.append("".join(json.dumps(r, default=json_default) + "\n" for r in records))

    def close(self) -> None:
        self.f.close()


def json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "item"):
        return o.item()
    return str(o)


