"""The decode engine's waste, before and after a change, in one run: each measurement runs in a fresh
worker process per code version (`--baseline DIR`, a checkout of the code before; this checkout after),
alternating before/after round by round, and the table gives the median over rounds.

    .venv/bin/python benchmarks/bench_engine.py --baseline /tmp/base [--quickstart runs/quickstart]
        [--items compile,profile,adaptive] [--rounds 3] [--json out.json]

Items (batch 1, one torch thread, process CPU time: robust to other processes on a shared machine):
- compile: per-step time of the eager and the compiled step (`compile: true`, torch.compile/inductor)
  for SetDLM w = 4, BD3-LM B = 4 and AR on the `tiny` shape (4 x 256, GPT-2 vocabulary + MASK,
  random weights), prompt 240 tokens + 32 new; compiled / eager speed.
- profile: a step's time against the head matmul and the transformer body of the same step. step =
  decode CPU time per step (prefill excluded); body = CPU time inside the transformer blocks during
  the steps (forward hooks); head = the output head in place (`output_logits`: the final norm, the
  matrix product over the 50k vocabulary, the logit bias; the product is all but a few percent); plus top-level aten calls per step inside and outside the
  blocks (torch.profiler). SetDLM w = 4 (threshold off and 0), adaptive w = 4..8 at threshold 0.5,
  BD3-LM B = 4, AR; tiny shape, prompt 240 + 32 new.
- adaptive (needs `--quickstart RUN`, the quickstart model, D = 4): tokens/step, ms/step and tokens/s
  of greedy decoding of 16 prompts (the first 12 tokens of 16 of Python's pydoc topics, 48 new tokens)
  with fixed windows 2, 4, 8 and the adaptive window (w = 4, bounds 1..8) at thresholds 0.5 and 0.9,
  and the share of tokens equal to one-token-per-step decoding; and the most tokens one step
  committed with window = S_max = 8 (the infill default), adaptive, threshold 0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
VOCAB = 50258
CLK = time.thread_time


# -- worker side (imports the code version under test) ------------------------------------------
def tiny_model():
    import torch
    from model.config import ModelConfig
    from model.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(ModelConfig(n_layers=4, hidden=256, n_heads=4, ffn_hidden=1024, vocab_size=VOCAB, mask_id=VOCAB - 1,
                                   dropout=0.0, max_seq_len=2048, init_std=0.5)).eval()


def decode(model, prompts, cfg, hooks=None, patch=None):
    """(per-step ms, outputs, decoder) of one generate-like call, prefill (admission) time excluded."""
    from model.sampling.api import decoder_class
    from model.sampling.engine import to_requests

    reqs = to_requests(prompts, cfg, model.cfg.mask_id, model.cfg.vocab_size, None)
    dec = decoder_class(cfg.family)(model, reqs, cfg, mask_id=model.cfg.mask_id, eos_id=None)
    pre, admit = [0.0], dec.admit

    def timed_admit(*a):
        t = CLK()
        if hooks:
            hooks["on"] = False
        admit(*a)
        if hooks:
            hooks["on"] = True
        pre[0] += CLK() - t

    dec.admit = timed_admit
    if patch:
        patch(dec)
    t = CLK()
    outs = dec.run()
    steps = max(o.steps for o in outs)
    return (CLK() - t - pre[0]) / steps * 1e3, outs, dec


def random_prompt(n=240):
    import torch

    return [torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(1)).tolist()]


# family names as strings: the workers import older code versions too, from before model/families
TINY = {"SetDLM w=4": dict(family="setdlm", window=4), "SetDLM w=4 thr=0": dict(family="setdlm", window=4, threshold=0.0),
        "SetDLM adaptive w=4..8 thr=0.5": dict(family="setdlm", window=4, adaptive_window=True, window_max=8, threshold=0.5),
        "BD3-LM B=4": dict(family="bd3lm", block_size=4), "AR": dict(family="ar")}


def item_compile(args):
    from model.sampling import SamplingConfig

    model, out = tiny_model(), {}
    for name in ("SetDLM w=4", "BD3-LM B=4", "AR"):
        row = {}
        for mode in (False, True):
            cfg = SamplingConfig(**TINY[name], max_new_tokens=32, stop_on_eos=False, compile=mode)
            decode(model, random_prompt(), cfg)  # warm-up (compiles)
            row["compiled" if mode else "eager"] = min(decode(model, random_prompt(), cfg)[0] for _ in range(2))
        out[name] = row
    return out


def item_profile(args):
    from model.sampling import SamplingConfig

    model, out = tiny_model(), {}
    for name, kw in TINY.items():
        cfg = SamplingConfig(**kw, max_new_tokens=32, stop_on_eos=False)
        hooks = {"on": True, "body": 0.0, "head": 0.0}
        blocks = list(model.layers.values())

        def pre(mod, a):
            hooks["t0"] = CLK()

        def post(mod, a, r):
            if hooks["on"]:
                hooks["body"] += CLK() - hooks["t0"]

        handles = [blocks[0].register_forward_pre_hook(pre), blocks[-1].register_forward_hook(post)]
        head = model.output_logits

        def timed_head(h):
            t = CLK()
            out = head(h)
            if hooks["on"]:
                hooks["head"] += CLK() - t
            return out

        model.output_logits = timed_head
        decode(model, random_prompt(), cfg)
        hooks.update(body=0.0, head=0.0)
        step, outs, _ = decode(model, random_prompt(), cfg, hooks)
        steps = max(o.steps for o in outs)
        model.output_logits = head
        for h in handles:
            h.remove()
        ops = count_ops(model, cfg, steps)
        out[name] = dict(step=step, head=hooks["head"] / steps * 1e3, body=hooks["body"] / steps * 1e3, **ops)
    return out


def count_ops(model, cfg, steps):
    """Top-level aten calls per step (prefill excluded): inside the transformer blocks, and the rest."""
    from torch.profiler import ProfilerActivity, profile, record_function

    def scoped(name, fn):
        def run(*a, **k):
            with record_function(name):
                return fn(*a, **k)
        return run

    blocks = list(model.layers.values())
    for b in blocks:
        b.forward = scoped("BLOCK", b.forward)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode(model, random_prompt(), cfg, patch=lambda dec: setattr(dec, "admit", scoped("ADMIT", dec.admit)))
    for b in blocks:
        del b.forward
    counts = {"BLOCK": 0, None: 0}
    for e in prof.events():
        if not e.name.startswith("aten::") or (e.cpu_parent and e.cpu_parent.name.startswith("aten::")):
            continue
        p, scope = e.cpu_parent, None
        while p is not None and scope != "ADMIT":
            scope = p.name if p.name in ("BLOCK", "ADMIT") else scope
            p = p.cpu_parent
        if scope != "ADMIT":
            counts[scope] += 1
    return dict(ops_body=counts["BLOCK"] / steps, ops_other=counts[None] / steps)


def item_adaptive(args):
    import torch
    from pydoc_data.topics import topics

    from model.sampling import SamplingConfig, generate
    from pretrain.checkpoint.inference import load_model

    model, tok, cfg = load_model(args.quickstart)
    names = sorted(topics)[:16]
    prompts = [tok.encode(topics[k].strip()[:80])[:12] for k in names]
    one = generate(model, prompts, SamplingConfig.from_objective(cfg.objective, window=4, max_new_tokens=48, stop_on_eos=False))
    out = {}
    for thr in (0.5, 0.9):
        for label, kw in (("fixed w=2", dict(window=2)), ("fixed w=4", dict(window=4)), ("fixed w=8", dict(window=8)),
                          ("adaptive w=4 (1..8)", dict(window=4, adaptive_window=True))):
            c = SamplingConfig.from_objective(cfg.objective, threshold=thr, max_new_tokens=48, stop_on_eos=False, **kw)
            generate(model, prompts[:1], c, max_new_tokens=4)
            t = CLK()
            outs = generate(model, prompts, c)
            dt = CLK() - t
            n, s = sum(len(o.tokens) for o in outs), sum(o.steps for o in outs)
            same = sum(a == b for o, r in zip(outs, one) for a, b in zip(o.tokens, r.tokens))
            out[f"thr={thr} {label}"] = dict(tokens_per_step=n / s, ms_per_step=dt / s * 1e3, tokens_per_s=n / dt,
                                             same=same / n)
    c = SamplingConfig.from_objective(cfg.objective, window=8, threshold=0.0, adaptive_window=True, max_new_tokens=48,
                                      stop_on_eos=False)
    outs = generate(model, prompts, c)
    out["cap"] = dict(max_per_step=max(int(torch.bincount(torch.tensor(o.commit_step)).max()) for o in outs),
                      window_max=c.max_window, D=int(cfg.objective.set_size))
    return out


def worker(args) -> int:
    import torch

    sys.path.insert(0, str(Path(args.code).resolve()))
    torch.set_num_threads(1)
    with torch.inference_mode():
        res = {"compile": item_compile, "profile": item_profile, "adaptive": item_adaptive}[args.worker](args)
    print("RESULT " + json.dumps(res))
    return 0


# -- driver ----------------------------------------------------------------------------------------
def run_worker(item, code, args):
    cmd = [sys.executable, str(HERE), "--worker", item, "--code", str(code)]
    if args.quickstart:
        cmd += ["--quickstart", str(args.quickstart)]
    env = {**os.environ, "PYTHONPATH": str(code)}
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(code))
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"worker {item} ({code}) failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def median_of(rounds):
    """Median over rounds of each leaf value of the nested result dicts."""
    first = rounds[0]
    if isinstance(first, dict):
        return {k: median_of([r[k] for r in rounds]) for k in first}
    return statistics.median(rounds) if isinstance(first, (int, float)) else first


def table(head, rows):
    sys.path.insert(0, str(HERE.parent))
    from bench_sampling import table as markdown

    markdown(head, rows)


def report(item, before, after):
    if item == "compile":
        rows = [[n, f"{before[n]['eager']:.2f}", f"{before[n]['compiled']:.2f}", f"{before[n]['eager'] / before[n]['compiled']:.2f}x",
                 f"{after[n]['eager']:.2f}", f"{after[n]['compiled']:.2f}", f"{after[n]['eager'] / after[n]['compiled']:.2f}x"]
                for n in before]
        print("### compiled vs eager step (ms per step; speed = eager / compiled)")
        table(["sampler", "before eager", "before compiled", "before speed", "after eager", "after compiled", "after speed"], rows)
    elif item == "profile":
        rows = []
        for n in before:
            for tag, r in (("before", before[n]), ("after", after[n])):
                rows.append([n, tag, f"{r['step']:.2f}", f"{r['head']:.2f}", f"{r['body']:.2f}",
                             f"{r['step'] - r['head'] - r['body']:.2f}", f"{r['step'] / (r['head'] + r['body']):.2f}x",
                             f"{r['ops_other']:.0f}", f"{r['ops_body']:.0f}"])
        print("### batch-1 step vs head + body (ms per step; head: output_logits in place, all but a few percent the "
              "vocabulary matmul; ops: top-level aten calls per step)")
        table(["sampler", "code", "step", "head", "body", "rest", "step / (head + body)", "ops outside body",
               "ops in body"], rows)
    elif item == "adaptive":
        rows = [[k, f"{before[k]['tokens_per_step']:.2f}", f"{after[k]['tokens_per_step']:.2f}", f"{before[k]['ms_per_step']:.2f}",
                 f"{after[k]['ms_per_step']:.2f}", f"{before[k]['tokens_per_s']:.0f}", f"{after[k]['tokens_per_s']:.0f}",
                 f"{after[k]['same']:.2f}"] for k in before if k != "cap"]
        print("### quickstart model: fixed windows vs the adaptive window (greedy, 16 prompts x 48 tokens; same = share "
              "of tokens equal to one-token-per-step decoding)")
        table(["setting", "tokens/step before", "after", "ms/step before", "after", "tokens/s before", "after", "same (after)"], rows)
        b, a = before["cap"], after["cap"]
        print(f"window = S_max = 8, adaptive, threshold 0 (D = {a['D']}): window_max {b['window_max']} -> "
              f"{a['window_max']}; most tokens committed in one step {b['max_per_step']} -> {a['max_per_step']}\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", help="a checkout of the code before (e.g. `git archive BASE | tar -x -C DIR`)")
    p.add_argument("--quickstart", help="the quickstart run directory (item adaptive)")
    p.add_argument("--items", default="compile,profile,adaptive")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--code", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if not args.baseline:
        p.error("--baseline DIR is required (a checkout of the code before)")
    here = HERE.parent.parent
    print(f"# bench_engine {datetime.datetime.now().isoformat(timespec='seconds')} | {platform.node()} | "
          f"{platform.machine()} ({os.cpu_count()} cores), one torch thread, process CPU time, load average "
          f"{os.getloadavg()[0]:.1f} | before: {args.baseline} | after: {here}\n")
    results = {}
    for item in args.items.split(","):
        if item == "adaptive" and not args.quickstart:
            print("(adaptive: skipped, no --quickstart run)\n")
            continue
        runs = {"before": [], "after": []}
        for _ in range(args.rounds):
            for tag, code in (("before", args.baseline), ("after", here)):
                runs[tag].append(run_worker(item, code, args))
        results[item] = {tag: median_of(r) for tag, r in runs.items()}
        report(item, results[item]["before"], results[item]["after"])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
