"""The flex-attention block masks (GPU fast path) equal the dense masks; checked forward on CPU."""

import pytest
import torch

from model import families
from model import flex
from model.config import ModelConfig, ObjectiveConfig
from model.masks import build_mask
from model.objectives import build_objective
from model.transformer import Transformer

pytestmark = pytest.mark.skipif(not flex.available(), reason="torch has no flex attention")


@pytest.mark.parametrize("kind,L,bs", [("causal", 24, 0), ("bidirectional", 24, 0), ("set_causal", 24, 0), ("block_diffusion", 24, 4)])
def test_mask_mod_equals_dense_mask(kind, L, bs):
    T = L if kind in ("causal", "bidirectional") else 2 * L
    q = torch.arange(T)[:, None].expand(T, T)
    kv = torch.arange(T)[None, :].expand(T, T)
    got = flex.mask_mod(kind, L, bs)(torch.tensor(0), torch.tensor(0), q, kv)
    assert torch.equal(got, build_mask(kind, L, bs))


@pytest.mark.parametrize("objective", families.names())
def test_flex_backend_matches_sdpa(objective):
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, vocab_size=50, mask_id=49,
                      dropout=0.0, max_seq_len=64, attention_backend="sdpa")
    model = Transformer(cfg).eval()
    obj = build_objective(ObjectiveConfig(name=objective, set_size=4, block_size=4), cfg, 16)
    inputs = obj.prepare({"input_ids": torch.randint(0, 49, (2, 16))}, torch.Generator().manual_seed(1))
    assert inputs.mask_spec is not None
    with torch.no_grad():
        dense = model(inputs.input_ids, inputs.position_ids, **inputs.model_kwargs())
        cfg.attention_backend = "flex"
        fast = model(inputs.input_ids, inputs.position_ids, **inputs.model_kwargs())
    torch.testing.assert_close(fast, dense, atol=1e-5, rtol=1e-5)
