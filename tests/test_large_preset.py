"""The 7B-class preset: qwen3-8b has Qwen3-8B's shape and parameter count, an HF Qwen3-8B config.json
derives the same shape for train.init_from, one rank of it at TP=8 x PP=2 holds what pretrain/plan.py
says and builds without the model's memory, and its recipes' dry runs fit 80 GB GPUs in the layouts the
plan ranks fastest."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from helpers import REPO, cli_env
from launch.cli import main as cli_main
from model.config import ModelConfig, apply_preset
from model.shapes import parameter_count
from model.transformer import Transformer
from pretrain.config import load_config

RECIPE = REPO / "configs" / "qwen3-8b-setdlm.yaml"
QWEN3_VOCAB = ["model.vocab_size=151670", "model.mask_id=151669"]  # the qwen3 tokenizer: 151,669 + MASK

# Qwen3-8B's published config.json (architecture fields; transformers 4.51 layout)
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 12288, "max_position_embeddings": 40960,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": False, "use_sliding_window": False,
    "vocab_size": 151936, "eos_token_id": 151645, "bos_token_id": 151643,
}


def preset_cfg(name: str, vocab: int = 151936, **over) -> ModelConfig:
    return ModelConfig(**{**apply_preset({"preset": name}), "vocab_size": vocab, "mask_id": vocab - 1, **over})


def test_qwen3_8b_has_qwen3_8b_parameter_count():
    cfg = preset_cfg("qwen3-8b")  # Qwen3-8B's own 151,936-row embedding and head
    assert parameter_count(cfg) == 8_190_735_360  # Qwen3-8B: 8.19B
    assert parameter_count(cfg, embeddings=False) == 6_946_075_648  # its model card: 6.95B non-embedding
    cfg.validate(tp=8)


@pytest.mark.parametrize("variant", [
    dict(norm="rmsnorm", activation="swiglu", qk_norm=True, bias=False, tie_embeddings=False, n_kv_heads=2),
    dict(norm="rmsnorm", activation="swiglu", qk_norm=True, bias=False, tie_embeddings=True),
    dict(norm="layernorm", activation="gelu", bias=True, tie_embeddings=False, head_bias=True),
    dict(norm="layernorm", activation="gelu", bias=False, tie_embeddings=True),
])
def test_parameter_count_is_what_the_model_holds(variant):
    cfg = ModelConfig(n_layers=2, hidden=32, n_heads=4, ffn_hidden=48, vocab_size=300, mask_id=299, **variant)
    model = Transformer(cfg)
    assert parameter_count(cfg) == sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for n, p in model.named_parameters() if not n.startswith(("embed.", "head.")))
    assert parameter_count(cfg, embeddings=False) == blocks


@pytest.mark.parametrize("layout", ["rope_theta", "rope_parameters"])
def test_hf_qwen3_8b_config_derives_the_preset(layout):
    """init_from of a Qwen3-8B directory: the architecture read from config.json is the preset's, so a
    recipe naming the preset merges without a disagreement and keeps every value."""
    from model.convert.hf_stock import ARCH_FIELDS, model_section
    from pretrain.init_from import _merge_model

    config = dict(QWEN3_8B_CONFIG)
    if layout == "rope_parameters":  # transformers 5 writes the rotary settings this way
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
        config.pop("rope_scaling")
    derived = model_section(config)
    preset = apply_preset({"preset": "qwen3-8b"})
    assert {k: v for k, v in derived.items() if k in preset} == {k: preset[k] for k in derived if k in preset}
    assert set(ARCH_FIELDS) - set(preset) == {"head_bias"} and derived["head_bias"] is False
    cfg = load_config(RECIPE, QWEN3_VOCAB)
    before = dataclasses.asdict(cfg.model)
    notes = []
    _merge_model(cfg, derived, "Qwen3-8B/config.json", notes)
    assert dataclasses.asdict(cfg.model) == before and notes == []  # nothing changed: the preset is Qwen3-8B's
    wrong = {**derived, "ffn_hidden": 11008}
    with pytest.raises(ValueError, match="model.ffn_hidden.*preset 'qwen3-8b'"):
        _merge_model(load_config(RECIPE, QWEN3_VOCAB), wrong, "other/config.json", [])


@pytest.mark.slow
def test_one_rank_of_qwen3_8b_at_tp8_pp2_holds_what_the_plan_says():
    """Two of the 16 ranks of a TP=8 x PP=2 qwen3-8b (stage 0 TP rank 0, stage 1 TP rank 7), each built
    on `meta` by pretrain.parallelize.build_stage in a fake 16-rank process group: their parameters are
    pretrain/plan.py's per-rank counts, the two stages cover the whole model once, nothing is allocated,
    and the host holds about one initialisation unit (1/8 of the embedding) at a time, not the model."""
    pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_rank_build.py"), "--preset", "qwen3-8b",
                        "--tp", "8", "--pp", "2", "--json"], cwd=REPO, env=cli_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(x["stage"], x["tp_rank"]) for x in rows] == [(0, 0), (1, 7)]
    first, last = rows
    for x in rows:
        assert x["params"] == x["plan_params"], x
        assert x["devices"] == ["meta"]
        assert x["params"] < 0.07 * x["model_params"]  # about 1/16 of the model
    assert first["params"] == 18 * 24_125_696 + 151_680 * 4096 // 8  # 18 blocks + 1/8 of the padded embedding
    assert last["params"] == first["params"] + 4096  # the head's slice instead of the embedding's, + final norm
    assert first["full_params_covered"] + last["full_params_covered"] == first["model_params"]
    assert first["model_params"] == parameter_count(preset_cfg("qwen3-8b", 151670))
    assert "embed.weight" in first["names"] and "layers.17.mlp.fc2.weight" in first["names"]
    assert not any(n.startswith(("head.", "final_norm.", "layers.18.")) for n in first["names"])
    assert {"head.weight", "final_norm.weight", "layers.18.attn.qkv.weight", "layers.35.norm2.weight"} <= set(last["names"])
    assert not any(n.startswith(("embed.", "layers.17.")) for n in last["names"])
    for x in rows:
        if x["host_peak_mib"] == x["host_peak_mib"]:  # VmHWM available (Linux)
            assert x["host_peak_mib"] < 1.3 * x["largest_fp32_mib"] + 128, x
            assert x["host_peak_mib"] * 2**20 < 0.2 * x["fp32_gib"] * 2**30  # far below the rank's own shard


@pytest.mark.parametrize("world", [32, 64])
def test_qwen3_8b_recipe_dry_run_fits_80gb(world, capsys, tmp_path):
    from pretrain.plan import GIB, plan

    code = cli_main(["pretrain", "--config", str(RECIPE), "--dry-run", "--world-size", str(world), "--out",
                     str(tmp_path), *QWEN3_VOCAB])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"world {world} = TP 2 x PP 1 x DP {world // 2} | ZeRO-2 + overlap_comm" in out
    assert "4094.5M parameters per rank" in out and "MFU" in out
    cfg = load_config(RECIPE, QWEN3_VOCAB)
    info = plan(cfg, world)
    peak = max(m.total for m in info["memory"])
    assert peak < 0.9 * 80 * GIB, peak / GIB  # the plan's rule: within 90% of 80 GiB
    fit, _ = info["fit"][cfg.train.activation_checkpointing]
    assert fit >= cfg.train.micro_batch, info["fit"]
    assert info["time"].mfu > 0.5 and info["time"].tp < 0.1 * info["time"].total
    for seq_len in (1024, 4096):  # the whole L range of the recipe fits at its micro-batch
        cfg = load_config(RECIPE, [*QWEN3_VOCAB, f"data.seq_len={seq_len}"])
        assert max(m.total for m in plan(cfg, world)["memory"]) < 0.9 * 80 * GIB


def test_long_context_recipe_uses_context_parallelism_and_fits():
    from pretrain.plan import GIB, plan

    cfg = load_config(REPO / "configs" / "qwen3-8b-setdlm-16k.yaml", QWEN3_VOCAB)
    assert cfg.data.seq_len == 16384 and cfg.parallel.cp > 1
    for world in (32, 64):
        info = plan(cfg, world)
        assert max(m.total for m in info["memory"]) < 0.9 * 80 * GIB
        assert info["time"].cp > 0 and info["comm"]["context parallel"] > 0


def test_gsm8k_qwen3_8b_recipe_plans_one_node():
    from pretrain.plan import GIB, plan

    cfg = load_config(REPO / "configs" / "gsm8k-qwen3-8b-setdlm.yaml", QWEN3_VOCAB)
    assert cfg.model.n_layers == 36 and cfg.train.init_from == "models/Qwen3-8B-Base"
    info = plan(cfg, 8)
    assert (info["tp"], info["dp"], info["accum"]) == (2, 4, 2)
    peak = max(m.total for m in info["memory"])
    assert peak < 0.6 * 80 * GIB and info["fit"]["none"][0] >= cfg.train.micro_batch, (peak / GIB, info["fit"])


@pytest.mark.slow
def test_dry_run_plans_an_init_from_source_with_its_architecture(tmp_path, capsys):
    """The dry run of a fine-tuning recipe derives the model and vocabulary from train.init_from as the
    run would (here a tiny HF Qwen3 directory); a source not on this machine is a note, not an error."""
    import yaml

    from hf_fixtures import make_hf_model
    from pretrain.plan import plan

    src = make_hf_model(tmp_path / "hf", "qwen3", layers=3, tie=False)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "run": {"name": "ft"}, "model": {"max_seq_len": 64}, "objective": {"name": "setdlm"},
        "data": {"source": "builtin:pydoc_topics", "seq_len": 32},
        "train": {"init_from": str(src), "micro_batch": 2, "global_batch": 4}}))
    code = cli_main(["pretrain", "--config", str(recipe), "--dry-run", "--world-size", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"planned with the architecture and tokenizer of train.init_from {src}" in out
    from pretrain.init_from import prepare_for_plan

    cfg = load_config(recipe)
    prepare_for_plan(cfg)  # what the run would derive: 3 untied qwen3 blocks, GPT-2's 50,257 tokens + MASK
    assert (cfg.model.n_layers, cfg.model.tie_embeddings, cfg.model.vocab_size) == (3, False, 50258)
    assert f"| {parameter_count(cfg.model) / 1e9:.3f}B parameters" in out
    assert plan(cfg, 2)["params_total"] == parameter_count(cfg.model)
    assert not (tmp_path / "ft").exists()
    code = cli_main(["pretrain", "--config", str(recipe), "--dry-run", "--world-size", "2", "--out", str(tmp_path),
                     "train.init_from=/no/such/model"])
    out = capsys.readouterr().out
    assert code == 0 and "is not on this machine" in out, out
