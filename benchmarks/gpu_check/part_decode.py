"""The decode part: tokens/s, forwards/s and tokens/step of every sampler, eager and compiled, in the
order that matters most first, so that the part's time limit trims the least useful rows."""

from __future__ import annotations

import time

from .rows import CUT, Deadline, emit

def samplers() -> dict:
    """Row name -> SamplingConfig fields (imported when the part runs: after the install part)."""
    from model.families import AR, BD3LM, SETDLM

    return {
        "SetDLM w=4 thr=off": dict(family=SETDLM.name, window=4),
        "AR": dict(family=AR.name),
        "SetDLM w=4 thr=0.9": dict(family=SETDLM.name, window=4, threshold=0.9),
        "SetDLM w=4 thr=0": dict(family=SETDLM.name, window=4, threshold=0.0),
        "BD3-LM B=4": dict(family=BD3LM.name, block_size=4),
    }


def _decode_plan(smoke: bool) -> list[tuple[str, bool, str]]:
    """(sampler, compiled, "many" | "one") in the order they run: compiled batch-16 SetDLM and AR first
    (the numbers the GPU check is for), then batch 1, then eager (the compile's gain), then the other
    samplers. Each compiled row pays its compilation in a warm-up run outside the timing."""
    head = [("SetDLM w=4 thr=off", True, "many"), ("AR", True, "many"),
            ("SetDLM w=4 thr=off", True, "one"), ("AR", True, "one"),
            ("SetDLM w=4 thr=off", False, "many"), ("AR", False, "many"),
            ("SetDLM w=4 thr=off", False, "one"), ("AR", False, "one")]
    if smoke:
        return head
    rest = [(name, compiled, size) for name in ("SetDLM w=4 thr=0.9", "SetDLM w=4 thr=0", "BD3-LM B=4")
            for compiled in (True, False) for size in ("many", "one")]
    return head + rest


def part_decode(args) -> int:
    deadline = Deadline.of(args)  # counted from the process's start: these imports spend from it
    import torch

    from model.config import ModelConfig, apply_preset
    from model.sampling import SamplingConfig, generate
    from model.transformer import Transformer

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    torch.manual_seed(0)
    if args.smoke:
        shape = dict(n_layers=1, hidden=64, n_heads=4, ffn_hidden=128, vocab_size=512, mask_id=511)
        prompt_len, new, batch = 8, 8, 4
    else:
        shape = {**apply_preset({"preset": "paper-12x768"}), "vocab_size": 50258, "mask_id": 50257}
        prompt_len, new, batch = 64, 128, 16
    shape.update(dropout=0.0, max_seq_len=2 * (prompt_len * 3 // 2 + new), init_std=0.5)
    shape.pop("preset", None)
    model = Transformer(ModelConfig(**shape)).eval().to(dev)
    if cuda:
        model = model.to(torch.bfloat16)
    V = shape["vocab_size"] - 1
    g = torch.Generator().manual_seed(1)
    one = [torch.randint(0, V, (prompt_len,), generator=g).tolist()]
    lens = torch.randint(prompt_len // 2, prompt_len * 3 // 2 + 1, (batch,), generator=g).tolist()
    many = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    print(f"decode: {shape['n_layers']} x {shape['hidden']}, vocab {shape['vocab_size']}, "
          f"{'bf16' if cuda else 'fp32'} on {dev}, prompt {prompt_len} (batch {batch}: {min(lens)}-{max(lens)}), "
          f"{new} new tokens; {deadline.left():.0f}s left", flush=True)

    def timed(prompts, cfg):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = generate(model, prompts, cfg)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, outs

    failures = 0
    cost = {False: 3.0 if args.smoke else 10.0, True: 10.0 if args.smoke else 30.0}  # a row's seconds, as seen so far
    for name, compiled, size in _decode_plan(args.smoke):
        prompts = many if size == "many" else one
        row = {"sampler": name, "mode": "compiled" if compiled else "eager", "batch": len(prompts)}
        if deadline.left() < cost[compiled]:
            emit({**row, CUT: True, "note": f"not run: {deadline.left():.0f}s left, a row takes about {cost[compiled]:.0f}s"})
            continue
        cfg = SamplingConfig(max_new_tokens=new, stop_on_eos=False, compile=compiled, **samplers()[name])
        t_row = time.perf_counter()
        try:
            warm, _ = timed(prompts, cfg)  # compile / first-shape costs stay out of the numbers
            best, outs = min((timed(prompts, cfg) for _ in range(2 if size == "one" else 1)), key=lambda r: r[0])
            toks = sum(len(o.tokens) for o in outs)
            steps = sum(o.steps for o in outs)
            forwards = max(o.steps for o in outs)
            row.update(tokens_per_s=round(toks / best, 1), forwards_per_s=round(forwards / best, 1),
                       tokens_per_step=round(toks / max(steps, 1), 2), seconds=round(best, 3),
                       warmup_s=round(warm, 2), tokens=toks)
        except Exception as e:  # noqa: BLE001
            row["note"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
            failures += 1
            import traceback

            traceback.print_exc()
        cost[compiled] = max(cost[compiled], 1.2 * (time.perf_counter() - t_row))
        emit(row)
    return 1 if failures else 0
