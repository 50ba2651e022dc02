"""What a streamed choice shows as its steps land: committed spans, the left-to-right prefix, final text.

A set model commits tokens out of order, so each server-sent event carries, under the choice's
`setdlm` key, the step's committed *spans* (runs of adjacent positions: offset from the first
generated position, token ids and each token's text), the step's `window`, the span's current `end`
(EOS or a stop string moves it left: tokens at or past it are dropped), how many positions are
`decoded` from the start without a gap and their text (`prefix`). The OpenAI field (`text`, or
`delta.content` in chat) carries only the newly *final* part of that prefix: text a later step can
no longer change (held back: a trailing partial character, the start of a stop string, and with a
stop regex the last token's text). The deltas of a choice add up to its final text exactly. Nothing
here matches the stop regex: the decode thread does (model/sampling/stopping.py), so a slow pattern
never holds this event loop.
"""

from __future__ import annotations

import json
import logging

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
    """The stream of one choice. The decoded prefix is detokenised incrementally: each step decodes
    only its new tokens with a few tokens of context before them (the usual window, so a leading space
    or a character split over tokens comes out right), never the whole prefix again."""

    def __init__(self, tokenizer, stop: list[str], stop_regex: str | None):
        self.tok, self.stop, self.regex = tokenizer, list(stop), stop_regex is not None
        self.longest = max(map(len, self.stop), default=0)
        self.tokens: dict[int, int] = {}  # offset -> committed token not yet in the decoded prefix
        self.ids: list[int] = []  # the decoded left-to-right prefix
        self.text = ""  # text of ids[:read]: complete characters
        self.tail = ""  # text of ids[read:]: a character that needs more bytes (U+FFFD until it has them)
        self.window = self.read = 0  # ids[window:read] is the context decoded again with new tokens
        self.sent = ""  # final text already streamed

    def _extend(self, new: list[int]) -> None:
        """Append tokens to the decoded prefix, decoding only them (with their context)."""
        self.ids += new
        head = self.tok.decode(self.ids[self.window:self.read])
        full = self.tok.decode(self.ids[self.window:])
        if len(full) > len(head) and not full.endswith("\ufffd"):
            self.text += full[len(head):]
            self.window, self.read, self.tail = self.read, len(self.ids), ""
        else:
            self.tail = full[len(head):]

    def _final(self, text: str) -> str:
        """The part of the decoded prefix `text` no later step can change: cut before a stop string it
        already holds, else without the characters a later token may still change (an incomplete
        UTF-8 character, the start of a stop string, with a stop regex the last token's text: the
        decode thread matches the regex, and a match ends the output, whose final text then follows).
        Only the text past what was sent, less a stop string's length, is searched."""
        start = max(0, len(self.sent) - self.longest + 1)
        cuts = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if cuts:
            return text[: min(cuts)]
        hold = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        if self.regex and self.ids:
            hold = max(hold, len(self.tok.decode(self.ids[-1:])))
        return text[: len(text) - min(hold, len(text))]

    def step(self, ev) -> tuple[str, dict]:
        """(newly final text, the event's `setdlm` payload) for one StepEvent."""
        a, e = ev.span
        end = e - a
        fresh = [(p - a, t) for p, t in zip(ev.positions, ev.tokens) if p < e]
        self.tokens.update(fresh)
        for o in [o for o in self.tokens if o >= end]:
            del self.tokens[o]
        if ev.decoded < len(self.ids):  # the prefix never shrinks while a choice runs; start again if it did
            old, self.ids, self.text, self.tail, self.window, self.read = self.ids[: ev.decoded], [], "", "", 0, 0
            self._extend(old)
        elif ev.decoded > len(self.ids):
            self._extend([self.tokens.pop(o) for o in range(len(self.ids), ev.decoded)])
        text = self.text + self.tail
        final = self._final(text)
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
