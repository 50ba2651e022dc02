"""One rank of a multi-process job fails or is killed: every other rank exits within BOUND_S seconds with
one line naming that rank and why, none prints a traceback for it, and the last good checkpoint stays
complete (common/rankguard.py, docs/cluster.md "When a rank fails").

The slow tests run the real `setdlm pretrain` and `setdlm eval` under `setdlm launch local -n N`
(2 and 4 CPU ranks, gloo) through tests/rank_faults.py: a `kill -9` mid-step and mid-save, a user
error at start-up (the missing ZeRO-1 optimizer shard of one rank) and mid-step (a damaged shard only
one rank reads), for training and for evaluation. The fast ones check the notice board, the process
and heartbeat checks and the runner's line in one process.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, cli_env, write_recipe
from rank_faults import checkpoint_intact, records_written, run_with_rank_fault, saving, step_logged

BOUND_S = 60  # every survivor exits within this many seconds of the fault (CPU, gloo)
TRAIN = ["-m", "launch.cli", "pretrain"]


def assert_others_stopped(out, faulty: int, *, status: int, says: str) -> None:
    """Every rank but `faulty` exited with `status` within the bound, printing one error line holding `says`."""
    print(f"statuses {out.statuses}; seconds from the fault to each exit: {[round(x, 2) for x in out.exit_s]}")
    shown = [r for r in out.tracebacks if r != faulty]  # (a bug of the faulty rank keeps its own traceback)
    tails = "\n".join(out.logs[r][-3000:] for r in shown)
    assert not shown, f"a traceback in the output of ranks {shown}:\n{tails}"
    for r in out.survivors(faulty):
        assert out.statuses[r] == status, (r, out.statuses, out.logs[r][-2000:])
        assert out.exit_s[r] <= BOUND_S, (r, out.exit_s)
        assert len(out.error_lines[r]) == 1 and says in out.error_lines[r][0], (r, out.error_lines[r])


def latest(run: Path) -> Path:
    root = run / "checkpoints"
    return root / (root / "latest").read_text().strip()


# ---------------------------------------------------------------------------------------- fast checks
def test_board_keeps_the_first_notice_and_sees_a_killed_process(tmp_path):
    import datetime

    import torch.distributed as dist

    from common.env import find_free_port
    from common.rankfail import RANK_LOST, Board, process_alive, process_info
    from common.rankguard import Watchdog

    port = find_free_port()
    store = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=10),
                          wait_for_workers=False)
    board = Board(store, "t")
    first = board.publish(1, 2, "data.path: missing", by=1)
    assert board.publish(0, 75, "later", by=0) == first and board.notice()["reason"] == "data.path: missing"

    board = Board(store, "t2")
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.2)
        here = process_info()
        info = {**here, "pid": peer.pid}
        info["start"] = Path(f"/proc/{peer.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        board.register(1, info)
        watch = Watchdog("setdlm test", board, 0, 2, address=f"127.0.0.1:{port}", host_rank=0)
        assert process_alive(info, here) is True and watch.watch_next() is None
        peer.kill()
        peer.wait()
        assert process_alive(info, here) is False
        notice = watch.watch_next()
        assert notice["rank"] == 1 and notice["status"] == RANK_LOST and f"pid {peer.pid}" in notice["reason"]
        assert "rank 1 of 2 was lost: its process" in watch.line(notice) and "exit status 75" in watch.line(notice)
    finally:
        peer.kill()

    board = Board(store, "t3")  # a rank on another host: its heartbeat tells
    board.register(1, {**process_info(), "host": "elsewhere"})
    watch = Watchdog("setdlm test", board, 0, 2, address=f"127.0.0.1:{port}", host_rank=0, heartbeat_timeout_s=0.5)
    board.beat(1)
    assert watch.watch_next() is None
    board.beat(1)
    time.sleep(0.3)
    assert watch.watch_next() is None  # it beat since the last look
    time.sleep(0.7)
    notice = watch.watch_next()
    assert notice["rank"] == 1 and "no heartbeat from elsewhere" in notice["reason"]
    board = Board(store, "t4")  # a rank that finished normally is not watched
    board.register(1, {**process_info(), "host": "elsewhere"})
    board.leave(1)
    watch = Watchdog("setdlm test", board, 0, 2, address=f"127.0.0.1:{port}", host_rank=0, heartbeat_timeout_s=0.1)
    time.sleep(0.3)
    assert watch.watch_next() is None and watch.gone == {1}


def test_runner_names_the_rank_that_failed(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "launch.cli", "launch", "local", "-n", "2", "--", str(script)],
                       cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and time.monotonic() - t0 < 60
    assert "setdlm launch: rank 1 exited with status 3; stopping the other 1" in p.stderr


# ---------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """2 ranks, ZeRO-1, checkpoints every 2 steps; rank 1 gets `kill -9` once step 5 is logged."""
    tmp = tmp_path_factory.mktemp("killed")
    recipe = write_recipe(tmp / "r.yaml", train={"max_steps": 60, "micro_batch": 2, "eval_every": 0, "save_every": 2},
                          parallel={"zero_stage": 1})
    run = tmp / "runs" / "tiny"
    out = run_with_rank_fault([*TRAIN, "--config", str(recipe), "--out", str(tmp / "runs")], 2, log_dir=tmp / "logs",
                              kill_rank=1, when=lambda: step_logged(run, 5), timeout=400)
    return out, recipe, run


@pytest.mark.slow
def test_kill_9_of_one_of_two_ranks_mid_step(killed_run):
    out, _, run = killed_run
    assert out.triggered and out.statuses[1] == 128 + 9, out.runner_err
    assert_others_stopped(out, 1, status=75, says="rank 1 of 2 was lost: its process")
    assert "setdlm launch: rank 1 was killed by SIGKILL" in out.runner_err
    ckpt = latest(run)
    assert int(ckpt.name.split("_")[1]) >= 4 and checkpoint_intact(ckpt, 2) == []


@pytest.mark.slow
def test_missing_data_file_of_one_rank_at_start_up(killed_run, tmp_path):
    """The review's probe, for a sharded checkpoint: rank 1's data file is gone. Every rank reads the
    checkpoint's index before any data, so every rank stops at once with the one line naming the missing
    file (no gloo traceback, no hang), and the checkpoint is left as it was."""
    _, recipe, run = killed_run
    copy = tmp_path / "runs" / "tiny"
    shutil.copytree(run, copy)
    ckpt = latest(copy)
    shard = ckpt / "__1_0.distcp"
    shard.unlink()
    out = run_with_rank_fault([*TRAIN, "--config", str(recipe), "--out", str(tmp_path / "runs")], 2,
                              log_dir=tmp_path / "logs", timeout=400)
    said = f"checkpoint {ckpt}: incomplete: __1_0.distcp missing"
    assert out.statuses == [2, 2], (out.statuses, out.error_lines)
    for rank in (0, 1):
        assert len(out.error_lines[rank]) == 1 and said in out.error_lines[rank][0], out.error_lines
    assert latest(copy) == ckpt  # nothing was saved over it


@pytest.mark.slow
def test_kill_9_of_rank_0_of_four_mid_save(tmp_path):
    """Rank 0 hosts the job's store and publishes checkpoints: killed while step 6 is being written, the
    others name it, and step 3 stays the complete, undamaged latest checkpoint."""
    recipe = write_recipe(tmp_path / "r.yaml", train={"max_steps": 60, "micro_batch": 1, "eval_every": 0, "save_every": 3})
    run = tmp_path / "runs" / "tiny"
    out = run_with_rank_fault([*TRAIN, "--config", str(recipe), "--out", str(tmp_path / "runs")], 4,
                              log_dir=tmp_path / "logs", kill_rank=0, when=lambda: saving(run, after_step=3), timeout=500)
    assert out.triggered and out.statuses[0] == 128 + 9, out.runner_err
    assert_others_stopped(out, 0, status=75, says="rank 0 of 4 was lost")
    ckpt = latest(run)
    interrupted = sorted(p.name for p in (run / "checkpoints").glob(".tmp-step_*"))
    assert interrupted and interrupted[-1] > "." + ckpt.name, (interrupted, ckpt)  # killed mid-save of a later step
    assert checkpoint_intact(ckpt, 4) == []


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Training shards of 4 sequences: with global batch 16 over 4 ranks, rank r reads shard 4k + r at step k+1."""
    out = tmp_path_factory.mktemp("shards") / "data"
    p = subprocess.run([sys.executable, "-m", "launch.cli", "data", "prepare", "--input", "builtin:pydoc_topics",
                        "--output", str(out), "--seq-len", "32", "--val-docs", "1", "--max-docs", "4",
                        "--samples-per-shard", "4"], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return out


@pytest.mark.slow
def test_damaged_shard_read_by_one_of_four_ranks_mid_step(shards, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(shards, data)
    bad = data / "train" / "shard-000015.tar"  # rank 3's at step 4
    bad.write_bytes(bad.read_bytes()[:3000])
    recipe = write_recipe(tmp_path / "r.yaml", data={"source": str(data), "shuffle": False},
                          train={"max_steps": 8, "micro_batch": 4, "global_batch": 16, "eval_every": 0, "save_every": 2})
    run = tmp_path / "runs" / "tiny"
    out = run_with_rank_fault([*TRAIN, "--config", str(recipe), "--out", str(tmp_path / "runs")], 4,
                              log_dir=tmp_path / "logs", timeout=500)
    assert out.statuses[3] == 2 and len(out.error_lines[3]) == 1 and str(bad) in out.error_lines[3][0]
    assert_others_stopped(out, 3, status=2, says=f"rank 3 of 4 failed: {bad}: 3000 bytes, the manifest says")
    assert latest(run).name == "step_00000002" and checkpoint_intact(latest(run), 4) == []


# ---------------------------------------------------------------------------------------- evaluation
def _eval(run: Path, out: Path) -> list[str]:
    return ["-m", "launch.cli", "eval", "likelihood", "--checkpoint", str(run), "--out", str(out), "--batch-size", "1"]


@pytest.mark.slow
def test_kill_9_of_one_of_four_eval_ranks(killed_run, tmp_path):
    """Evaluation ranks share no collective: without the guard the others went on and rank 0 waited for
    the merge forever."""
    _, _, run = killed_run
    res = tmp_path / "lik"
    out = run_with_rank_fault(_eval(run, res), 4, log_dir=tmp_path / "logs", kill_rank=2,
                              when=lambda: records_written(res, 2, 2), timeout=400)
    assert out.triggered and out.statuses[2] == 128 + 9, out.runner_err
    assert_others_stopped(out, 2, status=75, says="rank 2 of 4 was lost: its process")
    assert not (res / "metrics.json").exists()


@pytest.mark.slow
def test_unusable_records_file_of_one_of_two_eval_ranks_at_start_up(killed_run, tmp_path):
    """A socket sits where rank 1's records file goes (rank 0 reads only regular files' contents): rank 1
    fails at start-up naming it, rank 0 names rank 1 and its reason."""
    import os
    import socket

    _, _, run = killed_run
    res = tmp_path / "lik"
    res.mkdir()
    here = os.getcwd()
    os.chdir(res)  # a relative name: socket paths are limited to 108 bytes
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.bind("records.rank00001.jsonl")
    finally:
        os.chdir(here)
    out = run_with_rank_fault(_eval(run, res), 2, log_dir=tmp_path / "logs", timeout=400)
    status = out.statuses[1]
    assert status in (1, 2) and "records.rank00001.jsonl" in out.logs[1], out.logs[1][-2000:]
    assert_others_stopped(out, 1, status=status, says="rank 1 of 2 failed: ")
    assert "records.rank00001.jsonl" in out.error_lines[0][0]


# ---------------------------------------------------------------------------------------- Slurm
def _worker_pid(job: str, rank: int) -> int | None:
    """The torchrun worker of Slurm job `job` with RANK=`rank` (a process of this machine)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            env = set((proc / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if f"SLURM_JOB_ID={job}".encode() in env and f"RANK={rank}".encode() in env \
                and any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env):
            return int(proc.name)
    return None


@pytest.mark.slurm
@pytest.mark.slow
def test_a_lost_rank_requeues_the_slurm_job_and_a_user_error_does_not(slurm, tmp_path):
    """The template under torchrun: `kill -9` of a worker -> the other says rank 1 was lost (75) ->
    the template requeues the job -> it resumes from the last checkpoint and completes. A recipe error
    exits 2 and is not requeued."""
    import os
    import signal

    from tests.cluster.jobs import (
        TEMPLATES,
        checkpoint_steps,
        job_env,
        metric_steps,
        tiny_train_args,
    )

    steps, runs = 24, tmp_path / "runs"
    sbatch = str(TEMPLATES / "slurm_train.sbatch")

    def submit(name, args):
        extra = ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1", "--time=10", "--ntasks-per-node=1",
                 f"--job-name={name}", f"--output={tmp_path}/%x-%j.out"]
        job = slurm.sbatch([sbatch, *args], extra=extra, env=job_env(LAUNCHER="torchrun", GPUS_PER_NODE="2",
                                                                      RUNS_DIR=str(runs)), cwd=REPO)
        return job, lambda: (tmp_path / f"{name}-{job}.out").read_text(errors="replace")

    job, log = submit("lost-rank", tiny_train_args(steps, 4))
    run = runs / "lost-rank"
    deadline = time.monotonic() + 300
    while max(checkpoint_steps(run), default=0) < 4 or len(metric_steps(run)) < 6:
        assert slurm.state(job) in ("PENDING", "RUNNING", "CONFIGURING"), log() + slurm.logs_tail()
        assert time.monotonic() < deadline, "job did not train in time:\n" + log()
        time.sleep(0.2)
    pid = _worker_pid(job, 1)
    assert pid is not None, log()
    os.kill(pid, signal.SIGKILL)
    saved = max(checkpoint_steps(run))
    info = slurm.wait(job, timeout=180, states={"PENDING", "COMPLETED", "FAILED", "CANCELLED"}, poll=0.2)
    while info.get("JobState") != "PENDING" or info.get("Restarts") != "1":
        assert info.get("JobState") not in ("COMPLETED", "FAILED", "CANCELLED"), f"not requeued: {info}\n{log()}"
        time.sleep(0.2)
        info = slurm.job_info(job)
    out = log()
    assert "setdlm pretrain: error: rank 1 of 2 was lost: its process" in out, out
    assert "requeueing job" in out and "rank00000 exit status 75 rank 1 of 2 was lost" in out
    first = out.split("requeueing job")[0]
    assert first.count("Traceback") == first.count("Traceback (most recent call last):\n  File \"" +
                                                    str(Path(sys.executable).parent / "torchrun"))  # torchrun's own report
    slurm.release(job)
    info = slurm.wait(job, timeout=300)
    out = log()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out + slurm.logs_tail()
    resumed = int(out.split("resumed at step ")[1].split()[0])
    assert resumed >= saved, out
    assert sorted(set(metric_steps(run))) == list(range(1, steps + 1)) and max(checkpoint_steps(run)) == steps

    job, log = submit("user-error", tiny_train_args(steps, 4) + ["train.max_steps=0"])
    info = slurm.wait(job, timeout=300)
    out = log()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0" and info["Restarts"] == "0", out
    assert "train.max_steps" in out and "not requeued" in out
