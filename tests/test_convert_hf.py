"""Hugging Face conversion: training checkpoint -> export (loaded with plain transformers in a separate
process that cannot import setdlm) -> re-imported run directory, for every family (docs/convert.md)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from helpers import run_transformers_only, write_recipe
from model import families

FAMILIES = families.names()  # the default (trained below) first
# One architecture per family, so every mapping path is exercised (biases, SwiGLU, GQA, QK-norm, ties).
ARCH = {
    "setdlm": {},  # the tiny recipe: LayerNorm + bias, GELU, MHA, tied embeddings; trained by the Trainer
    "bd3lm": {"norm": "rmsnorm", "activation": "swiglu", "n_heads": 4, "n_kv_heads": 2, "qk_norm": True, "bias": False,
              "tie_embeddings": False, "ffn_hidden": 48},
    "mdlm": {"bias": False, "tie_embeddings": False, "n_layers": 2},
    "ar": {"tie_embeddings": False, "head_bias": True, "n_heads": 4},
}
D, SEQ = 4, 32
LIMIT = 64  # the tiny recipe's max_seq_len: decoding cases past it
OVERFLOW = {"overflow": dict(threshold=None), "overflow_threshold": dict(threshold=0.0005)}

HF_SCRIPT = r'''
import importlib.abc, sys, torch

class Block(importlib.abc.MetaPathFinder):  # the export must not need setdlm
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"model", "pretrain", "data_pipeline", "eval", "launch"}:
            raise ImportError(f"blocked import of setdlm package {name}")
sys.meta_path.insert(0, Block())
from transformers import AutoModel, AutoModelForMaskedLM

jobs = torch.load(sys.argv[1])
out = {}
for name, job in jobs.items():
    cls = AutoModel if job.get("auto_model") else AutoModelForMaskedLM
    m = cls.from_pretrained(job["dir"], trust_remote_code=True).eval()
    r = {"class": type(m).__name__}
    with torch.no_grad():
        if "ids" in job:
            r["logits"] = m(job["ids"], position_ids=job["pos"], attention_mask=job["mask"]).logits
    for key, kw in job.get("decode", {}).items():
        g = m.set_diffusion_generate(**kw)
        r[key] = (g.sequences, g.steps)
    out[name] = r
torch.save(out, sys.argv[2])
'''


def _run_hf(jobs: dict, tmp: Path) -> dict:
    """`jobs` run by HF_SCRIPT in a process that imports transformers and the exported files only."""
    return run_transformers_only(HF_SCRIPT, jobs, tmp, timeout=300)


def _logits(model, ids, pos, mask):
    from model.transformer import full_logits

    with torch.no_grad():
        return full_logits(model, model(ids, pos, mask))


def _inputs(cfg, seed: int):
    from model.objectives import build_objective

    obj = build_objective(cfg.objective, cfg.model, cfg.data.seq_len)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.mask_id, (2, cfg.data.seq_len), generator=g)
    context = torch.zeros_like(x, dtype=torch.bool)
    context[0, :5] = True
    inp = obj.prepare({"input_ids": x, "context_mask": context}, g)
    mask = inp.attn_mask
    return inp.input_ids, inp.position_ids, mask


@pytest.fixture(scope="module")
def world(tmp_path_factory, model_parallel):
    """Checkpoints of all four families, their exports, re-imports and the plain-transformers results."""
    from model.sampling import Infill, SamplingConfig, generate
    from pretrain.checkpoint.inference import load_model
    from pretrain.config import load_config
    from pretrain.convert.export import export_checkpoint
    from pretrain.convert.from_hf import import_hf, write_run
    from pretrain.trainer import Trainer
    from model.transformer import Transformer
    from data_pipeline.tokenizers import load_tokenizer

    tmp = tmp_path_factory.mktemp("convert")
    recipe = write_recipe(tmp / "r.yaml")
    w = {"tmp": tmp, "runs": {}, "exports": {}, "imports": {}, "ref": {}, "inputs": {}}
    # SetDLM: a real training run (DeepSpeed checkpoint, EMA, validation metrics) exported by train.export_hf.
    cfg = load_config(recipe, [f"run.out_dir={tmp}", "run.name=setdlm", "train.max_steps=4", "train.save_every=4",
                               "train.eval_every=0", "train.ema=0.5", "train.export_hf=true",
                               f"objective.set_size={D}", "train.lr=0.03"])
    Trainer(cfg).train()
    w["runs"]["setdlm"], w["exports"]["setdlm"] = tmp / "setdlm", tmp / "setdlm" / "hf"
    # The other families: random weights written as consolidated checkpoints (what consolidation produces).
    tok = load_tokenizer("gpt2")
    for fam in FAMILIES[1:]:
        over = [f"run.out_dir={tmp}", f"objective.name={fam}"] + [f"model.{k}={v}" for k, v in ARCH.get(fam, {}).items()]
        c = load_config(recipe, over)
        c.resolve_vocab(tok)
        torch.manual_seed(len(fam))
        m = Transformer(c.model)
        write_run(tmp / fam, c, m.state_dict(), tok, info={}, log=lambda s: None)
        w["runs"][fam] = tmp / fam
        shard = "200KB" if fam == "bd3lm" else "5GB"  # bd3lm: a sharded export with an index
        w["exports"][fam] = export_checkpoint(tmp / fam, tmp / f"{fam}-hf", max_shard_size=shard, log=lambda s: None)
    jobs = {}
    for fam in FAMILIES:
        model, _, c = load_model(w["runs"][fam])
        ids, pos, mask = _inputs(c, seed=11)
        w["inputs"][fam] = (ids, pos, mask)
        w["ref"][fam] = _logits(model, ids, pos, mask)
        jobs[fam] = {"dir": str(w["exports"][fam]), "ids": ids, "pos": pos, "mask": mask}
        w["imports"][fam] = import_hf(w["exports"][fam], tmp / f"{fam}-back",
                                      log=lambda s: None)
    jobs["automodel"] = {"dir": str(w["exports"]["mdlm"]), "auto_model": True, **{k: jobs["mdlm"][k] for k in ("ids", "pos", "mask")}}
    # Greedy decoding: the training checkpoint with model.sampling vs the export's set_diffusion_generate.
    model, tk, c = load_model(w["runs"]["setdlm"])
    prompts = [tk.encode("The meaning of"), tk.encode("In the beginning there was a")]
    infill = Infill(prefix=tk.encode("One day"), length=7, suffix=tk.encode("the end."))
    cases = {"plain": dict(threshold=None), "threshold": dict(threshold=0.0005), "window2": dict(threshold=None, window=2)}
    w["decode_ref"], decode = {}, {}
    for key, kw in cases.items():
        window = kw.get("window", D)
        sc = SamplingConfig(family="setdlm", max_new_tokens=12, window=window, threshold=kw["threshold"])
        outs = generate(model, prompts, sc, mask_id=c.model.mask_id, eos_id=tk.eos_id)
        w["decode_ref"][key] = ([o.tokens for o in outs], [o.steps for o in outs])
        decode[key] = dict(input_ids=prompts, max_new_tokens=12, window=window, threshold=kw["threshold"])
    outs = generate(model, [infill], SamplingConfig(family="setdlm", window=2 * D), mask_id=c.model.mask_id)
    w["decode_ref"]["infill"] = ([o.tokens for o in outs], [o.steps for o in outs])
    decode["infill"] = dict(input_ids=[infill.prefix], suffix_ids=[infill.suffix], max_new_tokens=7, window=2 * D)
    # Past the model's 64 positions (EOS ignored, so every row overflows): both drop the oldest cached tokens.
    assert c.model.max_seq_len == LIMIT
    for key, kw in OVERFLOW.items():
        sc = SamplingConfig(family="setdlm", max_new_tokens=LIMIT + 6, window=D, stop_on_eos=False, **kw)
        outs = generate(model, prompts, sc, mask_id=c.model.mask_id, eos_id=tk.eos_id)
        w["decode_ref"][key] = ([o.tokens for o in outs], [o.steps for o in outs])
        decode[key] = dict(input_ids=prompts, max_new_tokens=LIMIT + 6, window=D, stop_on_eos=False, **kw)
    long_infill = Infill(prefix=infill.prefix, length=LIMIT, suffix=infill.suffix)
    outs = generate(model, [long_infill], SamplingConfig(family="setdlm", window=2 * D), mask_id=c.model.mask_id)
    w["decode_ref"]["overflow_infill"] = ([o.tokens for o in outs], [o.steps for o in outs])
    decode["overflow_infill"] = dict(input_ids=[infill.prefix], suffix_ids=[infill.suffix], max_new_tokens=LIMIT,
                                     window=2 * D)
    jobs["decode"] = {"dir": str(w["exports"]["setdlm"]), "decode": decode}
    ar, tk, c = load_model(w["runs"]["ar"])
    outs = generate(ar, prompts, SamplingConfig(family="ar", max_new_tokens=6), mask_id=c.model.mask_id, eos_id=tk.eos_id)
    w["decode_ref"]["ar"] = ([o.tokens for o in outs], [o.steps for o in outs])
    outs = generate(ar, prompts, SamplingConfig(family="ar", max_new_tokens=LIMIT + 6, stop_on_eos=False),
                    mask_id=c.model.mask_id, eos_id=tk.eos_id)
    w["decode_ref"]["ar_overflow"] = ([o.tokens for o in outs], [o.steps for o in outs])
    jobs["decode_ar"] = {"dir": str(w["exports"]["ar"]), "decode": {
        "ar": dict(input_ids=prompts, max_new_tokens=6),
        "ar_overflow": dict(input_ids=prompts, max_new_tokens=LIMIT + 6, stop_on_eos=False)}}
    w["hf"] = _run_hf(jobs, tmp)
    return w


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    assert a.shape == b.shape, (a.shape, b.shape)
    fa, fb = torch.isfinite(a), torch.isfinite(b)
    assert torch.equal(fa, fb), "MASK/-inf logits differ"
    diff = (a[fa] - b[fb]).abs().max().item()
    assert diff <= tol, f"max |logit difference| {diff:.3g} > {tol}"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow
def test_logits_agree_training_hf_reimported(world, family):
    from pretrain.checkpoint.inference import load_model

    ref = world["ref"][family]
    assert ref.shape[-1] == 50258 and torch.isinf(ref[..., 50257]).all()
    _close(world["hf"][family]["logits"], ref)
    back, _, cfg = load_model(world["imports"][family])
    ids, pos, mask = world["inputs"][family]
    _close(_logits(back, ids, pos, mask), ref)
    assert cfg.objective.name == family


def test_automodel_gives_the_same_logits(world):
    assert world["hf"]["automodel"]["class"] == "SetDLMForMaskedLM"
    _close(world["hf"]["automodel"]["logits"], world["ref"]["mdlm"])


@pytest.mark.parametrize("case", ["plain", "threshold", "window2", "infill", *OVERFLOW, "overflow_infill"])
def test_greedy_set_decoding_matches_training_checkpoint(world, case):
    hf_tokens, hf_steps = world["hf"]["decode"][case]
    ref_tokens, ref_steps = world["decode_ref"][case]
    assert hf_tokens == ref_tokens
    assert hf_steps == ref_steps
    if case == "threshold":
        assert any(len(t) > s for t, s in zip(ref_tokens, ref_steps)), "the threshold never accepted two tokens"
    if case in OVERFLOW:  # every row decoded past the model's positions
        assert [len(t) for t in ref_tokens] == [LIMIT + 6] * 2


def test_ar_decoding_matches(world):
    assert world["hf"]["decode_ar"]["ar"] == world["decode_ref"]["ar"]
    tokens, _ = world["hf"]["decode_ar"]["ar_overflow"]
    assert [len(t) for t in tokens] == [LIMIT + 6] * 2  # past the 64 positions, as model.sampling decodes
    assert world["hf"]["decode_ar"]["ar_overflow"] == world["decode_ref"]["ar_overflow"]


def test_export_directory_contents(world):
    d = world["exports"]["setdlm"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForMaskedLM"] == "modeling_setdlm.SetDLMForMaskedLM"
    sd = cfg["set_diffusion"]
    assert (sd["family"], sd["length"], sd["set_size"], sd["s_max"], sd["mask_token_id"]) == ("setdlm", SEQ, D, 2 * D, 50257)
    assert abs(sd["expected_budget"] - D / 2) < 1e-9 and 0 < sd["k"] < 1 and sd["block_size"] == 4
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["set_diffusion"]["window"] == D and gen["mask_token_id"] == 50257
    for f in ("tokenizer.json", "tokenizer_config.json", "modeling_setdlm.py", "configuration_setdlm.py",
              "model.safetensors", "setdlm_recipe.json"):
        assert (d / f).is_file(), f
    card = (d / "README.md").read_text()
    assert "## Training recipe" in card and "builtin:pydoc_topics" in card and "EMA" in card
    code = (d / "modeling_setdlm.py").read_text() + (d / "configuration_setdlm.py").read_text()
    imported = {m.split(".")[0] for m in re.findall(r"^\s*(?:from|import)\s+(\S+)", code, re.M)}
    assert imported <= {"__future__", "math", "dataclasses", "torch", "transformers", ""}, imported
    sharded = world["exports"]["bd3lm"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (sharded / "model.safetensors").exists()


def test_from_hf_run_continues_training(world, model_parallel):
    """The re-imported run holds a consolidated checkpoint: `setdlm pretrain` continues from it (the
    trainer's re-layout path), here with one process."""
    from pretrain.config import load_config
    from pretrain.trainer import Trainer

    run = world["imports"]["setdlm"]
    assert (run / "checkpoints" / "step_00000000" / "consolidated.pt").is_file()
    cfg = load_config(run / "config.yaml", ["train.max_steps=1", "train.eval_every=0", "train.save_every=1",
                                            "train.export_hf=false"])
    out = Trainer(cfg).train()
    assert out["step"] == 1 and (run / "checkpoints" / "latest").read_text() == "step_00000001"


def test_bf16_export_with_evaluation_results_in_the_card(world, tmp_path):
    from safetensors import safe_open

    from pretrain.convert.export import export_checkpoint

    run = tmp_path / "run"
    shutil.copytree(world["runs"]["mdlm"], run)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/nll": 3.5, "val/bpt": 5.05, "val/ppl": 33.1}) + "\n")
    (run / "eval").mkdir()
    (run / "eval" / "metrics_gsm8k.json").write_text(json.dumps({"accuracy": 0.25, "n": 8, "decoding": {"tokens_per_step": 2.5}}))
    d = export_checkpoint(run, tmp_path / "bf16", dtype="bf16", log=lambda s: None)
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    card = (d / "README.md").read_text()
    assert "| validation NLL bound (nats/token, step 0) | 3.5 |" in card
    assert "| metrics_gsm8k: accuracy | 0.25 |" in card and "decoding/tokens_per_step" in card


def _broken(world, tmp_path, name, fam="mdlm"):
    d = tmp_path / name
    shutil.copytree(world["exports"][fam], d)
    return d


@pytest.mark.parametrize("damage,expect", [
    ("no_config", "config.json is missing"),
    ("bad_json", "not valid JSON"),
    ("truncated", "corrupt or truncated"),
    ("no_weights", "no weights"),
    ("missing_tensor", "tensor(s) missing"),
    ("wrong_shape", "has shape"),
    ("no_tokenizer", "tokenizer.json is missing"),
    ("other_model", "model_type is 'llama'"),
    ("missing_shard", "is missing (incomplete export?)"),
])
def test_corrupt_or_incomplete_export_gives_a_clear_error(world, tmp_path, damage, expect):
    from safetensors.torch import load_file, save_file

    from model.convert import ConvertError
    from pretrain.convert.from_hf import import_hf

    d = _broken(world, tmp_path, damage, fam="bd3lm" if damage == "missing_shard" else "mdlm")
    weights = d / "model.safetensors"
    if damage == "no_config":
        (d / "config.json").unlink()
    elif damage == "bad_json":
        (d / "config.json").write_text((d / "config.json").read_text()[:100])
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no_weights":
        weights.unlink()
    elif damage in ("missing_tensor", "wrong_shape"):
        t = load_file(str(weights))
        if damage == "missing_tensor":
            t.pop("model.layers.1.mlp.down_proj.weight")
        else:
            t["model.norm.weight"] = torch.ones(7)
        save_file(t, str(weights), metadata={"format": "pt"})
    elif damage == "no_tokenizer":
        (d / "tokenizer.json").unlink()
    elif damage == "other_model":
        cfg = json.loads((d / "config.json").read_text())
        cfg["model_type"] = "llama"
        (d / "config.json").write_text(json.dumps(cfg))
    elif damage == "missing_shard":
        index = json.loads((d / "model.safetensors.index.json").read_text())
        (d / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(ConvertError, match=expect.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        import_hf(d, tmp_path / "run", log=lambda s: None)
    assert not (tmp_path / "run").exists()


def test_cli_errors_are_reported_not_raised(world, tmp_path, capsys):
    from launch.cli import main

    assert main(["convert", "from-hf", "--model", str(tmp_path / "nothing"), "--out", str(tmp_path / "r")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["convert", "to-hf", "--checkpoint", str(world["runs"]["mdlm"]), "--out", str(world["exports"]["mdlm"])]) == 2
    assert "--overwrite" in capsys.readouterr().err
