"""`--device`: the one check of a torch device name that `setdlm sample`, `eval` and `serve` share.

`check_device("cuda:3")` refuses, before anything is loaded, a name torch does not know (`bogus`),
a device type this build or machine does not have (`cuda` on a CPU build of torch, `mps` off a Mac)
and an index past the devices present (`cuda:3` with two GPUs), each as one line naming the option.
"""

from __future__ import annotations

from .errors import UsageError


def check_device(value: str | None, flag: str = "--device", error: type = UsageError) -> None:
    """Raise `error` naming `flag` when `value` (None: the default) is not a usable torch device here."""
    if value is None:
        return
    import torch

    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise error(f"{flag} {value}: not a torch device (cpu, cuda, cuda:N)") from None
    if dev.type == "cpu":
        return
    backend = getattr(torch, dev.type, None)
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        why = (f"this torch {torch.__version__} has no CUDA" if dev.type == "cuda" and torch.version.cuda is None
               else f"no {dev.type} device on this machine")
        raise error(f"{flag} {value}: {why}; use --device cpu")
    count = getattr(backend, "device_count", None)
    if dev.index is not None and count is not None and dev.index >= count():
        raise error(f"{flag} {value}: only {count()} {dev.type} device(s) here (indices 0-{count() - 1})")
