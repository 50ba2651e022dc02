"""Decoding throughput on random-weight models: batch scaling, cache vs recompute, per-step time split,
and a GSM8K-like job with continuous batching vs shrinking batches. Prints markdown tables.

    .venv/bin/python benchmarks/bench_sampling.py [--quick] [--sections scaling,cache,profile,job]
        [--shapes tiny,paper] [--lengths 256,1024] [--batches 1,4,16,64] [--device cpu|cuda] [--compile]

Shapes: `tiny` is the reference implementation's tiny model (4 layers x 256, 4 heads, GPT-2 vocabulary
50,258 with MASK); `paper` is paper-12x768 (12 x 768, untied head). Samplers: SetDLM w = 4 with the
threshold off (one token per step) and at 0 (the whole window every step), BD3-LM B = 4, AR.

- scaling: decode-phase tokens/s at each batch size with a context of L tokens: every row has a prompt
  of L - N tokens and generates N, and the time of a prefill-only call (N = 0) is subtracted, so the
  number is the steady-state decoding rate at context about L (the prefill is what it is for any sampler).
- cache: the cached sampler's decode rate at batch 1 against the recomputing reference
  (model/sampling/reference.py: every step re-runs the model over the whole context), same tokens.
- profile: one decode step split into matrix products (mm/addmm/bmm/linear kernels), attention
  (SDPA kernels), other tensor ops, and host time (Python, dispatch: the step's wall time minus the
  ops' own time), from torch.profiler over a few steps.
- job: 200 prompts with answer lengths drawn from the GSM8K train answers (../shared/data/gsm8k,
  GPT-2 tokens; else a documented synthetic distribution, see `answer_lengths`) and their questions as
  prompts, each answer length an exact span (an `Infill` with no suffix: a random model never emits
  EOS where a trained one would); examples/s with continuous batching (`max_batch` slots) against
  today's shrinking batches (consecutive chunks of `max_batch` prompts, finished rows dropped), and the
  batch forwards each needs (`forwards`: hardware-independent; on a GPU a step costs about the same for
  1 or 16 rows, so their ratio is the speedup to expect there).

CPU timings use process CPU time with one thread (`--clock auto`): immune to other processes on a
shared machine, equal to wall time on an idle one. Random weights: tokens/step under a threshold says
nothing about a trained model.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from model import families  # noqa: E402

SHAPES = {"tiny": dict(n_layers=4, hidden=256, n_heads=4, ffn_hidden=1024),
          "paper": dict(n_layers=12, hidden=768, n_heads=12, ffn_hidden=3072)}
VOCAB = 50258  # GPT-2 + MASK


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="scaling,cache,profile,job")
    p.add_argument("--shapes", default="tiny,paper")
    p.add_argument("--lengths", default="256,1024", help="context lengths L")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per row in the timed calls")
    p.add_argument("--max-work", type=float, default=40,
                   help="skip a scaling cell when batch x L x layers x hidden / 1e6 exceeds this (CPU budget; "
                        "0: no cap); skipped cells print 'skip'")
    p.add_argument("--jobs", type=int, default=200, help="prompts in the GSM8K-like job")
    p.add_argument("--slots", type=int, default=16, help="max_batch of the job")
    p.add_argument("--job-shape", default="tiny")
    p.add_argument("--job-scale", type=float, default=1.0, help="multiply the job's answer lengths (CPU budget)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--compile", action="store_true", help="SamplingConfig.compile (and CUDA graphs on a GPU)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["auto", "wall", "cpu"], default="auto")
    p.add_argument("--step-shape", default="tiny", help="step section: model shape")
    p.add_argument("--step-length", type=int, default=256, help="step section: the model's length L")
    p.add_argument("--step-prompt", type=int, default=16, help="step section: prompt tokens")
    p.add_argument("--step-new", type=int, default=224, help="step section: new tokens (MDLM: 32)")
    p.add_argument("--repeats", type=int, default=7, help="step section: decodes per sampler (the fastest counts)")
    p.add_argument("--step-samplers", default="", help="step section: only the samplers whose name contains one of "
                                                       "these (comma-separated; e.g. setdlm)")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.lengths, args.batches, args.new_tokens = "tiny", "64", "1,4", 4
        args.jobs, args.slots, args.job_scale = 12, 4, 0.1
        args.step_new, args.repeats = 32, 2
    return args


CLOCK = time.perf_counter


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def build_model(shape: str, L: int, device, dtype, max_len: int | None = None):
    from model.config import ModelConfig
    from model.transformer import Transformer

    torch.manual_seed(0)
    cfg = ModelConfig(**SHAPES[shape], vocab_size=VOCAB, mask_id=VOCAB - 1, dropout=0.0, max_seq_len=max_len or max(L, 2048),
                      init_std=0.5 if shape == "tiny" else 0.2)
    model = Transformer(cfg).eval().to(device)
    return model.to(torch.bfloat16) if dtype == "bf16" else model


def samplers(compile_: bool):
    from model.sampling import SamplingConfig

    base = dict(stop_on_eos=False, compile=compile_)
    return [("SetDLM w=4 thr=off", SamplingConfig(family=families.SETDLM.name, window=4, **base)),
            ("SetDLM w=4 thr=0 (full window)", SamplingConfig(family=families.SETDLM.name, window=4, threshold=0.0, **base)),
            ("BD3-LM B=4", SamplingConfig(family=families.BD3LM.name, block_size=4, **base)),
            ("AR", SamplingConfig(family=families.AR.name, **base))]


def timed(fn):
    sync(DEVICE)
    t = CLOCK()
    out = fn()
    sync(DEVICE)
    return CLOCK() - t, out


def decode_rate(model, prompts, cfg, n_new: int, warm: set | None = None):
    """(decode tokens/s, tokens/step, steps) of one call generating n_new tokens per row: the prefill
    (admission) time, measured inside the call, is subtracted."""
    key = (id(model), cfg.family, cfg.threshold, cfg.compile)
    if warm is None or key not in warm:
        run_decoder(model, prompts[:1], cfg, 2)  # warm-up (and compiles)
        if warm is not None:
            warm.add(key)
    total, pre, outs = run_decoder(model, prompts, cfg, n_new)
    toks = sum(len(o.tokens) for o in outs)
    return toks / max(total - pre, 1e-9), toks / max(sum(o.steps for o in outs), 1), max(o.steps for o in outs)


def run_decoder(model, prompts, cfg, n_new: int):
    """(total seconds, prefill seconds, outputs) of generate() with the prefill timed separately."""
    import dataclasses

    from model.sampling.api import decoder_class
    from model.sampling.engine import to_requests

    cfg = dataclasses.replace(cfg, max_new_tokens=n_new)
    reqs = to_requests(prompts, cfg, model.cfg.mask_id, model.cfg.vocab_size, None)
    dec = decoder_class(cfg.family)(model, reqs, cfg, mask_id=model.cfg.mask_id, eos_id=None)
    pre = [0.0]
    admit = dec.admit

    def timed_admit(*a):
        sync(DEVICE)
        t = CLOCK()
        admit(*a)
        sync(DEVICE)
        pre[0] += CLOCK() - t

    dec.admit = timed_admit
    total, outs = timed(dec.run)
    return total, pre[0], outs


def prompts_for(L: int, n_new: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (L - n_new,), generator=g).tolist() for _ in range(batch)]


def table(head, rows):
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    print()
    sys.stdout.flush()


# -- sections ------------------------------------------------------------------------------------------
def scaling(args, results):
    batches = [int(b) for b in args.batches.split(",")]
    warm: set = set()
    for shape in args.shapes.split(","):
        for L in [int(x) for x in args.lengths.split(",")]:
            model = build_model(shape, L, args.device, args.dtype)
            sh = SHAPES[shape]
            rows = []
            for name, cfg in samplers(args.compile):
                cells, rates = [name], {}
                for b in batches:
                    work = b * L * sh["n_layers"] * sh["hidden"] / 1e6
                    if args.max_work and work > args.max_work and b > 1:
                        cells.append("skip")
                        continue
                    rate, tps, _ = decode_rate(model, prompts_for(L, args.new_tokens, b), cfg, args.new_tokens, warm)
                    rates[b] = rate
                    cells.append(f"{rate:.0f} ({tps:.1f})")
                    results.append(dict(section="scaling", shape=shape, L=L, sampler=name, batch=b,
                                        tokens_per_s=rate, tokens_per_step=tps))
                big = max((b for b in rates if b > 1), default=None)
                cells.append(f"{rates[big] / rates[1]:.1f}x (b{big})" if big and 1 in rates else "-")
                rows.append(cells)
            print(f"### scaling: {shape} ({sh['n_layers']} x {sh['hidden']}), context L = {L}: decode tokens/s "
                  f"(tokens/step), {args.new_tokens} new tokens per row")
            table(["sampler"] + [f"batch {b}" for b in batches] + ["largest / batch 1"], rows)


def cache_vs_recompute(args, results):
    from model.sampling.reference import generate_reference

    for shape in args.shapes.split(","):
        rows = []
        for L in [int(x) for x in args.lengths.split(",")]:
            model = build_model(shape, L, args.device, args.dtype)
            n_ref = max(2, args.new_tokens // 4)
            for name, cfg in samplers(args.compile):
                p = prompts_for(L, args.new_tokens, 1)
                rate, _, _ = decode_rate(model, p, cfg, args.new_tokens)
                pr = [p[0][: L - n_ref]]
                dt, outs = timed(lambda: generate_reference(model, pr, cfg, max_new_tokens=n_ref))
                ref = sum(len(o.tokens) for o in outs) / dt
                rows.append([name, L, f"{rate:.1f}", f"{ref:.1f}", f"{rate / ref:.1f}x"])
                results.append(dict(section="cache", shape=shape, L=L, sampler=name, cached=rate, recompute=ref))
        print(f"### cache vs recompute: {shape}, batch 1, decode tokens/s at context L")
        table(["sampler", "L", "cached", "recompute", "speedup"], rows)


MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv", "aten::dot")
ATTN = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math",
        "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward", "aten::_efficient_attention_forward")


def profile(args, results):
    """Per-step split: torch.profiler's own time per op kind over a decode of N tokens minus a
    prefill-only call, as fractions of the profiled wall time; the step time itself from CLOCK."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    L = min(int(x) for x in args.lengths.split(","))
    n = max(args.new_tokens, 48)
    rows = []
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    for shape in args.shapes.split(","):
        model = build_model(shape, L, args.device, args.dtype)
        for b in (1, 16):
            for name, cfg in samplers(False):
                p = prompts_for(L, n, b)
                rate, _, steps = decode_rate(model, p, cfg, n)
                step_ms = len(p) * n / rate / steps * 1e3  # decode time per step (every row makes n tokens)
                parts = []
                for k in (n, 0):
                    with tprofile(activities=acts) as prof:
                        t0 = time.perf_counter()
                        run_decoder(model, p, cfg, k)
                        sync(args.device)
                        wall = time.perf_counter() - t0
                    mm = at = other = 0.0
                    for e in prof.key_averages():
                        us = e.self_cpu_time_total if args.device == "cpu" else getattr(e, "self_device_time_total", 0)
                        if e.key in MATMUL:
                            mm += us
                        elif e.key in ATTN:
                            at += us
                        elif e.key.startswith("aten::") or args.device != "cpu":
                            other += us
                    parts.append((wall * 1e6, mm, at, other))
                w, mm, at, ot = (max(x - y, 0.0) for x, y in zip(*parts))
                ops = mm + at + ot
                if ops <= 0:  # a noisy machine can make the difference meaningless: skip the cell
                    rows.append([shape, b, name, f"{step_ms:.2f}", "n/a", "n/a", "n/a", "n/a", "n/a"])
                    continue
                # the ops' share of the decode time (host = the rest, when the profiled wall time shows any)
                fr = [v / max(w, ops) for v in (mm, at, ot)]
                fr.append(max(0.0, 1 - sum(fr)))
                rows.append([shape, b, name, f"{step_ms:.2f}"] + [f"{step_ms * f:.2f}" for f in fr] + [f"{100 * fr[0]:.0f}%"])
                results.append(dict(section="profile", shape=shape, L=L, batch=b, sampler=name, step_ms=step_ms,
                                    matmul_ms=step_ms * fr[0], attention_ms=step_ms * fr[1], other_ops_ms=step_ms * fr[2],
                                    host_ms=step_ms * fr[3]))
    print(f"### per-step time (ms) at context L = {L}, eager, {n} steps: matrix products vs the rest")
    table(["shape", "batch", "sampler", "step", "matmul", "attention", "other ops", "host", "matmul share"], rows)


