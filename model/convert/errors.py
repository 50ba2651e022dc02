"""The error of model/convert/ (a leaf module: every converter raises it)."""

from __future__ import annotations

from common.errors import Error

__all__ = ["ConvertError"]


class ConvertError(Error):
    """A checkpoint or export directory cannot be converted; the message says what is wrong."""
