"""The `setdlm` command line.

    setdlm pretrain --config FILE [--out DIR] [section.key=value ...]
    setdlm sample   --checkpoint RUN_OR_CKPT --prompt TEXT ...
    setdlm data     prepare ...
    setdlm eval     TASK --checkpoint ...
    setdlm convert  to-hf | from-hf | consolidate ...
    setdlm launch   local -n N -- COMMAND ...

Subcommands other than `pretrain` live next to the code they drive and are imported on demand, so
`setdlm --help` stays fast and a missing optional dependency only affects its own command.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> (module, function taking argv, one-line help)
SUBCOMMANDS = {
    "sample": ("eval.sample", "main", "decode from a checkpoint (SetDLM, BD3-LM, MDLM, AR samplers)"),
    "data": ("data_pipeline.cli", "main", "prepare and inspect tokenized webdataset shards"),
    "eval": ("eval.cli", "main", "likelihood and sampling benchmarks from checkpoints"),
    "convert": ("pretrain.hf_convert", "main", "checkpoint conversion (Hugging Face, reference checkpoints, consolidation)"),
    "launch": ("launch.runner", "main", "start a command on N local processes"),
}


def pretrain_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="setdlm pretrain", description="Train a model from a YAML recipe.")
    parser.add_argument("--config", required=True, help="recipe YAML (see configs/)")
    parser.add_argument("--out", help="directory for run directories (overrides run.out_dir)")
    parser.add_argument("--name", help="run name (overrides run.name); the run directory is OUT/NAME")
    parser.add_argument("--dry-run", action="store_true", help="validate the recipe and layout, print the plan, do not train")
    parser.add_argument("--world-size", type=int, default=None, help="with --dry-run: the number of GPUs to plan for")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=10")
    args = parser.parse_args(argv)

    from pretrain.config import load_config

    overrides = list(args.overrides)
    if args.out:
        overrides.append(f"run.out_dir={args.out}")
    if args.name:
        overrides.append(f"run.name={args.name}")
    try:
        cfg = load_config(args.config, overrides)
    except ValueError as e:
        print(f"setdlm pretrain: error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        from pretrain.plan import print_plan

        try:
            print_plan(cfg, world_size=args.world_size or int(os.environ.get("WORLD_SIZE", "1")))
        except ValueError as e:
            print(f"setdlm pretrain: error: {e}", file=sys.stderr)
            return 2
        return 0

    from launch.env import init_distributed

    init_distributed()
    from pretrain.trainer import Trainer

    try:
        Trainer(cfg).train()
    except (ValueError, FileNotFoundError) as e:  # bad recipe, data, checkpoint or layout: no traceback
        if os.environ.get("SETDLM_DEBUG"):
            raise
        print(f"setdlm pretrain: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    names = ["pretrain", *SUBCOMMANDS]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\ncommands:\n  pretrain  train a model from a YAML recipe")
        for name, (_, _, help_) in SUBCOMMANDS.items():
            print(f"  {name:<9} {help_}")
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "pretrain":
        return pretrain_main(rest)
    if cmd not in SUBCOMMANDS:
        print(f"setdlm: unknown command {cmd!r}; valid: {', '.join(names)}", file=sys.stderr)
        return 2
    module, func, _ = SUBCOMMANDS[cmd]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name and module.startswith(e.name):
            print(f"setdlm {cmd}: not available in this version ({module} is missing)", file=sys.stderr)
            return 2
        raise
    return int(getattr(mod, func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
