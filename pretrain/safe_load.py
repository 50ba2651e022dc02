"""Reading checkpoint files without running code from them.

Every checkpoint file setdlm reads as a whole (format-1 DeepSpeed model and optimizer shards, EMA and
per-rank extra files, consolidated.pt, imported reference checkpoints) goes through `load()`: `torch.load` with
`weights_only=True`, which rebuilds only tensors, containers and primitive values, plus the few data
types allow-listed in `SAFE_GLOBALS` (DeepSpeed's loss-scaler and fragment records, the ZeRO stage
enum, numpy arrays of the random-number states saved by older setdlm versions). A file that needs
anything else (a planted pickle payload: a `__reduce__` that calls a function) is refused before
any of it runs, and a damaged file (empty, truncated, random bytes) is reported, both as a
`CheckpointError` naming the file.

DeepSpeed calls `torch.load(..., weights_only=False)` itself, in its checkpoint engine and in
`zero_to_fp32`; `restricted_torch_load()` is a context manager that routes those calls through
`load()` for the duration of a DeepSpeed checkpoint read (pretrain/checkpoint/resume.py, shards.py).
A format-2 checkpoint's tensors are read by torch.distributed.checkpoint with `weights_only=True`, and
its index through an allow-list of DCP's own records (pretrain/checkpoint/distcp.py).
"""

from __future__ import annotations

from common.errors import Error

import contextlib
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path

import torch


class CheckpointError(Error):
    """A checkpoint (or a file in it) that cannot be used: the message names the file and why."""


def _safe_globals() -> list:
    out: list = []
    try:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        out += [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
    except ImportError:  # DeepSpeed absent (inference-only install): its files cannot be present either
        pass
    try:  # numpy RNG state of checkpoints written before the RNG state was stored as tensors
        import numpy as np

        multiarray = getattr(np, "_core", None) or np.core
        out += [multiarray.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    except (ImportError, AttributeError):
        pass
    return out


SAFE_GLOBALS = _safe_globals()
_REAL_LOAD = torch.load
_REFUSED = re.compile(r"Unsupported global: GLOBAL (\S+)|Can only build .*? but got (<[^>]*>)|"
                      r"(Unsupported class \S+)", re.S)


def _describe(path) -> str:
    return str(path) if isinstance(path, (str, os.PathLike)) else "checkpoint stream"


def load(path, map_location="cpu", **kw):
    """`torch.load(path, weights_only=True)` with setdlm's allow-list; CheckpointError on a refused
    or damaged file (the cause is named in one line). `mmap=True` (a file path): the tensors are mapped
    from the file, not read into memory (whole-model files: consolidated.pt, format-1 model files)."""
    kw.pop("weights_only", None)
    if kw.get("mmap") and not isinstance(path, (str, os.PathLike)):
        kw.pop("mmap")
    where = _describe(path)
    if isinstance(path, (str, os.PathLike)):
        p = Path(path)
        if not p.is_file():
            raise CheckpointError(f"{where}: missing (the checkpoint is incomplete: a shard or file was not copied)")
        if p.stat().st_size == 0:
            raise CheckpointError(f"{where}: empty file (0 bytes): the checkpoint is damaged; use another step")
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return _REAL_LOAD(path, map_location=map_location, weights_only=True, **kw)
    except pickle.UnpicklingError as e:
        raise _unpickling_error(where, e) from None
    except (EOFError, zipfile.BadZipFile) as e:
        raise CheckpointError(f"{where}: truncated or damaged ({type(e).__name__}); use another step") from None
    except OSError as e:  # torch's zip reader on a cut-off archive: `OSError: [Errno 22] Invalid argument`
        if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError)):
            raise CheckpointError(f"{where}: cannot be read ({e.strerror or e})") from None
        raise CheckpointError(f"{where}: truncated or damaged ({type(e).__name__}: {e.strerror or e}); use another "
                              "step") from None
    except RuntimeError as e:
        msg = str(e)
        if "zip archive" in msg or "PytorchStreamReader" in msg:
            raise CheckpointError(f"{where}: truncated or damaged (not a complete torch zip archive); use another "
                                  "step") from None
        if "storage" in msg.lower() or "magic" in msg:
            raise CheckpointError(f"{where}: truncated or damaged ({msg.splitlines()[0][:100]}); use another step") from None
        raise
    except (KeyError, IndexError, ValueError, TypeError, OverflowError, UnicodeDecodeError, struct.error) as e:
        # what the unpickler raises on arbitrary bytes (a legacy-format parse of garbage)
        raise CheckpointError(f"{where}: not a checkpoint file or damaged ({type(e).__name__} while reading it); "
                              "use another step") from None


