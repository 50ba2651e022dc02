"""Every shipped recipe loads and validates; overrides parse as YAML; presets can be overridden."""

from pathlib import Path

import pytest

from pretrain.config import load_config, parse_overrides

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_recipe_validates(path):
    mixture = "mixture:" in path.read_text()  # a mixture's directories are only opened by the loader
    cfg = load_config(path, [] if mixture else ["data.source=builtin:pydoc_topics"])  # shard folders do not exist here
    cfg.model.vocab_size = cfg.model.vocab_size or 50258
    cfg.model.mask_id = cfg.model.mask_id if cfg.model.mask_id >= 0 else cfg.model.vocab_size - 1
    world = cfg.parallel.tp * cfg.parallel.pp * (cfg.train.global_batch // cfg.train.micro_batch)
    cfg.validate(world_size=world)


def test_overrides_are_yaml_and_presets_yield_to_explicit_keys(tmp_path):
    assert parse_overrides(["train.lr=1e-3", "model.qk_norm=true", "run.name=x"]) == {
        "train": {"lr": 1e-3}, "model": {"qk_norm": True}, "run": {"name": "x"}}
    r = tmp_path / "r.yaml"
    r.write_text("model:\n  preset: paper-12x768\n  n_layers: 3\nobjective: {name: ar}\ndata: {seq_len: 64}\n"
                 "train: {max_steps: 3}\n")
    cfg = load_config(r, ["train.lr=1e-3", "model.hidden=96", "model.n_heads=4"])
    assert cfg.train.lr == 1e-3 and isinstance(cfg.train.lr, float)
    assert (cfg.model.n_layers, cfg.model.hidden, cfg.model.ffn_hidden) == (3, 96, 3072)


def test_qwen3_preset_shape():
    from model.config import ModelConfig, apply_preset
    from model.shapes import parameter_count

    cfg = ModelConfig(**{**apply_preset({"preset": "qwen3-1.7b"}), "vocab_size": 151936, "mask_id": 151935})
    assert 1.6e9 < parameter_count(cfg) < 2.2e9
    cfg.validate(tp=8)
    paper = ModelConfig(**{**apply_preset({"preset": "paper-12x768"}), "vocab_size": 50258, "mask_id": 50257})
    assert 150e6 < parameter_count(paper) < 175e6  # 85M blocks + two 50k x 768 embeddings


@pytest.mark.parametrize("item", ["trainmax_steps=3", "train.max_steps"])
def test_malformed_override(item):
    with pytest.raises(ValueError, match="section.key=value"):
        parse_overrides([item])


def test_mixture_recipe():
    from data_pipeline.mixture import source_configs

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "owt-lm1b-mixture-setdlm.yaml")
    assert cfg.data.source is None
    assert [(n, share, one.source) for n, share, one in source_configs(cfg.data)] == [
        ("owt", 0.7, "data/owt"), ("lm1b", 0.3, "data/lm1b-gpt2")]
