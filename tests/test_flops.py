"""FLOPs per step count the attention pairs each objective's mask allows (pretrain/flops.py)."""

from __future__ import annotations

import pytest
import torch

from model.config import ModelConfig
from model.masks import build_mask
from model import families
from pretrain.flops import StepFlops, attention_pairs, train_step_flops

# 1 layer, hidden 8, 2 heads of 4, GELU MLP 16, vocabulary 100 padded to 128.
TINY = ModelConfig(n_layers=1, hidden=8, n_heads=2, ffn_hidden=16, vocab_size=100, mask_id=99, dropout=0.0)


@pytest.mark.parametrize("kind,L,B", [("causal", 5, 0), ("bidirectional", 6, 0), ("set_causal", 7, 0), ("set_causal", 1, 0),
                                      ("block_diffusion", 8, 2), ("block_diffusion", 6, 3), ("block_diffusion", 4, 4)])
def test_pair_counts_are_the_masks(kind, L, B):
    assert attention_pairs(kind, L, B) == int(build_mask(kind, L, B).sum())


def test_hand_counts_per_objective():
    # Per token and layer: QKV 2*8*(2+2*2)*4 = 384, proj 2*2*4*8 = 128, MLP 2*8*16*2 = 512 -> 1024.
    # Per allowed attention pair: 4 * 2 heads * 4 = 32. Head: 2 * 8 * 128 = 2048 per predicted token.
    # L = 4, one sequence; a step is 3 forwards.
    hand = {
        "ar": 3 * (1024 * 4 + 32 * 10 + 2048 * 3),       # causal: 10 pairs, 3 next-token predictions
        "mdlm": 3 * (1024 * 4 + 32 * 16 + 2048 * 4),     # bidirectional: 16 pairs
        "setdlm": 3 * (1024 * 8 + 32 * 20 + 2048 * 4),   # 2L = 8 tokens, 10 clean-causal + 6 earlier + 4 self
        "bd3lm": 3 * (1024 * 8 + 32 * 24 + 2048 * 4),    # B = 2: 8 in own blocks, 4 + 12 to clean blocks
    }
    for name, value in hand.items():
        assert train_step_flops(TINY, name, 4, 1, block_size=2) == value, name
    assert train_step_flops(TINY, "setdlm", 4, 5) == 5 * hand["setdlm"]
    # recomputation: full adds one forward of the blocks, selective the attention core's forward
    assert train_step_flops(TINY, "ar", 4, 1, recompute="full") == hand["ar"] + 1024 * 4 + 32 * 10
    assert train_step_flops(TINY, "ar", 4, 1, recompute="selective") == hand["ar"] + 32 * 10


def test_setdlm_attention_is_about_two_causal_attentions_not_a_dense_2L():
    L = 1024
    assert attention_pairs("set_causal", L) < 1.01 * 2 * attention_pairs("causal", L)
    assert attention_pairs("set_causal", L) < 0.26 * (2 * L) ** 2


