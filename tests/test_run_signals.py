"""Real `setdlm pretrain` processes and real signals: a signal during start-up is honoured after set-up,
SIGKILL + resume leaves one metrics.jsonl row per step, Ctrl-C saves at the next step, a second Ctrl-C
exits at once.

Event-driven, with bounded waits: signals are sent when the process is seen in the state the test needs
(its handler installed: /proc/PID/status; a step logged: metrics.jsonl; the first Ctrl-C handled: its
notice), never after a fixed sleep or on the assumption that a step takes long enough. To hold a run
inside a step, its stdout is a one-page pipe the test stops reading: the step blocks in writing its
console line, before it can reach the step boundary where the save happens.
"""

from __future__ import annotations

import json
import os
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


def _wait_until(done, proc: subprocess.Popen, what: str, timeout: float = 400) -> None:
    """Poll `done()` until it holds; fail if the process exits first or after `timeout` seconds."""
    t0 = time.monotonic()
    while not done():
        assert proc.poll() is None, f"the run exited before {what}"
        assert time.monotonic() - t0 < timeout, f"no {what} after {timeout:.0f}s"
        time.sleep(0.05)


def _wait_for_step(proc: subprocess.Popen, run: Path, step: int, timeout: float = 400) -> None:
    _wait_until(lambda: max(_steps(run), default=-1) >= step, proc, f"metrics row for step {step}", timeout)


def _catches(pid: int, sig: int) -> bool:
    """Whether the process has a handler for `sig` (the SigCgt mask of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def _blocked_writing_stdout(pid: int) -> bool:
    """Whether the process's main thread sleeps in write(1, ...) on a full pipe (/proc/PID/syscall: the
    syscall number and its first argument; /proc/PID/wchan: where the kernel put it to sleep)."""
    write = {"x86_64": 1, "aarch64": 64}.get(os.uname().machine)
    try:
        call = Path(f"/proc/{pid}/syscall").read_text().split()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False
    return (len(call) > 1 and call[0] == str(write) and int(call[1], 16) == 1) or "pipe_write" in wchan


def _finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out


def test_startup_signal_kill_resume_and_ctrl_c(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    out, run = tmp_path / "runs", tmp_path / "runs" / "4242"
    long = ["train.max_steps=40", "train.save_every=4", "train.eval_every=100"]

    # 1. SIGTERM while the process is still importing / setting up: kept, honoured after the first step.
    #    Sent once the handler is installed (the CLI does it first) and before the trainer has written the
    #    run's config.yaml (it does before step 1).
    proc = _start(recipe, out, *long)
    _wait_until(lambda: _catches(proc.pid, signal.SIGTERM), proc, "SIGTERM handler", timeout=120)
    assert not (run / "config.yaml").exists()
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
    """The first Ctrl-C asks for a save at the end of the step; a second one inside that step exits at
    once, without the save. The step is held open by the full stdout pipe (module docstring)."""
    recipe = write_recipe(tmp_path / "r.yaml")
    out, run = tmp_path / "runs", tmp_path / "runs" / "4242"
    log = tmp_path / "err.log"
    with open(log, "w") as sink:
        cmd = [sys.executable, "-m", "launch.cli", "pretrain", "--config", str(recipe), "--out", str(out), "--name",
               "4242", "train.max_steps=100000", "train.save_every=100000", "train.eval_every=100000"]
        proc = subprocess.Popen(cmd, cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=sink, pipesize=4096)
        try:
            printed = b""
            while b"step 1/" not in printed:  # read the console until training runs, then stop reading
                chunk = os.read(proc.stdout.fileno(), 4096)
                assert chunk, log.read_text()[-3000:]
                printed += chunk
            _wait_until(lambda: _blocked_writing_stdout(proc.pid), proc, "write blocked on the full pipe", timeout=120)
            proc.send_signal(signal.SIGINT)
            # Two signals that arrive before the interpreter runs its Python handler run it once: send the
            # second only after the first one has been handled (its notice is printed).
            _wait_until(lambda: "Ctrl-C: saving" in log.read_text(), proc, "notice of the first Ctrl-C", timeout=60)
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
            elapsed = time.monotonic() - t0
            printed += proc.stdout.read()
        finally:
            proc.kill()
            proc.wait()
    code, text = proc.returncode, log.read_text() + printed.decode(errors="replace")
    assert code == 130, text[-3000:]
    assert elapsed < 10
    assert "Ctrl-C again: exiting without saving" in text and "Traceback" not in text
    assert not list((run / "checkpoints").glob("step_*")), "the step the first Ctrl-C ended was saved"
