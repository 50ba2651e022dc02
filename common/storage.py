"""Where outputs go: checked before any work, and a failed write (a full disk) as one line.

- `check_output_dir(path, option)` / `check_output_file(path, option)`: refuse, before a command does
  any work, an output of the wrong kind (a file where a directory belongs, a directory where a file
  belongs, a looping or dangling symbolic link) or one on a read-only file system or without write
  permission, naming the option and the path.
- `write_failure(error, path, needed)`: the one-line `StorageError` for an exception a write raised
  (a full disk or quota: the path, the free space and the space the write needs; a read-only file
  system; no permission), or None when the exception is not a failed write. torch's zip writer
  (`torch.save`, DeepSpeed's checkpoint files) raises `RuntimeError: [enforce fail at
  inline_container.cc]` instead of OSError when a write comes up short; that is recognised by its
  message, and the free space then tells a full disk from another I/O failure.
- `free_bytes(path)`, `tree_bytes(path)`, `human_bytes(n)`: what a message needs.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from .errors import StorageError

__all__ = ["check_output_dir", "check_output_file", "free_bytes", "tree_bytes", "human_bytes", "is_write_failure",
           "write_failure", "disk_full_text"]

FULL_ERRNOS = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_TORCH_WRITER = ("inline_container.cc", "PytorchStreamWriter")
_FULL_TEXT = ("No space left on device", "Disk quota exceeded")  # strerror texts, in other libraries' errors
_SLACK = 1 << 20  # a torch write that failed with less than this free failed for lack of space


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _existing(path: Path) -> Path:
    """`path`, or the nearest of its parents that exists (where a new file or directory would go)."""
    path = Path(os.path.abspath(path))
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged writer can still use on the file system of `path` (or of its nearest
    existing parent); None where that cannot be asked."""
    try:
        st = os.statvfs(_existing(Path(path)))
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def tree_bytes(path: str | os.PathLike) -> int:
    """Total size of the files under `path` (symbolic links are not followed)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def _read_only(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


def _check_parent(option: str, target: Path, what: str) -> None:
    """The nearest existing parent of `target` must be a writable directory."""
    base = _existing(target.parent)
    if not base.is_dir():
        raise StorageError(f"{option} {target}: {base} is a file, so the {what} cannot be created under it")
    _check_writable(option, target, base)


def _check_writable(option: str, target: Path, d: Path) -> None:
    if _read_only(d):
        raise StorageError(f"{option} {target}: {d} is on a read-only file system; choose a writable location")
    if not os.access(d, os.W_OK | os.X_OK):
        raise StorageError(f"{option} {target}: no permission to write in {d}")
    try:  # what a pseudo file system (/proc, /sys) or a root-only mount refuses only when asked
        os.rmdir(tempfile.mkdtemp(prefix=".setdlm-probe-", dir=d))
    except OSError as e:
        if e.errno in FULL_ERRNOS:  # a full disk: the space checks say so, with the sizes
            return
        raise StorageError(f"{option} {target}: nothing can be created in {d} ({e.strerror or type(e).__name__}); "
                           f"choose another location") from None


def _check_link(option: str, p: Path) -> None:
    if p.is_symlink() and not p.exists():
        raise StorageError(f"{option} {p}: a symbolic link that loops or points nowhere ({os.readlink(p)}); remove it "
                           "or choose another path")


def check_output_dir(path: str | os.PathLike, option: str) -> Path:
    """Refuse, naming `option`, an output directory that cannot be used: an existing file, a looping
    symbolic link, a read-only or unwritable location. Creates nothing."""
    p = Path(path)
    _check_link(option, p)
    if p.exists():
        if not p.is_dir():
            raise StorageError(f"{option} {p}: is a file, not a directory; choose a directory")
        _check_writable(option, p, p)
    else:
        _check_parent(option, p, "directory")
    return p


def check_output_file(path: str | os.PathLike, option: str) -> Path:
    """Refuse, naming `option`, an output file that cannot be written: an existing directory, a
    looping symbolic link, a read-only or unwritable location. Creates nothing."""
    p = Path(path)
    _check_link(option, p)
    if p.is_dir():
        raise StorageError(f"{option} {p}: is a directory, not a file; name a file")
    _check_parent(option, p, "file")
    if p.exists() and not os.access(p, os.W_OK):
        raise StorageError(f"{option} {p}: no permission to write it")
    return p


def is_write_failure(e: BaseException) -> bool:
    """An OSError, torch's zip writer failing (a short write: it raises RuntimeError, not OSError), or
    a library's own error for a full disk (safetensors: `SafetensorError: ... (os error 28)`)."""
    if isinstance(e, OSError):
        return True
    text = str(e)
    return (isinstance(e, RuntimeError) and any(s in text for s in _TORCH_WRITER)) or any(s in text for s in _FULL_TEXT)


def disk_full_text(path: str | os.PathLike, needed: int | None, what: str = "the write", free: int | None = None) -> str:
    """`PATH: No space left on device (the disk is full: F free; WHAT needs about N)`; `free` (bytes)
    when the caller measured it, else asked now."""
    free = free_bytes(path) if free is None else free
    have = f"{human_bytes(free)} free" if free is not None else "no space left"
    need = f"; {what} needs about {human_bytes(needed)}" if needed else ""
    return f"{path}: No space left on device (the disk is full: {have}{need})"


def write_failure(e: BaseException, path: str | os.PathLike, needed: int | None = None,
                  what: str = "the write", free: int | None = None) -> StorageError | None:
    """The StorageError a failed write of `path` (about `needed` bytes) is reported as, or None when
    `e` is not a failed write. The message names the path and, for a full disk, the space."""
    if isinstance(e, StorageError):
        return e
    if not is_write_failure(e):
        return None
    where = getattr(e, "filename", None) or path
    code = getattr(e, "errno", None)
    if code in FULL_ERRNOS or (not isinstance(e, OSError) and any(s in str(e) for s in _FULL_TEXT)):
        return StorageError(disk_full_text(where, needed, what, free))
    if code == errno.EROFS:
        return StorageError(f"{where}: read-only file system")
    if code in (errno.EACCES, errno.EPERM):
        return StorageError(f"{where}: permission denied")
    if isinstance(e, OSError):
        return None  # another I/O failure: the caller decides (it is not a user's mistake)
    if free is None:
        free = free_bytes(path)  # torch's writer does not say why; the free space does
    if free is not None and free < max(needed or 0, _SLACK):
        return StorageError(disk_full_text(path, needed, what, free))
    return StorageError(f"{path}: writing failed ({' '.join(str(e).split())[:120]})")
