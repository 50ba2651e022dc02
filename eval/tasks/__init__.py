"""Evaluation tasks: name -> class (each defines its typed options, units of examples, records and metrics)."""

from __future__ import annotations

import importlib

from ..errors import EvalError

TASKS = {
    "likelihood": ("eval.tasks.likelihood", "LikelihoodTask"),
    "gsm8k": ("eval.tasks.gsm8k", "GSM8KTask"),
    "infill": ("eval.tasks.infill", "InfillTask"),
    "summarize": ("eval.tasks.summarize", "SummarizeTask"),
    "uncond": ("eval.tasks.uncond", "UncondTask"),
    "throughput": ("eval.tasks.throughput", "ThroughputTask"),
}


def get_task(name: str):
    if name not in TASKS:
        raise EvalError(f"unknown task {name!r}; valid: {', '.join(TASKS)}")
    module, cls = TASKS[name]
    return getattr(importlib.import_module(module), cls)
