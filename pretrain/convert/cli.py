"""`setdlm convert`: training checkpoints to and from Hugging Face exports, the importer for the
reference implementation's checkpoints, and consolidation (docs/convert.md).

    setdlm convert to-hf --checkpoint RUN_OR_CKPT --out DIR [--ema/--no-ema] [--dtype fp32|bf16]
                         [--max-shard-size 5GB] [--results FILE ...] [--overwrite]
                         [--format auto|stock|setdlm] [--adapter-only | --base-only]
    setdlm convert from-hf --model DIR --out RUN_DIR [--overwrite] [section.key=value ...]
    setdlm convert from-reference --model PATH_OR_HUB_ID --out RUN_DIR [--base-model DIR_OR_ID] [--family F]
                         [--set-size D] [--seq-len L] [--n-heads N] [--tokenizer T] [--ema/--no-ema] [--sigma 0]
                         [section.key=value ...]
    setdlm convert consolidate ...      (sharded TP/PP/ZeRO-3 checkpoints; pretrain/checkpoint/consolidate.py)
"""

from __future__ import annotations

import argparse
import sys

from common.cli import ArgumentParser as CLIParser
from common.storage import check_output_dir

from model import families
from model.convert.hf_stock_export import FORMATS

__all__ = ["build_parser", "main"]


def _bool_flag(p, name: str, default: bool, help_: str) -> None:
    p.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction, default=default,
                   help=help_)


def build_parser() -> argparse.ArgumentParser:
    parser = CLIParser(prog="setdlm convert", description="Checkpoint conversion (docs/convert.md).")
    sub = parser.add_subparsers(dest="command", metavar="{to-hf,from-hf,from-reference,consolidate}")
    p = sub.add_parser("to-hf", help="export a training checkpoint as a Hugging Face model directory")
    p.add_argument("--checkpoint", required=True, help="run directory (newest checkpoint), RUN:best / RUN:STEP, its checkpoints/ folder, or one checkpoint")
    p.add_argument("--out", required=True, help="output directory")
    _bool_flag(p, "ema", True, "export the EMA weights when the checkpoint has them (default) or the raw weights")
    p.add_argument("--format", default="auto", choices=FORMATS, dest="fmt",
                   help="auto (default): a stock Qwen3/Llama/Mistral architecture for an AR model of that shape, else "
                        "setdlm's modeling code; stock: require the stock architecture; setdlm: always setdlm's code")
    lo = p.add_mutually_exclusive_group()
    lo.add_argument("--adapter-only", action="store_true",
                    help="a LoRA run: write only its adapters, as a PEFT adapter (adapter_config.json, "
                         "adapter_model.safetensors) for the --base-only export")
    lo.add_argument("--base-only", action="store_true",
                    help="a LoRA run: write the frozen base model, without the adapters (default: merged into it)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp16"), help="weights dtype (default fp32)")
    p.add_argument("--max-shard-size", default="5GB", help="split model.safetensors above this size (default 5GB)")
    p.add_argument("--results", nargs="*", default=[], help="metrics JSON files to list in the model card")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p = sub.add_parser("from-hf", help="turn an export back into a training run directory")
    p.add_argument("--model", required=True, help="directory written by `setdlm convert to-hf`")
    p.add_argument("--out", required=True, help="run directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("overrides", nargs="*", help="section.key=value recipe overrides (e.g. data.source=DIR train.lr=1e-4)")
    p = sub.add_parser("from-reference", help="import a checkpoint of the reference implementation (a release with a "
                                              "Qwen3 backbone, or a DiT checkpoint)")
    p.add_argument("--model", required=True, help="HF-style directory (config.json + weights), a hub id in the local "
                                                  "Hugging Face cache, or a .ckpt/.pt/.bin file")
    p.add_argument("--out", required=True, help="run directory to create")
    p.add_argument("--family", choices=families.names(), help="objective (default: from config.json)")
    p.add_argument("--set-size", type=int, help="SetDLM D (S_max = 2D), or the BD3-LM block size")
    p.add_argument("--seq-len", type=int, help="training sequence length L (default: config.json, else 1024)")
    p.add_argument("--n-heads", type=int, help="attention heads (default: config.json or the rotary buffer)")
    p.add_argument("--tokenizer", help="default: the release's own tokenizer files, else gpt2 (MASK appended as 50257); "
                                      "bert-base-uncased, or a directory")
    p.add_argument("--base-model", help="a release with a pretrained backbone: the base model (a directory with its "
                                        "config.json, or a hub id in the local Hugging Face cache) whose shapes it has "
                                        "(default: the one its config.json names)")
    _bool_flag(p, "ema", True, "use the EMA weights of a Lightning checkpoint when present")
    p.add_argument("--sigma", type=float, default=0.0, help="noise level at which adaLN time conditioning is folded")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("overrides", nargs="*", help="section.key=value recipe overrides")
    sub.add_parser("consolidate", help="consolidate a sharded (TP/PP/ZeRO-3) checkpoint", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    """`setdlm convert` (errors are reported by common.cli.run_command)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "consolidate":
        from ..checkpoint.consolidate import main as consolidate_main

        return consolidate_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    check_output_dir(args.out, "--out")  # a file, a read-only mount: refused before any checkpoint is read
    if args.command == "to-hf":
        from .export import export_checkpoint

        export_checkpoint(args.checkpoint, args.out, ema=args.ema, dtype=args.dtype, max_shard_size=args.max_shard_size,
                          results=args.results, overwrite=args.overwrite, fmt=args.fmt,
                          lora="adapter" if args.adapter_only else "base" if args.base_only else "merge")
    elif args.command == "from-hf":
        from .from_hf import import_hf

        import_hf(args.model, args.out, overrides=args.overrides, overwrite=args.overwrite)
    else:
        from .from_reference import import_reference

        import_reference(args.model, args.out, family=args.family, set_size=args.set_size, seq_len=args.seq_len,
                         n_heads=args.n_heads, tokenizer=args.tokenizer, base_model=args.base_model, ema=args.ema,
                         sigma=args.sigma, overrides=args.overrides, overwrite=args.overwrite)
    return 0
