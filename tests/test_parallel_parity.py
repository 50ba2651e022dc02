"""Parallel layouts train exactly like one process on the same global batch (CPU, gloo, fp32).

`train_layouts` (run on N ranks by tests/distributed_run.py) trains two tiny models (Qwen-style: GQA, SwiGLU, RMSNorm, QK-norm, tied
embeddings, 3 layers so PP=2 splits 2+1; GPT-style: LayerNorm, GELU, biases, untied head) for 3
steps under each layout, on 8 sequences per step in micro-batches of 2 (gradient accumulation 4 on
one process), with gradient clipping active. Losses, gradient norms and the validation NLL must agree
with the one-process run within 1e-5 relative, and the weights within PARAM_ATOL; each layout's
sharded checkpoint must consolidate to the one-process weights and Adam moments. A bf16
run of TP=2, PP=2 (ZeRO 0 and 1) checks DeepSpeed's bf16 optimizers' gradient norms under those layouts.
Every run also counts what its collectives move in one step (tests/comm_counter.py), which
tests/test_comm_plan.py compares with the dry run's count.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from comm_counter import CommCounter
from distributed_run import run_distributed
from helpers import gathered_weights
from pretrain.checkpoint.consolidate import consolidate
from pretrain.checkpoint.shards import merge

pytestmark = pytest.mark.slow

VARIANTS = ("qwen", "gpt")
REL = 1e-5
# Observed differences are ~1e-7 (DP, PP) to ~7e-6 (TP: other summation orders, amplified by Adam on
# near-zero gradients); one Adam step moves a weight by up to lr = 3e-3.
PARAM_ATOL = 3e-5

# -- the runs: every layout trains on the same global batches (fixed random tokens, orders drawn once for
# the whole global batch and sliced by data-parallel rank), through the code the trainer runs
# (`build_stage`, `build_engine`, `StepRunner`), so its losses, gradient norms, validation NLL and final
# weights must equal the one-process reference. LAYOUT is `tp{T}pp{P}z{Z}` (the data-parallel size is
# N / (T * P)); `ref` is tp1pp1z0 on one process. Writes OUT/V-LAYOUT.json (rank 0), OUT/V-LAYOUT_mp{XX}.pt
# (one per TP x PP shard, data-parallel rank 0: shard info + weights) and a sharded checkpoint
# OUT/ckpt-V-LAYOUT/ (pretrain/checkpoint/save.py) for the consolidation checks.
MODELS = {
    # Qwen-style: GQA, RMSNorm, SwiGLU, QK-norm, no biases, tied embeddings; 3 layers (uneven PP split)
    "qwen": dict(n_layers=3, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, norm="rmsnorm", activation="swiglu",
                 qk_norm=True, bias=False, tie_embeddings=True),
    # GPT-style: LayerNorm, GELU, biases, untied head
    "gpt": dict(n_layers=2, hidden=32, n_heads=2, ffn_hidden=64, norm="layernorm", activation="gelu", bias=True,
                tie_embeddings=False),
}
# bf16 (DeepSpeed's bf16 optimizers): only a smoke test of the layouts that change its code path
MODELS["qwen_bf16"] = MODELS["qwen"]
# Activation checkpointing, per-block compile and sequence parallelism (tests/test_recompute_parallel.py):
# the same models with extra recipe keys, compared with the plain variant's reference.
EXTRA = {
    "qwen_full": {"train": {"activation_checkpointing": "full"}},
    "gpt_selective": {"train": {"activation_checkpointing": "selective"}},
    "qwen_compile": {"train": {"compile": True, "activation_checkpointing": "selective"}},
    "qwen_sp": {"parallel": {"sequence_parallel": True}},
    # LoRA (tests/test_lora_parallel.py): adapters on every block linear, the base frozen
    "qwen_lora": {"train": {"lora": {"rank": 4, "alpha": 8.0, "random_base": True}}},
    "gpt_lora": {"train": {"lora": {"rank": 4, "alpha": 8.0, "random_base": True}}},
    "qwen_lorasp": {"train": {"lora": {"rank": 4, "alpha": 8.0, "random_base": True}}, "parallel": {"sequence_parallel": True}},
    # tests/test_comm_plan.py: an embedding above ZeRO-3's persistence threshold (1e5 elements), gathered per
    # micro-batch
    "qwen_z3wide": {"model": {"vocab_size": 4000, "mask_id": 3999}},
    # DeepSpeed's overlap_comm (the gradient reduction beside the backward, ZeRO-1/2)
    "qwen_overlap": {"parallel": {"overlap_comm": True}},
}
for _name in EXTRA:
    MODELS[_name] = MODELS[_name.split("_")[0]]
ONLY = {"qwen_bf16": {"ref", "tp2pp1z0", "tp1pp2z0", "tp1pp2z1"}, "qwen_compile": {"tp2pp1z0"},
        "qwen_sp": {"tp2pp1z0"}, "gpt_lora": {"ref", "tp2pp1z0", "tp1pp1z1"}, "qwen_lorasp": {"tp2pp1z0"}}
SEQ, GLOBAL, MICRO, STEPS, VOCAB = 16, 8, 2, 3, 250


def recipe(variant: str, tp: int, pp: int, zero: int) -> dict:
    return {
        "run": {"seed": 11},
        "model": {**MODELS[variant], "dropout": 0.0, "max_seq_len": SEQ, "vocab_size": VOCAB, "mask_id": VOCAB - 1},
        "objective": {"name": "setdlm", "set_size": 2},
        "data": {"seq_len": SEQ},
        "train": {"micro_batch": MICRO, "global_batch": GLOBAL, "lr": 3e-3, "warmup_steps": 0, "grad_clip": 0.5,
                  "weight_decay": 0.1, "precision": "bf16" if variant.endswith("bf16") else "fp32"},
        "parallel": {"tp": tp, "pp": pp, "zero_stage": zero},
        "logging": {"wandb": "disabled"},
    } if variant not in EXTRA else _with_extra(recipe(variant.split("_")[0], tp, pp, zero), EXTRA[variant])


def _with_extra(base: dict, extra: dict) -> dict:
    for section, values in extra.items():
        base[section] = {**base[section], **values}
    return base


def parse(layout: str) -> tuple[int, int, int]:
    if layout == "ref":
        return 1, 1, 0
    m = re.fullmatch(r"tp(\d+)pp(\d+)z(\d)", layout)
    if not m:
        raise ValueError(f"bad layout {layout!r}")
    return tuple(int(x) for x in m.groups())


def global_inputs(objective, step: int):
    """The step's global batch, prepared once (same on every rank)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, VOCAB - 1, (GLOBAL, SEQ), generator=g)
    return objective.prepare({"input_ids": x}, g)


