"""The errors of `setdlm eval` and `setdlm sample` (a leaf: every eval module may import it)."""

from __future__ import annotations

from common.errors import Error

__all__ = ["EvalError", "OptionError", "IncompleteError"]


class EvalError(Error):
    """Bad input or an inconsistent output directory; the message says what to change."""


class OptionError(EvalError):
    """An option of `setdlm eval TASK` or `setdlm sample` that cannot be used (the message names the flag)."""


class IncompleteError(EvalError):
    """The merge found units without records (ranks still running, or failed); exit status 3."""

    exit_status = 3
