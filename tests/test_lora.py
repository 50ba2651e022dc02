"""LoRA fine-tuning (`train.lora`) of a tiny stock Qwen3 (built with transformers, GPT-2 tokenizer) on CPU:

- with B = 0 the step-0 validation NLL and the first step's loss are the base model's (a full
  fine-tune from the same directory), and only the adapters change;
- the merged export (`setdlm convert to-hf`, a stock Qwen3 for AR, setdlm's code for SW-SetDLM) gives
  the live adapted model's logits (1e-5), and `peft` loading the `--adapter-only` export onto the
  `--base-only` export gives the merged export's;
- a LoRA run killed and resumed trains exactly as an uninterrupted one;
- the dry run counts the adapters as the built model holds them and shows the memory they save.
(TP / SP / PP / ZeRO 1-3 parity: tests/test_lora_parallel.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from helpers import kill_after_checkpoint, read_metrics, setdlm
from hf_fixtures import make_hf_model

pytestmark = pytest.mark.slow
LORA = {"rank": 4, "alpha": 8.0}
SEQ = 32


def _recipe(path: Path, hf: Path, objective: str, **train) -> Path:
    recipe = {"run": {"name": path.stem, "seed": 5}, "model": {"max_seq_len": 64},
              "objective": {"name": objective, **({"set_size": 4} if objective == "setdlm" else {})},
              "data": {"source": "builtin:pydoc_topics", "seq_len": SEQ},
              "train": {"init_from": str(hf), "max_steps": 6, "micro_batch": 2, "global_batch": 4, "lr": 2e-2,
                        "warmup_steps": 0, "log_every": 1, "eval_every": 3, "eval_batches": 2, "save_every": 3,
                        "keep_last": 3, **train},
              "logging": {"wandb": "disabled", "progress": False}}
    path.write_text(yaml.safe_dump(recipe))
    return path


def _train(recipe: Path, out: Path, *overrides):
    r = setdlm("pretrain", "--config", recipe, "--out", out, *overrides, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / recipe.stem, r.stdout + r.stderr


def _export(run, out: Path, *flags) -> Path:
    r = setdlm("convert", "to-hf", "--checkpoint", run, "--out", out, *flags, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lora")
    hf = make_hf_model(tmp / "qwen3", "qwen3")
    w = {"tmp": tmp, "hf": hf}
    w["full"], _ = _train(_recipe(tmp / "full.yaml", hf, "ar"), tmp / "runs")
    w["ar"], w["ar_log"] = _train(_recipe(tmp / "ar.yaml", hf, "ar", lora=LORA), tmp / "runs")
    w["setdlm"], _ = _train(_recipe(tmp / "sd.yaml", hf, "setdlm", lora={**LORA, "targets": ["qkv", "fc2"]},
                                    ema=0.5), tmp / "runs")
    return w


def _live(run):
    """The trained model with its adapters live (not merged), TP=1, as the run's checkpoint holds it."""
    from pretrain.checkpoint import rundir
    from pretrain.checkpoint.inference import checkpoint_weights
    from pretrain.parallelize import build_stage

    ckpt = rundir.resolve_checkpoint(run)
    meta = rundir.read_meta(ckpt)
    cfg = rundir.read_recipe(ckpt, meta)
    weights, _ = checkpoint_weights(ckpt, meta, merge_lora=False)
    model = build_stage(cfg.model, 1, 1, lora=cfg.train.lora)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")] and not unexpected
    return model.eval(), cfg, weights


def _ours(model, cfg, ids):
    from model.objectives import build_objective
    from model.transformer import full_logits

    inp = build_objective(cfg.objective, cfg.model, ids.shape[1]).prepare({"input_ids": ids}, torch.Generator().manual_seed(0))
    with torch.no_grad():
        return full_logits(model, model(inp.input_ids, inp.position_ids, attn_mask=inp.attn_mask)), inp


def _ids(n=SEQ):
    return torch.randint(0, 50257, (2, n), generator=torch.Generator().manual_seed(3))


