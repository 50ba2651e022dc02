"""How a part hands its results to the orchestrator (one JSON row per line after a marker), and a part's
deadline."""

from __future__ import annotations

import json
import time

MARK = "GPU_REPORT_ROW "  # a part prints one JSON row per line after this marker
CUT = "cut"  # a row key: True when the part's time ran out before the row was (fully) measured


def emit(row: dict) -> None:
    print(MARK + json.dumps(row, default=str), flush=True)


def parse(line: str) -> dict | None:
    """The row a part's output line carries, or None."""
    if not line.startswith(MARK):
        return None
    try:
        return json.loads(line[len(MARK):])
    except json.JSONDecodeError:
        return None


class Deadline:
    """A part's deadline: wall-clock seconds since the epoch (`--deadline-at`, set by the orchestrator
    just before it starts the part's process, so the part's imports spend from it too)."""

    def __init__(self, at: float):
        self.at = at

    @classmethod
    def of(cls, args) -> "Deadline":
        return cls(float(args.deadline_at) if args.deadline_at else time.time() + float(args.deadline))

    def left(self) -> float:
        return self.at - time.time()