def step_samplers():
    """(name, config, new tokens) of the step section: the acceptance pair (SetDLM at 1 and at 4 tokens per
    step), BD3-LM at 1 and 4, AR, and MDLM on a short span (it re-runs the whole sequence every step)."""
    from model.sampling import SamplingConfig

    base = dict(stop_on_eos=False)
    S, B, A, M = (f.name for f in (families.SETDLM, families.BD3LM, families.AR, families.MDLM))
    return [("SetDLM w=4 thr=off", SamplingConfig(family=S, window=4, **base), None),
            ("SetDLM w=4 thr=0", SamplingConfig(family=S, window=4, threshold=0.0, **base), None),
            ("BD3-LM B=4", SamplingConfig(family=B, block_size=4, **base), None),
            ("BD3-LM B=4 thr=0", SamplingConfig(family=B, block_size=4, threshold=0.0, **base), None),
            ("AR", SamplingConfig(family=A, **base), None),
            ("MDLM (32 new)", SamplingConfig(family=M, **base), 32)]


def split_decode(model, prompt, cfg, n_new: int):
    """(decode seconds, forward seconds, steps, tokens) of one decode at batch 1: decode = the call's time less
    the prefill (admission); forward = the time inside the model's calls during the steps (the forward:
    embedding, cache write and mask, blocks, and the head, also where the decoder applies it to the
    active slots itself); everything else is the decoder's own work."""
    fwd = [0.0]
    depth = [0]
    inner_forward, inner_head = model.forward, model.output_logits

    def timed(fn):
        def call(*a, **k):
            if depth[0]:
                return fn(*a, **k)
            depth[0] += 1
            sync(DEVICE)
            t = CLOCK()
            try:
                return fn(*a, **k)
            finally:
                sync(DEVICE)
                fwd[0] += CLOCK() - t
                depth[0] -= 1
        return call

    model.forward, model.output_logits = timed(inner_forward), timed(inner_head)
    pre_fwd = [0.0]
    try:
        import dataclasses

        from model.sampling.api import decoder_class
        from model.sampling.engine import to_requests

        c = dataclasses.replace(cfg, max_new_tokens=n_new)
        reqs = to_requests([prompt], c, model.cfg.mask_id, model.cfg.vocab_size, None)
        dec = decoder_class(c.family)(model, reqs, c, mask_id=model.cfg.mask_id, eos_id=None)
        pre = [0.0]
        admit = dec.admit

        def timed_admit(*a):
            f0 = fwd[0]
            sync(DEVICE)
            t = CLOCK()
            admit(*a)
            sync(DEVICE)
            pre[0] += CLOCK() - t
            pre_fwd[0] += fwd[0] - f0

        dec.admit = timed_admit
        total, outs = _timed_run(dec)
    finally:
        del model.forward, model.output_logits  # back to the class's methods
    out = outs[0]
    return total - pre[0], fwd[0] - pre_fwd[0], out.steps, len(out.tokens)