def _unpickling_error(where: str, e: Exception) -> CheckpointError:
    m = _REFUSED.search(str(e))
    if m:
        what = next(g for g in m.groups() if g)
        return CheckpointError(
            f"{where}: refused: it holds a Python object ({what}) that would run code when loaded; setdlm "
            "loads checkpoints as weights only (tensors and plain values). Do not use files from an "
            "untrusted source")
    return CheckpointError(f"{where}: damaged or not a torch checkpoint (cannot be unpickled)")


def _routed_load(f, map_location=None, pickle_module=None, *, weights_only=None, **kw):
    return load(f, map_location=map_location, **kw)


@contextlib.contextmanager
def restricted_torch_load():
    """Inside the block, every `torch.load` (DeepSpeed's own included) is a weights-only `load()`."""
    saved = torch.load
    torch.load = _routed_load
    try:
        yield
    finally:
        torch.load = saved


class Inert:
    """What a foreign checkpoint's non-allow-listed class or function becomes in `load_foreign`: calling
    it, constructing it or setting its state does nothing, so no code named by the file runs."""

    qualname = "?"

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state) -> None:
        pass

    def __setitem__(self, key, value) -> None:
        pass

    def append(self, value) -> None:
        pass

    def extend(self, values) -> None:
        pass

    def __repr__(self) -> str:
        return f"<not loaded: {self.qualname}>"


def load_foreign(path) -> tuple[object, list[str]]:
    """A checkpoint written by other code (a Lightning or Composer training checkpoint, whose
    hyper-parameters and callback states are pickled objects of its own classes): loaded as weights
    only, with every class or function it names that is not allow-listed replaced by an inert
    stand-in (`Inert`), so its tensors can be used and nothing in it runs. Returns (object, the
    replaced names); the caller refuses the file if a stand-in sits where it needs weights."""
    p = Path(path)
    if p.is_file() and p.stat().st_size == 0:
        raise CheckpointError(f"{p}: empty file (0 bytes)")
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(str(p))
    except (ValueError, RuntimeError, pickle.UnpicklingError, EOFError, zipfile.BadZipFile):
        return load(p), []  # not a zip checkpoint (legacy format, or damaged): the strict reader says which
    stubs = [(type(f"Inert_{i}", (Inert,), {"qualname": n}), n) for i, n in enumerate(names)]
    with torch.serialization.safe_globals([*SAFE_GLOBALS, *stubs]):
        try:
            obj = _REAL_LOAD(str(p), map_location="cpu", weights_only=True, mmap=True)  # a whole model
        except pickle.UnpicklingError as e:  # a global the scan above did not see: refused, as by load()
            raise _unpickling_error(str(p), e) from None
        except (EOFError, RuntimeError, zipfile.BadZipFile) as e:
            raise CheckpointError(f"{p}: truncated or damaged ({type(e).__name__}); use another file") from None
    return obj, list(names)


def inert_entries(obj, prefix: str = "", limit: int = 3) -> list[str]:
    """Keys under which `obj` (nested dicts/lists) holds an `Inert` stand-in."""
    found: list[str] = []

    def walk(x, key):
        if len(found) >= limit:
            return
        if isinstance(x, Inert):
            found.append(f"{key or '(top level)'}: {x.qualname}")
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{key}[{i}]")

    walk(obj, prefix)
    return found
