"""init_from worker: import a Hugging Face directory under a TP x PP layout, run the AR forward, save.

    torchrun --standalone --nproc-per-node N tests/hf_import_worker.py --model DIR --target RUN --tp T [--pp P]

Goes through the trainer's code (`init_from.prepare`, `build_stage`, `build_engine`, `init_from.load`)
and writes, on rank 0, RUN/logits.pt (the gathered full-vocabulary AR logits of fixed token ids, last
stage) and, from every rank, a step-0 checkpoint RUN/checkpoints/step_00000000 of this layout (with
config and tokenizer), which `setdlm convert to-hf` consolidates and exports.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

SEQ = 12


def ids_for_test() -> torch.Tensor:
    return torch.randint(0, 50257, (2, SEQ), generator=torch.Generator().manual_seed(5))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--target", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from data_pipeline.tokenizers import load_tokenizer
    from model.objectives import build_objective
    from pretrain.parallel import ensure_model_parallel, ensure_process_group
    from model.transformer import full_logits
    from pretrain import checkpoint, init_from
    from pretrain.config import from_dict, save_config
    from pretrain.engine import _skip_cpu_shm_op, build_engine
    from pretrain.parallelize import build_stage

    ensure_process_group()
    _skip_cpu_shm_op()
    run = Path(args.target)
    cfg = from_dict({"run": {"out_dir": str(run.parent), "name": run.name, "seed": 3},
                     "objective": {"name": "ar"}, "data": {"seq_len": SEQ},
                     "train": {"init_from": args.model, "micro_batch": 1, "global_batch": 1 * (dist.get_world_size()
                                                                                              // (args.tp * args.pp))},
                     "parallel": {"tp": args.tp, "pp": args.pp}, "logging": {"wandb": "disabled"}})
    source = init_from.prepare(cfg)
    tok = load_tokenizer(cfg.data.tokenizer, add_mask=cfg.data.add_mask_token)
    cfg.resolve_vocab(tok)
    cfg.validate(dist.get_world_size())
    ensure_model_parallel(args.tp, args.pp)
    torch.manual_seed(cfg.run.seed)
    model = build_stage(cfg.model, args.tp, args.pp)
    engine, _, _ = build_engine(model, cfg, dist.get_world_size(), "fp32")
    notes = init_from.load(engine, source, cfg.model)
    assert notes, "init_from.load did not load anything"
    objective = build_objective(cfg.objective, cfg.model, SEQ)
    inputs = objective.prepare({"input_ids": ids_for_test()})
    engine.module.eval()
    last = parallel_state.is_pipeline_last_stage()
    from pretrain.compat_cpu import megatron_compat

    with torch.no_grad(), megatron_compat():
        if args.pp == 1:
            logits = engine.module(inputs.input_ids, inputs.position_ids, attn_mask=inputs.attn_mask)
            full = full_logits(engine.module, logits)
        else:
            full = None  # parity under PP is the consolidation + export below
    mp_rank = parallel_state.get_model_parallel_group().rank()
    if dist.get_rank() == 0:
        run.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run / "config.yaml")
        tok.save(run / "tokenizer")
        if full is not None and last:
            torch.save(full, run / "logits.pt")
    dist.barrier()
    meta = {"step": 0, "tokens_seen": 0, "wandb_id": None, "tokenizer": tok.name, "tokenizer_sha256": tok.sha256,
            "objective": "ar", "config": cfg.to_dict(),
            "layout": {"world": dist.get_world_size(), "tp": args.tp, "pp": args.pp,
                       "dp": parallel_state.get_data_parallel_world_size(), "zero_stage": 0}}
    checkpoint.save(engine, run / "checkpoints", 0, meta=meta, extra={"rng": checkpoint.rng_state()}, ema_state=None,
                    keep_last=1, mp_rank=mp_rank, dp_rank=parallel_state.get_data_parallel_rank(), rank=dist.get_rank())
    return 0


if __name__ == "__main__":
    sys.exit(main())
