"""The Slurm batch template on a real one-node Slurm cluster, running real `setdlm pretrain` jobs.

The cluster (munge, slurmctld, slurmd) is started by the module fixture; the tests skip when not
root or when the Debian packages slurm-wlm/munge are missing (`bash scripts/install.sh --test`
as root installs them).
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.cluster.jobs import REPO, TEMPLATES, checkpoint_steps, job_env, metric_steps, tiny_train_args
from tests.cluster.slurm import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SBATCH = str(TEMPLATES / "slurm_train.sbatch")
# one node, no GPUs: override the template's GPU/CPU/exclusive requests on the command line
CPU_NODE = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10"]


def _submit(slurm: SlurmCluster, tmp_path: Path, name: str, launcher: str, steps: int, save_every=None,
            **env_extra):
    runs = tmp_path / "runs"
    extra = [*CPU_NODE, f"--job-name={name}", f"--output={tmp_path}/%x-%j.out"]
    extra.append("--ntasks-per-node=2" if launcher == "srun" else "--ntasks-per-node=1")
    env = job_env(LAUNCHER=launcher, GPUS_PER_NODE="2", RUNS_DIR=str(runs), **env_extra)
    job = slurm.sbatch([SBATCH, *tiny_train_args(steps, save_every)], extra=extra, env=env, cwd=REPO)
    return job, runs / name, lambda: (tmp_path / f"{name}-{job}.out").read_text(errors="replace")


def test_two_task_training_job_completes(slurm, tmp_path):
    """srun starts 2 tasks; common.env reads SLURM_PROCID/SLURM_NTASKS; the run trains 6 steps."""
    # launcher variables of the submitting shell are exported by sbatch: the template must drop them
    stale = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "10.255.255.1", "MASTER_PORT": "1"}
    job, run_dir, log = _submit(slurm, tmp_path, "slurm-2task", "srun", steps=6, save_every=3, **stale)
    info = slurm.wait(job, timeout=300)
    out = log()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out + slurm.logs_tail()
    assert "world 2 " in out and "launcher=srun" in out
    assert metric_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    assert checkpoint_steps(run_dir) == [3, 6]
    assert (run_dir / "config.yaml").exists()


@pytest.mark.parametrize(
    "launcher, how",
    [
        # the warning signal path: --signal=USR1@120 = USR1 to every process of the steps; torchrun ignores it
        ("torchrun", ["--signal=USR1"]),
        # TERM to the batch shell only: the template forwards it to the steps as USR1
        ("srun", ["--batch", "--signal=TERM"]),
    ],
    ids=["torchrun-USR1-to-steps", "srun-TERM-to-batch-shell"],
)
def test_signalled_job_saves_is_requeued_and_resumes(slurm, tmp_path, launcher, how):
    steps = 40
    name = f"slurm-preempt-{launcher}"
    job, run_dir, log = _submit(slurm, tmp_path, name, launcher, steps=steps, save_every=20)
    deadline = time.monotonic() + 240
    while len(metric_steps(run_dir)) < 3:  # training is under way, handler installed
        assert slurm.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), log() + slurm.logs_tail()
        assert time.monotonic() < deadline, "job did not start training in time:\n" + log()
        time.sleep(0.2)
    slurm.scancel(job, *how)

    # the job saves, rank 0 runs `scontrol requeue`; Slurm holds a requeued job back for about two
    # minutes (BeginTime) -- release it now instead of waiting
    info = slurm.wait(job, timeout=180, states={"PENDING", "COMPLETED", "FAILED", "CANCELLED"},
                      poll=0.2)
    while info.get("JobState") != "PENDING" or info.get("Restarts") != "1":
        assert info.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"), \
            f"job was not requeued: {info}\n{log()}"
        time.sleep(0.2)
        info = slurm.job_info(job)
    first = metric_steps(run_dir)
    saved = checkpoint_steps(run_dir)
    assert first and first[-1] < steps, f"the signal did not stop the run: {first[-5:]}\n{log()}"
    assert saved and saved[-1] == first[-1], f"no checkpoint at the stop step {first[-1]}: {saved}"
    slurm.release(job)

    info = slurm.wait(job, timeout=300)
    out = log()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out + slurm.logs_tail()
    assert info["Restarts"] == "1"
    stop = first[-1]
    assert f"preemption signal received: saved at step {stop}" in out
    assert f"resumed at step {stop}" in out
    assert "restart 1 on" in out  # the template's banner of the second attempt
    assert metric_steps(run_dir) == list(range(1, steps + 1))  # nothing lost, nothing repeated
    assert checkpoint_steps(run_dir)[-1] == steps
