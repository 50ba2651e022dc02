"""Host-side stop strings and regular expressions (the only per-row host work in decoding).

A stop string ends the text just before its first occurrence; a regular expression ends it just after
the end of its first match (so a pattern such as ``r"#### -?\\d+\\n"`` keeps the answer). The tokens
are cut after the token that completes the occurrence. Both are searched in the decoded text of the
contiguous decoded part of the span (set decoders may have decoded positions further right; those are
dropped). Token ids that end a sequence (EOS, `stop_token_ids`) are handled on the device instead.
"""

from __future__ import annotations

import re

from .config import SamplingError


class StopChecker:
    def __init__(self, tokenizer, stop: list[str], stop_regex: str | None):
        if (stop or stop_regex) and tokenizer is None:
            raise SamplingError("sampling.stop / sampling.stop_regex: stop strings need a tokenizer (pass tokenizer=...)")
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.regex = re.compile(stop_regex) if stop_regex else None

    @property
    def enabled(self) -> bool:
        return bool(self.stop) or self.regex is not None

    def _search(self, text: str):
        """(cut position in text, kind, match start) of the earliest stop in `text`, or None."""
        best = None
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[2]):
                best = (i, "stop_string", i)
        if self.regex is not None:
            m = self.regex.search(text)
            if m is not None and (best is None or m.start() < best[2]):
                best = (m.end(), "regex", m.start())
        return best

    def check(self, tokens: list[int], checked: int) -> tuple[int, str, str] | None:
        """tokens: the contiguous decoded tokens of the span; checked: how many were checked before.

        Returns (tokens to keep, text, reason) when a stop occurs, else None."""
        if not self.enabled or len(tokens) <= checked:
            return None
        decode = self.tokenizer.decode
        if self._search(decode(tokens)) is None:
            return None
        for n in range(max(checked, 0) + 1, len(tokens) + 1):  # first prefix that contains a stop
            text = decode(tokens[:n])
            hit = self._search(text)
            if hit is not None:
                return n, text[: hit[0]], hit[1]
        return None
