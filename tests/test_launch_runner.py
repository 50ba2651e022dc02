"""launch.runner: N local processes with the torchrun-style environment (gloo on CPU)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import runner

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "tests" / "cluster" / "toy_train.py")


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_build_command_and_rank_env():
    assert runner.build_command(["x.py", "-a"]) == [sys.executable, "x.py", "-a"]
    assert runner.build_command(["-m", "launch.cli"]) == [sys.executable, "-m", "launch.cli"]
    assert runner.build_command(["echo", "hi"]) == ["echo", "hi"]
    with pytest.raises(ValueError, match="no command"):
        runner.build_command([])
    e = runner.rank_env(1, 3, "127.0.0.1", 1234, base={})
    assert {k: e[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "OMP_NUM_THREADS")} == {
        "RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "MASTER_PORT": "1234", "OMP_NUM_THREADS": "1"}


def test_main_rejects_missing_command(capsys):
    with pytest.raises(SystemExit) as err:
        runner.main(["-n", "2", "--"])
    assert err.value.code == 2
    assert "no command" in capsys.readouterr().err


def test_launch_subcommands_print_templates(capsys):
    assert runner.main(["slurm"]) == 0
    out = capsys.readouterr().out
    assert "slurm_train.sbatch" in out and "sbatch" in out
    assert (runner.TEMPLATES / "slurm_train.sbatch").exists() and (runner.TEMPLATES / "mpirun_train.sh").exists()
    assert runner.main(["mpirun"]) == 0
    assert "mpirun_train.sh" in capsys.readouterr().out


@pytest.mark.slow
def test_setdlm_launch_local_command(tmp_path):
    """The installed console script: `setdlm launch local -n 2 -- CMD`."""
    setdlm = Path(sys.executable).parent / "setdlm"
    if not setdlm.exists():
        pytest.skip("setdlm console script not installed in this environment")
    res = subprocess.run([str(setdlm), "launch", "local", "-n", "2", "--timeout", "120", "--",
                          TOY, "--out", str(tmp_path), "--steps", "1"], env=_env(), capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("env-rank*.json")) == ["env-rank0.json", "env-rank1.json"]


@pytest.mark.slow
def test_two_processes_all_reduce(tmp_path):
    rc = runner.main(["-n", "2", "--log-dir", str(tmp_path / "logs"), "--timeout", "120", "--",
                      TOY, "--out", str(tmp_path), "--steps", "2"])
    assert rc == 0, (tmp_path / "logs" / "rank0.log").read_text()
    envs = [json.loads((tmp_path / f"env-rank{r}.json").read_text()) for r in range(2)]
    assert [e["dist_rank"] for e in envs] == [0, 1]
    assert all(e["world_size"] == 2 and e["backend"] == "gloo" and e["launcher"] == "torchrun" for e in envs)
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["sum"] for m in metrics] == [3.0, 3.0]  # (0+1) + (1+1): both ranks took part


@pytest.mark.slow
def test_failure_of_one_rank_stops_the_others(tmp_path):
    t0 = time.monotonic()
    statuses = runner.run_local([TOY, "--out", str(tmp_path), "--steps", "1000", "--step-time", "1",
                                 "--fail-rank", "1"], 2, timeout=120, grace=5, env=_env())
    assert statuses[1] == 3
    assert statuses[0] != 0  # terminated (or failed in the collective) instead of running 1000 s
    assert runner.overall_status(statuses) != 0
    assert time.monotonic() - t0 < 90


@pytest.mark.slow
def test_signal_to_runner_is_forwarded_and_run_resumes(tmp_path):
    """SIGUSR1 to the runner reaches both ranks: they save and exit 0; a second run resumes."""
    cmd = [sys.executable, "-m", "launch.runner", "-n", "2", "--timeout", "150", "--",
           TOY, "--out", str(tmp_path), "--steps", "8", "--step-time", "0.5"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=_env())
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, "toy job did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=120) == 0
    ckpt = json.loads((tmp_path / "checkpoint.json").read_text())
    assert 2 <= ckpt["step"] < 8 and ckpt["signal"] == signal.SIGUSR1
    assert not (tmp_path / "done.json").exists()

    assert runner.run_local([TOY, "--out", str(tmp_path), "--steps", "8"], 2, timeout=120, env=_env()) == [0, 0]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(1, 9))  # resumed after the checkpointed step, nothing repeated or lost
    assert (tmp_path / "done.json").exists()
