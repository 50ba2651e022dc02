"""The tests part: `pytest -m gpu` over the gpu test files into a JUnit file (standard library only;
pytest imports the stack)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .rows import Deadline
from .verdict import GPU_TESTS

REPO = Path(__file__).resolve().parents[2]


def selection(smoke: bool) -> list[str]:
    """What pytest runs: the files that hold `gpu` tests (verdict.GPU_TESTS, which tests/test_gpu_report.py
    keeps equal to what `pytest -m gpu tests` collects), or with --cpu-smoke two of them. Not the whole
    tests/ tree: a file that fails to collect on the GPU image for want of a package the check does not
    need would fail the verdict without being a gpu test."""
    return ["tests/test_gpu_decode.py", "tests/test_gpu_train.py"] if smoke else sorted(GPU_TESTS)


def part_tests(args) -> int:
    import importlib.util

    left = Deadline.of(args).left()
    cmd = [sys.executable, "-m", "pytest", *selection(args.smoke and not args.rehearse), "-m", "gpu",
           "--continue-on-collection-errors", "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={args.junit}",
           "-o", "junit_family=xunit1"]
    if importlib.util.find_spec("pytest_timeout"):
        cmd.append(f"--timeout={int(max(30, min(150, left - 15)))}")
    if args.workers >= 0:
        workers = args.workers
    elif args.rehearse:
        workers = 2  # the GPU run's xdist + timeout plugins, exercised on a small machine
    else:
        workers = 0 if args.smoke else min(8, (os.cpu_count() or 1) // 2)
    if workers > 1 and importlib.util.find_spec("xdist"):
        # Compiles dominate: each worker compiles its own kernels, in parallel on the machine's cores
        # (into the one inductor cache the orchestrator set, so no kernel is compiled twice).
        cmd += ["-n", str(workers)]
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")
    print("running: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=REPO)
