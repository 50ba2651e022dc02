"""`setdlm sample`: decode text from a trained checkpoint.

    setdlm sample --checkpoint RUN_OR_CKPT --prompt "The for statement" [--max-new-tokens 64]
    setdlm sample --checkpoint RUN --prompt "Once upon a time" --infill 12 --suffix " The end."
    setdlm sample --checkpoint RUN --prompts-file in.jsonl --out out.jsonl [--batch-size 16]

The sampler family and its defaults (window w = D, block size) come from the checkpoint's recipe;
every SamplingConfig field can be overridden. Input JSONL lines hold {"prompt": TEXT} (plain) or
{"prompt": PREFIX, "suffix": TEXT, "infill_length": N} (infilling), plus any other fields (an "id",
a reference answer...), which are copied to the output line together with the generated "text",
"tokens", "steps", "tokens_per_step", "seconds", "stopped_early", "stop_reason", "masks_dropped".
An existing --out file is resumed: its complete lines are kept and the remaining prompts appended.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from common.cli import ArgumentParser as CLIParser


def build_parser() -> argparse.ArgumentParser:
    p = CLIParser(prog="setdlm sample", description="Decode from a checkpoint.")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    src = p.add_argument_group("prompts")
    src.add_argument("--prompt", action="append", default=None, help="prompt text (repeatable); the prefix when infilling")
    src.add_argument("--infill", type=int, default=None, metavar="N",
                     help="fill N masked tokens between --prompt and --suffix instead of continuing the prompt")
    src.add_argument("--suffix", default="", help="text after the masked span (with --infill)")
    src.add_argument("--prompts-file", help="JSONL with one prompt per line (see the module help)")
    src.add_argument("--out", help="JSONL to write outputs to (resumed if it exists)")
    src.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default 16)")
    s = p.add_argument_group("sampling (defaults from the checkpoint's recipe)")
    s.add_argument("--family", choices=["setdlm", "bd3lm", "mdlm", "ar"], help="sampler (default: the objective)")
    s.add_argument("--max-new-tokens", type=int, default=64)
    s.add_argument("--window", type=int, help="SetDLM window w (default D; S_max when infilling)")
    s.add_argument("--threshold", type=float, help="confidence threshold for extra tokens per step")
    s.add_argument("--block-size", type=int, help="BD3-LM block size (default: the recipe's)")
    s.add_argument("--steps-per-block", type=int, help="BD3-LM steps per block (default: block size)")
    s.add_argument("--steps", type=int, help="MDLM steps (default: one token per step)")
    s.add_argument("--remasking", choices=["confidence", "random"], default="confidence")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--stop-regex", help="stop at the end of the first match of this regular expression")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    m = p.add_argument_group("model")
    m.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA")
    m.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    m.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p.add_argument("--json", action="store_true", help="print one JSON object per output instead of text")
    p.add_argument("--trace", metavar="OUT.html", help="also write a page showing how each output was decoded (docs/sampling.md)")
    return p


def read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt", None), str):
                raise ValueError(f'{path}:{n}: each line must be an object with a "prompt" string')
            if "infill_length" in row and (not isinstance(row["infill_length"], int) or row["infill_length"] < 0):
                raise ValueError(f'{path}:{n}: "infill_length" must be a non-negative integer')
            rows.append(row)
    return rows


def done_lines(path: Path) -> int:
    """Complete JSON lines already in an output file (a torn last line is dropped)."""
    if not path.is_file():
        return 0
    good, keep = 0, []
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            json.loads(line)
        except json.JSONDecodeError:
            break
        keep.append(line)
        good += 1
    text = "".join(keep)
    if text != path.read_text(encoding="utf-8"):
        path.write_text(text, encoding="utf-8")
    return good


def sampling_config(args, recipe, infill: bool):
    from model.sampling import SamplingConfig

    obj = recipe.objective
    cfg = SamplingConfig.from_objective(obj)
    if infill and args.window is None and cfg.family == "setdlm":  # the paper uses w = S_max for infilling
        cfg.window = int(obj.s_max) if getattr(obj, "s_max", None) else 2 * int(obj.set_size)
    fields = dict(family=args.family, max_new_tokens=args.max_new_tokens, window=args.window, threshold=args.threshold,
                  block_size=args.block_size, steps_per_block=args.steps_per_block, steps=args.steps,
                  remasking=args.remasking, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                  repetition_penalty=args.repetition_penalty, seed=args.seed, stop=list(args.stop),
                  stop_regex=args.stop_regex, stop_on_eos=not args.ignore_eos)
    cfg = dataclasses.replace(cfg, **{k: v for k, v in fields.items() if v is not None})
    cfg.validate()
    return cfg


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    err = lambda msg: (print(f"setdlm sample: error: {msg}", file=sys.stderr), 2)[1]  # noqa: E731
    if not args.prompt and not args.prompts_file:
        return err("give --prompt TEXT or --prompts-file FILE.jsonl")
    if args.prompt and args.prompts_file:
        return err("--prompt and --prompts-file are exclusive")
    if args.infill is not None and args.infill < 0:
        return err(f"--infill: span length must be >= 0, got {args.infill}")
    if args.suffix and args.infill is None:
        return err("--suffix needs --infill N (the number of tokens to fill)")
    if args.batch_size < 1:
        return err(f"--batch-size must be >= 1, got {args.batch_size}")
    try:
        if args.prompts_file:
            rows = read_jsonl(args.prompts_file)
        else:
            rows = [{"prompt": t} | ({"suffix": args.suffix, "infill_length": args.infill} if args.infill is not None else {})
                    for t in args.prompt]
    except (OSError, ValueError) as e:
        return err(str(e))
    ckpt = Path(args.checkpoint)
    if not ckpt.exists():
        return err(f"--checkpoint {ckpt}: no such directory")

    import torch

    from pretrain.checkpoint import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model, tokenizer, recipe = load_model(ckpt, ema=not args.no_ema, device=device)
    except (OSError, ValueError) as e:  # CheckpointError: refused, damaged or incomplete checkpoint files
        if os.environ.get("SETDLM_DEBUG"):
            raise
        return err(str(e))
    model = model.to(dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype])
    infill = any("infill_length" in r for r in rows)
    try:
        cfg = sampling_config(args, recipe, infill)
    except ValueError as e:
        return err(str(e))
    return run(model, tokenizer, cfg, rows, args)


def run(model, tokenizer, cfg, rows: list[dict], args) -> int:
    from model.sampling import Infill, generate

    out_path = Path(args.out) if args.out else None
    start = 0
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        start = done_lines(out_path)
        if start:
            print(f"setdlm sample: {out_path} has {start} outputs; resuming", file=sys.stderr)
    sink = open(out_path, "a", encoding="utf-8") if out_path is not None else None
    trace = [] if getattr(args, "trace", None) else None  # rows of the --trace page (eval/trace.py)
    try:
        for i in range(start, len(rows), args.batch_size):
            batch = rows[i : i + args.batch_size]
            prompts = []
            for r in batch:
                ids = tokenizer.encode(r["prompt"])
                if "infill_length" in r:
                    prompts.append(Infill(ids, int(r["infill_length"]), tokenizer.encode(r.get("suffix", ""))))
                else:
                    prompts.append(ids)
            events = []
            outs = generate(model, prompts, cfg, tokenizer=tokenizer, on_step=events.append if trace is not None else None)
            if trace is not None:
                from .trace import sample_rows

                trace += sample_rows(batch, outs, events, tokenizer)
            for r, o in zip(batch, outs):
                line = {**r, **o.to_dict()}
                if sink is not None:
                    sink.write(json.dumps(line, ensure_ascii=False) + "\n")
                if args.json:
                    print(json.dumps(line, ensure_ascii=False))
                elif sink is None:
                    mid = f"[{o.text}]" if "infill_length" in r else o.text
                    print(f"{r['prompt']}{mid}{r.get('suffix', '')}")
                    print(f"-- {o.steps} steps, {o.tokens_per_step:.2f} tokens/step, {len(o.tokens)} tokens, "
                          f"{o.seconds:.2f} s, stop: {o.stop_reason}", file=sys.stderr)
            if sink is not None:
                sink.flush()
                os.fsync(sink.fileno())
    finally:
        if sink is not None:
            sink.close()
    if out_path is not None:
        print(f"setdlm sample: wrote {len(rows) - start} outputs to {out_path}", file=sys.stderr)
    if trace is not None:
        from .trace import write_sample

        print(f"setdlm sample: wrote the decoding trace to {write_sample(args.trace, args.checkpoint, cfg, trace)}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
