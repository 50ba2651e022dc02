"""Importer for the reference implementation's DiT checkpoints, on synthetic state dicts with the key
names and shapes of kuleshov-group/setdlms src/backbone/dit.py (the hub is not reachable here).

`dit_forward` below is a small, independent re-statement of that backbone's documented math
(LayerNorm without bias, adaLN modulate/gate, rotate-half rotary on q and k, GELU-tanh MLP, final
layer with bias), used as the ground truth for the imported model's logits."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

H, NH, FF, C, NL, L, V = 32, 2, 128, 16, 2, 16, 50258  # V: GPT-2 + MASK appended (id 50257)


def synthetic_dit(adaln: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    sd = {"vocab_embed.embedding": r(V, H, std=1.0),
          "rotary_emb.inv_freq": 1.0 / (10000 ** (torch.arange(0, H // NH, 2).float() / (H // NH)))}
    if adaln:
        sd.update({"sigma_map.mlp.0.weight": r(C, 256), "sigma_map.mlp.0.bias": r(C), "sigma_map.mlp.2.weight": r(C, C),
                   "sigma_map.mlp.2.bias": r(C)})
    for i in range(NL):
        p = f"blocks.{i}."
        sd.update({p + "norm1.weight": 1 + r(H), p + "attn_qkv.weight": r(3 * H, H), p + "attn_out.weight": r(H, H),
                   p + "norm2.weight": 1 + r(H), p + "mlp.0.weight": r(FF, H), p + "mlp.0.bias": r(FF),
                   p + "mlp.2.weight": r(H, FF), p + "mlp.2.bias": r(H)})
        if adaln:
            sd.update({p + "adaLN_modulation.weight": r(6 * H, C), p + "adaLN_modulation.bias": r(6 * H)})
    sd.update({"output_layer.norm_final.weight": 1 + r(H), "output_layer.linear.weight": r(V, H),
               "output_layer.linear.bias": r(V)})
    if adaln:
        sd.update({"output_layer.adaLN_modulation.weight": r(2 * H, C), "output_layer.adaLN_modulation.bias": r(2 * H)})
    return sd


def dit_forward(sd, ids, pos, mask, sigma=0.0):
    """The reference backbone's forward (eval mode), written from its documented structure."""
    d = H // NH
    x = sd["vocab_embed.embedding"][ids]
    c = None
    if "sigma_map.mlp.0.weight" in sd:
        half = 128
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = torch.full((1,), sigma)[:, None] * freqs[None]
        t = torch.cat([torch.cos(args), torch.sin(args)], -1)
        t = F.linear(F.silu(F.linear(t, sd["sigma_map.mlp.0.weight"], sd["sigma_map.mlp.0.bias"])),
                     sd["sigma_map.mlp.2.weight"], sd["sigma_map.mlp.2.bias"])
        c = F.silu(t)
    inv = sd["rotary_emb.inv_freq"]
    emb = torch.cat([pos.float()[..., None] * inv] * 2, -1)  # [B, T, d]
    cos, sin = emb.cos()[:, :, None], emb.sin()[:, :, None]

    def rot(v):
        v1, v2 = v[..., : d // 2], v[..., d // 2:]
        return v * cos + torch.cat((-v2, v1), -1) * sin

    def ln(v, w):
        return F.layer_norm(v, [H], weight=w)

    for i in range(NL):
        p = f"blocks.{i}."
        if c is not None:
            mods = F.linear(c, sd[p + "adaLN_modulation.weight"], sd[p + "adaLN_modulation.bias"])[:, None].chunk(6, -1)
        else:
            z, o = torch.zeros(1, 1, H), torch.zeros(1, 1, H)
            mods = (z, z, o + 1, z, z, o + 1)
        shift1, scale1, gate1, shift2, scale2, gate2 = mods
        h = ln(x, sd[p + "norm1.weight"]) * (1 + scale1) + shift1
        qkv = F.linear(h, sd[p + "attn_qkv.weight"]).view(*h.shape[:2], 3, NH, d)
        q, k, v = rot(qkv[:, :, 0]), rot(qkv[:, :, 1]), qkv[:, :, 2]
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + gate1 * F.linear(a.transpose(1, 2).reshape(*h.shape[:2], H), sd[p + "attn_out.weight"])
        h = ln(x, sd[p + "norm2.weight"]) * (1 + scale2) + shift2
        h = F.linear(F.gelu(F.linear(h, sd[p + "mlp.0.weight"], sd[p + "mlp.0.bias"]), approximate="tanh"),
                     sd[p + "mlp.2.weight"], sd[p + "mlp.2.bias"])
        x = x + gate2 * h
    h = ln(x, sd["output_layer.norm_final.weight"])
    if c is not None:
        shift, scale = F.linear(c, sd["output_layer.adaLN_modulation.weight"], sd["output_layer.adaLN_modulation.bias"])[:, None].chunk(2, -1)
        h = h * (1 + scale) + shift
    return F.linear(h, sd["output_layer.linear.weight"], sd["output_layer.linear.bias"])


def _setdlm_inputs(mask_id):
    """Two-stream SetDLM layout over L tokens with a permuted order (SETDLM.md section 3)."""
    from model.masks import build_mask

    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, mask_id, (2, L), generator=g)
    perm = torch.stack([torch.randperm(L, generator=g) for _ in range(2)])
    clean = torch.gather(x, 1, perm)
    ids = torch.cat((clean, torch.full_like(clean, mask_id)), 1)
    pos = torch.cat((perm, perm), 1)
    return ids, pos, build_mask("set_causal", L)


