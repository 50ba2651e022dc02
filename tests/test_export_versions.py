"""Hugging Face export format versions (model/convert/hf_config.py): a frozen tiny export of format 1
(tests/fixtures/export_v1.tar.gz: written by setdlm at export format 1, a random 1-layer SW-SetDLM over
tests/helpers.py's word tokenizer, with that version's modeling code) still loads in transformers,
imports through `from-hf` (its config.json migrated and checked), loads with `load_model` giving the
same logits, and re-exports at the current format, which transformers loads with the current code and
decodes to the same tokens. The migration fills every registered family's inference traits, and the
check of the fields read back refuses wrong types and ranges in one line."""

from __future__ import annotations

import json
import tarfile

import pytest
import torch

from helpers import REPO
from model import families

FIXTURE = REPO / "tests" / "fixtures" / "export_v1.tar.gz"


@pytest.fixture(scope="module")
def v1(tmp_path_factory):
    out = tmp_path_factory.mktemp("export_v1")
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(out, filter="data")
    return out / "export_v1"


def _config(v1) -> dict:
    return json.loads((v1 / "config.json").read_text())


def test_the_fixture_is_a_format_1_export(v1):
    cfg = _config(v1)
    assert cfg["setdlm_format_version"] == 1 and "decoding" not in cfg["set_diffusion"]
    assert json.loads((v1 / "setdlm_recipe.json").read_text())["format_version"] == 1
    assert {"modeling_setdlm.py", "configuration_setdlm.py", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in v1.iterdir()}


@pytest.mark.parametrize("name", families.names())
def test_the_migration_fills_each_familys_traits(v1, name):
    from model.convert.hf_config import FORMAT_VERSION, migrate_export

    cfg = _config(v1)
    cfg["set_diffusion"]["family"] = name
    out = migrate_export(cfg, "setdlm_format_version", "config.json")
    spec = families.get(name)
    assert out["setdlm_format_version"] == FORMAT_VERSION == 2
    assert (out["set_diffusion"]["inference_mask"], out["set_diffusion"]["decoding"]) == (spec.inference_mask, spec.decoding)
    assert cfg["set_diffusion"].get("decoding") is None  # the record read is not changed
    recipe = json.loads((v1 / "setdlm_recipe.json").read_text())
    assert migrate_export(recipe, "format_version", "r.json") == {**recipe, "format_version": FORMAT_VERSION}


@pytest.mark.parametrize("change,message", [
    ({"decoding": "beam"}, "set_diffusion.decoding: must be one of next_token, set_window, block, full_sequence, got 'beam'"),
    ({"inference_mask": 3}, "set_diffusion.inference_mask: must be one of causal, bidirectional, block_causal, got 3"),
    ({"decoding": "block"}, "set_diffusion.decoding: 'block' is not the setdlm family's \\('set_window'\\)"),
    ({"length": "16"}, "set_diffusion.length: must be a whole number >= 1, got '16'"),
    ({"block_size": 0}, "set_diffusion.block_size: must be a whole number >= 1, got 0"),
    ({"set_size": True}, "set_diffusion.set_size: must be a whole number >= 1, got True"),
    ({"eps": 1.5}, "set_diffusion.eps: must be a number in \\(0, 1\\), got 1.5"),
    ({"family": "gpt"}, "set_diffusion.family: unknown family 'gpt'"),
    ({"top": {"mask_token_id": 99}}, "mask_token_id: must be a token id in \\[0, vocab_size\\), got 99"),
    ({"top": {"num_hidden_layers": 0}}, "num_hidden_layers: must be a whole number >= 1, got 0"),
])
def test_fields_read_back_are_checked_by_type_and_range(v1, change, message):
    from model.convert.errors import ConvertError
    from model.convert.hf_config import migrate_export

    cfg = _config(v1)
    cfg.update(change.pop("top", {}))
    cfg["set_diffusion"].update(change)
    with pytest.raises(ConvertError, match=f"^config.json: {message}"):
        migrate_export(cfg, "setdlm_format_version", "config.json")


@pytest.mark.slow
def test_a_format_1_export_loads_imports_and_exports_again(v1, tmp_path):
    from test_family_contract import run_hf

    from model.sampling import SamplingConfig, generate
    from model.transformer import full_logits
    from pretrain.checkpoint.inference import load_model
    from pretrain.convert.export import export_checkpoint
    from pretrain.convert.from_hf import import_hf

    run = import_hf(v1, tmp_path / "run", log=lambda s: None)
    model, tok, cfg = load_model(run)
    assert cfg.objective.name == "setdlm" and cfg.objective.set_size == 2 and tok.mask_id == 31
    v2 = export_checkpoint(run, tmp_path / "v2", log=lambda s: None)
    sd = json.loads((v2 / "config.json").read_text())
    assert sd["setdlm_format_version"] == 2 and sd["set_diffusion"]["decoding"] == "set_window"
    L = 8
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 31, (2, 2 * L), generator=g)
    pos = torch.cat((torch.randperm(L, generator=g), torch.arange(L))).expand(2, -1).contiguous()
    from model.masks import build_mask

    mask = build_mask("set_causal", L)
    with torch.no_grad():
        ref = full_logits(model, model(ids, pos, mask))
        ref_default = full_logits(model, model(ids[:1, :L], torch.arange(L)[None], build_mask("causal", L)))
    prompts = [tok.encode("the cat sat on"), tok.encode("a big dog")]
    sc = SamplingConfig.from_objective(cfg.objective, max_new_tokens=8)
    want = [generate(model, [p], sc, mask_id=tok.mask_id, eos_id=tok.eos_id)[0] for p in prompts]
    want = ([o.tokens for o in want], [o.steps for o in want])
    job = {"ids": ids, "pos": pos, "mask": mask, "plain": ids[:1, :L],
           "decode": {"plain": {"input_ids": prompts, "max_new_tokens": 8}}}
    hf = run_hf({"v1": {"dir": str(v1), **job}, "v2": {"dir": str(v2), **job}}, tmp_path)
    assert hf["v1"]["traits"] == (None, None) and hf["v2"]["traits"] == ("causal", "set_window")
    for version in ("v1", "v2"):
        for got, exp in ((hf[version]["logits"], ref), (hf[version]["default"], ref_default)):
            fin = torch.isfinite(exp)
            assert torch.equal(torch.isfinite(got), fin) and (got[fin] - exp[fin]).abs().max() < 1e-4, version
        assert hf[version]["plain"] == want, version