def _close(a, b, tol=1e-5):
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max |logit difference| {diff:.3g} > {tol}"


def test_b_zero_starts_at_the_base_model_and_only_adapters_train(runs):
    from model.lora import is_adapter
    from pretrain.checkpoint import rundir
    from pretrain.checkpoint.inference import checkpoint_weights
    from pretrain.init_from import prepare, weights

    full, lora = read_metrics(runs["full"]), read_metrics(runs["ar"])
    assert lora[0]["val/nll"] == pytest.approx(full[0]["val/nll"], rel=1e-6)
    assert lora[1]["train/loss"] == pytest.approx(full[1]["train/loss"], rel=1e-6)  # step 1: before any update
    assert lora[6]["train/loss"] != pytest.approx(full[6]["train/loss"], rel=1e-3)
    assert lora[6]["val/nll"] < lora[0]["val/nll"]
    assert "LoRA: rank 4, alpha 8" in runs["ar_log"] and "trainable parameters" in runs["ar_log"]
    ckpt = rundir.resolve_checkpoint(runs["ar"])
    trained, _ = checkpoint_weights(ckpt, rundir.read_meta(ckpt), merge_lora=False)
    cfg = rundir.read_recipe(ckpt, rundir.read_meta(ckpt))
    base = weights(prepare(_fresh(cfg, runs["hf"])), cfg.model).state_dict()
    adapters = [k for k in trained if is_adapter(k)]
    assert len(adapters) == 2 * 4 * 2  # 2 layers x 4 linears x (A, B)
    assert all(trained[k].abs().max() > 0 for k in adapters)
    for k, v in base.items():  # the base is the imported model, untouched
        torch.testing.assert_close(trained[k], v, rtol=0, atol=0, msg=k)


def _fresh(cfg, hf):
    """A recipe that imports `hf` into a new run directory (for the imported weights alone)."""
    from pretrain.config import from_dict

    raw = cfg.to_dict()
    raw["run"] = {**raw["run"], "name": "fresh-import"}
    raw["model"] = {"max_seq_len": cfg.model.max_seq_len}
    raw["data"] = {k: v for k, v in raw["data"].items() if k != "tokenizer"}  # taken from `hf`, as the run did
    raw["train"] = {**raw["train"], "init_from": str(hf)}
    return from_dict(raw)



def _exports(run, tmp, prefix: str):
    """The merged export, the frozen base (--base-only) and the PEFT adapter (--adapter-only) of a LoRA run."""
    return (_export(run, tmp / f"{prefix}-merged"), _export(run, tmp / f"{prefix}-base", "--base-only"),
            _export(run, tmp / f"{prefix}-adapter", "--adapter-only"))

def test_ar_merged_export_equals_the_live_model_and_peft_equals_the_merged(runs):
    peft = pytest.importorskip("peft", reason="the PEFT check needs peft (the test extra)")
    from transformers import AutoModelForCausalLM

    merged, base, adapter = _exports(runs["ar"], runs["tmp"], "ar")
    cfg_json = json.loads((merged / "config.json").read_text())
    assert cfg_json["model_type"] == "qwen3" and not list(merged.glob("*.py"))  # a stock Qwen3
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    live, cfg, _ = _live(runs["ar"])
    ids = _ids()
    ours, _ = _ours(live, cfg, ids)
    n = cfg.model.vocab_size - 1  # every token but MASK (-inf in setdlm, a finite logit in a stock model)
    m = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    with torch.no_grad():
        hf = m(input_ids=ids).logits
    _close(hf[..., :n], ours[..., :n])
    b = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        plain = b(input_ids=ids).logits
    assert (plain[..., :n] - hf[..., :n]).abs().max() > 1e-3  # the adapters matter
    p = peft.PeftModel.from_pretrained(b, str(adapter)).eval()
    with torch.no_grad():
        _close(p(input_ids=ids).logits, hf)


