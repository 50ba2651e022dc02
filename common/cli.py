"""One convention for every `setdlm` subcommand: a user's mistake is one line, never a traceback.

- `ArgumentParser`: argparse with one-line usage errors (`setdlm pretrain: error: ... (see --help)`,
  exit status 2) and `section.key=value` overrides accepted anywhere on the line, before or after
  flags (`--config R a.b=1 --name x c.d=2`), for every parser with an ``overrides`` positional.
- `run_command`: calls a subcommand's ``main(argv)``; configuration, data, checkpoint and
  command-line errors (``ValueError`` and its subclasses, missing files, shard errors) print
  ``setdlm CMD: error: MESSAGE`` on one line and return 2 (or the error's ``exit_status``).
  ``SETDLM_DEBUG=1`` re-raises them with their traceback. Ctrl-C outside training prints ``interrupted`` and returns 130.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys

from .errors import Error
from .storage import FULL_ERRNOS

__all__ = ["ArgumentParser", "run_command", "debug_enabled", "one_line", "is_user_error", "report"]

OVERRIDE = re.compile(r"^[A-Za-z_][\w]*\.[\w.]+=")


def debug_enabled() -> bool:
    return os.environ.get("SETDLM_DEBUG", "").strip() not in ("", "0")


def one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, OSError) and not isinstance(error, Error) and error.filename \
            and str(error.filename) not in text:
        text = f"{text}: {error.filename}"
    return text


def report(prog: str, error: BaseException | str) -> None:
    print(f"{prog}: error: {error if isinstance(error, str) else one_line(error)}", file=sys.stderr, flush=True)


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with one-line errors and overrides accepted in any position."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        report(self.prog, f"{message} (see {self.prog} --help)")
        sys.exit(2)

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        if extra and hasattr(ns, "overrides"):
            late = [a for a in extra if OVERRIDE.match(a)]
            ns.overrides = [*(ns.overrides or []), *late]
            extra = [a for a in extra if not OVERRIDE.match(a)]
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns


def is_user_error(error: BaseException) -> bool:
    if isinstance(error, (Error, ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return True
    if isinstance(error, OSError) and error.errno in (*FULL_ERRNOS, errno.EROFS):
        return True  # a full disk or a read-only mount met by a write without its own message: one line too
    shard_error = getattr(sys.modules.get("data_pipeline.sources"), "ShardError", None)
    return shard_error is not None and isinstance(error, shard_error)


def run_command(prog: str, main, argv: list[str]) -> int:
    """`main(argv)` under the one-line error convention (see the module docstring)."""
    try:
        return int(main(argv) or 0)
    except SystemExit as e:  # argparse's --help and usage errors (already reported on one line)
        if isinstance(e.code, str):
            report(prog, e.code)
            return 1
        return int(e.code or 0)
    except KeyboardInterrupt:
        if debug_enabled():
            raise
        report(prog, "interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - filtered just below
        if debug_enabled() or not is_user_error(e):
            raise
        report(prog, e)
        status = int(getattr(e, "exit_status", 2))  # an Error may name another status (eval merge: 3, incomplete)
        from .rankfail import write_status  # for a batch script under torchrun, which reports 1 (common/rankfail.py)

        write_status(None, status, one_line(e))
        return status
