"""Real storage faults for tests: a small tmpfs (a disk that fills up) and a read-only bind mount.

Both need root and mount permission; `Mounts.unavailable()` says why they cannot be made (tests skip
with that reason). Every mount is undone by `Mounts.close()` (the fixtures call it on success and
failure alike); a busy mount is detached lazily so a failing test never leaves one behind.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

_REASON: list[str | None] = []


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)


class Mounts:
    def __init__(self, base: Path):
        self.base = Path(base)
        self.points: list[Path] = []

    @staticmethod
    def unavailable(probe_dir: Path) -> str | None:
        """Why tmpfs / bind mounts cannot be made here (None: they can). Probed once per process."""
        if _REASON:
            return _REASON[0]
        reason = None
        if os.geteuid() != 0 or not shutil.which("mount"):
            reason = "needs root and mount(8) to create a tmpfs and a read-only bind mount"
        else:
            d = Path(probe_dir) / "mount-probe"
            d.mkdir(parents=True, exist_ok=True)
            r = _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d))
            if r.returncode != 0:
                reason = f"cannot mount a tmpfs here ({r.stderr.strip()[:120]})"
            else:
                _run("umount", str(d))
        _REASON.append(reason)
        return reason

    def tmpfs(self, name: str, size: str) -> Path:
        """A tmpfs of `size` (mount's syntax: 512k, 40m) at BASE/name."""
        d = self.base / name
        d.mkdir(parents=True, exist_ok=True)
        r = _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d))
        assert r.returncode == 0, r.stderr
        self.points.append(d)
        return d

    def full(self, name: str, size: str = "256k") -> Path:
        """A tmpfs that is already full (a filler file takes every block)."""
        d = self.tmpfs(name, size)
        fill(d)
        return d

    def read_only(self, name: str, content: Path | None = None) -> Path:
        """A read-only bind mount at BASE/name of a directory holding a copy of `content` (if given)."""
        src = self.base / f"{name}.src"
        if content is not None:
            shutil.copytree(content, src, symlinks=True)
        src.mkdir(parents=True, exist_ok=True)
        d = self.base / name
        d.mkdir(parents=True, exist_ok=True)
        r = _run("mount", "--bind", "-o", "ro", str(src), str(d))
        if r.returncode == 0 and os.access(d, os.W_OK) and not (os.statvfs(d).f_flag & os.ST_RDONLY):
            _run("mount", "-o", "remount,ro,bind", str(d))  # older mount(8): bind first, then remount read-only
        assert r.returncode == 0, r.stderr
        self.points.append(d)
        return d

    def resize(self, d: Path, size: str) -> None:
        r = _run("mount", "-o", f"remount,size={size}", str(d))
        assert r.returncode == 0, r.stderr

    def close(self) -> None:
        for d in reversed(self.points):
            if _run("umount", str(d)).returncode != 0:
                _run("umount", "-l", str(d))
        self.points.clear()


def fill(d: Path) -> None:
    """Take every free block of the file system of `d` with a file `d/filler`."""
    with open(d / "filler", "ab", buffering=0) as f:
        block = b"\0" * 4096
        try:
            while True:
                f.write(block)
        except OSError:
            pass
        for n in (1024, 64, 1):  # the last partial block
            try:
                while True:
                    f.write(b"\0" * n)
            except OSError:
                pass
