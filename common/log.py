"""The `setdlm` logger: one console format, rank-aware.

Code that logs asks ``get_logger(name)`` for a child of the ``setdlm`` logger (the trainer's
``setdlm.train``, the data loader's ``setdlm.data``, preemption's ``setdlm.preemption``); commands
that report a result print their own lines, and ``setdlm serve``'s long-running log is timestamped on
stderr (serve/cli.py configures it). The console
handler, installed on first use, prints the message alone (the lines users see: ``step 4/8 | loss
...``), INFO to stdout and warnings/errors to stderr, through ``tqdm.write`` while a progress bar is
shown. INFO records from ranks other than 0 are dropped unless logged with ``extra={"all_ranks":
True}``; warnings and errors are printed by every rank. Lines from ranks other than 0 start with
``[rank N]``. The rank is read from ``torch.distributed`` once a
group exists, else from the launcher variables (common/env.py).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["get_logger", "current_rank", "RankFilter", "ConsoleHandler", "ALL_RANKS"]

ROOT = "setdlm"
ALL_RANKS = {"all_ranks": True}


def current_rank() -> int:
    dist = sys.modules.get("torch.distributed")  # no import: without torch loaded there is no group
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    from .env import env_rank

    return env_rank()


class RankFilter(logging.Filter):
    """Pass rank 0's records; other ranks' only when marked `all_ranks` or at WARNING and above."""

    def filter(self, record: logging.LogRecord) -> bool:
        rank = current_rank()
        record.rank = rank
        everywhere = getattr(record, "all_ranks", False) or record.levelno >= logging.WARNING
        if rank != 0 and not everywhere:
            return False
        record.rank_prefix = f"[rank {rank}] " if rank != 0 else ""
        return True


class ConsoleHandler(logging.Handler):
    """INFO and below to stdout, WARNING and above to stderr; through tqdm.write while a bar is open."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = getattr(record, "rank_prefix", "") + self.format(record)
            stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
            tqdm = sys.modules.get("tqdm")
            if tqdm is not None and getattr(tqdm.tqdm, "_instances", None):
                tqdm.tqdm.write(msg, file=stream)
            else:
                stream.write(msg + "\n")
                stream.flush()
        except Exception:  # noqa: BLE001 - logging must never crash training
            self.handleError(record)


def _install() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, ConsoleHandler) for h in root.handlers):
        handler = ConsoleHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(RankFilter())
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return root


def get_logger(name: str | None = None) -> logging.Logger:
    """`setdlm` or `setdlm.<name>` (a module's ``__name__`` is used as is under `setdlm`)."""
    _install()
    if not name:
        return logging.getLogger(ROOT)
    return logging.getLogger(name if name.startswith(ROOT + ".") else f"{ROOT}.{name}")
