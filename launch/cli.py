"""The `setdlm` command line.

    setdlm pretrain --config FILE [--out DIR] [--name NAME] [section.key=value ...]
    setdlm pretrain --describe [SECTION]     every recipe key: type, valid values, default, description
    setdlm sample   --checkpoint RUN_OR_CKPT --prompt TEXT ...
    setdlm serve    --checkpoint RUN [--host 127.0.0.1] [--port 8000] [--max-batch 8] [--api-key KEY]
    setdlm data     prepare ...
    setdlm eval     TASK --checkpoint ...
    setdlm convert  to-hf | from-hf | consolidate ...
    setdlm launch   local -n N -- COMMAND ...

Subcommands other than `pretrain` live next to the code they drive and are imported on demand, so
`setdlm --help` stays fast and a missing optional dependency only affects its own command. Every
subcommand runs under common/cli.py: a configuration, data, checkpoint or command-line mistake is one
line (`setdlm CMD: error: ...`, exit status 2) and `SETDLM_DEBUG=1` shows the traceback.
"""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, function taking argv, one-line help)
SUBCOMMANDS = {
    "sample": ("eval.sample", "main", "decode from a checkpoint (SetDLM, BD3-LM, MDLM, AR samplers)"),
    "serve": ("serve.cli", "main", "OpenAI-compatible HTTP server for a checkpoint (continuous batching, streaming)"),
    "data": ("launch.cli", "data_main", "prepare and inspect tokenized webdataset shards"),
    "eval": ("eval.cli", "main", "likelihood and sampling benchmarks from checkpoints"),
    "convert": ("pretrain.convert.cli", "main", "checkpoint conversion (Hugging Face, reference checkpoints, consolidation)"),
    "launch": ("launch.runner", "main", "start a command on N local processes"),
}


def pretrain_main(argv: list[str]) -> int:
    from common.cli import ArgumentParser

    parser = ArgumentParser(prog="setdlm pretrain", description="Train a model from a YAML recipe.")
    parser.add_argument("--config", help="recipe YAML (see configs/); required unless --describe/--schema")
    parser.add_argument("--out", help="directory for run directories (overrides run.out_dir)")
    parser.add_argument("--name", help="run name (overrides run.name); the run directory is OUT/NAME")
    parser.add_argument("--dry-run", action="store_true", help="validate the recipe and layout, print the plan, do not train")
    parser.add_argument("--world-size", type=int, default=None, help="with --dry-run: the number of GPUs to plan for")
    parser.add_argument("--hardware", choices=("h100", "h200"), default=None,
                        help="with --dry-run: the GPU whose rates time the step (default h100; SETDLM_ variables "
                             "override each rate, pretrain/hardware.py)")
    parser.add_argument("--compare-layouts", action="store_true",
                        help="with --dry-run: also rank the recipe's other layouts by predicted step time")
    parser.add_argument("--describe", nargs="?", const="", metavar="SECTION",
                        help="print every recipe key (type, valid values, default, description) and exit")
    parser.add_argument("--schema", action="store_true", help="print the recipe's JSON schema and exit")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=10 (anywhere on the line)")
    args = parser.parse_args(argv)

    if args.describe is not None or args.schema:
        from pretrain.describe import describe, json_schema

        print(json_schema() if args.schema else describe(args.describe or None))
        return 0
    if not args.config:
        parser.error("the following arguments are required: --config")
    if args.world_size is not None and not args.dry_run:
        parser.error("--world-size: only with --dry-run (a run takes its world size from the launcher: torchrun, "
                     "srun, mpirun or setdlm launch local -n N)")
    for flag, given in (("--hardware", args.hardware is not None), ("--compare-layouts", args.compare_layouts)):
        if given and not args.dry_run:
            parser.error(f"{flag}: only with --dry-run (it sets what the plan is computed for)")
    if not args.dry_run:
        from pretrain.preemption import active_handler

        active_handler()  # SIGTERM/SIGUSR1/Ctrl-C from here on save at the first step after set-up

    from common.env import detect_env
    from pretrain.config import load_config

    overrides = list(args.overrides)
    if args.out:
        overrides.append(f"run.out_dir={args.out}")
    if args.name:
        overrides.append(f"run.name={args.name}")
    cfg = load_config(args.config, overrides)  # typed fields: wrong keys, types and ranges stop here
    if args.dry_run:
        from pretrain.init_from import prepare_for_plan
        from pretrain.plan import print_plan

        note = prepare_for_plan(cfg)  # train.init_from: the source's architecture and vocabulary when present
        if note:
            print(note, flush=True)
        from common.envvars import env_number
        from pretrain.plan import MAX_WORLD

        # --world-size, else the world the recipe is written for (parallel.world_size), else WORLD_SIZE or 1
        world = args.world_size if args.world_size is not None else cfg.parallel.world_size
        if world is None:
            world = env_number("WORLD_SIZE", 1, ge=1, le=MAX_WORLD, what="the world size to plan for; or --world-size")
        elif args.world_size is None:
            print(f"planned for parallel.world_size {world} (the recipe's; --world-size N plans another)", flush=True)
        print_plan(cfg, world_size=world, **({"hardware": args.hardware} if args.hardware else {}),
                   **({"compare": True} if args.compare_layouts else {}))
        return 0
    try:  # the layout checks, before any process group (MPI without a size variable: checked after init)
        world = detect_env(use_mpi4py=False).world_size
    except ValueError:
        world = None
    cfg.validate(world_size=world, need_vocab=False)

    from common.dist import init_process_group
    from common.rankguard import guard

    init_process_group(timeout_s=cfg.parallel.collective_timeout_s)
    from pretrain.trainer import Trainer

    # a failure of any rank: one line at every rank, every rank exits (docs/cluster.md)
    with guard("setdlm pretrain", heartbeat_timeout_s=cfg.parallel.heartbeat_timeout_s):
        Trainer(cfg).train()
    return 0


def data_main(argv: list[str]) -> int:
    """`setdlm data` (data_pipeline/cli.py); `data inspect RUN_OR_CHECKPOINT` prints the run's data record,
    read through the one reader of checkpoint metadata (pretrain/checkpoint/rundir.py)."""
    from data_pipeline import cli

    if argv[:1] == ["inspect"] and len(argv) > 1 and not argv[1].startswith("-"):
        from pretrain.checkpoint import rundir

        if rundir.names_run_or_checkpoint(argv[1]):
            ckpt = rundir.resolve_checkpoint(argv[1])
            return cli.print_run_record(argv[1], str(ckpt), rundir.read_meta(ckpt, require=("step",)))
    return cli.main(argv)


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
    from common.cli import debug_enabled, run_command  # one-line errors for every subcommand (SETDLM_DEBUG=1: tracebacks)

    if not debug_enabled():  # before torch loads: c10d's socket warnings print C++ stack dumps when a peer is gone
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

    if cmd == "pretrain":
        return run_command("setdlm pretrain", pretrain_main, rest)
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
    return run_command(_prog(cmd, rest), getattr(mod, func), rest)


def _prog(cmd: str, rest: list[str]) -> str:
    """`setdlm eval likelihood`, `setdlm convert to-hf`, ...: the name an error message starts with."""
    if rest and not rest[0].startswith("-") and "=" not in rest[0] and cmd in ("data", "eval", "convert", "launch"):
        return f"setdlm {cmd} {rest[0]}"
    return f"setdlm {cmd}"


if __name__ == "__main__":
    sys.exit(main())
