"""A rank's peak host memory while loading a format-2 checkpoint is its own shard plus a bounded buffer.

A fresh interpreter (`measure`) writes a 64 MiB "model" (16 fp32 matrices of 4 MiB) as a 4-rank save
would store it (each matrix in 4 row chunks of 1 MiB), then, as rank 3 of a 16-rank ZeRO-3 layout,
reads only its slice of every matrix (1/16: 4 MiB in all) through the loader the trainer uses
(`distcp.load` with a `Chunked` state of views into its own buffers). Its peak resident memory grows
by at most DCP's read buffer (one stored chunk, 1 MiB, plus allocator slack), far below the whole
model; the same process reading the whole model grows by the whole model (the measurement can fail),
and the slice read holds the right values.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, cli_env

MIB = 2**20
N, ROWS, COLS = 16, 1024, 1024  # 16 x 4 MiB
SAVED_CHUNKS, WORLD, RANK = 4, 16, 3


def measure(path: str) -> dict:
    import gc
    import math

    import torch
    import torch.distributed.checkpoint as dcp

    from common.procmem import peak_rss_mib, reset_peak_rss, rss_mib
    from pretrain.checkpoint import distcp

    def release() -> None:
        """Free memory goes back to the system (glibc's malloc_trim), so a later read cannot grow into
        what the allocator kept from earlier work unseen by the resident-set measurement."""
        gc.collect()
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass

    def value(i: int) -> torch.Tensor:
        return torch.arange(ROWS * COLS, dtype=torch.float32).view(ROWS, COLS) + 1000.0 * i

    state = {}
    for i in range(N):
        full = value(i)
        rows = ROWS // SAVED_CHUNKS
        state[f"model/w{i}"] = distcp.Chunked((ROWS, COLS), torch.float32,
                                              [((c * rows, 0), full[c * rows:(c + 1) * rows].clone())
                                               for c in range(SAVED_CHUNKS)])
    dcp.save(state, storage_writer=distcp.writer(path), planner=distcp.ChunkSavePlanner(), no_dist=True)
    del state, full
    gc.collect()
    # warm up the read path (imports, first allocations) on one matrix, then measure
    distcp.read_full(path, ["model/w0"])
    n = ROWS * COLS
    part = math.ceil(n / WORLD)
    start, end = RANK * part, min(n, (RANK + 1) * part)
    mine = {f"model/w{i}": torch.empty(end - start) for i in range(N)}  # this rank's own state
    target = {}
    for key, flat in mine.items():
        target[key] = distcp.Chunked((ROWS, COLS), torch.float32)
        target[key].add_flat((ROWS, COLS), (0, 0), flat, start)
    release()
    assert reset_peak_rss(), "cannot reset the peak RSS here"
    before = rss_mib()
    distcp.load(target, path, no_dist=True)
    shard_read = peak_rss_mib() - before
    ok = all(torch.equal(mine[f"model/w{i}"], value(i).view(-1)[start:end]) for i in range(N))
    release()
    reset_peak_rss()
    before = rss_mib()
    whole = distcp.read_full(path, [f"model/w{i}" for i in range(N)])
    whole_read = peak_rss_mib() - before
    return {"shard_read_mib": shard_read, "whole_read_mib": whole_read, "values_ok": ok,
            "shard_mib": sum(t.numel() * 4 for t in mine.values()) / MIB, "whole_mib": N * ROWS * COLS * 4 / MIB,
            "n_whole": len(whole)}


@pytest.mark.slow
def test_a_rank_reads_its_shard_with_a_bounded_buffer(tmp_path):
    code = (f"import sys, json; sys.path.insert(0, {str(REPO / 'tests')!r}); from test_checkpoint_memory import measure; "
            f"print('RESULT', json.dumps(measure({str(tmp_path / 'ckpt')!r})))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    got = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert got["values_ok"] and got["n_whole"] == N
    assert got["whole_mib"] == 64 and got["shard_mib"] == 4
    # the whole model read takes the whole model (the measurement sees allocations)...
    assert got["whole_read_mib"] >= 0.75 * got["whole_mib"], got
    # ...the shard read, into the rank's own buffers, only DCP's buffer: one stored chunk (1 MiB) + slack
    assert got["shard_read_mib"] <= 8, got
