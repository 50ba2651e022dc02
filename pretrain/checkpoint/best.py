"""`train.keep_best`: keep the checkpoint with the best validation metric.

After each validation the trainer asks `BestCheckpoint.improves(metrics)`; on a new best it saves a
checkpoint at that step (whether or not `save_every` falls there) and `mark` records it in
RUN/checkpoints/best (rundir.py), where keep_last pruning never removes it, and prunes the previous
best when it is older than the last `keep_last`. With an EMA the validation scores the EMA weights and
the checkpoint holds them, so `RUN:best` loads the EMA weights of the best validation checkpoint (how
the reference releases its models). A resumed run continues from the recorded best value.
"""

from __future__ import annotations

import math
from pathlib import Path

from common.schema import ConfigError

from . import rundir
from .save import prune


class BestCheckpoint:
    def __init__(self, root: Path, metric: str, mode: str, keep_last: int):
        self.root, self.metric, self.mode, self.keep_last = Path(root), metric, mode, keep_last
        record = rundir.best_record(root)
        same = record is not None and record.get("metric") == metric and record.get("mode") == mode
        self.value = float(record["value"]) if same else None

    @classmethod
    def from_config(cls, train_cfg, root: Path) -> "BestCheckpoint | None":
        if not train_cfg.keep_best:
            return None
        return cls(root, train_cfg.best_metric, train_cfg.best_mode, train_cfg.keep_last)

    def improves(self, metrics: dict) -> bool:
        """Whether the validation row `metrics` beats the best so far (False when it has no validation)."""
        if not any(k.startswith("val/") for k in metrics):
            return False
        if self.metric not in metrics:
            have = ", ".join(sorted(k for k in metrics if k.startswith("val/")))
            raise ConfigError(f"train.best_metric: {self.metric!r} is not a validation metric of this run; "
                              f"valid: {have}")
        value = metrics[self.metric]
        if value is None or not math.isfinite(float(value)):
            return False
        value = float(value)
        if self.value is not None and (value >= self.value if self.mode == "min" else value <= self.value):
            return False
        self.value = value
        return True

    def mark(self, ckpt: Path, step: int) -> str:
        """Record `ckpt` (just saved) as the best, prune the previous best if it is now outside
        keep_last (rank 0). Returns the log line."""
        rundir.point_best(self.root, {"tag": Path(ckpt).name, "step": int(step), "metric": self.metric,
                                      "value": self.value, "mode": self.mode})
        prune(self.root, self.keep_last)
        return f"best checkpoint: {self.metric} {self.value:.6f} at step {step} ({self.root / rundir.BEST})"


__all__ = ["BestCheckpoint"]