def run_layout(layout: str, variant: str, out: Path) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from model.objectives import build_objective, summarize
    from pretrain.parallel import ensure_model_parallel
    from pretrain.checkpoint.shards import shard_info
    from pretrain.checkpoint.writer import save
    from pretrain.config import from_dict
    from pretrain.engine import build_engine, zero3_init
    from pretrain.parallelize import build_stage, prepare_model
    from pretrain.pipeline import StepRunner

    tp, pp, zero = parse(layout)
    world = dist.get_world_size()
    cfg = from_dict(recipe(variant, tp, pp, zero))
    cfg.validate(world)
    ensure_model_parallel(tp, pp)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    torch.manual_seed(cfg.run.seed)
    model = build_stage(cfg.model, tp, pp, sequence_parallel=cfg.parallel.sequence_parallel,
                        zero_init=zero3_init(cfg, world, cfg.train.precision),  # ZeRO-3: as the trainer builds it
                        lora=cfg.train.lora)
    prepare_model(model, cfg)  # activation checkpointing / compile, as the trainer does
    engine, _, _ = build_engine(model, cfg, world, cfg.train.precision)
    objective = build_objective(cfg.objective, cfg.model, SEQ, cross_entropy=model.tp.cross_entropy)
    stepper = StepRunner(engine, objective, cfg)
    per_rank = GLOBAL // dp
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    result = {"losses": [], "grad_norms": [], "layout": [tp, pp, dp, zero]}
    for step in range(STEPS):
        full = global_inputs(objective, step)
        micro = [_rows(full, i, i + MICRO) for i in range(mine.start, mine.stop, MICRO)]
        COUNTER.clear()
        m, gnorm = stepper.train_step(micro)
        if step == COUNTED_STEP:  # what this rank's collectives moved in one step (tests/test_comm_plan.py)
            write_counts(out / f"{variant}-{layout}.comm{dist.get_rank()}.json", COUNTER, cfg)
        red = stepper.reduce(m)
        result["losses"].append(red["loss_sum"] / red["loss_count"])
        result["grad_norms"].append(None if gnorm is None else float(gnorm))  # the engine's norm: a tensor
    engine.module.eval()
    val = global_inputs(objective, 99)
    red = stepper.reduce(stepper.eval_step([_rows(val, i, i + MICRO) for i in range(mine.start, mine.stop, MICRO)]))
    result["val_nll"] = summarize(red)["nll"]
    state = gathered_weights(engine.module, zero == 3) if dp_rank == 0 or zero == 3 else None
    if dp_rank == 0:
        mp = dist.get_rank(group=parallel_state.get_model_parallel_group())
        torch.save({"info": shard_info(engine), "state": state}, out / f"{variant}-{layout}_mp{mp:02d}.pt")
    if variant in VARIANTS or "lora" in variant:  # a real sharded checkpoint, for the consolidation checks
        meta = {"step": STEPS, "tokens_seen": 0, "layout": {"world": world, "tp": tp, "pp": pp, "dp": dp, "zero_stage": zero}}
        save(engine, out / f"ckpt-{variant}-{layout}", STEPS, meta=meta, extra={}, keep_last=1, rank=dist.get_rank())
    if dist.get_rank() == 0:
        (out / f"{variant}-{layout}.json").write_text(json.dumps(result))
    dist.barrier()


