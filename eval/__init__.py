"""Evaluation from saved checkpoints: `setdlm eval TASK` (likelihood, gsm8k, infill, summarize, uncond,
throughput), sharded across ranks and resumable (eval/units.py), merged into metrics.json and
summary.md; see docs/eval.md. `eval.sample` (setdlm sample) belongs to the sampling module."""
