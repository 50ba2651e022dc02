#!/usr/bin/env bash
# The `####`-format rate (fraction of generations with a "#### <number>" final-answer line) and the
# accuracy on N held-out GSM8K problems, before and after a short CPU fine-tune, for AR and SW-SetDLM,
# full fine-tuning and LoRA: the table in docs/finetune.md ("Format rate before and after").
# The base is the tiny random Qwen3 of scripts/finetune_gsm8k_cpu.sh (real Qwen tokenizer, the
# tokenizer's chat template, the paper's context split); held out = the last HELD_OUT rows of the
# train file (the prepared val split): no run trains on them.
#   GSM8K=path/to/train.jsonl STEPS=30 N=50 bash scripts/gsm8k_format_rate.sh
# "before" is the imported base itself (one step at lr 1e-12, which moves no weight by more than
# ~1e-12: the base as a setdlm checkpoint);
# full and LoRA start from the same base, so they share it.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/gsm8k_tiny_base.sh   # PY, GSM8K, HELD_OUT, W; the base model and shards
R=${R:-runs/gsm8k-format}
STEPS=${STEPS:-30} N=${N:-50} NEW=${NEW:-128} LR=${LR:-3e-3} LORA_LR=${LORA_LR:-1e-2}
mkdir -p "$R"
run() {  # NAME OVERRIDES...
  local name=$1; shift
  local t0=$SECONDS
  $PY -m launch.cli pretrain --config configs/gsm8k-tiny-cpu.yaml run.out_dir="$R" run.name="$name" \
    train.eval_every=0 train.log_every=10 "$@" > "$R/$name.train.log" 2>&1
  echo $((SECONDS - t0)) > "$R/$name.train_s"
  t0=$SECONDS
  $PY -m launch.cli eval gsm8k --checkpoint "$R/$name" --data "$W/heldout.jsonl" --limit "$N" --backend direct \
    --prompt-format tokenizer --max-new-tokens "$NEW" --batch-size 25 --out "$R/$name.eval" --overwrite \
    > "$R/$name.eval.log" 2>&1
  echo $((SECONDS - t0)) > "$R/$name.eval_s"
  echo "$name: $(tail -n 1 "$R/$name.eval.log")"
}
for obj in ar setdlm; do
  run "$obj-before" objective.name=$obj train.max_steps=1 train.lr=1e-12 train.min_lr=1e-12 train.warmup_steps=0 train.save_every=1
  run "$obj-full" objective.name=$obj train.max_steps="$STEPS" train.lr="$LR" train.min_lr=3e-4 \
    train.warmup_steps=3 train.save_every="$STEPS"
  run "$obj-lora" objective.name=$obj train.max_steps="$STEPS" train.lr="$LORA_LR" train.min_lr=1e-3 \
    train.warmup_steps=3 train.save_every="$STEPS" train.lora.rank=8 train.lora.alpha=16
done
$PY - "$R" "$N" "$STEPS" <<'PY'
import json, sys
from pathlib import Path
r, n, steps = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
def m(name):
    return json.loads((r / f"{name}.eval" / "metrics.json").read_text())["metrics"]
def loss(name):
    rows = [json.loads(l) for l in (r / name / "metrics.jsonl").read_text().splitlines()]
    return [x["train/loss"] for x in rows if "train/loss" in x][-1]
print(f"| objective | fine-tune ({steps} steps) | #### rate before | #### rate after | accuracy before | accuracy after | "
      f"final train loss | train s | eval s (N={n}) |")
print("|---|---|---|---|---|---|---|---|---|")
for obj in ("ar", "setdlm"):
    b = m(f"{obj}-before")
    for mode in ("full", "lora"):
        a, name = m(f"{obj}-{mode}"), f"{obj}-{mode}"
        print(f"| {obj} | {mode} | {b['format_rate']:.2f} | {a['format_rate']:.2f} | {b['accuracy']:.2f} | "
              f"{a['accuracy']:.2f} | {loss(name):.3f} | {(r / f'{name}.train_s').read_text().strip()} | "
              f"{(r / f'{name}.eval_s').read_text().strip()} |")
PY
