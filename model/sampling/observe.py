"""What each decoding step committed, where: the events behind streaming and the decoding trace.

A `StepObserver` hangs on a decoder (`Decoder.observer`). Before each step it reads the window of
every watched row (`Decoder.window_bounds`: the positions that step may commit), and at each host
check, before finished rows are retired, it reads which positions each row committed since the last
check (their `commit_step` stamps) and calls back once per row and step with a `StepEvent`. Only
watched rows are read back, so an observer that watches nothing costs two list scans per step; the
step itself (`device_step`) is untouched, and the decoded tokens are the same with or without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class StepEvent:
    """One step of one request. Positions are those of the whole sequence (prompt or prefix first);
    `span` is the generated span [start, end) as of this check (its end moves left when EOS or a stop
    string ends the row: committed positions at or past it are dropped), `window` the [start, end)
    the step could commit in, `decoded` how many span positions from its start are decoded without a
    gap (the left-to-right prefix)."""

    row: int
    step: int
    positions: list[int]
    tokens: list[int]
    window: tuple[int, int] | None
    span: tuple[int, int]
    decoded: int


class StepObserver:
    def __init__(self, dec, callback: Callable[[StepEvent], None], rows: set[int] | None = None):
        self.dec, self.callback = dec, callback
        self.rows = rows  # request indices to report (None: every row)
        self.windows: dict[int, dict[int, tuple[int, int]]] = {}  # row -> step -> window
        self.seen: dict[int, int] = {}  # row -> last step reported

    def _slots(self) -> list[int]:
        rows, only = self.dec.rows, self.rows
        return [b for b, r in enumerate(rows) if r >= 0 and (only is None or r in only)]

    def forget(self, row: int) -> None:
        self.windows.pop(row, None)
        self.seen.pop(row, None)

    def before_step(self) -> None:
        slots = self._slots()
        if not slots:
            return
        dec = self.dec
        idx = torch.tensor(slots, device=dec.device)
        start, end = dec.window_bounds()
        table = torch.stack((start[idx], end[idx], dec.steps[idx])).cpu().tolist()
        for j, b in enumerate(slots):
            self.windows.setdefault(dec.rows[b], {})[table[2][j] + 1] = (table[0][j], table[1][j])

    def after_step(self) -> None:
        slots = self._slots()
        if not slots:
            return
        dec = self.dec
        idx = torch.tensor(slots, device=dec.device)
        commit, canvas, todo = dec.commit_step[idx].cpu(), dec.canvas[idx].cpu(), dec.todo[idx].cpu()
        s0, s1, steps = dec.span_start[idx].tolist(), dec.span_end[idx].tolist(), dec.steps[idx].tolist()
        for j, b in enumerate(slots):
            row, n = dec.rows[b], steps[j]
            last = self.seen.get(row, 0)
            if n <= last:
                continue
            a, e = s0[j], s1[j]
            masked = torch.nonzero(todo[j, a:e]).flatten()
            decoded = int(masked[0]) if len(masked) else e - a
            stamps = commit[j, a:e]
            windows = self.windows.get(row, {})
            for k in range(last + 1, n + 1):
                pos = (torch.nonzero(stamps == k).flatten() + a).tolist()
                self.callback(StepEvent(row, k, pos, canvas[j, pos].tolist(), windows.pop(k, None), (a, e), decoded))
            self.seen[row] = n
