"""How a part hands its results to the orchestrator (one JSON row per line after a marker), and a part's
deadline."""

from __future__ import annotations

import json
import time

MARK = "GPU_REPORT_ROW "  # a part prints one JSON row per line after this marker


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
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()
