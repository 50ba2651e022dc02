"""Run this process's share of a task with its typed options, and merge when this process should
(the one driver behind `setdlm eval TASK`, `eval.api` and the matrix cells)."""

from __future__ import annotations

from common.device import check_device
from common.storage import check_output_dir

from .errors import EvalError
from .merge import merge
from .report import PERCENT, fmt
from .shard import detect_shard, isolate_process_group, rank_guard
from .tasks import get_task
from .units import EvalRun

__all__ = ["execute", "print_headline"]


def _select_device(shard, device: str | None) -> None:
    """One GPU per local rank: make it the current device before anything allocates (megatron-core
    builds layers on the current device), so ranks on one node do not all start on GPU 0."""
    import torch

    if not torch.cuda.is_available() or (device and not device.startswith("cuda")):
        return
    from .models import pick_device

    torch.cuda.set_device(pick_device(shard.local_rank, device))


def execute(name: str, args, *, predictor=None, after_unit=None) -> dict:
    """Run this rank's share of task `name` with typed options `args` (the task's `options`), merge
    when this process should.

    Returns {"metrics": ... or None, "stats": ..., "merged": bool, "out": DIR}. `predictor` replaces
    the checkpoint's sampler (tests, or scoring another system); `after_unit(unit, records)` is
    called after each unit is written (tests use it to simulate a kill). Every option check, the
    task's included, runs before --out is created."""
    check_device(args.device, error=EvalError)  # `bogus`, `cuda` on a CPU build: refused before any work
    check_output_dir(args.out, "--out")  # a file, a read-only mount: refused before the checkpoint is read
    shard = detect_shard(args.shard)
    if args.overwrite and shard.world > 1:
        raise EvalError("--overwrite: with several ranks the deletion would race with their writes; delete --out first")
    with rank_guard(shard, f"setdlm eval {name}"):  # one rank fails or dies: the others stop, naming it
        return _execute(name, args, shard, predictor, after_unit)


def _execute(name: str, args, shard, predictor, after_unit) -> dict:
    _select_device(shard, args.device)
    isolate_process_group()
    cls = get_task(name)
    task = cls(args, shard, predictor)
    if hasattr(task, "check_fits"):
        task.check_fits()
    spec = task.spec()
    run = EvalRun(args.out, name, spec, shard, overwrite=args.overwrite)
    for note in task.notes() if hasattr(task, "notes") else ():
        run.log(note)
    stats = task.execute(run, after_unit)
    result = {"metrics": None, "stats": stats, "merged": False, "out": args.out}
    if args.no_merge:
        return result
    if shard.world == 1:
        do = True
    elif shard.explicit:
        do, missing = run.complete()
        if not do:
            run.log(f"done; {missing} examples of other shards remain (the last shard to finish merges, or run "
                    f"`setdlm eval merge {args.out}`)")
    elif shard.rank == 0:
        do = run.wait_for_all(args.merge_timeout)
    else:
        do = False
    if do:
        result["metrics"] = merge(args.out, log=run.log)
        result["merged"] = True
        print_headline(name, result["metrics"], cls)
    return result


def print_headline(name, metrics, cls) -> None:
    keys = [k for k in getattr(cls, "headline", ()) if k in metrics] or list(metrics)[:4]
    print(f"{name}: " + ", ".join(f"{k} {fmt(k, metrics[k])}{'%' if k in PERCENT else ''}" for k in keys), flush=True)
    for k, v in metrics.items():
        if k.endswith("_warning") and v:
            print(f"{name}: warning: {v}", flush=True)