def test_setdlm_merged_export_equals_the_live_model_and_peft_equals_the_merged(runs):
    peft = pytest.importorskip("peft", reason="the PEFT check needs peft (the test extra)")
    from transformers import AutoModelForMaskedLM

    merged, base, adapter = _exports(runs["setdlm"], runs["tmp"], "sd")
    assert json.loads((merged / "config.json").read_text())["model_type"] == "setdlm"  # set diffusion: own code
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(conf["target_modules"]) == ["down_proj", "k_proj", "q_proj", "v_proj"] and conf["r"] == 4
    live, cfg, weights = _live(runs["setdlm"])
    ids = _ids()
    ours, inp = _ours(live, cfg, ids)
    args = dict(position_ids=inp.position_ids, attention_mask=inp.attn_mask)
    m = AutoModelForMaskedLM.from_pretrained(str(merged), trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = m(inp.input_ids, **args).logits
    finite = torch.isfinite(ours)
    assert torch.equal(torch.isfinite(hf), finite)
    _close(hf[finite], ours[finite])
    b = AutoModelForMaskedLM.from_pretrained(str(base), trust_remote_code=True, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = b(inp.input_ids, **args).logits
    p = peft.PeftModel.from_pretrained(b, str(adapter)).eval()  # (injects the adapters into b)
    with torch.no_grad():
        got = p(inp.input_ids, **args).logits
    _close(got[finite], hf[finite])
    assert (plain[finite] - hf[finite]).abs().max() > 1e-3
    # the merge folded the EMA adapters (the run keeps an EMA): the export is the EMA model
    ema = json.loads((merged / "setdlm_recipe.json").read_text())["weights"]
    assert ema == "ema" and any(k.endswith(".lora.B") for k in weights)


def test_adapter_flags_need_a_lora_run(runs):
    r = setdlm("convert", "to-hf", "--checkpoint", runs["full"], "--out", runs["tmp"] / "x", "--adapter-only", timeout=300)
    assert r.returncode == 2 and "--adapter-only:" in r.stderr and "train.lora" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_killed_lora_run_resumes_exactly(runs, tmp_path):
    recipe = _recipe(tmp_path / "ar.yaml", runs["hf"], "ar", lora=LORA)
    killed_at = kill_after_checkpoint(recipe, tmp_path / "out", "ar", 3, timeout=600)
    assert killed_at < "step_00000006"
    run, text = _train(recipe, tmp_path / "out")
    assert "resumed at step" in text
    a, b = read_metrics(runs["ar"]), read_metrics(run)
    for step in range(1, 7):
        assert b[step]["train/loss"] == a[step]["train/loss"], step
    assert b[6]["val/nll"] == a[6]["val/nll"]


def test_the_dry_run_counts_the_adapters_and_the_memory_they_save(runs, tmp_path):
    from pretrain.checkpoint import rundir
    from pretrain.memory import estimate_memory
    from pretrain.parallelize import build_stage

    ckpt = rundir.resolve_checkpoint(runs["ar"])
    cfg = rundir.read_recipe(ckpt, rundir.read_meta(ckpt))
    model = build_stage(cfg.model, 1, 1, lora=cfg.train.lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    (sm,) = estimate_memory(cfg, 1, precision="fp32", device="cpu")
    (full,) = estimate_memory(cfg, 1, precision="fp32", device="cpu", lora=False)
    assert (sm.trainable, sm.params) == (trainable, total)
    assert sm.grads == trainable * 4 and sm.optimizer == trainable * 8  # fp32 ZeRO-0: grads, AdamW m and v
    assert full.grads == (total - trainable) * 4 and full.weights == sm.weights - trainable * 4
    r = setdlm("pretrain", "--config", _recipe(tmp_path / "d.yaml", runs["hf"], "ar", lora=LORA), "--dry-run", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"LoRA rank 4 on qkv, proj, fc1, fc2: {trainable:,} of {total:,} parameters per rank train" in r.stdout
    assert "saved per GPU" in r.stdout
