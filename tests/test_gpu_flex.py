"""Flex attention (the CUDA training path) equals dense SDPA for every mask kind, forward and backward.

On CUDA (marker `gpu`): the compiled flex kernel against SDPA with the dense boolean mask, both
measured against a float64 reference, in fp32 and bf16, outputs and the gradients of q, k and v;
grouped-query attention; and the whole model with padded batches (flex backend vs SDPA backend vs the
same weights on the CPU). On CPU the same checks run forward only (flex has no CPU backward).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from model import families
from model import flex
from model.config import ModelConfig, ObjectiveConfig
from model.masks import build_mask
from model.objectives import build_objective
from model.transformer import Transformer

CUDA = torch.cuda.is_available()
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none is visible)")]
pytestmark = pytest.mark.skipif(not flex.available(), reason="torch has no flex attention")

KINDS = [("causal", 0), ("bidirectional", 0), ("set_causal", 0), ("block_diffusion", 8)]
# (device, dtype): CPU runs fp32 forward only.
SETUPS = [pytest.param("cpu", torch.float32, id="cpu-fp32"),
          pytest.param("cuda", torch.float32, id="cuda-fp32", marks=ON_GPU),
          pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=ON_GPU)]


def raise_recompile_limit() -> None:
    """No silent fallback to eager flex: each (mask kind, shape, dtype, grad mode) is its own compiled
    kernel, and a test process makes more than dynamo's default limit of 8. Kept for the process (the
    Trainer tests that follow on the same xdist worker need it too)."""
    import torch._dynamo

    conf = torch._dynamo.config
    for name, value in (("recompile_limit", 256), ("cache_size_limit", 256), ("fail_on_recompile_limit_hit", True)):
        if hasattr(conf, name):
            setattr(conf, name, value)


@pytest.fixture(autouse=True)
def strict_numerics():
    """IEEE fp32 matmuls on CUDA (flex's Triton kernels follow the same setting), and no eager fallback."""
    if not CUDA:
        yield
        return
    raise_recompile_limit()
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(x).all(), "non-finite values"
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


def check(name: str, fast, dense, ref, dtype) -> None:
    """fast (flex) must be as close to the float64 reference as dense SDPA in the same dtype is."""
    e_fast, e_dense = rel_err(fast, ref), rel_err(dense, ref)
    if dtype == torch.float32:
        assert e_fast < 1e-4, f"{name}: flex fp32 relative error {e_fast:.2e} (SDPA {e_dense:.2e})"
    else:
        assert e_fast < 5e-2 and e_fast <= 2 * e_dense + 2e-3, \
            f"{name}: flex bf16 relative error {e_fast:.2e} vs SDPA bf16 {e_dense:.2e}"


def _qkv(B, Hq, Hkv, T, D, device, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=g).to(device, dtype) for h in (Hq, Hkv, Hkv)]