def _timed_run(dec):
    sync(DEVICE)
    t = CLOCK()
    outs = dec.run()
    sync(DEVICE)
    return CLOCK() - t, outs


def step_section(args, results):
    """ms per decoding step split into the forward and the rest, fastest of --repeats decodes, the samplers
    interleaved (so slow phases of a shared machine hit them alike); the decode-multi-token-step ratio."""
    L, n_new, n_prompt = args.step_length, args.step_new, args.step_prompt
    model = build_model(args.step_shape, L, args.device, args.dtype, max_len=L)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB - 1, (n_prompt,), generator=g).tolist()
    cases = [c for c in step_samplers() if not args.step_samplers
             or any(k.strip().lower() in c[0].lower() for k in args.step_samplers.split(","))]
    for _, cfg, n in cases:  # warm-up: one-time costs (the head's transposed copy, allocator)
        split_decode(model, prompt, cfg, 8)
    best: dict[str, tuple] = {}
    for _ in range(args.repeats):
        for name, cfg, n in cases:
            dt, fw, steps, toks = split_decode(model, prompt, cfg, n or n_new)
            if name not in best or dt / steps < best[name][0] / best[name][2]:
                best[name] = (dt, fw, steps, toks)
    rows = []
    for name, cfg, n in cases:
        dt, fw, steps, toks = best[name]
        ms, f = dt / steps * 1e3, fw / steps * 1e3
        rows.append([name, n or n_new, f"{toks / steps:.2f}", steps, f"{ms:.2f}", f"{f:.2f}", f"{ms - f:.2f}",
                     f"{ms / f:.2f}x"])
        results.append(dict(section="step", shape=args.step_shape, L=L, prompt=n_prompt, new=n or n_new, sampler=name,
                            tokens_per_step=toks / steps, steps=steps, step_ms=ms, forward_ms=f, rest_ms=ms - f))
    sh = SHAPES[args.step_shape]
    print(f"### ms per decoding step: {args.step_shape} ({sh['n_layers']} x {sh['hidden']}), L = {L}, batch 1, "
          f"{n_prompt}-token prompt, fastest of {args.repeats} decodes (samplers interleaved); forward = the model's "
          f"calls (the floor of a step), rest = the decoder's own work")
    table(["sampler", "new tokens", "tokens/step", "steps", "ms/step", "forward", "rest", "step / forward"], rows)
    r = {x["sampler"]: x for x in results if x.get("section") == "step"}
    if "SetDLM w=4 thr=off" not in r or "SetDLM w=4 thr=0" not in r:
        return
    one, four = r["SetDLM w=4 thr=off"], r["SetDLM w=4 thr=0"]
    print(f"decode-multi-token-step: SetDLM ms/step at threshold 0 ({four['tokens_per_step']:.1f} tokens/step) / at "
          f"threshold off ({one['tokens_per_step']:.1f}) = {four['step_ms'] / one['step_ms']:.3f} (target <= 1.05); "
          f"forward alone {four['forward_ms'] / one['forward_ms']:.3f}, rest {four['rest_ms']:.2f} vs {one['rest_ms']:.2f} ms\n")
    sys.stdout.flush()


