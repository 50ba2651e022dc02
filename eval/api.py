"""The Python API of `setdlm eval`: every task is a function with typed options returning its metrics.

    from eval import api
    m = api.likelihood(checkpoint="runs/x", out="results/x-ppl", orders=8)      # -> metrics dict
    m = api.gsm8k(checkpoint="runs/x", out="results/x-gsm8k", data="gsm8k.jsonl", threshold=0.9)
    opts = api.options("infill", checkpoint="runs/x", out="o", data="cloze.csv", preset="paper")
    res = api.run("infill", opts)                                             # metrics + run stats

The options of a task are its typed options class (`api.options_class(task)`, e.g.
`eval.tasks.gsm8k.GSM8KOptions`; eval/options.py): frozen, one field per flag of `setdlm eval TASK`
(the flag's name with `_` for `-`) with its type, range, default and description. A value of the
wrong type or range, outside its choices, or a missing required option raises `OptionError` (an
`EvalError`) naming the flag, before anything is loaded or written. The command line is generated
from the same class and parses its argv into exactly this object, so the API and the CLI give the
same metrics.
"""

from __future__ import annotations

import dataclasses

from common.cli import ArgumentParser
from common.options import add_flags, describe_options, from_namespace

from .errors import EvalError
from .execute import execute
from .tasks import get_task

__all__ = ["options", "options_class", "task_parser", "describe", "from_argv", "run", "likelihood", "gsm8k", "infill",
           "summarize", "uncond", "throughput"]


def options_class(task: str) -> type:
    """The typed options class of `task` (unknown task: EvalError listing the valid ones)."""
    return get_task(task).options


def options(task: str, **values):
    """Typed options of `task`; unknown names raise EvalError listing the valid ones."""
    cls = options_class(task)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise EvalError(f"{task}: unknown option {unknown[0]!r}; valid: {', '.join(names)}")
    return cls(**values)


def task_parser(task: str) -> ArgumentParser:
    """`setdlm eval TASK`'s parser: one flag per option (common/options.py) and --describe."""
    cls = get_task(task)
    p = ArgumentParser(prog=f"setdlm eval {task}", description=(cls.__doc__ or cls.help).strip().split("\n")[0])
    p.add_argument("--describe", action="store_true", help="print every option (type, valid values, default) and exit")
    add_flags(p, cls.options)
    return p


def describe(task: str) -> str:
    """`setdlm eval TASK --describe`: every option of the task with its type, range and default."""
    return describe_options(options_class(task), f"setdlm eval {task} options")


def from_argv(task: str, argv: list[str]):
    """The CLI's parse: argv -> the same typed options `options()` builds."""
    return from_namespace(options_class(task), task_parser(task).parse_args(argv))


def run(task: str, opts=None, *, predictor=None, after_unit=None, **values) -> dict:
    """Run this process's share of `task` and merge when it should. Returns {"metrics": dict or
    None (not merged by this rank), "stats", "merged", "out"}. `predictor` replaces the checkpoint's
    sampler (scoring another system); `after_unit(unit, records)` runs after each unit is written."""
    if opts is None:
        opts = options(task, **values)
    elif values:
        opts = dataclasses.replace(opts, **values)
    if type(opts) is not options_class(task):
        raise EvalError(f"options of type {type(opts).__name__} given to task {task!r} "
                        f"(expected {options_class(task).__name__})")
    return execute(task, opts, predictor=predictor, after_unit=after_unit)


def _task_function(task: str):
    def fn(*, predictor=None, **values) -> dict | None:
        return run(task, predictor=predictor, **values)["metrics"]

    fn.__name__ = task
    fn.__doc__ = (f"`setdlm eval {task}` as a function: keyword options as in `options_class({task!r})`; "
                  f"returns the merged metrics (None on a rank that does not merge).")
    return fn


likelihood = _task_function("likelihood")
gsm8k = _task_function("gsm8k")
infill = _task_function("infill")
summarize = _task_function("summarize")
uncond = _task_function("uncond")
throughput = _task_function("throughput")
