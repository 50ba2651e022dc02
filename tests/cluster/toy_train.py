"""A tiny stand-in for `setdlm pretrain` used by the launcher tests.

Initialises torch.distributed through common.dist, all-reduces once per "step", installs the
PreemptionHandler, checkpoints (a JSON step counter) on a stop signal, requeues under Slurm and
resumes from the checkpoint when started again. Writes into the run directory (--out, or --out/--name like `setdlm pretrain`):
  env-rank{r}.json   the DistEnv each rank detected (+ a few launcher variables)
  metrics.jsonl      one line per step (rank 0)
  checkpoint.json    last saved step (rank 0, atomic)
  done.json          written when all steps finished
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # repo root, when run as a script


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="runs directory (with --name) or the run directory")
    ap.add_argument("--name", default=None, help="run name: the run directory is OUT/NAME")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--step-time", type=float, default=0.0)
    ap.add_argument("--fail-rank", type=int, default=-1, help="this rank exits 3 after init")
    ap.add_argument("--signal-rank", type=int, default=-1, help="this rank sends itself SIGUSR1 ...")
    ap.add_argument("--signal-step", type=int, default=2, help="... after this step")
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    from common.dist import destroy_process_group, init_process_group
    from pretrain.preemption import PreemptionHandler

    handler = PreemptionHandler().install()
    env = init_process_group(timeout_s=120)
    out = Path(args.out) / args.name if args.name else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = env.to_dict()
    info.update(pid=os.getpid(), host=os.uname().nodename,
                backend=dist.get_backend(), dist_world=dist.get_world_size(), dist_rank=dist.get_rank(),
                **{k: os.environ[k] for k in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_RESTART_COUNT",
                                              "OMPI_COMM_WORLD_RANK", "TORCHELASTIC_RUN_ID")
                   if k in os.environ})
    (out / f"env-rank{env.rank}.json").write_text(json.dumps(info))
    if env.rank == args.fail_rank:
        return 3

    ckpt = out / "checkpoint.json"
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    for step in range(start, args.steps):
        t = torch.tensor([float(env.rank + 1)])
        dist.all_reduce(t)
        if env.rank == 0:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step + 1, "sum": t.item(), "world": env.world_size,
                                    "restart": int(os.environ.get("SLURM_RESTART_COUNT", 0))}) + "\n")
        time.sleep(args.step_time)
        if env.rank == args.signal_rank and step + 1 == args.signal_step:
            os.kill(os.getpid(), signal.SIGUSR1)
        if handler.should_stop() and step + 1 < args.steps:
            if env.rank == 0:
                tmp = ckpt.with_suffix(".tmp")
                tmp.write_text(json.dumps({"step": step + 1, "signal": handler.received}))
                os.replace(tmp, ckpt)
            print(f"[toy] rank {env.rank}: stopped at step {step + 1} (signal {handler.received})", flush=True)
            handler.requeue()
            destroy_process_group()
            return 0
    if env.rank == 0:
        (out / "done.json").write_text(json.dumps({"steps": args.steps}))
    destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
