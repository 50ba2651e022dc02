"""Training under mpirun (Open MPI) through launch/templates/mpirun_train.sh."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.cluster.jobs import REPO, TEMPLATES, checkpoint_steps, job_env, metric_steps, tiny_train_args

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

if shutil.which("mpirun") is None:
    pytest.skip("mpirun not found (Debian: apt-get install openmpi-bin libopenmpi-dev; "
                "`bash scripts/install.sh --test` as root does it)", allow_module_level=True)

ROOT_ARGS = ["--allow-run-as-root"] if os.geteuid() == 0 else []


def _mpirun_template(tmp_path, args, timeout=300, **env):
    environ = {**os.environ, **job_env(GPUS_PER_NODE="2", NP="2", **env),
               "MPIRUN_ARGS": " ".join([*ROOT_ARGS, "--oversubscribe"])}
    return subprocess.run(["bash", str(TEMPLATES / "mpirun_train.sh"), *args], cwd=REPO, env=environ,
                          capture_output=True, text=True, timeout=timeout)


def _without_launcher_vars() -> dict:
    # Earlier in-process tests export RANK/WORLD_SIZE (a one-process group); torchrun's variables take
    # precedence in detect_env, so the probe must not inherit them.
    drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def test_launch_env_reads_open_mpi_variables_and_mpi4py_fallback(tmp_path):
    pytest.importorskip("mpi4py")
    res = subprocess.run(["mpirun", *ROOT_ARGS, "--oversubscribe", "-np", "2", sys.executable,
                          str(REPO / "tests" / "cluster" / "mpi_env_probe.py")],
                         capture_output=True, text=True, timeout=120,
                         env={**_without_launcher_vars(), **job_env(), "PROBE_DIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout + res.stderr
    rows = sorted((json.loads(f.read_text()) for f in tmp_path.glob("rank*.json")), key=lambda r: r["full"]["rank"])
    assert [r["full"]["rank"] for r in rows] == [0, 1]
    for r in rows:
        full, fb = r["full"], r["mpi4py"]
        assert full["launcher"] == "mpi" and full["world_size"] == 2 and full["local_world_size"] == 2
        assert full["local_rank"] == full["rank"] and full["master_addr"] == "127.0.0.1"
        # only PMIX_RANK left: world size and local rank from mpi4py, same answer
        assert (fb["launcher"], fb["rank"], fb["world_size"], fb["local_rank"], fb["local_world_size"]) == (
            "mpi", full["rank"], 2, full["local_rank"], 2)
    assert rows[0]["full"]["master_port"] == rows[1]["full"]["master_port"]  # derived from the MPI job id


def test_training_under_mpirun_template(tmp_path):
    # stale launcher variables in the calling shell must not override Open MPI's
    stale = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "1"}
    res = _mpirun_template(tmp_path, tiny_train_args(6, save_every=3), RUNS_DIR=str(tmp_path), RUN_NAME="mpi-run",
                           **stale)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    assert "world 2 " in out
    run_dir = tmp_path / "mpi-run"
    assert metric_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    assert checkpoint_steps(run_dir) == [3, 6]
