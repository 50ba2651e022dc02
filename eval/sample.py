"""`setdlm sample`: decode text from a trained checkpoint.

    setdlm sample --checkpoint RUN_OR_CKPT --prompt "The for statement" [--max-new-tokens 64]
    setdlm sample --checkpoint RUN --prompt "Once upon a time" --infill 12 --suffix " The end."
    setdlm sample --checkpoint RUN --prompts-file in.jsonl --out out.jsonl [--batch-size 16]

The sampler family and its defaults (window w = D, block size) come from the checkpoint's recipe;
the decoding flags override them (`setdlm sample --describe` lists every option with its type, range
and default). Input JSONL lines hold {"prompt": TEXT} (plain) or
{"prompt": PREFIX, "suffix": TEXT, "infill_length": N} (infilling), plus any other fields (an "id",
a reference answer...), which are copied to the output line together with the generated "text",
"tokens", "steps", "tokens_per_step", "seconds", "stopped_early", "stop_reason", "masks_dropped".
An existing --out file is resumed: its complete lines are kept and the remaining prompts appended.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Literal

from common.cli import ArgumentParser, run_command
from common.errors import InputFileError, StorageError
from common.io import AppendFile, atomic_write_text
from common.jsonl import read_jsonl
from common.options import add_flags, describe_options, from_namespace
from common.schema import Field, PathText, TextList, like
from common.storage import check_output_file

from .errors import OptionError
from .options import DecodingOptions, eval_options, infill_window, sampling_config


@eval_options("setdlm sample")
class PromptOptions:
    """Where the prompts come from and where the outputs go."""

    option_group = "prompts and output"

    checkpoint: PathText = Field(description="run directory (newest checkpoint), RUN:best / RUN:STEP, or a checkpoint directory")
    prompt: TextList | None = Field(None, description="prompt text (repeatable); the prefix when infilling")
    infill: int | None = Field(None, ge=0, json_schema_extra={"metavar": "N"}, description=(
        "fill N masked tokens between --prompt and --suffix instead of continuing the prompt"))
    suffix: str = Field("", description="text after the masked span (with --infill)")
    prompts_file: PathText | None = Field(None, description="JSONL with one prompt per line (the format: setdlm sample --help)")
    out: PathText | None = Field(None, description="JSONL to write outputs to (resumed if it exists)")
    batch_size: int = Field(16, ge=1, description="prompts decoded together")
    json: bool = Field(False, description="print one JSON object per output instead of text")
    trace: PathText | None = Field(None, json_schema_extra={"metavar": "OUT.html"}, description=(
        "also write a page showing how each output was decoded (docs/sampling.md)"))


@eval_options("setdlm sample")
class SampleOptions(DecodingOptions, PromptOptions):
    """`setdlm sample`'s options: prompts, the sampler (unset: from the checkpoint's recipe), the model."""

    option_group = "stopping and model"

    max_new_tokens: int = like(DecodingOptions, "max_new_tokens", 64)
    window: int | None = like(DecodingOptions, "window", description=(
        "SW-SetDLM window w (default: D; S_max when infilling)"))
    seed: int | None = Field(None, description="seeds the sampler (temperature > 0)")
    stop: TextList = Field((), description="stop string (repeatable)")
    stop_regex: str | None = Field(None, description="stop at the end of the first match of this regular expression")
    ignore_eos: bool = Field(False, description="do not stop at EOS")
    no_ema: bool = Field(False, description="use the raw weights instead of the EMA")
    device: str | None = Field(None, description="cpu, cuda, cuda:1 ... (default: cuda if available)")
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="weights' dtype for decoding")

    def __post_init__(self):
        if not self.prompt and not self.prompts_file:
            raise OptionError("--prompt / --prompts-file: give --prompt TEXT or --prompts-file FILE.jsonl")
        if self.prompt and self.prompts_file:
            raise OptionError("--prompt and --prompts-file are exclusive")
        if self.suffix and self.infill is None:
            raise OptionError("--suffix needs --infill N (the number of tokens to fill)")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="setdlm sample", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--describe", action="store_true", help="print every option (type, valid values, default) and exit")
    add_flags(p, SampleOptions)
    return p


def _prompt_row(row: dict) -> str | None:
    """What is wrong with a --prompts-file row (None: nothing)."""
    if not isinstance(row.get("prompt", None), str):
        return 'each line must be an object with a "prompt" string'
    if "infill_length" in row and (not isinstance(row["infill_length"], int) or row["infill_length"] < 0):
        return '"infill_length" must be a non-negative integer'
    return None


def done_lines(path: Path) -> int:
    """Complete JSON lines already in an output file (a torn last line is dropped). A file that is not
    an earlier output (a complete line that is not a JSON object) is refused, never truncated."""
    if not path.is_file():
        return 0
    good, keep = 0, []
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        lines = [""]  # refused just below
    for i, line in enumerate(lines, 1):
        if not line.endswith("\n") and i == len(lines):
            break  # cut short by a kill: dropped and decoded again
        try:
            ok = isinstance(json.loads(line), dict)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise OptionError(f"--out {path}: line {i} is not a JSON object, so the file is not an earlier output of "
                              "setdlm sample (which --out resumes); choose another file")
        keep.append(line)
        good += 1
    text = "".join(keep)
    if text != path.read_text(encoding="utf-8"):
        atomic_write_text(path, text)
    return good


def prompt_rows(opts: SampleOptions) -> list[dict]:
    if opts.prompts_file:
        return read_jsonl(opts.prompts_file, "--prompts-file", check=_prompt_row, error=InputFileError)
    infill = {"suffix": opts.suffix, "infill_length": opts.infill} if opts.infill is not None else {}
    return [{"prompt": t} | infill for t in opts.prompt]


def load_checkpoint(opts: SampleOptions):
    """(model, tokenizer, recipe) of --checkpoint on --device in --dtype."""
    import torch

    from pretrain.checkpoint.inference import load_model

    from pretrain.checkpoint.rundir import split_selector

    ckpt = Path(opts.checkpoint)
    if not split_selector(ckpt)[0].exists():  # RUN:best and the other selectors name a run that exists
        raise InputFileError(f"--checkpoint {ckpt}: no such directory")
    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, recipe = load_model(ckpt, ema=not opts.no_ema, device=device)
    model = model.to(dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[opts.dtype])
    return model, tokenizer, recipe


def decoding(opts: SampleOptions, objective, infill: bool):
    """The SamplingConfig: the options that are set, else the recipe's (w = D; S_max when infilling)."""
    window = infill_window(objective) if infill else None
    return sampling_config(objective, opts, window=window, seed=opts.seed, stop=list(opts.stop),
                           stop_regex=opts.stop_regex, stop_on_eos=not opts.ignore_eos)


