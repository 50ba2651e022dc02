"""What a streamed choice shows as its steps land: committed spans, the left-to-right prefix, final text.

A set model commits tokens out of order, so each server-sent event carries, under the choice's
`setdlm` key, the step's committed *spans* (runs of adjacent positions: offset from the first
generated position, token ids and each token's text), the step's `window`, the span's current `end`
(EOS or a stop string moves it left: tokens at or past it are dropped), how many positions are
`decoded` from the start without a gap and their text (`prefix`). The OpenAI field (`text`, or
`delta.content` in chat) carries only the newly *final* part of that prefix: text a later step can
no longer change (held back: a trailing partial character, the start of a stop string, and with a
stop regex the last token's text). The deltas of a choice add up to its final text exactly.
"""

from __future__ import annotations

import json
import logging
import re

log = logging.getLogger("setdlm.serve")

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"


def runs(offsets: list[int], tokens: list[int]) -> list[tuple[int, list[int]]]:
    """Adjacent offsets grouped: [(first offset, tokens)] in ascending order."""
    out: list[tuple[int, list[int]]] = []
    for o, t in sorted(zip(offsets, tokens)):
        if out and out[-1][0] + len(out[-1][1]) == o:
            out[-1][1].append(t)
        else:
            out.append((o, [t]))
    return out


class ChoiceText:
    def __init__(self, tokenizer, stop: list[str], stop_regex: str | None):
        self.tok, self.stop, self.regex = tokenizer, list(stop), stop_regex
        self.tokens: dict[int, int] = {}  # offset -> committed token
        self.sent = ""  # final text already streamed

    def _final(self, text: str, ids: list[int]) -> str:
        """The part of the decoded prefix `text` no later step can change: cut before a stop string
        (or after a regex match) it already holds, else without the characters a later token may
        still change (an incomplete UTF-8 character, the start of a stop string, with a stop regex
        the last token's text)."""
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if self.regex:
            m = re.search(self.regex, text)
            if m is not None:
                cuts.append(m.end())
        if cuts:
            return text[: min(cuts)]
        hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        if self.regex and ids:
            hold = max(hold, len(self.tok.decode(ids[-1:])))
        return text[: len(text) - min(hold, len(text))]

    def step(self, ev) -> tuple[str, dict]:
        """(newly final text, the event's `setdlm` payload) for one StepEvent."""
        a, e = ev.span
        end = e - a
        fresh = [(p - a, t) for p, t in zip(ev.positions, ev.tokens) if p < e]
        self.tokens.update(fresh)
        for o in [o for o in self.tokens if o >= end]:
            del self.tokens[o]
        ids = [self.tokens[o] for o in range(ev.decoded)]
        text = self.tok.decode(ids)
        final = self._final(text, ids)
        delta = ""
        if len(final) > len(self.sent) and final.startswith(self.sent):
            delta, self.sent = final[len(self.sent):], final
        spans = [{"offset": o, "tokens": ts, "pieces": [self.tok.decode([t]) for t in ts]}
                 for o, ts in runs([o for o, _ in fresh], [t for _, t in fresh])]
        window = [ev.window[0] - a, ev.window[1] - a] if ev.window is not None else None
        return delta, {"step": ev.step, "window": window, "spans": spans, "end": end, "decoded": ev.decoded,
                       "prefix": text}

    def finish(self, out) -> tuple[str, dict]:
        """(the rest of the final text, the final `setdlm` payload) for the choice's SampleOutput."""
        text = out.text or ""
        if text.startswith(self.sent):
            delta = text[len(self.sent):]
        else:  # cannot happen with the hold-back rules above; the final payload still has the whole text
            log.warning("setdlm serve: streamed text %r is not a prefix of the final text %r", self.sent, text)
            delta = ""
        self.sent = text
        return delta, final_payload(out)


def final_payload(out) -> dict:
    return {"tokens": out.tokens, "commit_step": out.commit_step, "steps": out.steps,
            "tokens_per_step": round(out.tokens_per_step, 4), "stop_reason": out.stop_reason}


def finish_reason(out) -> str:
    return "length" if out.stop_reason == "length" else "stop"
