"""Numbers read from environment variables (SETDLM_GPU_MEMORY_GIB, SETDLM_GPUS_PER_NODE, WORLD_SIZE for
a dry run), validated like recipe keys: a value that is not a number of the kind, or out of its
range, is one line naming the variable and what is valid (`UsageError`, exit status 2), never a
silent default or a traceback. Launcher variables are read by common/env.py."""

from __future__ import annotations

import math
import os

from .errors import UsageError

__all__ = ["env_number"]


def env_number(name: str, default: float, *, kind: type = int, ge: float | None = None, gt: float | None = None,
               le: float | None = None, what: str = ""):
    """`kind(os.environ[name])` within the bounds (`ge`/`gt` below, `le` above), `default` when unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    noun = "an integer" if kind is int else "a number"
    bounds = [f">= {ge:g}" if ge is not None else None, f"> {gt:g}" if gt is not None else None,
              f"<= {le:g}" if le is not None else None]
    valid = " and ".join(b for b in bounds if b)
    about = f" ({what})" if what else ""
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or (kind is float and not math.isfinite(value)) or \
            (ge is not None and value < ge) or (gt is not None and value <= gt) or (le is not None and value > le):
        raise UsageError(f"environment variable {name}={text!r}: must be {noun}" + (f" {valid}" if valid else "")
                         + about)
    return value
