"""The Python API of `setdlm eval`: every task is a function with typed options returning its metrics.

    from eval import api
    m = api.likelihood(checkpoint="runs/x", out="results/x-ppl", orders=8)      # -> metrics dict
    m = api.gsm8k(checkpoint="runs/x", out="results/x-gsm8k", data="gsm8k.jsonl", threshold=0.9)
    opts = api.options("infill", checkpoint="runs/x", out="o", data="cloze.csv", preset="paper")
    res = api.run("infill", opts)                                             # metrics + run stats

The options of a task are a frozen dataclass (`api.options_class(task)`) with one field per
command-line option of `setdlm eval TASK` (the flag's name with `_` for `-`), its type, default and
help; a value of the wrong type, outside its choices or a missing required option raises `EvalError`
naming the option, before anything is loaded or written. The CLI parses its argv into exactly this
object and calls `run`, so the API and the CLI give the same metrics.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from functools import lru_cache

from .runner import EvalError

_NO_DEFAULT_SEED = ("likelihood",)  # likelihood's default seed is the recipe's run.seed (None here)


@lru_cache(maxsize=None)
def _parser(task: str) -> argparse.ArgumentParser:
    from .cli import task_parser

    return task_parser(task)


def _field_type(action: argparse.Action):
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return bool
    if isinstance(action, argparse._AppendAction):
        return tuple
    return action.type or str


@lru_cache(maxsize=None)
def options_class(task: str) -> type:
    """The frozen options dataclass of `task` (one typed field per CLI option)."""
    fields, types = [], {}
    for a in _parser(task)._actions:
        if a.dest == "help" or isinstance(a, argparse._HelpAction):
            continue
        t = _field_type(a)
        types[a.dest] = t
        default = a.default if not isinstance(a, argparse._AppendAction) else tuple(a.default or ())
        meta = {"help": a.help or "", "flag": a.option_strings[0] if a.option_strings else a.dest,
                "required": bool(a.required), "choices": tuple(a.choices) if a.choices else None}
        fields.append((a.dest, typing.Optional[t], dataclasses.field(default=default, metadata=meta)))
    name = "".join(p.capitalize() for p in task.split("_")) + "Options"
    cls = dataclasses.make_dataclass(name, fields, frozen=True, namespace={"__post_init__": _check, "task": task,
                                                                           "_types": types})
    cls.__doc__ = f"Options of `setdlm eval {task}` (frozen; see `setdlm eval {task} --help`)."
    return cls


def _check(self) -> None:
    """Coerce what is unambiguous (ints for floats, paths for strings, lists for tuples) and refuse the rest."""
    for f in dataclasses.fields(self):
        v, t, meta = getattr(self, f.name), self._types[f.name], f.metadata
        flag = meta["flag"]
        if v is None:
            if meta["required"]:
                raise EvalError(f"{flag}: required ({meta['help']})")
            continue
        if t is bool:
            if not isinstance(v, bool):
                raise EvalError(f"{flag}: expected true/false, got {v!r}")
        elif t is tuple:
            if isinstance(v, str) or not isinstance(v, (list, tuple)):
                raise EvalError(f"{flag}: expected a list of strings, got {v!r}")
            v = tuple(str(x) for x in v)
        elif t is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise EvalError(f"{flag}: expected a number, got {v!r}")
            v = float(v)
        elif t is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise EvalError(f"{flag}: expected an integer, got {v!r}")
        elif t is str:
            if hasattr(v, "__fspath__"):
                v = str(v)
            if not isinstance(v, str):
                raise EvalError(f"{flag}: expected a string, got {v!r}")
        if meta["choices"] and v not in meta["choices"]:
            raise EvalError(f"{flag}: {v!r} is not one of {', '.join(map(str, meta['choices']))}")
        object.__setattr__(self, f.name, v)


def options(task: str, **values):
    """Typed options of `task`; unknown names raise EvalError listing the valid ones."""
    from .tasks import get_task

    get_task(task)  # unknown task -> EvalError
    cls = options_class(task)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise EvalError(f"{task}: unknown option {unknown[0]!r}; valid: {', '.join(names)}")
    if values.get("seed") is None and task not in _NO_DEFAULT_SEED:
        values["seed"] = 0
    return cls(**values)


def from_argv(task: str, argv: list[str]):
    """The CLI's parse: argv -> the same typed options `options()` builds."""
    ns = _parser(task).parse_args(argv)
    return options(task, **vars(ns))


def run(task: str, opts=None, *, predictor=None, after_unit=None, **values) -> dict:
    """Run this process's share of `task` and merge when it should. Returns {"metrics": dict or
    None (not merged by this rank), "stats", "merged", "out"}. `predictor` replaces the checkpoint's
    sampler (scoring another system); `after_unit(unit, records)` runs after each unit is written."""
    from .cli import execute

    if opts is None:
        opts = options(task, **values)
    elif values:
        opts = dataclasses.replace(opts, **values)
    if getattr(opts, "task", task) != task:
        raise EvalError(f"options of {opts.task!r} given to task {task!r}")
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

__all__ = ["options", "options_class", "from_argv", "run", "likelihood", "gsm8k", "infill", "summarize", "uncond",
           "throughput"]
