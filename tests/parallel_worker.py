"""Parity worker: trains a tiny model a few steps under several parallel layouts, in one launch.

    torchrun --standalone --nproc-per-node N tests/parallel_worker.py --out DIR --variants V[,V] LAYOUT [LAYOUT ...]

LAYOUT is `tp{T}pp{P}z{Z}` (the data-parallel size is N / (T * P)); `ref` is tp1pp1z0 on one process.
Every layout trains on the same global batches (fixed random tokens, orders drawn once for the
whole global batch and sliced by data-parallel rank), through the code the trainer runs
(`build_stage`, `build_engine`, `StepRunner`), so its losses, gradient norms, validation NLL and final
weights must equal the one-process reference. Writes DIR/V-LAYOUT.json (rank 0),
DIR/V-LAYOUT_mp{XX}.pt (one per TP x PP shard, data-parallel rank 0: shard info + weights) and a
sharded checkpoint DIR/ckpt-V-LAYOUT/ (pretrain/checkpoint.py) for the consolidation checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

VARIANTS = {
    # Qwen-style: GQA, RMSNorm, SwiGLU, QK-norm, no biases, tied embeddings; 3 layers (uneven PP split)
    "qwen": dict(n_layers=3, hidden=32, n_heads=4, n_kv_heads=2, ffn_hidden=64, norm="rmsnorm", activation="swiglu",
                 qk_norm=True, bias=False, tie_embeddings=True),
    # GPT-style: LayerNorm, GELU, biases, untied head
    "gpt": dict(n_layers=2, hidden=32, n_heads=2, ffn_hidden=64, norm="layernorm", activation="gelu", bias=True,
                tie_embeddings=False),
}
# bf16 (DeepSpeed's bf16 optimizers): only a smoke test of the layouts that change its code path
VARIANTS["qwen_bf16"] = VARIANTS["qwen"]
# Activation checkpointing, per-block compile and sequence parallelism (tests/test_recompute_parallel.py):
# the same models with extra recipe keys, compared with the plain variant's reference.
EXTRA = {
    "qwen_full": {"train": {"activation_checkpointing": "full"}},
    "gpt_selective": {"train": {"activation_checkpointing": "selective"}},
    "qwen_compile": {"train": {"compile": True, "activation_checkpointing": "selective"}},
    "qwen_sp": {"parallel": {"sequence_parallel": True}},
}
for _name in EXTRA:
    VARIANTS[_name] = VARIANTS[_name.split("_")[0]]
ONLY = {"qwen_bf16": {"ref", "tp2pp1z0", "tp1pp2z0", "tp1pp2z1"}, "qwen_compile": {"tp2pp1z0"},
        "qwen_sp": {"tp2pp1z0"}}
SEQ, GLOBAL, MICRO, STEPS, VOCAB = 16, 8, 2, 3, 250


def recipe(variant: str, tp: int, pp: int, zero: int) -> dict:
    return {
        "run": {"seed": 11},
        "model": {**VARIANTS[variant], "dropout": 0.0, "max_seq_len": SEQ, "vocab_size": VOCAB, "mask_id": VOCAB - 1},
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
        raise SystemExit(f"bad layout {layout!r}")
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
    from pretrain.checkpoint import save, shard_info
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
                        zero_init=zero3_init(cfg, world, cfg.train.precision))  # ZeRO-3: as the trainer builds it
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
        m, gnorm = stepper.train_step(micro)
        red = stepper.reduce(m)
        result["losses"].append(red["loss_sum"] / red["loss_count"])
        result["grad_norms"].append(gnorm)
    engine.module.eval()
    val = global_inputs(objective, 99)
    red = stepper.reduce(stepper.eval_step([_rows(val, i, i + MICRO) for i in range(mine.start, mine.stop, MICRO)]))
    result["val_nll"] = summarize(red)["nll"]
    if dp_rank == 0:
        params = list(engine.module.named_parameters())
        if zero == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p for _, p in params]):
                state = {n: p.detach().float().clone() for n, p in params}
        else:
            state = {n: p.detach().float().clone() for n, p in params}
        mp = dist.get_rank(group=parallel_state.get_model_parallel_group())
        torch.save({"info": shard_info(engine), "state": state}, out / f"{variant}-{layout}_mp{mp:02d}.pt")
    elif zero == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            pass
    if not variant.endswith("bf16"):  # a real sharded checkpoint, for the consolidation checks
        meta = {"step": STEPS, "tokens_seen": 0, "layout": {"world": world, "tp": tp, "pp": pp, "dp": dp, "zero_stage": zero}}
        save(engine, out / f"ckpt-{variant}-{layout}", STEPS, meta=meta, extra={}, ema_state=None, keep_last=1,
             mp_rank=dist.get_rank(group=parallel_state.get_model_parallel_group()), dp_rank=dp_rank, rank=dist.get_rank())
    if dist.get_rank() == 0:
        (out / f"{variant}-{layout}.json").write_text(json.dumps(result))
    dist.barrier()


def _rows(inputs, a: int, b: int):
    """Rows [a, b) of a prepared batch (the mask is shared by all rows)."""
    from model.objectives import ModelInputs

    return ModelInputs(input_ids=inputs.input_ids[a:b], position_ids=inputs.position_ids[a:b],
                       attn_mask=inputs.attn_mask, logits_slice=inputs.logits_slice, targets=inputs.targets[a:b],
                       loss_weight=inputs.loss_weight[a:b], nll_weight=inputs.nll_weight[a:b],
                       num_tokens=inputs.nll_weight[a:b].sum(), mask_spec=inputs.mask_spec)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", required=True, help=f"comma-separated, of {sorted(VARIANTS)}")
    parser.add_argument("layouts", nargs="+")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from pretrain.parallel import ensure_process_group
    from pretrain.engine import _skip_cpu_shm_op

    ensure_process_group()
    _skip_cpu_shm_op()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for variant in args.variants.split(","):
        for layout in args.layouts:
            if layout in ONLY.get(variant, {layout}):
                run_layout(layout, variant, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
