"""Host-side stop strings and regular expressions (the only per-row host work in decoding).

A stop string ends the text just before its first occurrence; a regular expression ends it just after
the end of its first match (so a pattern such as ``r"#### -?\\d+\\n"`` keeps the answer). The tokens
are cut after the token that completes the occurrence. Both are searched in the decoded text of the
contiguous decoded part of the span (set decoders may have decoded positions further right; those are
dropped). Token ids that end a sequence (EOS, `stop_token_ids`) are handled on the device instead.

Stop regexes come from users (a server's requests), so they run on RE2 (stop_regex.py: linear-time
matching, bounded compilation, the interpreter lock released while matching). On top of that each
output may spend at most `REGEX_SECONDS` matching its regex, summed over its steps: past that,
`check` raises `StopRegexTimeout` and the decoder ends the output at its decoded prefix
(stop_reason "regex_timeout").
"""

from __future__ import annotations

import time

from .config import SamplingError
from .stop_regex import compile_stop_regex

REGEX_SECONDS = 5.0  # matching time one output may spend on its stop regex, summed over its steps


class StopRegexTimeout(SamplingError):
    """An output used up its matching time (`REGEX_SECONDS`)."""


class StopChecker:
    def __init__(self, tokenizer, stop: list[str], stop_regex: str | None, budget: float | None = None):
        if (stop or stop_regex) and tokenizer is None:
            raise SamplingError("sampling.stop / sampling.stop_regex: stop strings need a tokenizer (pass tokenizer=...)")
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.regex = compile_stop_regex(stop_regex) if stop_regex else None
        self.budget = float(REGEX_SECONDS if budget is None else budget)
        self.spent: dict[int, float] = {}  # per output (row): seconds spent matching the regex

    @property
    def enabled(self) -> bool:
        return bool(self.stop) or self.regex is not None

    def forget(self, row: int) -> None:
        self.spent.pop(row, None)

    def _search(self, text: str, row: int):
        """(cut position in text, kind, match start) of the earliest stop in `text`, or None."""
        best = None
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[2]):
                best = (i, "stop_string", i)
        if self.regex is not None:
            spent = self.spent.get(row, 0.0)
            if spent > self.budget:
                raise StopRegexTimeout(f"sampling.stop_regex: matching took more than {self.budget:g} s on this "
                                       f"output; use a simpler pattern")
            t0 = time.perf_counter()
            m = self.regex.search(text)
            self.spent[row] = spent + time.perf_counter() - t0
            if m is not None and (best is None or m.start() < best[2]):
                best = (m.end(), "regex", m.start())
        return best

    def check(self, tokens: list[int], checked: int, row: int = 0) -> tuple[int, str, str] | None:
        """tokens: the contiguous decoded tokens of the span; checked: how many were checked before;
        row: whose matching time this counts against.

        Returns (tokens to keep, text, reason) when a stop occurs, else None. Raises
        StopRegexTimeout when the row has used up its matching time."""
        if not self.enabled or len(tokens) <= checked:
            return None
        decode = self.tokenizer.decode
        if self._search(decode(tokens), row) is None:
            return None
        for n in range(max(checked, 0) + 1, len(tokens) + 1):  # first prefix that contains a stop
            text = decode(tokens[:n])
            hit = self._search(text, row)
            if hit is not None:
                return n, text[: hit[0]], hit[1]
        return None
