#!/usr/bin/env bash
# The one-shot GPU check (docs/gpu.md): on one H100/H200, install the carried wheels the machine lacks
# (offline), record the environment, run the `gpu` tests, then the training and decoding benchmarks,
# and write report.json + report.md (+ gpu_check.log, tests.xml) to $OUT (or ./gpu_report), within
# about 7.5 minutes, each part under its own time limit. Exit status 0 only when CUDA was visible, every
# part ended ok and every expected `gpu` test ran and passed (benchmarks/gpu_check/verdict.py): a CPU
# run, --cpu-smoke included, exits 1.
#
#   bash scripts/gpu_check.sh                 # on the GPU machine (wheels/ built by scripts/build_gpu_wheels.sh)
#   bash scripts/gpu_check.sh --cpu-smoke     # here: the same machinery with tiny shapes on the CPU
#   bash scripts/gpu_check.sh --parts tests,decode --limit tests=300   # a partial rerun
#
# Every option is passed to benchmarks/gpu_report.py (--help lists them). PYTHON selects the
# interpreter (default: python3 on the GPU machine; .venv/bin/python for --cpu-smoke where it exists).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  PY=python3
  case " $* " in *" --cpu-smoke "*) [ -x .venv/bin/python ] && PY=.venv/bin/python ;; esac
fi
export PYTHONUNBUFFERED=1
echo "gpu_check: $("$PY" --version 2>&1) at $(command -v "$PY"), $(date -u '+%Y-%m-%d %H:%M:%S') UTC, repo $ROOT"
exec "$PY" benchmarks/gpu_report.py "$@"