def _compare(run_dir, sd, sigma=0.0):
    from model.transformer import full_logits
    from pretrain.checkpoint.inference import load_model

    model, tok, cfg = load_model(run_dir)
    ids, pos, mask = _setdlm_inputs(tok.mask_id)
    with torch.no_grad():
        ours = full_logits(model, model(ids, pos, mask))
        ref = dit_forward(sd, ids, pos, mask, sigma)
    ref[..., tok.mask_id] = float("-inf")
    fin = torch.isfinite(ours)
    assert torch.equal(fin, torch.isfinite(ref))
    diff = (ours[fin] - ref[fin]).abs().max().item()
    assert diff < 1e-4, diff  # logits of order 10: 1e-4 is a few float32 ulps
    return model, tok, cfg


def _write_hf_style(d, sd, config):
    d.mkdir()
    torch.save({"backbone." + k: v for k, v in sd.items()}, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps(config))


def test_published_style_setdlm_checkpoint_imports_exactly(tmp_path, model_parallel):
    from pretrain.convert.from_reference import import_reference

    sd = synthetic_dit(adaln=False)
    config = {"architectures": ["SetDLM"], "model_type": "denoiser",
              "backbone_config": {"_target_": "backbone_dit.DIT", "n_heads": NH, "length": L, "hidden_size": H,
                                  "num_layers": NL, "adaln": False, "vocab_size": V},
              "tokenization_config": {"vocab_size": V, "mask_token_id": 50257}}
    _write_hf_style(tmp_path / "owt-setdlm-d4", sd, config)
    run = import_reference(tmp_path / "owt-setdlm-d4", tmp_path / "run", set_size=4, log=lambda s: None)
    model, tok, cfg = _compare(run, sd)
    o = cfg.objective
    assert (o.name, o.set_size, o.s_max, cfg.data.seq_len) == ("setdlm", 4, None, L)  # S_max = 2D by default
    from model.schedule import SlidingWindow

    sw = SlidingWindow.build(L, o.set_size, o.s_max, o.k)
    assert sw.s_max == 8 and abs(sw.expected_budget - 2.0) < 1e-9
    assert cfg.model.head_bias and not cfg.model.tie_embeddings and tok.mask_id == 50257


