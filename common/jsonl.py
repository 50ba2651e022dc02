"""The one reader of JSONL files (one JSON object per line): inputs a user gives (prompt/answer
examples, evaluation data, prompts) and the logs the stack writes itself (metrics.jsonl).

`iter_jsonl` yields the rows one at a time (inputs larger than memory); `read_jsonl` lists them.
A line that is not a JSON object is one error naming the file and line (`what: FILE:LINE: ...`),
raised as `error` (an `Error` subclass of the caller's package), or is skipped with `skip_bad` (a
log whose last line a kill cut short). Blank lines are ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

from .errors import Error, InputFileError

__all__ = ["iter_jsonl", "read_jsonl"]


def read_jsonl(path, what: str = "", *, error: type[Error] = InputFileError,
               check: Callable[[dict], str | None] | None = None, skip_bad: bool = False) -> list[dict]:
    """The rows of the JSONL file `path`. `what` (an option or a description) starts each message;
    `check(row)` returns what is wrong with a row (or None), reported with its file and line."""
    return list(iter_jsonl(path, what, error=error, check=check, skip_bad=skip_bad))


def iter_jsonl(path, what: str = "", *, error: type[Error] = InputFileError,
               check: Callable[[dict], str | None] | None = None, skip_bad: bool = False) -> Iterator[dict]:
    """`read_jsonl`'s rows one at a time: the file is read as they are taken (a missing file is
    reported at the first one)."""
    p = Path(path)
    lead = f"{what}: " if what else ""
    if not p.is_file():
        raise error(f"{lead}no such file {str(path)!r} (a JSONL file, one JSON object per line)")
    try:
        with open(p, encoding="utf-8", errors="replace" if skip_bad else "strict") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    problem = None if isinstance(row, dict) else "not a JSON object"
                except ValueError as e:
                    problem = f"not valid JSON ({e})"
                if problem is None and check is not None:
                    problem = check(row)
                if problem is None:
                    yield row
                elif not skip_bad:
                    raise error(f"{lead}{path}:{n}: {problem}")
    except UnicodeDecodeError as e:
        raise error(f"{lead}{path} is not UTF-8 text ({e})") from None
