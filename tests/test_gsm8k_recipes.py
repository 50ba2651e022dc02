"""The GSM8K recipes state the reference's released runs key by key (github.com/kuleshov-group/setdlms:
bash_scripts/run_train_*_gsm8k.sh and configs/composer/*), cite where each value comes from, and the
optimizer they name behaves as the reference's Composer DecoupledAdamW; the dry run plans them with the
preset's vocabulary when train.init_from is not on this machine and on the world size they are written for."""

from __future__ import annotations

import math
import re

import pytest
import torch

from helpers import REPO, setdlm

# The reference's released GSM8K runs (its scripts), one recipe each: not the registry's families.
FAMILIES = {"ar": "run_train_ar_gsm8k.sh", "mdlm": "run_train_mdlm_gsm8k.sh", "bd3lm": "run_train_bd3lm_gsm8k.sh",
            "setdlm": "run_train_setdlm_gsm8k.sh"}


def _recipe(family):
    from pretrain.config import load_config

    path = REPO / "configs" / f"gsm8k-qwen3-1.7b-{family}.yaml"
    return load_config(path), path.read_text()


@pytest.mark.parametrize("family", FAMILIES)
def test_recipe_is_the_released_run(family):
    cfg, text = _recipe(family)
    t, p = cfg.train, cfg.parallel
    assert (t.lr, t.min_lr, t.global_batch, t.micro_batch, p.world_size) == (1e-5, 5e-6, 1, 1, 1)  # LR=1e-5 BATCH_SIZE=1
    assert (t.lr_schedule, t.warmup_steps, t.max_steps) == ("cosine", 100, 75000)  # alpha_f 0.5, 100ba, 75000ba
    assert (t.beta1, t.beta2, t.adam_eps, t.weight_decay, t.weight_decay_style) == (0.9, 0.98, 1e-8, 1e-5, "decoupled")
    assert (t.ema, t.grad_clip, t.precision, t.eval_every) == (0.9999, 1.0, "bf16", 1000)
    assert (t.keep_best, t.best_metric, t.best_mode, t.keep_last) == (True, "val/nll", "min", 1)
    assert (cfg.data.seq_len, cfg.model.max_seq_len, cfg.model.preset) == (1024, 1024, "qwen3-1.7b")
    assert t.save_every == (2000 if family in ("setdlm", "bd3lm") else 1000)
    if family in ("mdlm", "bd3lm"):
        assert cfg.objective.antithetic is False
    if family == "bd3lm":
        assert cfg.objective.block_size == 8
    if family == "setdlm":
        assert cfg.objective.set_size == 4 and cfg.objective.s_max is None  # S_max = 2D = 8
    # every value names its source; the LR conflict and the epochs are stated
    assert "kuleshov-group/setdlms" in text and f"bash_scripts/{FAMILIES[family]}" in text
    for source in ("decoupled_adamw", "algorithms/ema", "gradient_clipping", "cosine_annealing_with_warmup",
                   "save_best_checkpointing", "config.yaml", "gsm8k_train_distill"):
        assert source in text, source
    assert re.search(r"lr 1e-6\s*(?:#\s*)?at batch 16", text) and "lr 1e-5 at global batch 1" in text
    assert "10.0 epochs" in text and "train.epochs: 10" in text
    lines = [line for line in text.splitlines() if not line.startswith("#") and ":" in line and line.startswith("  ")]
    uncited = [line for line in lines if "#" not in line and line.split(":")[0].strip() in
               {"lr", "min_lr", "global_batch", "micro_batch", "max_steps", "warmup_steps", "ema", "weight_decay",
                "adam_eps", "grad_clip", "beta1"}]
    assert not uncited, uncited


def test_decoupled_weight_decay_is_composers():
    """One AdamW step of train.weight_decay_style decoupled equals Composer's DecoupledAdamW step (its
    documented update: every weight times 1 - (lr_t / lr) * weight_decay, then Adam's step at lr_t)."""
    from pretrain.engine import param_groups

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    peak, now, wd, b1, b2, eps = 1e-2, 4e-3, 0.3, 0.9, 0.98, 1e-8
    opt = torch.optim.AdamW(param_groups(model, wd, "decoupled", peak), lr=now, betas=(b1, b2), eps=eps)
    opt.step()
    for n, p in model.named_parameters():
        g, w = dict(model.named_parameters())[n].grad, before[n]
        w = w * (1 - (now / peak) * wd)  # Composer: decay not scaled by the LR, every parameter (norms too)
        m, v = (1 - b1) * g, (1 - b2) * g * g
        w = w - now / (1 - b1) * m / ((v / (1 - b2)).sqrt() + eps)
        torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-7, msg=n)
    adamw = param_groups(model, wd, "adamw", peak)  # torch's: matrices only, decay lr_t * wd
    assert [len(g["params"]) for g in adamw] == [1, 3] and adamw[0]["weight_decay"] == wd


def test_cosine_schedule_is_composers_with_alpha_f():
    """lr_at after warm-up equals Composer's CosineAnnealingWithWarmupScheduler(t_warmup=100, alpha_f=0.5)."""
    from pretrain.schedules import lr_at

    lr, warm, total = 1e-5, 100, 75000
    for step in (100, 101, 5000, 37550, 74999, 75000):
        frac = (step - warm) / (total - warm)
        want = lr * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi * frac)))
        assert lr_at(step, lr=lr, min_lr=0.5 * lr, warmup=warm, total=total, kind="cosine") == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("recipe,world,params", [("gsm8k-qwen3-8b-setdlm", 8, "8.189B"),
                                                  ("gsm8k-qwen3-1.7b-setdlm", 1, "1.720B")])
@pytest.mark.slow
def test_dry_run_plans_the_preset_vocabulary_on_the_recipes_world(recipe, world, params):
    r = setdlm("pretrain", "--config", REPO / "configs" / f"{recipe}.yaml", "--dry-run", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = r.stdout
    assert "preset's vocabulary (151,670 tokens with MASK id 151669)" in out
    assert f"planned for parallel.world_size {world}" in out and f"layout: world {world} =" in out
    assert f"| {params} parameters |" in out  # with GPT-2's vocabulary: 1.616B / 8.000B
    r = setdlm("pretrain", "--config", REPO / "configs" / f"{recipe}.yaml", "--dry-run", "--world-size", 16,
               "model.vocab_size=50304", "model.mask_id=50257", "train.global_batch=16", "train.micro_batch=1", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "layout: world 16 =" in r.stdout and "preset's vocabulary" not in r.stdout  # the flag and the keys win
