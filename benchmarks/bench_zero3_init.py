"""What a rank holds, and how long it takes, to build a model whole or under ZeRO-3's deepspeed.zero.Init.

    .venv/bin/python benchmarks/bench_zero3_init.py [--dp 1 2] [--layers 8] [--hidden 384] [--markdown]

For each data-parallel size (a real torchrun launch, gloo, one thread per process) every rank builds
the same model (tied embedding, GELU, vocab 2048; `--layers` x `--hidden`, FFN 4x) twice with the
trainer's code (`build_stage`, `zero3_init`): whole, as ZeRO 0-2 build it, and inside
`deepspeed.zero.Init`, as ZeRO-3 does. Per build it prints

- the peak of tensor bytes alive at once while building (every storage created by an aten op,
  tracked by a dispatch mode: parameters, partitions, drawn units, buffers), next to this rank's
  partition bytes and the largest parameter;
- the peak RSS increase of the process over the build (Linux VmHWM, reset before it);
- the build's wall time (two more builds without the dispatch mode, the faster one).

Each build runs in its own launch, measured first, so no memory freed by an earlier build is reused.

A script, not a test: times depend on the machine and its load (tests/test_zero3_init.py checks
the memory bound).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.procmem import peak_rss_mib, reset_peak_rss, rss_mib  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensor storages alive at once among those created inside the mode."""

    def __init__(self):
        super().__init__()
        self.live: dict = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.multiprocessing.reductions import StorageWeakRef
        from torch.utils._pytree import tree_flatten

        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                if st.data_ptr() and st.data_ptr() not in self.live:
                    self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def recipe(layers: int, hidden: int, dp: int) -> dict:
    return {"run": {"seed": 3, "name": "bench"},
            "model": {"n_layers": layers, "hidden": hidden, "n_heads": max(1, hidden // 64), "ffn_hidden": 4 * hidden,
                      "dropout": 0.0, "max_seq_len": 64, "vocab_size": 2048, "mask_id": 2047, "tie_embeddings": True},
            "objective": {"name": "setdlm", "set_size": 4}, "data": {"seq_len": 32},
            "train": {"micro_batch": 1, "global_batch": dp, "precision": "fp32"},
            "parallel": {"zero_stage": 3}, "logging": {"wandb": "disabled"}}


def worker(args) -> None:
    import torch.distributed as dist

    from pretrain.config import from_dict
    from pretrain.engine import zero3_init
    from pretrain.parallel import ensure_model_parallel, ensure_process_group
    from pretrain.parallelize import build_stage

    ensure_process_group()
    ensure_model_parallel(1, 1)
    dp = dist.get_world_size()
    cfg = from_dict(recipe(args.layers, args.hidden, dp))
    mode = args.mode

    def build(meter=None, zi=None):
        torch.manual_seed(3)
        dist.barrier()
        t = time.perf_counter()
        with meter if meter is not None else contextlib.nullcontext():
            model = build_stage(cfg.model, 1, 1, device="cpu", zero_init=zi)
        dist.barrier()
        return model, time.perf_counter() - t

    def context():  # made before the measurement: DeepSpeed's config parsing is not the build
        return zero3_init(cfg, dp, "fp32") if mode == "zero.Init" else None

    zi = context()
    rss0 = rss_mib()  # the measured build comes first: no freed memory of an earlier one to reuse
    reset = reset_peak_rss()
    meter = LiveBytes()
    model, _ = build(meter, zi)
    rss = peak_rss_mib() - rss0 if reset else float("nan")
    params = list(model.parameters())
    numel = [getattr(p, "ds_numel", p.numel()) for p in params]
    held = [p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in params]
    row = {"peak_mib": meter.peak / 2**20, "rss_mib": rss, "held_mib": 4 * sum(held) / 2**20,
           "full_mib": 4 * sum(numel) / 2**20, "largest_mib": 4 * max(numel) / 2**20}
    del model, params
    row["seconds"] = min(build(None, context())[1] for _ in range(2))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(row))
    dist.barrier()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for dp in args.dp:
            rows = {}
            for mode in ("whole", "zero.Init"):  # one launch per build: the RSS peak is the build's alone
                out = Path(tmp) / f"dp{dp}-{mode}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp}", __file__,
                       "--worker", "--mode", mode, "--out", str(out), "--layers", str(args.layers),
                       "--hidden", str(args.hidden)]
                r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
                if r.returncode:
                    print((r.stdout + r.stderr)[-3000:], file=sys.stderr)
                    return 1
                rows[mode] = json.loads(out.read_text())
            results.append((dp, rows))
    print(f"# ZeRO-3 build: {args.layers} layers x hidden {args.hidden}, fp32, rank 0 "
          f"({platform.machine()}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')})")
    head = ["dp", "build", "model MiB", "held MiB", "largest param MiB", "peak live MiB", "peak RSS MiB", "seconds"]
    sep, end = ("| ", " |") if args.markdown else ("", "")
    join = " | " if args.markdown else "  "
    print(sep + join.join(head) + end)
    if args.markdown:
        print("|" + "|".join("---" for _ in head) + "|")
    for dp, rows in results:
        for mode, r in rows.items():
            cells = [str(dp), mode, f"{r['full_mib']:.1f}", f"{r['held_mib']:.1f}", f"{r['largest_mib']:.1f}",
                     f"{r['peak_mib']:.1f}", f"{r['rss_mib']:.1f}", f"{r['seconds']:.2f}"]
            print(sep + join.join(cells) + end)
    return 0


if __name__ == "__main__":
    sys.exit(main())