def test_adaln_lightning_checkpoint_with_ema_and_prefixes(tmp_path, model_parallel):
    """MDLM-style Lightning .ckpt: `state_dict` with `backbone._orig_mod.` prefixes, EMA shadow list in
    parameter order, adaLN folded at sigma = 0."""
    from pretrain.convert.from_reference import import_reference

    raw = synthetic_dit(adaln=True, seed=1)
    ema = synthetic_dit(adaln=True, seed=2)
    state = {"backbone._orig_mod." + k: v for k, v in raw.items()}
    state["noise.sigma_max"] = torch.tensor(1.0)  # non-backbone entries are ignored
    shadow = [ema[k] for k in raw if not k.endswith("inv_freq")]
    torch.save({"state_dict": state, "ema": {"shadow_params": shadow}}, tmp_path / "last.ckpt")
    run = import_reference(tmp_path / "last.ckpt", tmp_path / "run", family="mdlm", seq_len=L,
                           log=lambda s: None)
    _compare(run, ema)  # EMA weights, time conditioning folded exactly
    run2 = import_reference(tmp_path / "last.ckpt", tmp_path / "run2", family="mdlm", seq_len=L, ema=False,
                            sigma=0.3, log=lambda s: None)
    _compare(run2, raw, sigma=0.3)


def test_missing_information_is_asked_for(tmp_path, model_parallel):
    from model.convert import ConvertError
    from pretrain.convert.from_reference import import_reference

    sd = synthetic_dit(adaln=False)
    _write_hf_style(tmp_path / "m", sd, {"architectures": ["SetDLM"], "backbone_config": {"n_heads": NH, "length": L}})
    with pytest.raises(ConvertError, match="--set-size"):
        import_reference(tmp_path / "m", tmp_path / "run", log=lambda s: None)
    no_heads = {k: v for k, v in sd.items() if "inv_freq" not in k}
    torch.save(no_heads, tmp_path / "w.bin")
    with pytest.raises(ConvertError, match="--n-heads"):
        import_reference(tmp_path / "w.bin", tmp_path / "run", family="ar", log=lambda s: None)
    torch.save({"something.else": torch.zeros(3)}, tmp_path / "x.bin")
    with pytest.raises(ConvertError, match="no DiT backbone"):
        import_reference(tmp_path / "x.bin", tmp_path / "run", family="ar", log=lambda s: None)
    with pytest.raises(ConvertError, match="--family"):
        import_reference(tmp_path / "w.bin", tmp_path / "run", n_heads=NH, log=lambda s: None)


def test_imported_model_samples_with_the_stack(tmp_path, model_parallel):
    """An imported reference model decodes with this stack's sampler (S_max = 2D, window D)."""
    from model.sampling import SamplingConfig, generate
    from pretrain.checkpoint.inference import load_model
    from pretrain.convert.from_reference import import_reference

    sd = synthetic_dit(adaln=False, seed=4)
    torch.save({"backbone." + k: v for k, v in sd.items()}, tmp_path / "w.bin")
    run = import_reference(tmp_path / "w.bin", tmp_path / "run", family="setdlm", set_size=2, seq_len=L,
                           log=lambda s: None)
    model, tok, cfg = load_model(run)
    out = generate(model, [tok.encode("Hello")], SamplingConfig(family="setdlm", window=cfg.objective.set_size,
                                                                 max_new_tokens=6), mask_id=tok.mask_id)[0]
    assert out.steps >= 1 and 0 < len(out.tokens) <= 6


def test_schedule_is_read_from_the_reference_config(tmp_path, model_parallel):
    """D and S_max come from the reference's own config.json (noise_config), no --set-size needed."""
    from model.convert.reference import schedule_from_config
    from pretrain.checkpoint.inference import load_model
    from pretrain.convert.from_reference import import_reference

    sd = synthetic_dit(adaln=False)
    base = {"architectures": ["SetDLM"], "backbone_config": {"n_heads": NH, "length": L},
            "tokenization_config": {"vocab_size": V, "mask_token_id": 50257}}
    _write_hf_style(tmp_path / "a", sd, {**base, "noise_config": {"desired_block_size": 2, "max_block_size": 4}})
    _, _, cfg = load_model(import_reference(tmp_path / "a", tmp_path / "ra", log=lambda s: None))
    assert (cfg.objective.set_size, cfg.objective.s_max) == (2, None)  # 4 = 2D: the default
    _write_hf_style(tmp_path / "b", sd, {**base, "noise_config": {"desired_block_size": 2, "max_block_size": 3}})
    _, _, cfg = load_model(import_reference(tmp_path / "b", tmp_path / "rb", log=lambda s: None))
    assert (cfg.objective.set_size, cfg.objective.s_max) == (2, 3)
    # an exported config with max_block_size == length: the reference uses 2 D, so do we
    assert schedule_from_config({"noise_config": {"desired_block_size": 4, "max_block_size": 1024}}, 1024) == {"set_size": 4}
    assert schedule_from_config({}, 1024) == {}


