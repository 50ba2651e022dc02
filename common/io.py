"""Atomic file writes: a reader sees the old file or the new one, never a part of either.

The bytes go to a temporary file in the same directory, are flushed and fsynced, the temporary file
is renamed over the target (`os.replace`, atomic on POSIX), and the directory is fsynced so the rename
itself survives a power loss. A failure removes the temporary file and leaves the old target
untouched; a full disk, a read-only file system or a missing permission is a `StorageError` naming
the path (and the space the write needs). The temporary file of a process that was killed is named
`.NAME.HOST.PID.RANDOM.tmp`, so `remove_temps` can clear it at the next start without touching one a
live writer holds.

`AppendFile` appends records to a log (metrics.jsonl, eval records, sample outputs): each append
is written, flushed and fsynced whole, and one that fails (a full disk) is cut off again, so the
file keeps its complete lines.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import tempfile
import time
from pathlib import Path
from typing import IO, Callable, Iterator

from .storage import write_failure

__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_write_json", "atomic_open", "atomic_save", "fsync_dir",
           "remove_temps", "process_alive", "HOST", "AppendFile"]

HOST = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"
# .NAME.HOST.PID.RANDOM.tmp (this module's) or .NAME.RANDOM.tmp (tempfile's default, older setdlm)
_TEMP = re.compile(r"^\.(?P<name>.+?)\.(?:(?P<host>[A-Za-z0-9-]+)\.(?P<pid>\d+)\.)?[A-Za-z0-9_]{8}\.tmp$")
FOREIGN_TEMP_AGE_S = 3600.0  # a temporary file of another host (or an older setdlm) is stale after this


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host is running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, under another user
        return True
    return True


def remove_temps(directory: str | os.PathLike, *, all_of_them: bool = False) -> list[Path]:
    """Remove the temporary files that killed writers left in `directory` (not recursive): those of a
    process of this host that is no longer running, and those of other hosts (or older setdlm
    versions) older than FOREIGN_TEMP_AGE_S; with `all_of_them`, every one (the caller knows no writer
    is running: a training job at start-up). Returns the files removed."""
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    now = time.time()
    for e in entries:
        m = _TEMP.match(e.name)
        if not m or not e.is_file(follow_symlinks=False):
            continue
        if not all_of_them:
            if m["host"] == HOST:
                if process_alive(int(m["pid"])):
                    continue
            else:
                try:
                    if now - e.stat(follow_symlinks=False).st_mtime < FOREIGN_TEMP_AGE_S:
                        continue
                except OSError:
                    continue
        with contextlib.suppress(OSError):
            os.unlink(e.path)
            removed.append(Path(e.path))
    return removed


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
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8", *,
                size: int | None = None) -> Iterator[IO]:
    """`with atomic_open(p) as f: f.write(...)`: `p` appears complete when the block ends, not before.
    `size` (bytes, when known) is the space a full-disk message names; else what was written."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    tmp = None
    written = 0
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{HOST}.{os.getpid()}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, mode, encoding=None if mode == "wb" else encoding) as f:
            try:
                yield f
                f.flush()
                os.fsync(f.fileno())
            finally:
                with contextlib.suppress(OSError, ValueError):
                    written = os.fstat(f.fileno()).st_size
        os.replace(tmp, path)
    except BaseException as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        failure = write_failure(e, path, size or written or None) if isinstance(e, Exception) else None
        if failure is not None and failure is not e:
            raise failure from None
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb", size=len(data)) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w", size=len(text.encode("utf-8", "replace"))) as f:
        f.write(text)


def atomic_write_json(path: str | os.PathLike, obj, *, indent: int | None = 1, **kw) -> None:
    with atomic_open(path, "w") as f:
        json.dump(obj, f, indent=indent, **kw)
        f.write("\n")


def atomic_save(path: str | os.PathLike, write: Callable[[IO], None], *, size: int | None = None) -> None:
    """Atomically write a binary file through `write(f)` (e.g. `lambda f: torch.save(obj, f)`); `size`:
    about how many bytes it takes (named when the disk is full)."""
    with atomic_open(path, "wb", size=size) as f:
        write(f)


class AppendFile:
    """An append-only log file: `append(text)` writes, flushes and fsyncs it whole; a failed append (a
    full disk) is cut off again, leaving the complete lines before it, and raises the StorageError
    naming the file and the bytes the append needed."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise (write_failure(e, self.path) or e) from None

    def append(self, text: str | bytes) -> None:
        data = text.encode("utf-8") if isinstance(text, str) else text
        start = os.fstat(self.fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            os.fsync(self.fd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, start)
            raise (write_failure(e, self.path, len(data)) or e) from None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "AppendFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