def _main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    if ns.describe:
        print(describe_options(SampleOptions, "setdlm sample options"))
        return 0
    opts = from_namespace(SampleOptions, ns)
    if opts.out:
        check_output_file(opts.out, "--out")  # a directory, a read-only mount: refused before the model loads
        done_lines(Path(opts.out))  # an existing file that is not an earlier output: refused now too
    if opts.trace:
        check_output_file(opts.trace, "--trace")
    rows = prompt_rows(opts)
    model, tokenizer, recipe = load_checkpoint(opts)
    cfg = decoding(opts, recipe.objective, infill=any("infill_length" in r for r in rows))
    return run(model, tokenizer, cfg, rows, opts)


def main(argv: list[str] | None = None) -> int:
    """`setdlm sample`: a mistake is one line `setdlm sample: error: ...`, exit status 2 (common/cli.py)."""
    return run_command("setdlm sample", _main, list(sys.argv[1:] if argv is None else argv))


def run(model, tokenizer, cfg, rows: list[dict], args) -> int:
    from model.sampling import Infill, generate

    out_path = Path(args.out) if args.out else None
    start = 0
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        start = done_lines(out_path)
        if start:
            print(f"setdlm sample: {out_path} has {start} outputs; resuming", file=sys.stderr)
    fresh = out_path is not None and not out_path.exists()
    sink = AppendFile(out_path) if out_path is not None else None  # whole lines; a full disk says so
    trace = [] if args.trace else None  # rows of the --trace page (eval/trace.py)
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
            lines = []
            for r, o in zip(batch, outs):
                line = {**r, **o.to_dict()}
                lines.append(json.dumps(line, ensure_ascii=False) + "\n")
                if args.json:
                    print(json.dumps(line, ensure_ascii=False))
                elif sink is None:
                    mid = f"[{o.text}]" if "infill_length" in r else o.text
                    print(f"{r['prompt']}{mid}{r.get('suffix', '')}")
                    print(f"-- {o.steps} steps, {o.tokens_per_step:.2f} tokens/step, {len(o.tokens)} tokens, "
                          f"{o.seconds:.2f} s, stop: {o.stop_reason}", file=sys.stderr)
            if sink is not None:
                sink.append("".join(lines))
    except StorageError:
        if fresh and out_path.stat().st_size == 0:  # a full disk before the first line: no empty file left
            out_path.unlink()
        raise
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
