"""Metrics sinks: console line, metrics.jsonl in the run directory, wandb (rank 0 only).

Nothing here can stall a run: `logging.wandb: auto` (and `online`) go online only when WANDB_API_KEY
is set *and* the wandb server (WANDB_BASE_URL) answers an HTTP request within `PROBE_TIMEOUT_S`;
otherwise, and whenever wandb.init fails, the run logs offline (or not at all)
after a one-line notice. A resumed run first drops the metrics.jsonl rows past its checkpoint's step,
so every step appears once.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from tqdm import tqdm

from common.io import AppendFile, atomic_write_text
from common.log import get_logger

log = get_logger("setdlm.train")

PROBE_TIMEOUT_S = 2.0
DEFAULT_WANDB_URL = "https://api.wandb.ai"


def wandb_reachable(timeout: float = PROBE_TIMEOUT_S) -> tuple[bool, str]:
    """(whether the wandb server -- WANDB_BASE_URL, through the HTTP(S) proxy of the environment if
    any -- answers an HTTP request within `timeout` seconds, the URL tried). Any HTTP status counts
    as an answer; no name resolution, a refused or silent connection does not. The probe runs in a
    daemon thread, so it never takes much longer than `timeout`, whatever the network does."""
    url = (os.environ.get("WANDB_BASE_URL") or DEFAULT_WANDB_URL).rstrip("/") + "/healthz"
    answer: list[bool] = []

    def probe():
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout):
                answer.append(True)
        except urllib.error.HTTPError:  # the server answered (401, 404, ...)
            answer.append(True)
        except (OSError, ValueError):  # URLError, timeouts, refused, bad URL
            answer.append(False)

    thread = threading.Thread(target=probe, name="wandb-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(answer and answer[0]), urlparse(url).netloc or url


def resolve_wandb_mode(requested: str) -> tuple[str, str | None]:
    """(wandb mode to use, a one-line notice or None) for `logging.wandb` and the environment."""
    env_mode = os.environ.get("WANDB_MODE")
    if requested == "auto" and env_mode:
        requested = env_mode
        if requested not in ("online", "offline", "disabled"):
            return "offline", f"wandb: WANDB_MODE={env_mode!r} is not online/offline/disabled; logging offline"
    if requested == "auto" and not os.environ.get("WANDB_API_KEY"):
        return "offline", None
    if requested in ("auto", "online"):
        ok, where = wandb_reachable()
        if not ok:
            return "offline", (f"wandb: server {where} unreachable within {PROBE_TIMEOUT_S:.0f} s; logging offline "
                               f"to the run directory (upload later with `wandb sync`)")
        return "online", None
    return requested, None


def truncate_metrics(path: Path, start_step: int) -> int:
    """Keep only the rows of steps <= start_step, the ones the resumed checkpoint covers (none for a
    fresh start at step 0, which logs step 0 again); also drops a row cut short by a kill. Returns how
    many rows were dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            step = int(row["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1  # a row cut short by a kill
            continue
        if start_step > 0 and step <= start_step:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(line + "\n" for line in keep))
    return dropped


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
        dropped = truncate_metrics(self.path, start_step)
        if dropped:
            self.write(f"metrics.jsonl: dropped {dropped} rows logged after step {start_step} by the previous attempt")
        if cfg.logging.progress:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                            disable=not sys.stderr.isatty() and not os.environ.get("SETDLM_PROGRESS"))
        mode, notice = resolve_wandb_mode(cfg.logging.wandb)
        if notice:
            self.write(notice)
        if mode != "disabled":
            try:
                import wandb

                self.wandb_run = wandb.init(project=cfg.logging.project, entity=cfg.logging.entity, name=cfg.run.name,
                                            id=wandb_id, resume="allow", dir=str(run_dir), mode=mode,
                                            config=cfg.to_dict(), settings=wandb.Settings(init_timeout=60))
                self.wandb_id = self.wandb_run.id
            except Exception as e:  # noqa: BLE001 - a logging backend must not stop training
                self.wandb_run = None
                self.write(f"wandb: init failed ({' '.join(str(e).split())[:200]}); continuing without wandb")

    def log(self, step: int, metrics: dict, *, print_line: bool = True) -> None:
        if not self.enabled:
            return
        row = {"step": step, **{k: v for k, v in metrics.items() if v is not None}}
        with AppendFile(self.path) as f:  # whole rows: a full disk cuts the row off and says so
            f.append(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(row, step=step)
        if print_line:
            self.write(console_line(step, self.total, metrics))

    def write(self, text: str) -> None:
        if not self.enabled:
            return
        log.info(text)  # common/log.py: rank-aware, through tqdm.write while the bar is shown

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