# The collectives of every rank are counted (tests/comm_counter.py) and those of step COUNTED_STEP (the
# second: the first also holds one-time work) written per rank, with the rank's groups, for
# tests/test_comm_plan.py to compare with the plan's count.
COUNTER = CommCounter()
COUNTED_STEP = 1


def write_counts(path: Path, counter: CommCounter, cfg) -> None:
    from megatron.core import parallel_state as ps

    groups = {"tp": ps.get_tensor_model_parallel_group(), "pp": ps.get_pipeline_model_parallel_group(),
              "dp": ps.get_data_parallel_group(with_context_parallel=True), "cp": ps.get_context_parallel_group()}
    if ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
        groups["embedding"] = ps.get_embedding_group()
    calls: dict = {}
    for r in counter.records:
        key = (r.op, r.ranks, r.nbytes, r.dtype)
        calls[key] = calls.get(key, 0) + 1
    path.write_text(json.dumps({
        "rank": torch.distributed.get_rank(), "world": torch.distributed.get_world_size(), "recipe": cfg.to_dict(),
        "groups": {k: torch.distributed.get_process_group_ranks(g) for k, g in groups.items()},
        "stage": ps.get_pipeline_model_parallel_rank(),
        "calls": [[op, list(ranks), nbytes, dtype, n] for (op, ranks, nbytes, dtype), n in calls.items()]}))


# Context-parallel cases of the CP runtime's own tests (tests/test_context_parallel_runs.py `run_case`),
# counted like the layouts above for tests/test_comm_plan.py, in the 4-process launch: where that runtime
# exists. TP x CP with sequence parallelism, ZeRO-1 over dp x cp, full recomputation of a one-stream family.
CP_COUNTED = ("setdlm-tp2cp2pp1z0sp", "bd3lm-tp1cp2pp1z1", "mdlm-tp1cp2pp1z0ac")


def cp_runtime() -> bool:
    import importlib.util

    return importlib.util.find_spec("model.context_parallel") is not None


def run_cp_case(case: str, out: Path) -> None:
    """One of the CP runtime's cases, its second optimizer step's collectives written per rank."""
    import torch.distributed as dist

    import test_context_parallel_runs as cpr
    from pretrain.config import from_dict
    from pretrain.pipeline import StepRunner

    cfg = from_dict(cpr.recipe(*cpr.parse(case)))
    original, steps = StepRunner.train_step, []

    def counted(self, micro):
        COUNTER.clear()
        result = original(self, micro)
        if len(steps) == COUNTED_STEP:
            write_counts(out / f"{case}.comm{dist.get_rank()}.json", COUNTER, cfg)
        steps.append(case)
        return result

    StepRunner.train_step = counted
    try:
        cpr.run_case(case, out)
    finally:
        StepRunner.train_step = original


def _rows(inputs, a: int, b: int):
    """Rows [a, b) of a prepared batch (the mask is shared by all rows)."""
    from model.objectives import ModelInputs

    return ModelInputs(input_ids=inputs.input_ids[a:b], position_ids=inputs.position_ids[a:b],
                       attn_mask=inputs.attn_mask, logits_slice=inputs.logits_slice, targets=inputs.targets[a:b],
                       loss_weight=inputs.loss_weight[a:b], nll_weight=inputs.nll_weight[a:b],
                       num_tokens=inputs.nll_weight[a:b].sum(), mask_spec=inputs.mask_spec)


