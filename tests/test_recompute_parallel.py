"""Activation checkpointing, per-block compile and sequence parallelism under TP=2, PP=2 and ZeRO-3, and
DeepSpeed's overlap_comm under ZeRO-1/2, train exactly like the plain one-process model (CPU, gloo, fp32;
the runs of tests/test_parallel_parity.py)."""

from __future__ import annotations


import pytest
import torch

from test_parallel_parity import PARAM_ATOL, RECOMPUTE_CASES, load

pytestmark = pytest.mark.slow


def test_recompute_compile_and_sequence_parallel_match_one_plain_process(parity_runs):
    failures = []
    for variant, layout, rel in RECOMPUTE_CASES:
        ref, ref_w = load(parity_runs, f"{variant.split('_')[0]}-ref")
        got, got_w = load(parity_runs, f"{variant}-{layout}")
        for key in ("losses", "grad_norms"):
            for a, b in zip(got[key], ref[key]):
                if abs(a - b) > rel * max(abs(a), abs(b)):
                    failures.append((variant, layout, key, got[key], ref[key]))
        if abs(got["val_nll"] - ref["val_nll"]) > rel * abs(ref["val_nll"]):
            failures.append((variant, layout, "val_nll", got["val_nll"], ref["val_nll"]))
        worst = max((got_w[k] - ref_w[k]).abs().max().item() for k in ref_w if torch.is_tensor(ref_w[k]))
        if worst > PARAM_ATOL * (10 if rel > 1e-5 else 1):
            failures.append((variant, layout, "weights", worst))
    assert not failures, failures
