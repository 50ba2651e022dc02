"""Real `setdlm pretrain` processes and real signals: a signal during start-up is honoured after set-up,
SIGKILL + resume leaves one metrics.jsonl row per step, Ctrl-C saves at the next step, a second Ctrl-C
exits at once."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, cli_env, write_recipe

pytestmark = pytest.mark.slow


def _start(recipe: Path, out: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "launch.cli", "pretrain", "--config", str(recipe), "--out", str(out), "--name", "4242",
           *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except (ValueError, KeyError):
            pass
    return steps


def _wait_for_step(proc: subprocess.Popen, run: Path, step: int, timeout: float = 400) -> None:
    t0 = time.monotonic()
    while max(_steps(run), default=-1) < step:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.monotonic() - t0 < timeout, "run too slow"
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_startup_signal_kill_resume_and_ctrl_c(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    out, run = tmp_path / "runs", tmp_path / "runs" / "4242"
    long = ["train.max_steps=40", "train.save_every=4", "train.eval_every=100"]

    # 1. SIGTERM while the process is still importing / setting up: kept, honoured after the first step
    proc = _start(recipe, out, *long)
    time.sleep(3.0)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    code, text = _finish(proc)
    assert code == 0, text[-3000:]
    assert "preemption signal received: saved at step 1" in text, text[-3000:]
    assert (run / "checkpoints" / "step_00000001" / "COMPLETE").is_file()

    # 2. resume, then SIGKILL after step 6 (past the step-4 checkpoint): the rows after the checkpoint the
    #    next run resumes from are in metrics.jsonl twice unless that run drops them...
    proc = _start(recipe, out, *long)
    _wait_for_step(proc, run, 6)
    proc.kill()
    proc.wait()
    killed = max(_steps(run))
    resume = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*") if (p / "COMPLETE").is_file())
    assert killed >= 6 and 4 <= resume <= killed

    # 3. ...which the resumed run does; then Ctrl-C saves at the next step and exits cleanly. Wait for a step
    #    the killed run never logged (the killed run's rows would satisfy any smaller one).
    proc = _start(recipe, out, *long)
    _wait_for_step(proc, run, killed + 2)
    proc.send_signal(signal.SIGINT)
    code, text = _finish(proc)
    assert code == 0, text[-3000:]
    assert f"resumed at step {resume}" in text, text[-3000:]
    assert ("metrics.jsonl: dropped" in text) == (killed > resume), text[-3000:]
    saved = int(text.split("preemption signal received: saved at step ")[1].split(",")[0])
    assert saved >= killed + 2 and (run / "checkpoints" / f"step_{saved:08d}" / "COMPLETE").is_file()
    steps = _steps(run)
    assert len(steps) == len(set(steps)) and steps == sorted(steps), steps
    assert steps[-1] == saved and "Traceback" not in text


def test_second_ctrl_c_exits_at_once(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    out, run = tmp_path / "runs", tmp_path / "runs" / "4242"
    log = tmp_path / "out.log"
    with open(log, "w") as sink:
        cmd = [sys.executable, "-m", "launch.cli", "pretrain", "--config", str(recipe), "--out", str(out), "--name",
               "4242", "train.max_steps=200", "train.save_every=100", "train.eval_every=1000",
               # 50 micro-batches per step (~2.5 s here): the second Ctrl-C lands inside the step the first one
               # asked to end with a save, not after the save, when the process is already exiting
               "train.global_batch=200"]
        proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=sink, stderr=subprocess.STDOUT, text=True)
        _wait_for_step(proc, run, 1)
        proc.send_signal(signal.SIGINT)
        # Two signals that arrive while the interpreter is inside one long kernel run one Python handler:
        # send the second only after the first one has been handled (its notice is printed).
        t1 = time.monotonic()
        while "Ctrl-C: saving" not in log.read_text():
            assert proc.poll() is None and time.monotonic() - t1 < 60, log.read_text()[-3000:]
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    code, text = proc.returncode, log.read_text()
    assert code == 130, text[-3000:]
    assert time.monotonic() - t0 < 10
    assert "Ctrl-C again: exiting without saving" in text and "Traceback" not in text
