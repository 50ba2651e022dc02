"""Per-shard initialisation (model/init.py): TP=2 shards are exactly the TP=1 weights, and the host
memory a rank needs to build its shard halves with TP=2 (no rank draws a full weight)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers import REPO, cli_env

pytestmark = pytest.mark.slow


def build(out, nproc: int) -> list[dict]:
    worker = [str(REPO / "tests" / "init_worker.py"), "--out", str(out)]
    cmd = [sys.executable, *worker] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *worker]
    # a fixed mmap threshold: glibc's default one grows after the first large free, after which freed
    # init units may stay resident in the heap and count in the peak RSS (about one in three runs at TP=2)
    env = {**cli_env(), "MALLOC_MMAP_THRESHOLD_": "65536"}
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return [torch.load(out / f"tp{nproc}_rank{r}.pt", weights_only=False) for r in range(nproc)]


def test_tp2_shards_equal_tp1_weights_and_host_memory_halves(tmp_path):
    (one,) = build(tmp_path, 1)
    two = build(tmp_path, 2)
    for name, full in one["state"].items():
        dim = two[0]["dims"][name]
        got = torch.cat([two[0]["state"][name], two[1]["state"][name]], dim=dim) if dim is not None else two[0]["state"][name]
        assert torch.equal(got, full), name
        if dim is None:
            assert torch.equal(two[1]["state"][name], full), name
    assert one["state"]["layers.0.attn.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    # building a rank's shard takes about its parameters' bytes: half under TP=2
    assert one["peak_mib"] < 1.3 * one["params_mib"] + 40, one
    for rank in two:
        assert rank["params_mib"] < 0.52 * one["params_mib"]
        assert rank["peak_mib"] < 0.65 * one["peak_mib"], (rank["peak_mib"], one["peak_mib"])
