"""The train part: tokens/s and MFU of bf16 training steps through the trainer's own engine and step."""

from __future__ import annotations

import time

from .rows import CUT, Deadline, emit


def _train_cases(smoke: bool) -> list[dict]:
    from model.families import AR, BD3LM, MDLM, SETDLM  # when the part runs: after the install part

    if smoke:
        return [dict(preset="tiny", objective=SETDLM.name, seq_len=32, micro=[4], steps=2, warmup=1)]
    # SetDLM and AR first: the part's time limit trims from the end
    cases = [dict(preset="paper-12x768", objective=s.name, seq_len=1024, micro=[16], steps=4, warmup=2)
             for s in (SETDLM, AR, BD3LM, MDLM)]
    cases.append(dict(preset="qwen3-1.7b", objective=SETDLM.name, seq_len=1024, micro=[32, 24, 16, 12, 8, 6, 4, 2, 1],
                      steps=3, warmup=2, largest=True))
    return cases


def part_train(args) -> int:
    deadline = Deadline.of(args)  # counted from the process's start: these imports spend from it
    import gc
    import statistics

    import torch

    from pretrain.config import load_config
    from pretrain.flops import train_step_flops
    from pretrain.plan import estimate_memory
    from pretrain.trainer import Trainer

    from .predict import predicted, ratio

    cuda = torch.cuda.is_available()
    peak = float(args.peak_tflops) if cuda else None
    failures = 0
    for i, case in enumerate(_train_cases(args.smoke)):
        row = {"preset": case["preset"], "objective": case["objective"], "seq_len": case["seq_len"]}
        if deadline.left() < (50 if case["preset"] == "qwen3-1.7b" else 25) and not args.smoke:
            emit({**row, CUT: True, "note": f"not run: {deadline.left():.0f}s left"})
            continue
        over = [f"model.preset={case['preset']}", "model.vocab_size=50258", "model.mask_id=50257",
                f"objective.name={case['objective']}", "objective.set_size=4", "objective.block_size=4",
                "data.source=builtin:pydoc_topics", "data.tokenizer=gpt2", f"data.seq_len={case['seq_len']}",
                f"run.out_dir={args.workdir}", f"run.name=train{i}", "run.seed=0", "train.max_steps=1000000",
                "train.eval_every=0", "train.save_every=1000000", "train.log_every=1000000", "train.warmup_steps=10",
                f"train.precision={'bf16' if cuda else 'fp32'}", "parallel.zero_stage=1", "logging.wandb=disabled",
                "logging.progress=false", f"model.max_seq_len={max(case['seq_len'], 64)}"]
        if peak:
            over.append(f"train.peak_tflops={peak}")
        use_ckpt = case["preset"] == "qwen3-1.7b"
        if use_ckpt:
            over.append("train.activation_checkpointing=full")
        micro = case["micro"][-1]
        if case.get("largest"):
            # The largest candidate micro-batch whose estimated memory fits in 85% of the GPU (no trial
            # runs: each new shape recompiles the attention kernels).
            total = torch.cuda.get_device_properties(0).total_memory if cuda else 8 * 2**30
            for mb in case["micro"]:
                est = estimate_memory(load_config(None, over + [f"train.micro_batch={mb}", f"train.global_batch={mb}"]),
                                      1, precision="bf16" if cuda else "fp32")[0].total
                if est <= 0.85 * total:
                    micro, row["estimated_mem_gib"] = mb, round(est / 2**30, 1)
                    break
        over += [f"train.micro_batch={micro}", f"train.global_batch={micro}"]
        row.update(micro_batch=micro, activation_checkpointing=use_ckpt, precision="bf16" if cuda else "fp32")
        print(f"train: {row}", flush=True)
        trainer = None
        try:
            t_build = time.perf_counter()
            trainer = Trainer(load_config(None, over))
            row["build_s"] = round(time.perf_counter() - t_build, 1)
            obj, dev, cfg = trainer.objective, trainer.device, trainer.cfg
            V = cfg.model.vocab_size
            g = torch.Generator(device=dev).manual_seed(0)
            times, losses = [], []
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            for step in range(case["warmup"] + case["steps"]):
                if deadline.left() < 5:
                    row.update({CUT: True, "note": f"stopped at the part time limit after {step} steps"})
                    break
                x = torch.randint(0, V - 1, (micro, case["seq_len"]), device=dev, generator=g)
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                from model.noise import TRAIN, SampleNoise

                idx = torch.arange(step * micro, (step + 1) * micro, device=dev)  # as the trainer does, inside the step
                inputs = obj.prepare({"input_ids": x}, SampleNoise(cfg.run.seed, idx, micro, TRAIN))
                metrics, _ = trainer.stepper.train_step([inputs])
                if cuda:
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                loss = float(metrics["loss_sum"]) / max(float(metrics["loss_count"]), 1.0)  # device tensors
                print(f"  step {step + 1}: {dt * 1000:.1f} ms, loss {loss:.4f}"
                      f"{' (warm-up)' if step < case['warmup'] else ''}", flush=True)
                if step >= case["warmup"]:
                    times.append(dt)
                    losses.append(loss)
            if times:
                t = statistics.median(times)
                flops = train_step_flops(cfg.model, case["objective"], case["seq_len"], micro)
                row.update(step_ms=round(1000 * t, 1), tokens_per_s=round(micro * case["seq_len"] / t),
                           tflops=round(flops / t / 1e12, 1), mfu=round(flops / t / (peak * 1e12), 3) if peak else None,
                           timed_steps=len(times), loss=round(losses[-1], 4))
                # the dry run's step time for this case on this GPU (predict.py): measured / predicted
                row.update(predicted(cfg, torch.cuda.get_device_name(0) if cuda else None, row["precision"], cuda=cuda))
                row["measured_over_predicted"] = ratio(row["step_ms"], row["predicted_ms"])
                if losses and not all(map(lambda v: v == v and abs(v) < 1e4, losses)):
                    row["note"] = "non-finite loss"
                    failures += 1
            if cuda:
                row["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        except Exception as e:  # noqa: BLE001 - reported, and the next case still runs
            oom = cuda and isinstance(e, torch.cuda.OutOfMemoryError)
            row["note"] = ("out of memory: " if oom else f"{type(e).__name__}: ") + (str(e).splitlines() or [''])[0][:200]
            failures += 1
            import traceback

            traceback.print_exc()
        finally:
            del trainer
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        emit(row)
    return 1 if failures else 0
