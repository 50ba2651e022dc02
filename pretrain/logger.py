"""Metrics sinks: console line, metrics.jsonl in the run directory, wandb (rank 0 only)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tqdm import tqdm


def _fmt_rate(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def console_line(step: int, total: int, m: dict) -> str:
    parts = [f"step {step}/{total}"]
    if "train/loss" in m:
        parts.append(f"loss {m['train/loss']:.4f}")
    if "val/nll" in m:
        parts.append(f"val nll {m['val/nll']:.4f} (ppl {m['val/ppl']:.1f})")
    if "train/lr" in m:
        parts.append(f"lr {m['train/lr']:.2e}")
    if "train/grad_norm" in m:
        parts.append(f"gnorm {m['train/grad_norm']:.3f}")
    if "perf/tokens_per_s" in m:
        parts.append(f"{_fmt_rate(m['perf/tokens_per_s'])} tok/s")
    if "perf/mfu" in m:
        mfu = m["perf/mfu"]
        parts.append("MFU N/A" if mfu is None else f"MFU {100 * mfu:.1f}%")
    return " | ".join(parts)


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg, *, enabled: bool, total_steps: int, start_step: int, wandb_id: str | None):
        self.enabled = enabled
        self.total = total_steps
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb_run = None
        self.wandb_id = wandb_id
        self.bar = None
        if not enabled:
            return
        if cfg.logging.progress:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                            disable=not sys.stderr.isatty() and not os.environ.get("SETDLM_PROGRESS"))
        mode = cfg.logging.wandb
        if mode == "auto":
            mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        if mode != "disabled":
            import wandb

            self.wandb_run = wandb.init(project=cfg.logging.project, entity=cfg.logging.entity, name=cfg.run.name,
                                        id=wandb_id, resume="allow", dir=str(run_dir), mode=mode,
                                        config=cfg.to_dict())
            self.wandb_id = self.wandb_run.id

    def log(self, step: int, metrics: dict, *, print_line: bool = True) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: v for k, v in metrics.items() if v is not None}}
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(row, step=step)
        if print_line:
            self.write(console_line(step, self.total, metrics))

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
