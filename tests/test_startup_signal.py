"""A signal during start-up is acknowledged at once, on one line ("stopping after set-up"), while the
run is still setting up; the run then saves at its first step and exits. A signal during training does
not print it. (Real processes and signals: tests/test_run_signals.py's helpers.)"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from helpers import write_recipe
from test_run_signals import _catches, _start, _wait_for_step, _wait_until

pytestmark = pytest.mark.slow
LINE = "stopping after set-up"


def _reader(proc):
    lines: list[tuple[float, str]] = []

    def read():
        for line in proc.stdout:
            lines.append((time.monotonic(), line))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return lines, t


def test_a_startup_signal_is_acknowledged_at_once(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    out, run = tmp_path / "runs", tmp_path / "runs" / "4242"
    proc = _start(recipe, out, "train.max_steps=40", "train.save_every=40", "train.eval_every=100")
    lines, reader = _reader(proc)
    _wait_until(lambda: _catches(proc.pid, signal.SIGTERM), proc, "SIGTERM handler", timeout=120)
    assert not (run / "config.yaml").exists()  # still setting up
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _wait_until(lambda: any(LINE in line for _, line in lines), proc, "the start-up signal line", timeout=10)
    seen = next(t for t, line in lines if LINE in line)
    assert seen - sent < 2.0, f"acknowledged {seen - sent:.1f}s after the signal"
    assert proc.wait(timeout=400) == 0
    reader.join(timeout=10)
    text = "".join(line for _, line in lines)
    assert text.count(LINE) == 1 and "SIGTERM during start-up" in text, text[-3000:]
    assert "preemption signal received: saved at step 1" in text, text[-3000:]


def test_a_signal_during_training_does_not_say_setup(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    out, run = tmp_path / "runs", tmp_path / "runs" / "4242"
    proc = _start(recipe, out, "train.max_steps=400", "train.save_every=400", "train.eval_every=1000")
    lines, reader = _reader(proc)
    _wait_for_step(proc, run, 1)  # a training step has run: set-up is over
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=400) == 0
    reader.join(timeout=10)
    text = "".join(line for _, line in lines)
    assert "preemption signal received: saved at step" in text and LINE not in text, text[-3000:]
