"""Checkpoints written in the background (pretrain/checkpoint/writer.py), with real processes and signals.

A run's writes are slowed on a made-slow disk: `slow_run` (run in a fresh interpreter) wraps DCP's file
writer so that each item of one chosen checkpoint takes `delay` seconds to write, then trains through
the real CLI. While that checkpoint is being written:

- the step loop goes on (metrics rows of later steps appear) and `latest` still names the previous one;
- a SIGKILL leaves the previous checkpoint as the one that resumes (the partial folder is removed by the
  next start) and the resumed run repeats the killed run's steps exactly;
- SIGTERM waits for the write in flight, then saves and exits: both checkpoints are published;
- every save logs ckpt/blocking_s, and the end of each write ckpt/write_s, in metrics.jsonl.
One run is killed, then the same command resumes it and is stopped by SIGTERM.

(A disk that fills during the background write: tests/test_storage_faults.py.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, cli_env, read_metrics, setdlm, write_recipe

pytestmark = pytest.mark.slow

SLOW_STEP = 4  # the checkpoint written slowly
DELAY = 0.08  # seconds per written item (about 130 items: about 10 s)


def slow_run(args: list[str], step: int, delay: float) -> int:
    """`setdlm pretrain ARGS` with checkpoint `step`'s items written `delay` seconds apart."""
    import time as _time

    from launch.cli import main
    from pretrain.checkpoint import distcp

    real = distcp.writer

    def writer(path):
        w = real(path)
        if Path(path).name.endswith(f"step_{step:08d}"):
            plain = w.write_data

            def write_data(plan, planner):
                resolve = planner.resolve_data

                def slowly(item):
                    _time.sleep(delay)
                    return resolve(item)

                planner.resolve_data = slowly
                return plain(plan, planner)

            w.write_data = write_data
        return w

    distcp.writer = writer
    return main(["pretrain", *args])


def _start(recipe: Path, out: Path, *overrides: str) -> subprocess.Popen:
    args = ["--config", str(recipe), "--out", str(out), *overrides]
    code = (f"import sys; sys.path.insert(0, {str(REPO / 'tests')!r}); from test_checkpoint_background import slow_run; "
            f"sys.exit(slow_run({args!r}, {SLOW_STEP}, {DELAY}))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _rows(run: Path) -> dict[int, dict]:
    try:
        return read_metrics(run)
    except (OSError, ValueError, KeyError):
        return {}


def _wait_until(done, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while not done():
        assert proc.poll() is None, f"the run exited before {what}: {proc.stdout.read()[-3000:]}"
        assert time.monotonic() - t0 < timeout, f"no {what} after {timeout:.0f}s"
        time.sleep(0.05)


def _writing(run: Path, since: float = 0.0) -> bool:
    """The slow checkpoint is being written: its temporary folder holds part of rank 0's data file
    (written after time `since`: not the part a killed run left)."""
    data = run / "checkpoints" / f".tmp-step_{SLOW_STEP:08d}" / "__0_0.distcp"
    try:
        return data.stat().st_size > 0 and data.stat().st_mtime >= since
    except OSError:
        return False


@pytest.fixture
def recipe(tmp_path) -> Path:
    chars = REPO / "tests" / "fixtures" / "checkpoint_format1" / "format1" / "tokenizer"  # small checkpoints
    return write_recipe(tmp_path / "r.yaml", data={"tokenizer": str(chars), "add_mask_token": True},
                        train={"max_steps": 1000, "save_every": 2, "eval_every": 0, "log_every": 1, "ema": 0.5,
                               "keep_last": 3, "sample_at_end": False})


def test_kill_then_sigterm_during_background_writes(recipe, tmp_path):
    out, run = tmp_path / "runs", tmp_path / "runs" / "tiny"
    root = run / "checkpoints"

    # 1. SIGKILL while step 4 is written; training went on meanwhile (step 5 is logged)
    proc = _start(recipe, out)
    try:
        _wait_until(lambda: 5 in _rows(run) and _writing(run), proc, "step 5 during the step-4 write")
        assert (root / "latest").read_text() == "step_00000002"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    killed = _rows(run)
    assert (root / "latest").read_text() == "step_00000002"
    assert (root / ".tmp-step_00000004").is_dir() and not (root / "step_00000004").exists()  # cut short
    # each save's row has the time the loop waited; the first row after a write ended, its duration
    assert "ckpt/blocking_s" in killed[2] and "ckpt/blocking_s" in killed[4]
    ended = [s for s in killed if killed[s].get("ckpt/write_step") == 2]
    assert len(ended) == 1 and ended[0] > 2 and killed[ended[0]]["ckpt/write_s"] > 0, killed
    assert not any(r.get("ckpt/write_step") == 4 for r in killed.values())  # step 4's write never ended

    # 2. the same command resumes from step 2 (the partial step 4 removed) and repeats the killed run's
    #    steps exactly; SIGTERM while its own step-4 write is in flight waits for it, saves, exits 0
    started = time.time()
    proc = _start(recipe, out)
    try:
        _wait_until(lambda: 5 in _rows(run) and _writing(run, since=started), proc, "step 5 during the step-4 write")
        proc.send_signal(signal.SIGTERM)
        text, _ = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, text[-3000:]
    assert "resumed at step 2" in text, text[-3000:]
    rows = read_metrics(run)
    for step in (3, 4, 5):
        assert rows[step]["train/loss"] == killed[step]["train/loss"], step
    saved = int(text.split("preemption signal received: saved at step ")[1].split(",")[0])
    assert saved > SLOW_STEP and (root / "latest").read_text() == f"step_{saved:08d}"
    for step in (SLOW_STEP, saved):
        assert (root / f"step_{step:08d}" / "COMPLETE").is_file(), step
    assert f"saved checkpoint {root / 'step_00000004'} (written in the background" in text, text[-3000:]
    assert not list(root.glob(".tmp-*"))
    assert sorted(rows) == list(range(1, saved + 1))  # one row per step
    assert rows[saved]["ckpt/write_step"] == saved
    assert rows[saved]["ckpt/blocking_s"] >= rows[saved]["ckpt/write_s"]  # it waited for its write
