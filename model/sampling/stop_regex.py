"""Stop regexes on RE2 (google-re2): the one place a user's pattern is compiled.

RE2's matching time is linear in the text (no catastrophic backtracking such as ``(\\s+)+x``), it
refuses a pattern whose compiled program would be too large (``(a{1000}){1000}``) instead of spending
minutes on it, and it releases the interpreter lock while it matches. Its syntax is Python's without
backreferences and lookaround.
"""

from __future__ import annotations

import functools

from common.errors import Error

MAX_PATTERN = 512  # characters of a stop regex
REGEX_MEMORY = 8 << 20  # bytes RE2 may use for a compiled pattern (its default)


class StopRegexError(Error):
    """A stop regex RE2 cannot compile (the message says why)."""


@functools.lru_cache(maxsize=256)
def compile_stop_regex(pattern: str):
    """The compiled RE2 pattern, or StopRegexError naming what is wrong with it."""
    import re2

    if len(pattern) > MAX_PATTERN:
        raise StopRegexError(f"at most {MAX_PATTERN} characters, got {len(pattern)}")
    opts = re2.Options()
    opts.log_errors = False
    opts.max_mem = REGEX_MEMORY
    try:
        return re2.compile(pattern, opts)
    except re2.error as e:
        why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
        raise StopRegexError(f"not a regular expression RE2 accepts ({why}; RE2 is Python's syntax without "
                             f"backreferences and lookaround)") from None
