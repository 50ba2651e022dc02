#!/usr/bin/env bash
# CPU fine-tuning demo (docs/finetune.md): tiny random Qwen3 -> GSM8K prompt/answer shards -> SW-SetDLM
# fine-tuning (configs/gsm8k-tiny-cpu.yaml) -> GSM8K accuracy on held-out problems.
#   GSM8K=path/to/train.jsonl bash scripts/finetune_gsm8k_cpu.sh      (default: ../shared/data/gsm8k/train.jsonl)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GSM8K=${GSM8K:-../shared/data/gsm8k/train.jsonl}
HELD_OUT=${HELD_OUT:-200}
W=runs/gsm8k-tiny
mkdir -p "$W"
[ -f "$GSM8K" ] || { echo "GSM8K train file not found: $GSM8K (set GSM8K=...)" >&2; exit 2; }
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
[ -f "$W/hf-tiny-qwen3/config.json" ] || $PY -m model.convert.hf_testing --out "$W/hf-tiny-qwen3" --arch qwen3 \
  --layers 4 --hidden 128 --heads 4 --kv-heads 2 --head-dim 32 --ffn 384
tail -n "$HELD_OUT" "$GSM8K" > "$W/heldout.jsonl"   # the val split below: never trained on
[ -f "$W/data/manifest.json" ] || $PY -m launch.cli data prepare --format prompt_answer --input "$GSM8K" \
  --output "$W/data" --tokenizer "$W/hf-tiny-qwen3" --add-mask --prompt-field question --template plain \
  --seq-len 256 --val-docs "$HELD_OUT"
$PY -m launch.cli pretrain --config configs/gsm8k-tiny-cpu.yaml "$@"
$PY -m launch.cli eval gsm8k --checkpoint runs/gsm8k-tiny-cpu --data "$W/heldout.jsonl" --limit "${EVAL_LIMIT:-20}" \
  --backend direct --max-new-tokens 96 --out "$W/eval"
