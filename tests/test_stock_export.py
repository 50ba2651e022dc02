"""An AR fine-tune of a stock Qwen3 or Llama (tiny random directories built with transformers) exports
as that architecture: `AutoModelForCausalLM` loads it without `trust_remote_code` in a process that
cannot import setdlm, its logits are setdlm's (1e-5; MASK aside: -inf in setdlm, finite in a stock
model), and `generate` gives setdlm's greedy AR decoding. A set-diffusion fine-tune of the same
model keeps setdlm's modeling code; `--format stock` on it says why not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import cli_env, setdlm
from hf_fixtures import make_hf_model

pytestmark = pytest.mark.slow
SEQ = 32

HF_SCRIPT = r'''
import importlib.abc, sys, torch

class Block(importlib.abc.MetaPathFinder):  # a stock export needs nothing of setdlm
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"model", "pretrain", "data_pipeline", "eval", "launch", "common"}:
            raise ImportError(f"blocked import of setdlm package {name}")
sys.meta_path.insert(0, Block())
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

job = torch.load(sys.argv[1])
m = AutoModelForCausalLM.from_pretrained(job["dir"], dtype=torch.float32).eval()  # no trust_remote_code
tok = AutoTokenizer.from_pretrained(job["dir"])
with torch.no_grad():
    logits = m(input_ids=job["ids"]).logits
    gen = [m.generate(torch.tensor([p]), max_new_tokens=job["new"], do_sample=False)[0, len(p):].tolist()
           for p in job["prompts"]]
torch.save({"class": type(m).__name__, "model_type": AutoConfig.from_pretrained(job["dir"]).model_type,
            "logits": logits, "generate": gen, "eos": tok.eos_token_id}, sys.argv[2])
'''


def _recipe(path: Path, hf: Path, objective: str) -> Path:
    recipe = {"run": {"name": path.stem, "seed": 3}, "model": {"max_seq_len": 64},
              "objective": {"name": objective, **({"set_size": 4} if objective == "setdlm" else {})},
              "data": {"source": "builtin:pydoc_topics", "seq_len": SEQ},
              "train": {"init_from": str(hf), "max_steps": 3, "micro_batch": 2, "global_batch": 2, "lr": 1e-2,
                        "warmup_steps": 0, "log_every": 1, "eval_every": 0, "save_every": 3},
              "logging": {"wandb": "disabled", "progress": False}}
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def exported(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"stock-{arch}")
    hf = make_hf_model(tmp / arch, arch)
    r = setdlm("pretrain", "--config", _recipe(tmp / "ar.yaml", hf, "ar"), "--out", tmp / "runs", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp / "runs" / "ar"
    e = setdlm("convert", "to-hf", "--checkpoint", run, "--out", tmp / "export", timeout=600)
    assert e.returncode == 0, e.stderr[-3000:]
    assert f"stock {arch}" in e.stdout + e.stderr
    return {"arch": arch, "tmp": tmp, "hf": hf, "run": run, "export": tmp / "export"}


def _run_hf(job: dict, tmp: Path) -> dict:
    torch.save(job, tmp / "job.pt")
    (tmp / "stock.py").write_text(HF_SCRIPT)
    env = cli_env()
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, str(tmp / "stock.py"), str(tmp / "job.pt"), str(tmp / "out.pt")], cwd=tmp,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(tmp / "out.pt")


def test_ar_finetune_exports_as_its_stock_architecture(exported):
    from model.objectives import build_objective
    from model.sampling import SamplingConfig, generate
    from model.transformer import full_logits
    from pretrain.checkpoint.inference import load_model

    d = exported["export"]
    cfg = json.loads((d / "config.json").read_text())
    src = json.loads((exported["hf"] / "config.json").read_text())
    assert cfg["model_type"] == src["model_type"] == exported["arch"]
    assert cfg["architectures"] == src["architectures"] and "auto_map" not in cfg
    assert not list(d.glob("*.py")), "a stock export ships no modeling code"
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "rms_norm_eps", "tie_word_embeddings", "rope_parameters"):
        assert cfg[k] == src[k], k
    model, tok, rc = load_model(exported["run"])
    ids = torch.randint(0, 50257, (2, SEQ), generator=torch.Generator().manual_seed(1))
    inp = build_objective(rc.objective, rc.model, SEQ).prepare({"input_ids": ids})
    with torch.no_grad():
        ours = full_logits(model, model(inp.input_ids, inp.position_ids, attn_mask=inp.attn_mask))
    prompts = [tok.encode("The for statement"), tok.encode("A class is")]
    outs = generate(model, prompts, SamplingConfig(family="ar", max_new_tokens=8), mask_id=rc.model.mask_id,
                    eos_id=tok.eos_id)
    got = _run_hf({"dir": str(d), "ids": ids, "prompts": prompts, "new": 8}, exported["tmp"])
    assert got["model_type"] == exported["arch"] and got["class"].endswith("ForCausalLM")
    mask = rc.model.mask_id
    assert got["logits"].shape == ours.shape and torch.isinf(ours[..., mask]).all()
    keep = torch.ones(ours.shape[-1], dtype=torch.bool)
    keep[mask] = False
    diff = (got["logits"][..., keep] - ours[..., keep]).abs().max().item()
    assert diff <= 1e-5, diff
    assert got["generate"] == [o.tokens for o in outs]  # transformers' greedy generate == setdlm's AR decoding
    assert got["eos"] == tok.eos_id


def test_set_diffusion_finetunes_keep_setdlm_code(exported):
    if exported["arch"] != "qwen3":
        pytest.skip("one architecture is enough")
    tmp = exported["tmp"]
    r = setdlm("pretrain", "--config", _recipe(tmp / "sd.yaml", exported["hf"], "setdlm"), "--out", tmp / "runs",
               "train.max_steps=1", "train.save_every=1", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    e = setdlm("convert", "to-hf", "--checkpoint", tmp / "runs" / "sd", "--out", tmp / "sd-export", timeout=600)
    assert e.returncode == 0, e.stderr[-3000:]
    assert json.loads((tmp / "sd-export" / "config.json").read_text())["model_type"] == "setdlm"
    assert (tmp / "sd-export" / "modeling_setdlm.py").is_file()
    bad = setdlm("convert", "to-hf", "--checkpoint", tmp / "runs" / "sd", "--out", tmp / "sd-stock", "--format", "stock",
                 timeout=600)
    assert bad.returncode == 2 and "--format stock:" in bad.stderr and "setdlm's decoding" in bad.stderr
    forced = setdlm("convert", "to-hf", "--checkpoint", exported["run"], "--out", tmp / "custom", "--format", "setdlm",
                    timeout=600)
    assert forced.returncode == 0 and json.loads((tmp / "custom" / "config.json").read_text())["model_type"] == "setdlm"


def test_shape_decides_the_type_when_the_source_is_gone():
    from model.config import ModelConfig
    from model.convert.hf_stock_export import stock_type, why_not_stock

    qwen = ModelConfig(norm="rmsnorm", activation="swiglu", qk_norm=True, bias=False)
    llama = ModelConfig(norm="rmsnorm", activation="swiglu", qk_norm=False, bias=True)
    assert stock_type(qwen, "ar") == "qwen3" and stock_type(llama, "ar") == "llama"
    assert stock_type(ModelConfig(norm="rmsnorm", activation="swiglu", bias=False), "ar", "mistral") == "mistral"
    assert stock_type(llama, "ar", "mistral") == "llama"  # mistral has no biases: the shape wins
    assert stock_type(ModelConfig(), "ar") is None  # LayerNorm + GELU: setdlm's code
    assert "head bias" in why_not_stock(ModelConfig(norm="rmsnorm", activation="swiglu", head_bias=True), "ar", "llama")
    assert stock_type(qwen, "mdlm") is None
