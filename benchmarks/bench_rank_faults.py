"""Soak: kill one of 4 local ranks at random, again and again, in a training run that resumes each time.

    python benchmarks/bench_rank_faults.py [--kills 3] [--ranks 4] [--seed 0] [--work DIR] [--json FILE]

Every round starts `setdlm launch local -n 4 -- setdlm pretrain` on the same run directory, so it
resumes from the last complete checkpoint; once training is under way (a random 1-4 steps after the
resume, or, every other round on average, during a checkpoint save) a random rank gets SIGKILL. The
round records how long each other rank took to exit after the kill, their statuses (75), that each
printed one line naming the killed rank and no traceback, and the checkpoints: `latest` never moves
back, every complete checkpoint passes tests/rank_faults.checkpoint_intact (files, COMPLETE marker,
CRC of every member of every .pt file), and the next round says "resumed at step N" for the `latest`
the previous one left. A last round trains to the end without a kill, and metrics.jsonl then holds every
step. `--kills 20` is the published run (docs/benchmarks.md); the default is a quick look.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from helpers import read_metrics, write_recipe  # noqa: E402
from rank_faults import checkpoint_intact, run_with_rank_fault, saving  # noqa: E402


def latest_step(run: Path) -> int:
    try:
        return int((run / "checkpoints" / "latest").read_text().strip().split("_")[1])
    except (OSError, IndexError, ValueError):
        return 0


def trained(logs: Path, step: int) -> bool:
    """Rank 0 of this round (its log in `logs`) has finished `step` (the run's metrics.jsonl still holds
    the rows a killed round logged after its last checkpoint until the next round resumes)."""
    try:
        text = (logs / "rank0.log").read_text(errors="replace")
    except OSError:
        return False
    return any(int(m) >= step for m in re.findall(r"^step (\d+)/", text, flags=re.M))


def damaged(run: Path, world: int) -> list[str]:
    from pretrain.checkpoint import rundir

    return [p for ckpt in rundir.complete_checkpoints(run / "checkpoints") for p in checkpoint_intact(ckpt, world)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=3, help="rounds with a kill (20: the published run)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the rounds here")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_rank_faults_"))
    work.mkdir(parents=True, exist_ok=True)
    max_steps = 6 * args.kills + 8
    recipe = write_recipe(work / "r.yaml", train={"max_steps": max_steps, "micro_batch": 1, "global_batch": args.ranks,
                                                  "eval_every": 0, "save_every": 2, "keep_last": 3, "log_every": 1})
    run = work / "runs" / "tiny"
    cmd = ["-m", "launch.cli", "pretrain", "--config", str(recipe), "--out", str(work / "runs")]
    load0 = os.getloadavg()[0]
    print(f"{datetime.date.today()} {platform.machine()} ({os.cpu_count()} cores) {platform.python_version()}, "
          f"load {load0:.1f}; {args.ranks} ranks, {args.kills} kills, seed {args.seed}, work {work}", flush=True)
    print("| round | killed rank | when | resumed at | latest after | others' exit (s) | statuses | one line each | ok |")
    print("|---|---|---|---|---|---|---|---|---|")
    rounds, expect_resume = [], None
    for i in range(args.kills + 1):
        before = latest_step(run)
        last = i == args.kills
        rank = rng.randrange(args.ranks)
        mid_save = rng.random() < 0.5
        ahead = rng.randint(1, 4)
        logs, t_round = work / f"logs{i:02d}", time.time()
        when = (lambda b=before, d=logs, t=t_round: trained(d, b + 1) and saving(run, after_step=b, since=t)) \
            if mid_save else (lambda s=before + ahead, d=logs: trained(d, s))
        out = run_with_rank_fault(cmd, args.ranks, log_dir=logs, kill_rank=None if last else rank,
                                  when=None if last else when, timeout=900)
        after = latest_step(run)
        said = re.search(r"resumed at step (\d+)", out.logs[0])
        resumed = int(said.group(1)) if said else 0
        others = [r for r in range(args.ranks) if r != rank]
        lines_ok = all(len(out.error_lines[r]) == 1 and f"rank {rank} of {args.ranks} was lost" in out.error_lines[r][0]
                       for r in others) and not out.tracebacks
        problems = damaged(run, args.ranks)
        if expect_resume is not None and resumed != expect_resume:
            problems.append(f"resumed at step {resumed}, expected {expect_resume}")
        if after < before:
            problems.append(f"latest moved back from {before} to {after}")
        if last:
            steps = sorted(read_metrics(run))
            ok = out.statuses == [0] * args.ranks and after == max_steps and steps[-1] == max_steps \
                and set(range(1, max_steps + 1)) <= set(steps) and not problems
            print(f"| end | - | trains to the end | {resumed} | {after} | - | {out.statuses} | - | "
                  f"{'yes' if ok else 'NO: ' + '; '.join(problems)} |", flush=True)
            rounds.append({"round": "end", "resumed": resumed, "latest": after, "statuses": out.statuses, "ok": ok,
                           "problems": problems})
            break
        exits = [out.exit_s[r] for r in others]
        ok = out.triggered and all(out.statuses[r] == 75 for r in others) and lines_ok and not problems
        print(f"| {i + 1} | {rank} | {'mid-save' if mid_save else f'after step {before + ahead}'} | {resumed} | {after} | "
              f"{', '.join(f'{x:.1f}' for x in exits)} | {out.statuses} | {'yes' if lines_ok else 'no'} | "
              f"{'yes' if ok else 'NO: ' + '; '.join(problems)} |", flush=True)
        rounds.append({"round": i + 1, "rank": rank, "mid_save": mid_save, "resumed": resumed, "latest": after,
                       "exit_s": exits, "statuses": out.statuses, "one_line": lines_ok, "ok": ok, "problems": problems})
        expect_resume = after
    exits = [x for r in rounds if "exit_s" in r for x in r["exit_s"]]
    good = all(r["ok"] for r in rounds)
    print(f"\nothers' exit after the kill: median {statistics.median(exits):.1f} s, max {max(exits):.1f} s over "
          f"{len(exits)} exits; rounds ok: {sum(r['ok'] for r in rounds)}/{len(rounds)}; load {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "seed": args.seed, "ranks": args.ranks}, indent=1))
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