def train_layouts(out: Path, pairs: list) -> None:
    """One rank: each (variant, layout) of `pairs`, one after another."""
    from pretrain.parallel import ensure_process_group
    from pretrain.engine import _skip_cpu_shm_op

    ensure_process_group()
    _skip_cpu_shm_op()
    COUNTER.install()  # before DeepSpeed's communication backend exists (it keeps references to the functions)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for variant, layout in pairs:
        if variant == "cp":
            run_cp_case(layout, out)
        else:
            run_layout(layout, variant, out)


def pairs(variants, layouts) -> list[tuple[str, str]]:
    """Every variant under every layout it is run in (ONLY)."""
    return [(v, lay) for v in variants for lay in layouts if lay in ONLY.get(v, {lay})]


TWO = ["tp2pp1z0", "tp1pp2z0", "tp1pp1z1", "tp1pp1z2", "tp1pp1z3"]  # TP=2; PP=2; DP=2 with ZeRO 1, 2, 3
FOUR = ["tp2pp2z0", "tp2pp1z2", "tp1pp2z1"]  # TP=2 x PP=2; DP=2 x TP=2 (ZeRO-2); DP=2 x PP=2 (ZeRO-1)
# tests/test_recompute_parallel.py: variant, layout, relative tolerance of losses / grad norms / val NLL
RECOMPUTE_CASES = [
    ("qwen_full", "tp2pp1z0", 1e-5), ("qwen_full", "tp1pp2z0", 1e-5), ("qwen_full", "tp1pp1z3", 1e-5),
    ("gpt_selective", "tp2pp1z0", 1e-5), ("gpt_selective", "tp1pp2z0", 1e-5),
    ("qwen_compile", "tp2pp1z0", 1e-4), ("qwen_sp", "tp2pp1z0", 1e-5),
    ("qwen_overlap", "tp1pp1z1", 1e-5), ("qwen_overlap", "tp1pp1z2", 1e-5),
]
# tests/test_lora_parallel.py: variant, layout; the reference is the variant's own one-process run
# (qwen_lorasp: qwen_lora's)
LORA_CASES = [
    ("qwen_lora", "tp2pp1z0"), ("qwen_lora", "tp1pp2z0"), ("qwen_lora", "tp1pp1z1"), ("qwen_lora", "tp1pp1z2"),
    ("qwen_lora", "tp1pp1z3"), ("qwen_lorasp", "tp2pp1z0"), ("gpt_lora", "tp2pp1z0"), ("gpt_lora", "tp1pp1z1"),
]
RUNS = {  # processes -> every (variant, layout) the four test modules compare, each run once
    1: pairs([*VARIANTS, "qwen_bf16", "qwen_lora", "gpt_lora"], ["ref"]),
    2: pairs([*VARIANTS, "qwen_bf16"], TWO) + [c[:2] for c in RECOMPUTE_CASES] + LORA_CASES + [("qwen_z3wide", "tp1pp1z3")],
    4: pairs([*VARIANTS, "qwen_bf16"], FOUR) + ([("cp", case) for case in CP_COUNTED] if cp_runtime() else []),
}


def run_all(out: Path) -> None:
    """Every run of RUNS: one launch per process count (conftest.py's session fixture `parity_runs`)."""
    for nproc, todo in RUNS.items():
        run_distributed(train_layouts, nproc, out, todo, timeout=1200)


def load(out: Path, name: str) -> tuple[dict, dict]:
    shards = [torch.load(f, weights_only=False) for f in sorted(out.glob(f"{name}_mp*.pt"))]
    assert shards, f"no weights written for {name}"
    return json.loads((out / f"{name}.json").read_text()), merge([(s["info"], s["state"]) for s in shards])


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b))


