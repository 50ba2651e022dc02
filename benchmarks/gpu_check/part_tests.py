"""The tests part: `pytest -m gpu` into a JUnit file (standard library only; pytest imports the stack)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def selection(smoke: bool) -> list[str]:
    """What pytest runs: every test file, or with --cpu-smoke two of the gpu files."""
    return ["tests/test_gpu_decode.py", "tests/test_gpu_train.py"] if smoke else ["tests"]


def part_tests(args) -> int:
    import importlib.util

    deadline = float(args.deadline)
    cmd = [sys.executable, "-m", "pytest", *selection(args.smoke), "-m", "gpu", "--continue-on-collection-errors",
           "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={args.junit}", "-o", "junit_family=xunit1"]
    if importlib.util.find_spec("pytest_timeout"):
        cmd.append(f"--timeout={int(max(30, min(150, deadline - 20)))}")
    workers = args.workers if args.workers >= 0 else (0 if args.smoke else min(8, (os.cpu_count() or 1) // 2))
    if workers > 1 and importlib.util.find_spec("xdist"):
        # Compiles dominate: each worker compiles its own kernels, in parallel on the machine's cores.
        cmd += ["-n", str(workers)]
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "2")
    print("running: " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, cwd=REPO)
