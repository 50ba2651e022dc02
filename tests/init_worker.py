"""Builds one mid-size model under TP=N (gloo) and records its weights and the host memory it took.

    torchrun --standalone --nproc-per-node N tests/init_worker.py --out DIR

Writes DIR/tp{N}_rank{R}.pt: this rank's parameters, their tensor-parallel split dims, and the peak
RSS increase of the process while the model was built (MiB). Used by tests/test_init_scaling.py.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

MID = dict(n_layers=4, hidden=512, n_heads=8, n_kv_heads=4, ffn_hidden=2048, norm="rmsnorm", activation="swiglu",
           qk_norm=True, bias=False, tie_embeddings=False, vocab_size=32000, mask_id=31999, dropout=0.0)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def reset_peak_rss() -> bool:
    """Reset this process's peak-RSS mark (Linux: `5` to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def hwm_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch.distributed as dist

    from model.config import ModelConfig
    from pretrain.parallel import ensure_model_parallel, ensure_process_group
    from pretrain.pipeline import build_stage

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
        peak = hwm_mib() - before
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