def test_linear_flops_match_torch_flop_counter():
    """The matmul part equals what torch's FlopCounterMode counts on the real model's forward + backward."""
    from torch.utils.flop_counter import FlopCounterMode

    from model.objectives import build_objective
    from model.config import ObjectiveConfig
    from model.transformer import Transformer

    cfg = ModelConfig(n_layers=2, hidden=16, n_heads=2, ffn_hidden=32, vocab_size=100, mask_id=99, dropout=0.0,
                      activation="swiglu", norm="rmsnorm", tie_embeddings=False)
    torch.manual_seed(0)
    model = Transformer(cfg)
    for name in ("ar", "setdlm"):
        L = 6
        objective = build_objective(ObjectiveConfig(name=name), cfg, L)
        inputs = objective.prepare({"input_ids": torch.randint(0, 99, (1, L))}, torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as counter:
            logits = model(inputs.input_ids, inputs.position_ids, **inputs.model_kwargs())
            objective.loss(logits, inputs)[0].backward()
        counts = counter.get_flop_counts()["Global"]
        attention = sum(v for k, v in counts.items() if "attention" in str(k))
        counted = sum(counts.values()) - attention
        pairs = attention_pairs(families.get(name).layout(L).mask_kind, L)
        ours = train_step_flops(cfg, name, L, 1)
        ours_attention = 3 * cfg.n_layers * 4 * cfg.n_heads * cfg.dim_head * pairs
        assert counted == ours - ours_attention, name  # (the CPU SDPA kernel is not in the counter's table)


def test_mfu_and_hfu_metrics():
    f = StepFlops(model=2e12, hardware=3e12)
    m = f.metrics(steps_per_s=0.5, peak_tflops=10.0, world=2)
    assert m["perf/model_tflops"] == pytest.approx(0.5) and m["perf/mfu"] == pytest.approx(0.05)
    assert m["perf/hfu"] == pytest.approx(0.075) and m["perf/hardware_tflops"] == pytest.approx(0.75)
    assert StepFlops(1e12, 1e12).metrics(1.0, None, 1) == {"perf/model_tflops": 1.0, "perf/mfu": None}


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H100 NVL", 835.0), ("NVIDIA GH200 480GB", 989.0),
                                       ("NVIDIA A100-SXM4-80GB", 312.0), ("NVIDIA A10", 125.0),
                                       ("NVIDIA GeForce RTX 3090", None)])
def test_datasheet_peak_of_a_device_name(name, peak):
    from pretrain.flops import datasheet_peak_tflops

    assert datasheet_peak_tflops(name) == peak


def test_train_peak_tflops_is_what_mfu_divides_by(tmp_path, model_parallel, capsys):
    """`train.peak_tflops` replaces the datasheet peak in the trainer's perf/mfu; 0 on CPU logs MFU N/A;
    a negative value is refused naming the key."""
    from helpers import read_metrics, write_recipe
    from launch.cli import main as cli_main
    from pretrain.config import load_config
    from pretrain.flops import device_peak_tflops
    from pretrain.trainer import Trainer

    assert device_peak_tflops(123.0) == 123.0
    if not torch.cuda.is_available():
        assert device_peak_tflops(0.0) is None
    recipe = write_recipe(tmp_path / "r.yaml")
    for peak in (0.0, 1e-4):
        out = tmp_path / f"peak{peak}"
        cfg = load_config(recipe, [f"run.out_dir={out}", "train.max_steps=2", "train.eval_every=0", "train.save_every=100",
                                   f"train.peak_tflops={peak}"])
        Trainer(cfg).train()
        m = read_metrics(out / "tiny")[2]
        if peak:
            assert m["perf/mfu"] == pytest.approx(m["perf/model_tflops"] / peak)
        elif not torch.cuda.is_available():
            assert "perf/mfu" not in m and m["perf/model_tflops"] > 0  # N/A: not written (the console says "MFU N/A")
    assert cli_main(["pretrain", "--config", str(recipe), "--out", str(tmp_path), "train.peak_tflops=-1"]) == 2
    assert "train.peak_tflops" in capsys.readouterr().err


@pytest.mark.parametrize("name", families.names())
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_pipeline_stage_shares_add_up_to_the_step(name, recompute):
    """The step-time model's per-stage (matmul, attention) split (sequence_flops) sums to train_step_flops."""
    from pretrain.flops import sequence_flops

    cfg = ModelConfig(n_layers=5, hidden=8, n_heads=2, ffn_hidden=16, vocab_size=100, mask_id=99, dropout=0.0)
    whole = train_step_flops(cfg, name, 8, 3, block_size=2, recompute=recompute)
    stages = [sequence_flops(cfg, name, 8, 2, recompute, n_layers=n, head=last) for n, last in ((2, False), (2, False),
                                                                                                (1, True))]
    assert 3 * sum(sum(s) for s in stages) == pytest.approx(whole)
    matmul, attention = sequence_flops(cfg, name, 8, 2, recompute)
    assert attention == pytest.approx((3 + (recompute != "none")) * 5 * 32 * attention_pairs(
        families.get(name).layout(8, 2).mask_kind, 8, 2))