def answer_lengths(n: int, seed: int = 0) -> tuple[list[int], list[list[int]], str]:
    """(answer lengths, question token ids, source) for n examples: GSM8K train answers in GPT-2 tokens
    when ../shared/data/gsm8k/train.jsonl exists, else lengths from a log-normal fitted to them
    (median 110 tokens, sigma 0.45, clipped to [16, 400]) with random 60-token questions."""
    g = torch.Generator().manual_seed(seed)
    root = Path(__file__).resolve().parents[1]
    cands = [os.environ.get("SETDLM_GSM8K_TRAIN", "")] + [str(d / "shared" / "data" / "gsm8k" / "train.jsonl")
                                                          for d in (root.parent, root.parent.parent)]
    path = next((Path(c) for c in cands if c and Path(c).is_file()), None)
    if path is not None:
        from common.jsonl import read_jsonl
        from data_pipeline.tokenizers import load_tokenizer

        tok = load_tokenizer("gpt2")
        rows = read_jsonl(path)
        idx = torch.randperm(len(rows), generator=g)[:n].tolist()
        ex = [rows[i] for i in idx]
        return ([len(tok.encode(e["answer"])) for e in ex], [tok.encode(e["question"]) for e in ex],
                f"GSM8K train answers ({path})")
    z = torch.randn(n, generator=g, dtype=torch.float64)
    lens = (110 * torch.exp(0.45 * z)).round().clamp(16, 400).long().tolist()
    qs = [torch.randint(0, VOCAB - 1, (60,), generator=g).tolist() for _ in range(n)]
    return lens, qs, "synthetic log-normal (median 110, sigma 0.45)"


