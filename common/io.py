"""Atomic file writes: a reader sees the old file or the new one, never a part of either.

The bytes go to a temporary file in the same directory, are flushed and fsynced, the temporary file
is renamed over the target (`os.replace`, atomic on POSIX), and the directory is fsynced so the rename
itself survives a power loss. A failure (disk full, a kill) removes the temporary file and leaves the
old target untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Callable, Iterator

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "atomic_open", "atomic_save", "fsync_dir"]


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (its entries: a rename or a new file in it). No-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """`with atomic_open(p) as f: f.write(...)`: `p` appears complete when the block ends, not before."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode, encoding=None if mode == "wb" else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike, obj, *, indent: int | None = 1, **kw) -> None:
    with atomic_open(path, "w") as f:
        json.dump(obj, f, indent=indent, **kw)
        f.write("\n")


def atomic_save(path: str | os.PathLike, write: Callable[[IO], None]) -> None:
    """Atomically write a binary file through `write(f)` (e.g. `lambda f: torch.save(obj, f)`)."""
    with atomic_open(path, "wb") as f:
        write(f)
