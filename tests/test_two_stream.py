"""The static two-stream masks give, position by position, the logits of separate forwards that see
only what the schedule allows (fp32, random tiny models)."""

import pytest
import torch

from model.config import ModelConfig, ObjectiveConfig
from model.masks import build_mask
from model.objectives import build_objective
from model.transformer import Transformer

L = 12


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    base = dict(n_layers=2, hidden=32, n_heads=4, ffn_hidden=64, vocab_size=50, mask_id=49, dropout=0.0, max_seq_len=64)
    base.update(kw)
    return Transformer(ModelConfig(**base)).eval()


@pytest.mark.parametrize("variant", [dict(), dict(n_kv_heads=2, norm="rmsnorm", activation="swiglu", qk_norm=True, bias=False, tie_embeddings=True)])
def test_setdlm_query_logits_match_separate_forwards(variant):
    model = tiny_model(**variant)
    cfg = model.cfg
    obj = build_objective(ObjectiveConfig(name="setdlm", set_size=4), cfg, L)
    x = torch.randint(0, 49, (2, L), generator=torch.Generator().manual_seed(1))
    inp = obj.prepare({"input_ids": x}, torch.Generator().manual_seed(2))
    perm = inp.extra["perm"]
    assert not torch.equal(perm, torch.arange(L).expand(2, L))
    with torch.no_grad():
        joint = model(inp.input_ids, inp.position_ids, inp.attn_mask, logits_slice=inp.logits_slice)
        for b in range(2):
            for r in range(L):
                ids = torch.cat((x[b, perm[b, :r]], torch.tensor([cfg.mask_id])))[None]
                pos = perm[b, : r + 1][None]
                alone = model(ids, pos, build_mask("causal", r + 1))[0, -1]
                torch.testing.assert_close(joint[b, r], alone, atol=1e-5, rtol=1e-5)


def test_bd3lm_block_logits_match_separate_forwards():
    model = tiny_model(seed=3)
    bs = 4
    obj = build_objective(ObjectiveConfig(name="bd3lm", block_size=bs), model.cfg, L)
    x = torch.randint(0, 49, (2, L), generator=torch.Generator().manual_seed(1))
    inp = obj.prepare({"input_ids": x}, torch.Generator().manual_seed(2))
    xt = inp.input_ids[:, :L]
    assert (xt == model.cfg.mask_id).any()
    with torch.no_grad():
        joint = model(inp.input_ids, inp.position_ids, inp.attn_mask, logits_slice=inp.logits_slice)
        for blk in range(L // bs):
            n = (blk + 1) * bs
            ids = torch.cat((x[:, : blk * bs], xt[:, blk * bs : n]), 1)
            pos = torch.arange(n).expand(2, n)
            q = torch.arange(n) // bs
            mask = q[:, None] >= q[None, :]  # block-causal
            alone = model(ids, pos, mask)[:, -bs:]
            torch.testing.assert_close(joint[:, blk * bs : n], alone, atol=1e-5, rtol=1e-5)


def test_mdlm_padding_is_invisible():
    model = tiny_model(seed=4)
    obj = build_objective(ObjectiveConfig(name="mdlm"), model.cfg, L)
    x = torch.randint(0, 49, (1, L), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(1, L, dtype=torch.bool)
    valid[:, 8:] = False
    inp = obj.prepare({"input_ids": x, "valid_mask": valid}, torch.Generator().manual_seed(2))
    with torch.no_grad():
        padded = model(inp.input_ids, inp.position_ids, inp.attn_mask)[:, :8]
        alone = model(inp.input_ids[:, :8], inp.position_ids[:, :8], build_mask("bidirectional", 8))
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)
    assert inp.loss_weight[:, 8:].sum() == 0


def test_ar_logits_are_causal():
    model = tiny_model(seed=5)
    obj = build_objective(ObjectiveConfig(name="ar"), model.cfg, L)
    x = torch.randint(0, 49, (1, L))
    inp = obj.prepare({"input_ids": x})
    with torch.no_grad():
        full = model(inp.input_ids, inp.position_ids, inp.attn_mask)
        prefix = model(x[:, :5], inp.position_ids[:, :5], build_mask("causal", 5))
    torch.testing.assert_close(full[:, :5], prefix, atol=1e-5, rtol=1e-5)


def test_mask_and_padding_logits_are_excluded():
    model = tiny_model()
    logits = model(torch.randint(0, 49, (1, 4)), torch.arange(4)[None], build_mask("causal", 4))
    assert logits.shape[-1] == model.cfg.padded_vocab_size
    assert torch.isinf(logits[..., 49]).all() and torch.isinf(logits[..., 50:]).all()
    assert torch.isfinite(logits[..., :49]).all()
