"""ZeRO-3 worker: builds under deepspeed.zero.Init and trains through the real Trainer, in one launch.

    torchrun --standalone --nproc-per-node 2 tests/zinit_worker.py RECIPE OUT SETDLM_RUN HF_DIR

1. build: a mid-size model built inside `zero3_init` (pretrain/engine.py) and the same model built
   whole, on every rank, under a dispatch mode that records the peak of live tensor bytes while the
   model is built; the zero.Init model's gathered weights against the whole one (fp32 and bf16).
   Writes OUT/build_dp{N}_rank{R}.json. With `--build-only RECIPE OUT` (any number of processes:
   under DP=3 partitions start mid-row and mid-unit) only this step runs.
2. Z: the recipe under ZeRO-3 over DP=2; its initial weights (gathered) go to OUT/Z_init.pt.
3. Zr: a copy of Z cut back to its step-2 checkpoint, trained again: it resumes there.
4. I: one step from `train.init_from=SETDLM_RUN` under ZeRO-3.
5. H: `train.init_from=HF_DIR` (a stock HF model) loaded into a ZeRO-3 model; the gathered weights and
   EMA against the imported ones go to OUT/H_mismatch.json.
Used by tests/test_zero3_init.py.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.bench_zero3_init import LiveBytes  # noqa: E402  (peak of live tensor bytes)

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


def main() -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist

    from pretrain.config import load_config
    from pretrain.parallel import ensure_model_parallel, ensure_process_group
    from pretrain.trainer import Trainer

    from pretrain import init_from

    ensure_process_group()
    ensure_model_parallel(1, 1)
    if sys.argv[1] == "--build-only":
        build(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    recipe, out, setdlm_run, hf_dir = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
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
    want = init_from.weights(hf.init_source, hf.cfg.model)
    got = gathered(hf.model)
    ema = {n: hf.ema.full(n) for n in hf.ema.shadow}
    if dist.get_rank() == 0:
        bad = [n for n, w in got.items() if not torch.equal(w, want[n].to(w.dtype))]
        bad += [f"ema:{n}" for n, w in ema.items() if not torch.equal(w, want[n].float())]
        (out / "H_mismatch.json").write_text(json.dumps(bad))
    return 0


if __name__ == "__main__":
    sys.exit(main())
