"""ZeRO-3 builds the model inside deepspeed.zero.Init (CPU, gloo, DP=2, through the real Trainer).

- build (DP=2 and DP=3): every parameter is partitioned as it is constructed (its data empty, its
  partition ceil(numel / dp)), the peak of live tensor bytes while building is this rank's partition plus one
  parameter (the whole build: the full model), and the gathered weights equal a whole build's bit for
  bit (fp32 and bf16, every parameter kind), with float32 buffers;
- Z (ZeRO-3, DP=2) starts from exactly the weights of A (one process, ZeRO-0), trains with the same
  losses, gradient norms and validation NLL, and its consolidated weights and EMA equal A's;
- Zr, Z cut back to its step-2 checkpoint, resumes there and continues exactly as Z did;
- I, `train.init_from` A's run under ZeRO-3, starts from A's (EMA) weights: its first validation
  equals A's last; H, `train.init_from` a stock Hugging Face Qwen3 directory, holds (gathered) exactly
  the weights the same init_from gives a whole one-process model, its EMA too, and those weights give
  transformers' own logits of the directory.

The ZeRO-3 runs go through `zero3_runs` and `build` on 2 and 3 ranks (tests/distributed_run.py).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest
import torch

from distributed_run import run_distributed
from helpers import REPO, read_metrics, write_recipe
from hf_fixtures import hf_logits, make_hf_model
from pretrain.config import load_config
from pretrain.checkpoint.consolidate import main as consolidate_main
from pretrain.trainer import Trainer

sys.path.insert(0, str(REPO))  # benchmarks/ is not an installed package
from benchmarks.bench_zero3_init import LiveBytes  # noqa: E402  (peak of live tensor bytes)

pytestmark = pytest.mark.slow

REL = 1e-5
ATOL = 3e-5  # weights after 4 Adam steps of lr 3e-3; the reduction order differs by layout


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_parallel):
    tmp = tmp_path_factory.mktemp("zinit")
    recipe = write_recipe(tmp / "r.yaml", model={"n_layers": 2, "dropout": 0.0},
                          train={"max_steps": 4, "global_batch": 8, "micro_batch": 8, "lr": 3e-3, "warmup_steps": 0,
                                 "eval_every": 2, "eval_batches": 2, "save_every": 2, "log_every": 1, "keep_last": 3,
                                 "ema": 0.5, "grad_clip": 0.5})
    a = Trainer(load_config(recipe, ["run.name=A", f"run.out_dir={tmp}"]))
    a_init = {n: p.detach().clone() for n, p in a.model.named_parameters()}
    a.train()
    hf_dir = make_hf_model(tmp / "hf", "qwen3", heads=2, kv_heads=2, head_dim=16, ffn=64, tie=True)
    ranks = run_distributed(zero3_runs, 2, recipe, tmp, tmp / "A", hf_dir, timeout=900)
    stderr = "".join(ranks.logs)
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):  # DeepSpeed's calls: filtered in pretrain/engine.py
        assert f"`torch.distributed.{name}` is deprecated" not in stderr, stderr[-3000:]
    run_distributed(build_only, 3, recipe, tmp, timeout=900)
    return tmp, a_init


# -- the ZeRO-3 ranks -------------------------------------------------------------------------------------
MID = dict(n_layers=8, hidden=384, n_heads=6, ffn_hidden=1536, tie_embeddings=True, vocab_size=2048, mask_id=2047,
           dropout=0.0, max_seq_len=64)
SMALL = dict(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, ffn_hidden=96, norm="rmsnorm", activation="swiglu",
             qk_norm=True, bias=False, tie_embeddings=False, vocab_size=1000, mask_id=999, dropout=0.0, max_seq_len=64)


def _cfg(recipe: Path, model: dict, precision: str, world: int):
    from pretrain.config import load_config

    return load_config(recipe, ["parallel.zero_stage=3", "train.micro_batch=1", f"train.global_batch={world}",
                                f"train.precision={precision}", *(f"model.{k}={v}" for k, v in model.items())])


def gathered(model) -> dict:
    """Full weights of a zero.Init model (a collective: every rank calls it)."""
    import deepspeed

    out = {}
    for n, p in model.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            out[n] = p.data.detach().clone()
    return out


def build(recipe: Path, out: Path) -> None:
    import torch.distributed as dist

    from pretrain.engine import zero3_init
    from pretrain.parallelize import build_stage

    world, rank = dist.get_world_size(), dist.get_rank()
    report: dict = {}
    cfg = _cfg(recipe, MID, "fp32", world)
    for mode in ("zinit", "whole"):
        torch.manual_seed(11)
        zi = zero3_init(cfg, world, "fp32") if mode == "zinit" else None
        live = LiveBytes()
        with live:
            model = build_stage(cfg.model, 1, 1, device="cpu", zero_init=zi)
        params = list(model.parameters())
        report[f"peak_{mode}"] = live.peak
        if mode == "zinit":
            report["partition_numel"] = [p.ds_tensor.numel() for p in params]
            report["numel"] = [p.ds_numel for p in params]
            report["data_numel"] = sum(p.data.numel() for p in params)
            zinit = gathered(model)
        else:
            report["mismatch"] = [n for n, p in model.named_parameters() if not torch.equal(zinit[n], p.detach())]
        del model, params
    for precision in ("fp32", "bf16"):  # a small model with every parameter kind (QK-norm, SwiGLU, untied head)
        small = _cfg(recipe, SMALL, precision, world)
        torch.manual_seed(12)
        whole = {n: p.detach().clone() for n, p in build_stage(small.model, 1, 1, device="cpu").named_parameters()}
        torch.manual_seed(12)
        zi = zero3_init(small, world, precision)
        model = build_stage(small.model, 1, 1, device="cpu", zero_init=zi)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        report[f"mismatch_small_{precision}"] = [n for n, w in gathered(model).items()
                                                 if w.dtype != dtype or not torch.equal(w, whole[n].to(dtype))]
        report[f"buffers_fp32_{precision}"] = all(b.dtype == torch.float32 for b in model.buffers())
    (out / f"build_dp{world}_rank{rank}.json").write_text(json.dumps(report))


def cut_back(src: Path, dest: Path, step: int) -> None:
    """The run as an interruption after checkpoint `step` leaves it."""
    shutil.copytree(src, dest)
    metrics = dest / "metrics.jsonl"
    metrics.write_text("".join(line for line in metrics.read_text().splitlines(keepends=True)
                               if json.loads(line)["step"] <= step))
    root = dest / "checkpoints"
    for ckpt in root.glob("step_*"):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    (root / "latest").write_text(f"step_{step:08d}")


def build_only(recipe: Path, out: Path) -> None:
    """One rank of the build alone (any number of ranks: under DP=3 partitions start mid-row and mid-unit)."""
    from pretrain.parallel import ensure_model_parallel, ensure_process_group

    ensure_process_group()
    ensure_model_parallel(1, 1)
    build(Path(recipe), Path(out))


def zero3_runs(recipe: Path, out: Path, setdlm_run: Path, hf_dir: Path) -> None:
    """One rank (DP=2) of: the build; Z; Zr; I; H (the module docstring)."""
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.parallel import ensure_model_parallel, ensure_process_group
    from pretrain.trainer import Trainer

    from pretrain import init_from

    ensure_process_group()
    ensure_model_parallel(1, 1)
    recipe, out = Path(recipe), Path(out)
    build(recipe, out)

    def config(name, *overrides):
        return load_config(recipe, [f"run.name={name}", f"run.out_dir={out}", "parallel.zero_stage=3",
                                    "train.micro_batch=4", *overrides])

    trainer = Trainer(config("Z"))
    init = gathered(trainer.model)
    if dist.get_rank() == 0:
        torch.save(init, out / "Z_init.pt")
    trainer.train()
    if dist.get_rank() == 0:
        cut_back(out / "Z", out / "Zr", 2)
    dist.barrier()
    Trainer(config("Zr")).train()
    Trainer(config("I", f"train.init_from={setdlm_run}", "train.max_steps=1", "train.ema=0")).train()
    hf = Trainer(config("H", f"train.init_from={hf_dir}"))  # a stock HF directory: the gathered load
    init_from.load(hf.engine, hf.init_source, hf.cfg.model, hf.ema)
    got = gathered(hf.model)
    ema = {n: hf.ema.full(n) for n in hf.ema.shadow}
    if dist.get_rank() == 0:
        torch.save({"weights": got, "ema": ema}, out / "H_weights.pt")


def _close(a, b, rel=REL):
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _max_diff(a: dict, b: dict) -> float:
    a, b = ({k: v for k, v in d.items() if torch.is_tensor(v)} for d in (a, b))
    assert a and set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_build_is_partitioned_peak_is_partition_plus_one_parameter_and_weights_are_exact(runs):
    tmp, _ = runs
    for dp, rank in ((2, 0), (2, 1), (3, 0), (3, 1), (3, 2)):  # DP=3: partitions start mid-row, mid-unit
        rep = json.loads((tmp / f"build_dp{dp}_rank{rank}.json").read_text())
        assert rep["data_numel"] == 0  # no parameter holds its full data after the build
        assert rep["partition_numel"] == [math.ceil(n / dp) for n in rep["numel"]]
        partition, full = 4 * sum(rep["partition_numel"]), 4 * sum(rep["numel"])
        largest = 4 * max(rep["numel"])
        assert largest < 0.1 * full  # the bound below separates "one parameter" from "the model"
        assert rep["peak_whole"] >= full, rep["peak_whole"]  # the meter sees the whole build
        assert rep["peak_zinit"] <= partition + 1.25 * largest + 2**20, (rep["peak_zinit"], partition, largest)
        assert rep["peak_zinit"] < (1 / dp + 0.1) * rep["peak_whole"]
        assert rep["mismatch"] == [], rep["mismatch"]
        for precision in ("fp32", "bf16"):
            assert rep[f"mismatch_small_{precision}"] == [], (precision, rep[f"mismatch_small_{precision}"])
            assert rep[f"buffers_fp32_{precision}"], precision


def test_initial_weights_equal_one_process_bit_for_bit(runs):
    tmp, a_init = runs
    z_init = torch.load(tmp / "Z_init.pt", weights_only=True)
    assert set(z_init) == set(a_init)
    for n, w in a_init.items():
        assert torch.equal(z_init[n], w), n


def test_training_validation_consolidation_and_ema_match_one_process(runs):
    tmp, _ = runs
    a, z = read_metrics(tmp / "A"), read_metrics(tmp / "Z")
    for step in (1, 2, 3, 4):
        for key in ("train/loss", "train/grad_norm"):
            assert _close(a[step][key], z[step][key]), (step, key, a[step][key], z[step][key])
    for step in (0, 2, 4):
        assert _close(a[step]["val/nll"], z[step]["val/nll"]), (step, a[step]["val/nll"], z[step]["val/nll"])
    ckpt = tmp / "Z" / "checkpoints" / "step_00000004"
    assert consolidate_main(["--checkpoint", str(ckpt)]) == 0
    cons = torch.load(ckpt / "consolidated.pt", weights_only=True)
    from pretrain.checkpoint.distcp import whole_state

    a_state = whole_state(tmp / "A" / "checkpoints" / "step_00000004")
    a_weights, a_ema = a_state["module"], a_state["ema"]
    assert _max_diff(a_weights, cons["module"]) <= ATOL
    assert _max_diff(a_ema, cons["ema"]) <= ATOL
    assert _max_diff(a_ema, cons["module"]) > 1e-4  # the EMA is not just the weights


def test_resume_from_a_zero_init_checkpoint_equals_the_uninterrupted_run(runs):
    tmp, _ = runs
    rows = [json.loads(line) for line in (tmp / "Zr" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["step"] <= 2] == sorted({r["step"] for r in rows if r["step"] <= 2})  # resumed, not restarted
    z, zr = read_metrics(tmp / "Z"), read_metrics(tmp / "Zr")
    for step in (3, 4):
        for key in ("train/loss", "train/grad_norm", "train/lr"):
            assert zr[step][key] == pytest.approx(z[step][key], rel=1e-6, abs=0), (step, key)
    assert zr[4]["val/nll"] == pytest.approx(z[4]["val/nll"], rel=1e-6, abs=0)


def test_init_from_a_setdlm_run_into_a_zero_init_model(runs):
    tmp, _ = runs
    a, i = read_metrics(tmp / "A"), read_metrics(tmp / "I")
    assert _close(i[0]["val/nll"], a[4]["val/nll"]), (i[0]["val/nll"], a[4]["val/nll"])


def test_init_from_a_hugging_face_directory_into_a_zero_init_model(runs):
    from model.transformer import full_logits
    from pretrain import init_from
    from test_hf_import import N_REAL, ids_for_test

    tmp, _ = runs
    h = torch.load(tmp / "H_weights.pt", weights_only=True)
    # the reference: the same init_from into a whole model in one process (no partitions, no gathering)
    whole = Trainer(load_config(tmp / "r.yaml", ["run.name=Hw", f"run.out_dir={tmp}", "train.micro_batch=4",
                                                 f"train.init_from={tmp / 'hf'}"]))
    init_from.load(whole.engine, whole.init_source, whole.cfg.model, whole.ema)
    want = {n: p.detach().clone() for n, p in whole.model.named_parameters()}
    assert set(h["weights"]) == set(want) and set(h["ema"]) == set(want)
    bad = [n for n, w in h["weights"].items() if not torch.equal(w, want[n].to(w.dtype))]
    bad += [f"ema:{n}" for n, w in h["ema"].items() if not torch.equal(w, want[n].float())]
    assert bad == []
    # and transformers' own forward of the directory: the gathered weights give its logits
    model = whole.model.eval()
    missing, unexpected = model.load_state_dict(h["weights"], strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    ids = ids_for_test()
    with torch.no_grad():
        ours = full_logits(model, model(ids, torch.arange(ids.shape[1]).expand_as(ids),
                                        attn_mask=torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).tril()))
    torch.testing.assert_close(ours[..., :N_REAL], hf_logits(tmp / "hf", ids)[..., :N_REAL], atol=1e-4, rtol=0)
