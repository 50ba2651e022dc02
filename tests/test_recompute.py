"""Activation checkpointing and per-block torch.compile give the plain model's losses and gradients
(pretrain/recompute.py, pretrain/block_compile.py) on a TP=1 model, no process group; multi-process
TP=2 / PP=2 checks are in test_recompute_parallel.py."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.masks import build_mask
from pretrain.block_compile import apply_compile
from pretrain.recompute import apply_activation_checkpointing

QWEN = dict(n_layers=2, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, norm="rmsnorm", activation="swiglu",
            qk_norm=True, bias=False, tie_embeddings=True)
GPT = dict(n_layers=2, hidden=32, n_heads=2, ffn_hidden=64, norm="layernorm", activation="gelu", bias=True,
           tie_embeddings=False)


def run(shape: dict, mode: str = "none", compile: bool = False, dropout: float = 0.0):
    from model.transformer import Transformer

    cfg = ModelConfig(**shape, vocab_size=250, mask_id=249, dropout=dropout, attention_dropout=dropout)
    torch.manual_seed(0)
    model = Transformer(cfg)
    apply_activation_checkpointing(model, mode)
    if compile:
        apply_compile(model)
    L = 8
    x = torch.randint(0, 249, (2, 2 * L), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.randperm(L, generator=torch.Generator().manual_seed(2))] * 2).expand(2, -1)
    torch.manual_seed(5)  # dropout masks
    logits = model(x, pos, build_mask("set_causal", L), logits_slice=slice(L, 2 * L))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1)[:, :250], x[:, :L].flatten())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a, b, rtol: float):
    assert abs(a[0] - b[0]) <= rtol * abs(b[0]), (a[0], b[0])
    for name, g in b[1].items():
        scale = g.abs().max().item() + 1e-12
        assert (a[1][name] - g).abs().max().item() <= rtol * scale, name


@pytest.mark.parametrize("shape", [QWEN, GPT], ids=["qwen", "gpt"])
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_checkpointing_matches_the_plain_model_with_dropout(shape, mode):
    """Recomputation replays the RNG: dropout masks (hidden and attention) are redrawn identically."""
    ref = run(shape, dropout=0.1)
    assert_same(run(shape, mode, dropout=0.1), ref, rtol=1e-6)
    assert abs(run(shape, dropout=0.0)[0] - ref[0]) > 1e-4  # dropout is active, so the test can fail


def test_checkpointing_is_off_without_autograd():
    from model.transformer import Transformer

    cfg = ModelConfig(**GPT, vocab_size=250, mask_id=249, dropout=0.0)
    torch.manual_seed(0)
    model = Transformer(cfg)
    x = torch.randint(0, 249, (1, 8))
    with torch.no_grad():
        plain = model(x, torch.arange(8)[None], build_mask("causal", 8))
    apply_activation_checkpointing(model, "full")
    with torch.no_grad():
        assert torch.equal(model(x, torch.arange(8)[None], build_mask("causal", 8)), plain)
    with pytest.raises(ValueError, match="train.activation_checkpointing"):
        apply_activation_checkpointing(model, "some")


@pytest.mark.parametrize("mode", ["none", "full"])
def test_compiled_blocks_match_the_plain_model(mode):
    """inductor on CPU (a tiny model: compiling takes tens of seconds); dropout off because inductor
    draws its own random numbers."""
    from torch._dynamo.utils import counters

    ref = run(QWEN)
    breaks = sum(counters["graph_break"].values())
    assert_same(run(QWEN, mode, compile=True), ref, rtol=1e-4)
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])  # one graph per block


def test_compile_falls_back_with_a_message_without_a_compiler(monkeypatch):
    import shutil

    from model.transformer import Transformer

    monkeypatch.setattr(shutil, "which", lambda name: None)
    model = Transformer(ModelConfig(**GPT, vocab_size=250, mask_id=249))
    note = apply_compile(model, torch.device("cpu"))
    assert "C++ compiler" in note and "eager" in note
    assert not any(getattr(b, "_compiled_call_impl", None) for b in model.layers.values())


@pytest.mark.parametrize("overrides,field", [
    (["train.activation_checkpointing=most"], "train.activation_checkpointing"),
    (["train.compile=yes please"], "train.compile"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel"),
    (["parallel.sequence_parallel=true", "parallel.tp=2", "data.seq_len=31", "objective.name=ar", "train.micro_batch=2"],
     "parallel.sequence_parallel"),
    (["train.compile=true", "parallel.zero_stage=3"], "train.compile"),
])
def test_new_keys_are_validated(tmp_path, overrides, field):
    from helpers import write_recipe
    from pretrain.config import load_config

    with pytest.raises(ValueError, match=field.replace(".", r"\.")):  # at load, or at the layout check
        cfg = load_config(write_recipe(tmp_path / "r.yaml"), ["model.vocab_size=300", "model.mask_id=299", *overrides])
        cfg.validate(1 if "parallel.tp=2" not in overrides else 2)


def test_trainer_runs_with_checkpointing_and_logs_model_and_hardware_flops(tmp_path, model_parallel):
    from helpers import read_metrics, write_recipe
    from pretrain.config import load_config
    from pretrain.flops import step_flops
    from pretrain.trainer import Trainer

    def run(name, mode):
        cfg = load_config(write_recipe(tmp_path / "r.yaml"), [
            f"run.out_dir={tmp_path}", f"run.name={name}", "train.max_steps=3", "train.eval_every=0",
            "train.save_every=3", f"train.activation_checkpointing={mode}", "model.dropout=0.1"])
        Trainer(cfg).train()
        return cfg, read_metrics(tmp_path / name)

    cfg, full = run("full", "full")
    _, plain = run("plain", "none")
    assert [full[s]["train/loss"] for s in (1, 2, 3)] == pytest.approx([plain[s]["train/loss"] for s in (1, 2, 3)], rel=1e-6)
    f = step_flops(cfg)
    assert f.hardware > f.model
    ratio = full[3]["perf/hardware_tflops"] / full[3]["perf/model_tflops"]
    assert ratio == pytest.approx(f.hardware / f.model)
    assert "perf/hardware_tflops" not in plain[3] and plain[3]["perf/model_tflops"] > 0
