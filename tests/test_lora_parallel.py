"""LoRA under tensor, sequence and pipeline parallelism and ZeRO 1-3 trains exactly like LoRA in one
process (CPU, gloo, fp32; the runs of tests/test_parallel_parity.py with `train.lora`): losses,
gradient norms, validation NLL and the trained adapters agree, the frozen base does not move, and each
layout's sharded checkpoint consolidates to the one-process adapters (and their Adam moments: the only
optimizer state there is)."""

from __future__ import annotations

import pytest
import torch

from test_parallel_parity import LORA_CASES, PARAM_ATOL, check_consolidation, close, load

pytestmark = pytest.mark.slow

def test_lora_layouts_match_one_process(parity_runs):
    from model.lora import is_adapter

    tmp_path = parity_runs
    failures = []
    base_ref, base_w = load(tmp_path, "qwen-ref")  # plain (full fine-tuning) run, same seed
    for variant, layout in LORA_CASES:
        ref_name = "qwen_lora" if variant == "qwen_lorasp" else variant
        ref, ref_w = load(tmp_path, f"{ref_name}-ref")
        got, got_w = load(tmp_path, f"{variant}-{layout}")
        for key in ("losses", "grad_norms"):
            if not all(close(a, b) for a, b in zip(got[key], ref[key])):
                failures.append((variant, layout, key, got[key], ref[key]))
        if not close(got["val_nll"], ref["val_nll"]):
            failures.append((variant, layout, "val_nll", got["val_nll"], ref["val_nll"]))
        assert set(got_w) == set(ref_w), set(got_w) ^ set(ref_w)
        worst = max(((got_w[k] - ref_w[k]).abs().max().item(), k) for k in ref_w if torch.is_tensor(ref_w[k]))
        if worst[0] > PARAM_ATOL:
            failures.append((variant, layout, "weights", worst))
        if variant != "qwen_lorasp":
            check_consolidation(tmp_path, variant, layout, got["layout"][3])
    assert not failures, failures
    # the adapters trained (B left zero, A moved) and nothing else did; step 1's loss is the base model's
    _, w = load(tmp_path, "qwen_lora-ref")
    adapters = [k for k in w if is_adapter(k)]
    assert len(adapters) == 3 * 4 * 2 and all(w[k].abs().max() > 0 for k in adapters if k.endswith(".B"))
    from pretrain.config import from_dict
    from pretrain.parallelize import build_stage
    from test_parallel_parity import recipe

    cfg = from_dict(recipe("qwen", 1, 1, 0))
    torch.manual_seed(cfg.run.seed)
    initial = build_stage(cfg.model, 1, 1).state_dict()
    for k, v in initial.items():
        if torch.is_tensor(v) and k in w:
            assert torch.equal(w[k], v.float()), f"frozen {k} moved"
    lora_ref, _ = load(tmp_path, "qwen_lora-ref")
    assert lora_ref["losses"][0] == pytest.approx(base_ref["losses"][0], rel=1e-6)
    assert lora_ref["losses"][1] != pytest.approx(base_ref["losses"][1], rel=1e-4)  # then they part
