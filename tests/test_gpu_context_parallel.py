"""A context-parallel rank's attention on the GPU path: the compiled flex kernel under the rank-local
block mask (model/context_parallel.py `RankLayout.block_mask`) equals SDPA under the rank-local dense
mask, output and dq/dk/dv, both measured against a float64 reference (fp32, TF32 off), for every mask
kind. On CUDA only (marker `gpu`); tests/test_context_parallel.py runs the forward on CPU."""

import pytest
import torch
import torch.nn.functional as F

from model import flex
from model.context_parallel import RankLayout

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (none is visible)"),
              pytest.mark.skipif(not flex.available(), reason="torch has no flex attention")]

# L = 96 over cp = 2: chunks of 24 (whole BD3-LM blocks of 8); a rank's 96 (two-stream) or 48 query
# tokens and 144 / 96 keys leave partial 128-token tiles
KINDS = [("causal", 0), ("bidirectional", 0), ("set_causal", 0), ("block_diffusion", 8)]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    assert torch.isfinite(x).all(), "non-finite values"
    return float((x - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.mark.parametrize("kind,bs", KINDS)
def test_rank_block_mask_matches_dense_forward_and_backward(kind, bs):
    from test_gpu_flex import raise_recompile_limit

    raise_recompile_limit()
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        lay = RankLayout(kind, 96, 2, 1, bs)
        rows, cols = lay.token_index().numel(), lay.key_index().numel()
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, rows, 64, generator=g)
        k, v = (torch.randn(2, 4, cols, 64, generator=g) for _ in range(2))
        do = torch.randn(2, 4, rows, 64, generator=g)
        got = {}
        for impl, dtype in (("flex", torch.float32), ("sdpa", torch.float32), ("ref", torch.float64)):
            xs = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
            if impl == "flex":
                out = flex.attend(*xs, lay.block_mask("cuda"))
            else:
                out = F.scaled_dot_product_attention(*xs, attn_mask=lay.mask("cuda"))
            got[impl] = (out, *torch.autograd.grad(out, xs, do.to("cuda", dtype)))
        for i, name in enumerate(("output", "dq", "dk", "dv")):
            e_flex, e_sdpa = rel_err(got["flex"][i], got["ref"][i]), rel_err(got["sdpa"][i], got["ref"][i])
            assert e_flex < 1e-4, f"{kind} {name}: flex {e_flex:.2e} (SDPA {e_sdpa:.2e})"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
