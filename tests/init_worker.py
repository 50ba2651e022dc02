"""Builds one mid-size model under TP=N (gloo) and records its weights and the host memory it took.

    torchrun --standalone --nproc-per-node N tests/init_worker.py --out DIR

Writes DIR/tp{N}_rank{R}.pt: this rank's parameters, their tensor-parallel split dims, and the peak
RSS increase of the process while the model was built (MiB). Used by tests/test_init_scaling.py.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from common.procmem import peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402

MID = dict(n_layers=4, hidden=512, n_heads=8, n_kv_heads=4, ffn_hidden=2048, norm="rmsnorm", activation="swiglu",
           qk_norm=True, bias=False, tie_embeddings=False, vocab_size=32000, mask_id=31999, dropout=0.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
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
    rank = dist.get_rank()
    torch.save({"state": state, "dims": dims, "peak_mib": peak, "params_mib": params_mib},
               Path(args.out) / f"tp{tp}_rank{rank}.pt")
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