def _attend_all(q, k, v, kind, L, bs, gqa, backward):
    """flex, SDPA (same dtype) and SDPA in float64: outputs and, on request, input gradients."""
    mask = build_mask(kind, L, bs, q.device)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(7)).to(q.device)
    results = []
    for impl in ("flex", "sdpa", "ref"):
        dt = torch.float64 if impl == "ref" else q.dtype
        xs = [t.detach().to(dt).requires_grad_(backward) for t in (q, k, v)]
        if impl == "flex":
            out = flex.attention(*xs, kind, L, bs, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(*xs, attn_mask=mask, enable_gqa=gqa)
        grads = torch.autograd.grad(out, xs, do.to(dt)) if backward else ()
        results.append((out, grads))
    return results


@pytest.mark.parametrize("device,dtype", SETUPS)
@pytest.mark.parametrize("kind,bs", KINDS)
def test_flex_kernel_matches_sdpa(device, dtype, kind, bs):
    # L = 80: 2L = 160 is not a multiple of flex's 128-token tiles, so partial tiles are exercised.
    L, B, H, D = (80, 2, 4, 64) if device == "cuda" else (24, 2, 2, 16)
    T = L if kind in ("causal", "bidirectional") else 2 * L
    q, k, v = _qkv(B, H, H, T, D, device, dtype)
    backward = device == "cuda"
    (fo, fg), (so, sg), (ro, rg) = _attend_all(q, k, v, kind, L, bs, False, backward)
    assert fo.dtype == dtype and fo.shape == (B, H, T, D)
    check(f"{kind} output", fo, so, ro, dtype)
    for name, f, s, r in zip(("dq", "dk", "dv"), fg, sg, rg):
        check(f"{kind} {name}", f, s, r, dtype)


@pytest.mark.parametrize("device,dtype", [SETUPS[0], SETUPS[2]])
def test_flex_grouped_query_attention(device, dtype):
    """qwen3-style GQA (4 query heads per KV head, head_dim 128) on the SetDLM two-stream mask."""
    L, B, D = (64, 2, 128) if device == "cuda" else (16, 1, 32)
    q, k, v = _qkv(B, 8, 2, 2 * L, D, device, dtype, seed=3)
    backward = device == "cuda"
    (fo, fg), (so, sg), (ro, rg) = _attend_all(q, k, v, "set_causal", L, 0, True, backward)
    check("gqa output", fo, so, ro, dtype)
    for name, f, s, r in zip(("dq", "dk", "dv"), fg, sg, rg):
        check(f"gqa {name}", f, s, r, dtype)


@pytest.mark.parametrize("device", [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=ON_GPU)])
@pytest.mark.parametrize("objective", families.names())
def test_model_flex_matches_sdpa_with_padding(device, objective):
    """Padded batches through the whole model: flex backend == SDPA backend (logits, loss and, on
    CUDA, every parameter gradient), and both == the same weights on the CPU. AR and SetDLM keep the
    static mask under padding (padding comes last in the order); MDLM and BD3-LM fall back to the dense
    mask with key padding, which flex cannot express."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=96, mask_id=95,
                      dropout=0.0, max_seq_len=128, qk_norm=True, attention_backend="sdpa")
    cpu_model = Transformer(cfg)
    model = Transformer(cfg).to(device)
    model.load_state_dict(cpu_model.state_dict())
    L = 48
    obj = build_objective(ObjectiveConfig(name=objective, set_size=4, block_size=8), cfg, L)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 95, (3, L), generator=g)
    valid = torch.ones(3, L, dtype=torch.bool)
    valid[1, 35:] = False
    valid[2, 20:] = False
    inputs = obj.prepare({"input_ids": x, "valid_mask": valid}, torch.Generator().manual_seed(2))
    assert (inputs.mask_spec is None) == (objective in ("mdlm", "bd3lm"))
    backward = device == "cuda"

    def run(m, backend, inp, dev):
        m.cfg.attention_backend = backend
        with torch.set_grad_enabled(backward):
            logits = m(inp.input_ids.to(dev), inp.position_ids.to(dev), inp.attn_mask.to(dev),
                       logits_slice=inp.logits_slice, mask_spec=inp.mask_spec)
            ids = type(inp)(**{f: getattr(inp, f).to(dev) if torch.is_tensor(getattr(inp, f)) else getattr(inp, f)
                               for f in inp.__dataclass_fields__})
            out = logits.detach().clone()  # the vocab-parallel CE works in place on float32 logits
            loss, _ = obj.loss(logits, ids)
        grads = {}
        if backward:
            m.zero_grad(set_to_none=True)
            loss.backward()
            grads = {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}
        return out, loss.detach(), grads

    try:
        dense = run(model, "sdpa", inputs, device)
        fast = run(model, "flex", inputs, device)
    finally:
        cfg.attention_backend = "sdpa"
    cpu_model.eval()
    with torch.no_grad():
        cpu_logits = cpu_model(inputs.input_ids, inputs.position_ids, inputs.attn_mask, logits_slice=inputs.logits_slice)
    finite = torch.isfinite(cpu_logits)
    for name, got in (("flex", fast[0]), ("sdpa", dense[0])):
        assert torch.equal(torch.isfinite(got).cpu(), finite), name
        assert rel_err(got[finite.to(got.device)], cpu_logits[finite]) < 1e-4, name
    assert abs(float(fast[1]) - float(dense[1])) < 1e-4 * max(1.0, abs(float(dense[1])))
    if backward:
        assert fast[2].keys() == dense[2].keys() and len(dense[2]) == len(list(model.parameters()))
        # Per parameter, relative to its own norm plus a floor from the whole gradient: the key bias's
        # true gradient is 0 (softmax ignores a per-row shift), so its computed one is rounding noise.
        total = math.sqrt(sum(float(g.double().norm()) ** 2 for g in dense[2].values()))
        for n in dense[2]:
            diff = float((fast[2][n].double() - dense[2][n].double()).norm())
            assert diff <= 1e-3 * float(dense[2][n].double().norm()) + 1e-6 * total, n


def test_auto_backend_keeps_sdpa_when_attention_dropout_is_on():
    """`attention_backend: auto` picks flex on CUDA only where it computes the same thing: flex has no
    attention-probability dropout, so with model.attention_dropout > 0 the SDPA path stays."""
    cfg = ModelConfig(n_layers=1, hidden=32, n_heads=2, ffn_hidden=64, vocab_size=50, mask_id=49, max_seq_len=32)
    model = Transformer(cfg)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert model.use_flex(cuda) and not model.use_flex(cpu)
    cfg.attention_dropout = 0.1
    assert not model.use_flex(cuda)
