"""tests/distributed_run.py: ranks get torchrun's environment and return their results; a rank that
raises, dies or hangs fails the call with that rank's traceback or name, without hanging the suite."""

from __future__ import annotations

import os
import time

import pytest

from distributed_run import RankFailed, RankTimeout, run_distributed

pytestmark = pytest.mark.slow


def all_reduce_rank(extra: int) -> dict:
    import torch
    import torch.distributed as dist

    from common.dist import ensure_process_group

    ensure_process_group()
    total = torch.tensor([dist.get_rank() + extra])
    dist.all_reduce(total)
    print(f"rank {dist.get_rank()} says hello")
    keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "SETDLM_PROBE")
    return {"backend": dist.get_backend(), "sum": int(total), "tensor": torch.arange(3) * dist.get_rank(),
            "env": {k: os.environ.get(k) for k in keys}}


def raise_on_rank_1() -> None:
    import torch.distributed as dist

    from common.dist import ensure_process_group

    ensure_process_group()
    if dist.get_rank() == 1:
        raise ValueError("rank 1 found a wrong value")
    dist.barrier()  # rank 0 waits here for a rank that will never come


def exit_on_rank_0() -> None:
    if os.environ["RANK"] == "0":
        os._exit(3)
    time.sleep(600)


def hang_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        print("rank 1 goes to sleep", flush=True)
        time.sleep(3600)


def test_ranks_get_torchrun_variables_and_return_their_results():
    ranks = run_distributed(all_reduce_rank, 2, 10, env={"SETDLM_PROBE": "yes"}, timeout=300)
    a, b = ranks.results
    assert a["sum"] == b["sum"] == 21 and a["backend"] == "gloo"
    assert a["tensor"].tolist() == [0, 0, 0] and b["tensor"].tolist() == [0, 1, 2]
    assert [r["env"]["RANK"] for r in ranks.results] == ["0", "1"]
    assert a["env"]["MASTER_PORT"] == b["env"]["MASTER_PORT"] and a["env"]["MASTER_ADDR"] == "127.0.0.1"
    assert a["env"]["WORLD_SIZE"] == "2" and a["env"]["OMP_NUM_THREADS"] == "1" and b["env"]["SETDLM_PROBE"] == "yes"
    assert "rank 1 says hello" in ranks.logs[1] and "rank 1 says hello" not in ranks.logs[0]
    assert "SETDLM_PROBE" not in os.environ  # the test process's environment is left as it was


def test_a_rank_that_raises_fails_the_call_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_distributed(raise_on_rank_1, 2, timeout=300)
    msg = str(info.value)
    assert not isinstance(info.value, RankTimeout)
    # rank 1 is the cause; rank 0, whose barrier lost its peer, failed after it
    assert msg.startswith("rank 1 of 2 failed first: Traceback") and "ValueError: rank 1 found a wrong value" in msg, msg
    assert "in raise_on_rank_1" in msg  # the traceback, not only the message
    assert "\n--- then rank 0 failed: RuntimeError" in msg, msg
    assert time.monotonic() - t0 < 200  # rank 0, blocked in the barrier, was stopped


def test_a_rank_that_dies_fails_the_call_with_its_exit_status():
    with pytest.raises(RankFailed, match="^rank 0 of 2 failed: exited with status 3"):
        run_distributed(exit_on_rank_0, 2, timeout=300)


def test_a_hung_rank_fails_the_call_at_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_distributed(hang_on_rank_1, 2, timeout=20)
    msg = str(info.value)
    assert msg.startswith("rank 1 of 2 still running after 20s (stopped)") and "rank 1 goes to sleep" in msg, msg
    assert time.monotonic() - t0 < 60