def forwards(steps: list[int], S: int) -> tuple[int, int]:
    """Decoding forwards (batch steps) of a job whose rows take `steps` each: shrinking batches of S
    (a chunk runs until its longest row is done) vs S continuously refilled slots (a row admitted at
    step t is done at t + steps; its slot takes the next prompt). On a GPU, where a step costs about the
    same for 1 or S rows, their ratio is the speedup continuous batching can give."""
    import heapq

    shrink = sum(max(steps[i:i + S]) for i in range(0, len(steps), S))
    slots = [0] * min(S, len(steps))
    for n in steps:
        heapq.heappush(slots, heapq.heappop(slots) + n)
    return shrink, max(slots)


def job(args, results):
    from model.sampling import Infill, generate

    lens, qs, source = answer_lengths(args.jobs)
    lens = [max(1, int(round(x * args.job_scale))) for x in lens]
    model = build_model(args.job_shape, 2048, args.device, args.dtype)
    prompts = [Infill(q, n, []) for q, n in zip(qs, lens)]
    S = args.slots
    rows = []
    for name, cfg in samplers(args.compile):
        if "thr=0" in name:
            continue
        generate(model, prompts[:S], cfg, max_new_tokens=2)
        t_cont, outs = timed(lambda: generate(model, prompts, cfg, max_batch=S))
        t_shrink, outs2 = timed(lambda: [o for i in range(0, len(prompts), S) for o in generate(model, prompts[i:i + S], cfg)])
        assert [o.tokens for o in outs] == [o.tokens for o in outs2]  # same tokens either way (greedy)
        n = len(prompts)
        f_shrink, f_cont = forwards([o.steps for o in outs], S)
        rows.append([name, f"{n / t_shrink:.2f}", f"{n / t_cont:.2f}", f"{t_shrink / t_cont:.2f}x",
                     f_shrink, f_cont, f"{f_shrink / f_cont:.2f}x"])
        results.append(dict(section="job", sampler=name, slots=S, examples=n, shrinking_examples_per_s=n / t_shrink,
                            continuous_examples_per_s=n / t_cont, forwards_shrinking=f_shrink, forwards_continuous=f_cont))
    print(f"### GSM8K-like job: {len(prompts)} prompts, {S} slots, {args.job_shape} shape; answer lengths from "
          f"{source}, x{args.job_scale} (mean {sum(lens) / len(lens):.0f}, max {max(lens)} tokens)")
    table(["sampler", "shrinking batches ex/s", "continuous batching ex/s", "speedup", "forwards shrinking",
           "forwards continuous", "forwards ratio"], rows)


def main(argv=None) -> int:
    global CLOCK, DEVICE
    args = parse(argv)
    torch.set_num_threads(args.threads)
    cpu_clock = args.clock == "cpu" or (args.clock == "auto" and args.device == "cpu" and args.threads == 1)
    CLOCK = time.process_time if cpu_clock else time.perf_counter
    DEVICE = args.device
    dev_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or platform.machine()
    print(f"# bench_sampling {datetime.datetime.now().isoformat(timespec='seconds')} | {platform.node()} | "
          f"{args.device} ({dev_name}), torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} cores, "
          f"{'process CPU' if cpu_clock else 'wall'} clock, load average {os.getloadavg()[0]:.1f}, {args.dtype}, "
          f"compile={args.compile}\n")
    results: list[dict] = []
    with torch.inference_mode():
        for sec in args.sections.split(","):
            {"scaling": scaling, "cache": cache_vs_recompute, "profile": profile, "job": job,
             "step": step_section}[sec](args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


DEVICE = "cpu"

if __name__ == "__main__":
    sys.exit(main())
