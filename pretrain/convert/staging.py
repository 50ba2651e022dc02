"""Writing a conversion's output directory: staged in a temporary sibling and renamed at the end, a
full disk reported as one line (`staging`), and the small helpers the writers share."""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from common.errors import StorageError
from common.io import HOST, process_alive
from common.storage import check_output_dir, write_failure

from model.convert.errors import ConvertError

__all__ = ["staging", "tensor_bytes", "write_json"]


def tensor_bytes(tensors: dict) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values() if torch.is_tensor(t))


@contextmanager
def staging(out: Path, overwrite: bool, what: str, need: int | None = None):
    """Write into a temporary sibling and rename it to `out` at the end (never a half-written `out`).
    A failed write (a full disk: `need` bytes is about what it takes) removes the partial directory,
    keeps an existing `out` and is one StorageError naming the path and the space."""
    out = Path(out)
    check_output_dir(out, "--out")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ConvertError(f"--out {out}: already exists and is not empty; choose another {what} or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*out.parent.glob(f".{out.name}.tmp-{HOST}-*"), *out.parent.glob(f".{out.name}.old-{HOST}-*")]:
        pid = stale.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not process_alive(int(pid)):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{HOST}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        failure = write_failure(e, out, need) if isinstance(e, Exception) else None
        if failure is not None:
            kept = f"; {out} is kept as it was" if out.exists() else ""
            raise StorageError(f"{failure}; the partial {what} was removed{kept}") from None
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{HOST}-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


