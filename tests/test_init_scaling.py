"""Per-shard initialisation (model/init.py): TP=2 shards are exactly the TP=1 weights, and the host
memory a rank needs to build its shard halves with TP=2 (no rank draws a full weight)."""

from __future__ import annotations

import resource

import pytest
import torch

from common.procmem import peak_rss_mib, reset_peak_rss, rss_mib
from distributed_run import run_distributed

pytestmark = pytest.mark.slow

MID = dict(n_layers=4, hidden=512, n_heads=8, n_kv_heads=4, ffn_hidden=2048, norm="rmsnorm", activation="swiglu",
           qk_norm=True, bias=False, tie_embeddings=False, vocab_size=32000, mask_id=31999, dropout=0.0)


def build_rank() -> dict:
    """One rank (TP = the world size, gloo) builds the mid-size model: its parameters, their
    tensor-parallel split dims, and the peak RSS increase of the process while the model was built (MiB)."""
    import torch.distributed as dist

    from model.config import ModelConfig
    from pretrain.parallel import ensure_model_parallel, ensure_process_group
    from pretrain.parallelize import build_stage

    ensure_process_group()
    tp = dist.get_world_size()
    ensure_model_parallel(tp, 1)
    cfg = ModelConfig(**MID)
    torch.manual_seed(5)
    before = rss_mib()
    reset = reset_peak_rss()  # the import-time high-water mark must not count as the build's
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    model = build_stage(cfg, tp, 1, device="cpu")
    if reset:
        peak = peak_rss_mib() - before
    else:
        peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, peak_before) - before
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    dims = {n: (p.partition_dim if getattr(p, "tensor_model_parallel", False) else None) for n, p in model.named_parameters()}
    params_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    dist.barrier()
    return {"state": state, "dims": dims, "peak_mib": peak, "params_mib": params_mib}


def build(nproc: int) -> list[dict]:
    # a fixed mmap threshold: glibc's default one grows after the first large free, after which freed
    # init units may stay resident in the heap and count in the peak RSS (about one in three runs at TP=2)
    return run_distributed(build_rank, nproc, env={"MALLOC_MMAP_THRESHOLD_": "65536"}, timeout=600).results


def test_tp2_shards_equal_tp1_weights_and_host_memory_halves():
    (one,) = build(1)
    two = build(2)
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
