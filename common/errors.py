"""The one base class of every error a user can cause and fix (a recipe, data, checkpoint, command
line or environment that cannot be used).

Every subcommand runs under `common.cli.run_command`, which prints an `Error` as one line
(`setdlm CMD: error: MESSAGE`, exit status 2) and keeps the traceback of anything else (a bug), unless
`SETDLM_DEBUG` is set to a value other than 0. The message names what is wrong and what would be valid.

`Error` derives from ValueError, so code that catches ValueError around a parse or a check keeps
working. Each package raises its own subclass (`ConfigError`, `ShardError`, `CheckpointError`, ...);
a new user-facing error is a subclass of one of these, never a bare ValueError.
"""

from __future__ import annotations

__all__ = ["Error", "UsageError", "InputFileError", "StorageError"]


class Error(ValueError):
    """A user's mistake; the message is one line naming the field, file or option and what is valid."""


class UsageError(Error):
    """A command-line option or environment variable that cannot be used."""


class InputFileError(Error):
    """An input file that is missing, empty, damaged or of the wrong kind (the message names it)."""


class StorageError(Error, OSError):
    """An output that cannot be written: a full disk (the message names the path and the space the
    write needs), a read-only file system, or a path of the wrong kind (a file where a directory
    belongs). Raised before any work where it can be seen then (common/storage.py). Also an OSError,
    so code that handles a failed write keeps handling it."""
