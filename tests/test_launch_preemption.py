"""pretrain.preemption.PreemptionHandler: signal recording, cross-rank agreement, Slurm requeue."""
from __future__ import annotations

import json
import os
import signal
import stat
from pathlib import Path

import pytest

from launch import runner
from pretrain.preemption import PreemptionHandler

REPO = Path(__file__).resolve().parents[1]
TOY = str(REPO / "tests" / "cluster" / "toy_train.py")


def test_records_signal_and_restores_previous_handler():
    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        h = PreemptionHandler()
        with h:
            assert not h.should_stop()
            os.kill(os.getpid(), signal.SIGUSR1)
            assert h.received == signal.SIGUSR1
            os.kill(os.getpid(), signal.SIGTERM)
            assert h.received == signal.SIGUSR1  # the first one is kept
            assert h.should_stop() and h.should_stop()  # sticky
        assert seen == []
        os.kill(os.getpid(), signal.SIGUSR1)  # the previous handler is back
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_custom_signals_and_trigger():
    h = PreemptionHandler(signals=(signal.SIGUSR2,)).install()
    try:
        assert h.signals == (signal.SIGUSR2,)
        h.trigger(signal.SIGUSR2)
        assert h.should_stop()
    finally:
        h.uninstall()
    assert signal.getsignal(signal.SIGUSR2) in (signal.SIG_DFL, None)


def _fake_scontrol(tmp_path: Path) -> Path:
    log = tmp_path / "scontrol.log"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "scontrol"
    exe.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return log


def test_requeue_runs_scontrol_only_under_slurm(tmp_path, monkeypatch):
    log = _fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    for k in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI", "RANK", "WORLD_SIZE"))]:
        monkeypatch.delenv(k)
    # without a process group the rank comes from the launcher variables (another test of this
    # session may have created a one-process group in this interpreter)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    h = PreemptionHandler()
    h.requeue()  # no SLURM_JOB_ID: no-op
    assert not log.exists()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SETDLM_NO_REQUEUE", "1")
    h.requeue()
    assert not log.exists()
    monkeypatch.delenv("SETDLM_NO_REQUEUE")
    h.requeue()
    assert log.read_text().split() == ["requeue", "4242"]
    # a non-zero rank never requeues
    log.unlink()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    h.requeue()
    assert not log.exists()


@pytest.mark.slow
def test_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    statuses = runner.run_local(
        [TOY, "--out", str(tmp_path), "--steps", "6", "--signal-rank", "1", "--signal-step", "3"],
        2, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert statuses == [0, 0]
    assert json.loads((tmp_path / "checkpoint.json").read_text())["step"] == 3
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # rank 0 got no signal but stopped with rank 1
    assert not (tmp_path / "done.json").exists()


def agree_every(every: int) -> list:
    """One rank: rank 1 is signalled after step 3; the ranks ask at steps 1..8, agreeing every `every`."""
    import torch.distributed as dist

    from common.dist import init_process_group

    init_process_group()
    h = PreemptionHandler(signals=(signal.SIGUSR2,)).install()
    try:
        answers = []
        for step in range(1, 9):
            if step == 4 and dist.get_rank() == 1:
                h.trigger(signal.SIGUSR2)
            answers.append(h.should_stop(step, every=every))
        return answers
    finally:
        h.uninstall()


@pytest.mark.slow
def test_ranks_agree_only_at_checking_steps():
    """A signal on one rank stops every rank at the same step: the first multiple of `every` at or after
    it; the steps between run no collective (every rank must still call at every step)."""
    from distributed_run import run_distributed

    for every, first in ((1, 4), (3, 6)):
        ranks = run_distributed(agree_every, 2, every, timeout=120)
        want = [False] * (first - 1) + [True] * (9 - first)
        assert ranks.results[0] == want and ranks.results[1] == want, (every, ranks.results)