def check_bf16(out: Path, layout: str) -> None:
    """bf16 runs round differently per layout, and DeepSpeed's bf16 optimizers differ by ZeRO stage, so
    only the first step is compared: loss within 0.2%, gradient norm within 1% (a tied embedding
    counted twice is ~10% off, TP shards counted on one rank ~50%)."""
    if not (out / f"qwen_bf16-{layout}.json").is_file():
        return
    ref = json.loads((out / "qwen_bf16-ref.json").read_text())
    got = json.loads((out / f"qwen_bf16-{layout}.json").read_text())
    for key, rel in (("losses", 2e-3), ("grad_norms", 1e-2)):
        assert abs(got[key][0] - ref[key][0]) <= rel * abs(ref[key][0]), (layout, key, got[key], ref[key])
    assert all(math.isfinite(x) for x in got["losses"] + got["grad_norms"]), got


def check(out: Path, layout: str) -> None:
    for variant in VARIANTS:
        ref, ref_w = load(out, f"{variant}-ref")
        got, got_w = load(out, f"{variant}-{layout}")
        what = f"{variant} {layout} (tp, pp, dp, zero = {got['layout']})"
        for key in ("losses", "grad_norms"):
            assert all(close(a, b) for a, b in zip(got[key], ref[key])), (what, key, got[key], ref[key])
        assert close(got["val_nll"], ref["val_nll"]), (what, got["val_nll"], ref["val_nll"])
        assert set(got_w) == set(ref_w), (what, set(got_w) ^ set(ref_w))
        worst = max(((got_w[k] - ref_w[k]).abs().max().item(), k) for k in ref_w if torch.is_tensor(ref_w[k]))
        assert worst[0] <= PARAM_ATOL, (what, "weights differ", worst)
        check_consolidation(out, variant, layout, got["layout"][3])


def consolidated(out: Path, name: str) -> dict:
    return torch.load(consolidate(out / f"ckpt-{name}", log=lambda m: None), weights_only=False)


def check_consolidation(out: Path, variant: str, layout: str, zero: int) -> None:
    """The layout's sharded checkpoint consolidates to the one-process state: weights, and the Adam
    moments (ZeRO-0: client optimizer; ZeRO-1/2: flat partitions; ZeRO-3: per-parameter slices)."""
    ref, got = consolidated(out, f"{variant}-ref"), consolidated(out, f"{variant}-{layout}")
    assert set(got["module"]) == set(ref["module"]), set(got["module"]) ^ set(ref["module"])
    worst = max(((got["module"][k] - ref["module"][k]).abs().max().item(), k) for k in ref["module"]
                if torch.is_tensor(ref["module"][k]))
    assert worst[0] <= PARAM_ATOL, (variant, layout, "consolidated weights differ", worst)
    assert got["optimizer"] is not None and got["optimizer"]["step"] == ref["optimizer"]["step"], (variant, layout)
    for key in ("exp_avg", "exp_avg_sq"):
        r, g = ref["optimizer"][key], got["optimizer"][key]
        assert set(g) == set(r), (variant, layout, key, set(g) ^ set(r))
        scale = max(t.abs().max().item() for t in r.values())
        diff = max((g[n] - r[n]).abs().max().item() for n in r)
        assert diff <= 1e-5 * scale, (variant, layout, key, diff, scale)


@pytest.mark.parametrize("nproc,layouts", [(2, TWO), (4, FOUR)], ids=["2proc", "4proc"])
def test_layouts_match_one_process(parity_runs, nproc, layouts):
    for layout in layouts:
        check(parity_runs, layout)
        check_bf16(parity_runs, layout)


# Each layout's checkpoint with one rank's data file removed (format 2: one file per rank): consolidation
# (and load_model, which reads the same files) refuses it, naming the missing file, instead of writing a
# smaller model.
MISSING = {
    "TP shard": ("tp2pp1z0", "__1_0.distcp"),
    "PP stage": ("tp1pp2z0", "__1_0.distcp"),
    "ZeRO-1 partition": ("tp1pp1z1", "__1_0.distcp"),
    "ZeRO-3 partition": ("tp1pp1z3", "__1_0.distcp"),
}


@pytest.mark.parametrize("what", MISSING)
def test_consolidation_refuses_a_checkpoint_with_a_missing_shard(parity_runs, tmp_path, capsys, what):
    import shutil

    from launch.cli import main as cli_main

    layout, name = MISSING[what]
    src = parity_runs / f"ckpt-qwen-{layout}"
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    step = next(ckpt.glob("step_*"))
    (step / name).unlink()
    out = tmp_path / "consolidated.pt"
    assert cli_main(["convert", "consolidate", "--checkpoint", str(ckpt), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    assert "incomplete" in err and name in err, err
    assert not out.exists()
