"""The one-shot GPU check: install, environment, `gpu` tests, training and decoding benchmarks, report.

    python benchmarks/gpu_report.py [--out DIR] [--parts install,env,tests,train,decode] [--budget 460]
                                    [--limit PART=SECONDS ...] [--cpu-smoke | --rehearse]

(scripts/gpu_check.sh is the entry point; docs/gpu.md says what runs and how to start it.) Each part
runs in its own process under its own time limit, counted from the process's start (and all of them
under `--budget`), so a hang, an out-of-memory error or a slow compile costs that part only; its status
(ok / partial / failed / timeout / skipped) and whatever rows it finished go into the report. A
benchmark part (train, decode) that measured rows and then ran out of time is `partial`. The report (`report.json`, `report.md`)
is rewritten after every part, next to `gpu_check.log` (everything printed) and `tests.xml` (the
tests' JUnit file), in --out (default: $OUT if set, else ./gpu_report).

Parts:
  install  scripts/install_wheels.py: the carried wheels the machine lacks, into --site (offline)
  env      versions, GPU, imports the stack needs (deepspeed, megatron-core, webdataset, pydantic, ...)
  tests    `pytest -m gpu tests` (in parallel with pytest-xdist where installed; per-test timeout
           with pytest-timeout where installed)
  train    tokens/s and MFU of bf16 training steps (flex attention) through the trainer's own engine
           and step: paper-12x768 at L=1024 for each objective, qwen3-1.7b (SetDLM) with full activation
           checkpointing at the largest micro-batch the memory estimate fits
  decode   tokens/s, forwards/s and tokens/step at batch 1 and 16: SetDLM (threshold off / 0.9 / 0),
           BD3-LM, AR; eager and compiled; paper-12x768 shape, random weights
--cpu-smoke runs every part with tiny shapes on the CPU (the `gpu` tests skip there): it checks the
orchestration, time limits and report writing, and its numbers mean nothing. --rehearse is the CPU
smoke with the tests part's real selection, run by scripts/gpu_check.sh --rehearse in a venv built like
the GPU image; its exit status says whether the check would get through there (gpu_check/verdict.py).

The exit status is 0 only when the check tested something (gpu_check/verdict.py): every part ok, CUDA
visible, and every expected `gpu` test run and passed; report.md opens with the reasons otherwise, so a
CPU run (--cpu-smoke included) always exits 1. The modules are in benchmarks/gpu_check/.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path

from gpu_check.orchestrate import PARTS, orchestrate

REPO = Path(__file__).resolve().parent.parent
H200_PEAK_TFLOPS = 790.0  # bf16 dense matmul measured on this workplace's H200 (8192^3, random data)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="report folder (default: $OUT if set, else ./gpu_report)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {', '.join(PARTS)}")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for everything (default 460 on the GPU; the sum of the limits with --cpu-smoke)")
    ap.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS", help="one part's time limit")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: checks the machinery only")
    ap.add_argument("--rehearse", action="store_true",
                    help="the CPU smoke with every gpu test file collected (scripts/gpu_check.sh --rehearse)")
    ap.add_argument("--emulated-python", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--wheels", default=str(REPO / "wheels"), help="carried wheels (scripts/build_gpu_wheels.sh)")
    ap.add_argument("--site", default="/tmp/setdlm-site", help="where missing wheels are installed (on PYTHONPATH)")
    ap.add_argument("--peak-tflops", type=float, default=H200_PEAK_TFLOPS, help="bf16 peak for MFU (H200: 790)")
    ap.add_argument("--part", choices=["env", "tests", "train", "decode"], help=argparse.SUPPRESS)
    ap.add_argument("--deadline", default="600", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-at", help=argparse.SUPPRESS)
    ap.add_argument("--junit", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", default=tempfile.gettempdir(), help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--workers", type=int, default=-1,
                    help="pytest-xdist workers for the tests part (default: half the cores, at most 8; 0: none)")
    args = ap.parse_args(argv)
    if args.part:
        if args.part != "tests":
            sys.path.insert(0, str(REPO))  # the parts import the stack
        module = importlib.import_module(f"gpu_check.part_{args.part}")
        return getattr(module, f"part_{args.part}")(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
