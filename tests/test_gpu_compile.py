"""`train.compile` with flex attention on CUDA, the GPU training path as the trainer builds it
(pretrain/parallelize.py `prepare_model`: activation checkpointing, then each block compiled by
pretrain/block_compile.py), against the same weights run eagerly: logits, loss and every parameter
gradient, fp32 with TF32 off. On the CPU this combination is refused (inductor's CPU flex kernel
ignores a view operand's offset: tests/test_flex_compiled.py, docs/gpu.md), so it can only be checked
here, on a GPU.
"""

import copy
import itertools
import math

import pytest
import torch

from model import families, flex
from model.config import ModelConfig, ObjectiveConfig
from model.objectives import build_objective
from model.transformer import Transformer

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none is visible)"),
              pytest.mark.skipif(not flex.available(), reason="torch has no flex attention")]


def _run(model, obj, inputs):
    logits = model(inputs.input_ids, inputs.position_ids, inputs.attn_mask, logits_slice=inputs.logits_slice,
                   mask_spec=inputs.mask_spec)
    out = logits.detach().clone()  # the vocab-parallel CE works in place on float32 logits
    loss, _ = obj.loss(logits, inputs)
    model.zero_grad(set_to_none=True)
    loss.backward()
    return out, loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def compiled_vs_eager(objective: str, checkpointing: str, device: str = "cuda", backend: str = "flex"):
    """(eager, compiled) results of one training forward + backward: (logits, loss, {name: grad})."""
    from pretrain.block_compile import apply_compile
    from pretrain.recompute import apply_activation_checkpointing

    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, hidden=128, n_heads=4, n_kv_heads=2, ffn_hidden=256, vocab_size=96, mask_id=95,
                      dropout=0.0, max_seq_len=256, qk_norm=True, attention_backend=backend)
    eager = Transformer(cfg).to(device)
    compiled = copy.deepcopy(eager)
    apply_activation_checkpointing(compiled, checkpointing)
    note = apply_compile(compiled)
    assert "compiled" in note, note  # not the eager fallback
    L = 80  # 2L = 160: not a multiple of flex's 128-token tiles
    obj = build_objective(ObjectiveConfig(name=objective, set_size=4, block_size=8), cfg, L)
    x = torch.randint(0, 95, (3, L), generator=torch.Generator().manual_seed(1))
    inputs = obj.prepare({"input_ids": x}, torch.Generator().manual_seed(2))
    assert inputs.mask_spec is not None  # the flex path, not the dense mask
    inputs = type(inputs)(**{f: getattr(inputs, f).to(device) if torch.is_tensor(getattr(inputs, f)) else
                             getattr(inputs, f) for f in inputs.__dataclass_fields__})
    return _run(eager, obj, inputs), _run(compiled, obj, inputs)


def assert_same(ref, got) -> None:
    finite = torch.isfinite(ref[0])
    assert torch.equal(torch.isfinite(got[0]), finite)
    err = float((got[0][finite] - ref[0][finite]).double().norm() / ref[0][finite].double().norm())
    assert err < 1e-4, f"logits: compiled blocks vs eager relative error {err:.2e}"
    assert abs(float(got[1]) - float(ref[1])) < 1e-4 * max(1.0, abs(float(ref[1])))
    assert got[2].keys() == ref[2].keys() and len(ref[2]) > 10
    # Per parameter, relative to its own norm plus a floor from the whole gradient (test_gpu_flex.py)
    total = math.sqrt(sum(float(g.double().norm()) ** 2 for g in ref[2].values()))
    for n in ref[2]:
        diff = float((got[2][n].double() - ref[2][n].double()).norm())
        assert diff <= 1e-3 * float(ref[2][n].double().norm()) + 1e-6 * total, n


def _one_family_per_mask_kind() -> list[str]:
    first: dict = {}
    for name in families.names():
        first.setdefault(families.get(name).mask_kind, name)
    return list(first.values())


# One family per mask kind, the activation-checkpointing modes in turn: each case is one more compile on the GPU.
@pytest.mark.parametrize("objective,checkpointing",
                         list(zip(_one_family_per_mask_kind(), itertools.cycle(("none", "full", "selective")))))
def test_compiled_blocks_with_flex_match_eager(objective, checkpointing):
    from test_gpu_flex import raise_recompile_limit

    raise_recompile_limit()
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        ref, got = compiled_vs_eager(objective, checkpointing)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert_same(ref, got)