class _OmegaConfStandIn:  # pickled objects of a training library's own classes, as Lightning saves them
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _legacy_ckpt(path, raw, ema):
    """The layout of the paper's legacy OWT .ckpt files (MDLM code base, DITLegacy backbone): a Lightning
    checkpoint with `state_dict` (backbone. prefixes), `ema` (shadow_params in parameter order, and its other
    fields), pickled hyper-parameters (config, tokenizer objects) and trainer states."""
    shadow = [ema[k] for k in raw if not k.endswith("inv_freq")]
    torch.save({"epoch": 3, "global_step": 1000, "pytorch-lightning_version": "2.2.1",
                "state_dict": {"backbone." + k: v for k, v in raw.items()},
                "ema": {"decay": 0.9999, "num_updates": 1000, "shadow_params": shadow, "collected_params": None},
                "hparams_name": "config",
                "hyper_parameters": {"config": _OmegaConfStandIn(model={"dropout": 0.1}),
                                     "tokenizer": _OmegaConfStandIn(name="gpt2")},
                "loops": {"fit_loop": {"state_dict": {}}}, "callbacks": {"ModelCheckpoint": {"best_model_score": None}},
                "optimizer_states": [{"state": {}, "param_groups": [{"lr": 3e-4}]}], "lr_schedulers": []}, path)


def test_legacy_owt_mdlm_and_ar_checkpoints_import(tmp_path, model_parallel):
    """The legacy OWT MDLM (adaLN, EMA) and AR (causal, no time conditioning) .ckpt files: the family from the
    file's name as the reference's loader reads it, EMA weights, the pickled objects never loaded."""
    from model.masks import build_mask
    from model.transformer import full_logits
    from pretrain.checkpoint.inference import load_model
    from pretrain.convert.from_reference import import_reference

    raw, ema = synthetic_dit(adaln=True, seed=5), synthetic_dit(adaln=True, seed=6)
    _legacy_ckpt(tmp_path / "owt-mdlm.ckpt", raw, ema)
    run = import_reference(tmp_path / "owt-mdlm.ckpt", tmp_path / "run", seq_len=L, log=lambda s: None)
    _, _, cfg = _compare(run, ema)
    assert cfg.objective.name == "mdlm"
    raw, ema = synthetic_dit(adaln=False, seed=7), synthetic_dit(adaln=False, seed=8)
    _legacy_ckpt(tmp_path / "owt-ar.ckpt", raw, ema)
    run = import_reference(tmp_path / "owt-ar.ckpt", tmp_path / "run-ar", seq_len=L, log=lambda s: None)
    model, tok, cfg = load_model(run)
    assert cfg.objective.name == "ar"
    ids = torch.randint(0, 50257, (2, L), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(L).expand(2, L)
    mask = build_mask("causal", L)
    with torch.no_grad():
        ours, ref = full_logits(model, model(ids, pos, mask)), dit_forward(ema, ids, pos, mask)
    ref[..., tok.mask_id] = float("-inf")
    fin = torch.isfinite(ref)
    assert (ours[fin] - ref[fin]).abs().max().item() < 1e-4


def test_dropout_comes_from_the_checkpoint(tmp_path, model_parallel):
    from pretrain.checkpoint.inference import load_model
    from pretrain.convert.from_reference import import_reference

    sd = synthetic_dit(adaln=False)
    for name, bc, want in (("a", {"dropout": 0.0}, 0.0), ("b", {"dropout": 0.25}, 0.25), ("c", {}, 0.1)):
        _write_hf_style(tmp_path / name, sd, {"architectures": ["AR"], "model_type": "ar",
                                              "backbone_config": {"n_heads": NH, "length": L, **bc}})
        _, _, cfg = load_model(import_reference(tmp_path / name, tmp_path / f"r{name}", log=lambda s: None))
        assert cfg.model.dropout == want
