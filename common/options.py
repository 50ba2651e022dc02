"""Command-line options as typed sections: the flags, `--help` and `--describe` come from the class.

    @options("setdlm sample")
    class SampleOptions:
        checkpoint: PathText = Field(description="run directory or checkpoint directory")
        batch_size: int = Field(16, ge=1, description="prompts decoded together")
        prompt: tuple[str, ...] | None = Field(None, description="prompt text (repeatable)")

    parser = ArgumentParser(prog="setdlm sample")
    add_flags(parser, SampleOptions)
    opts = from_namespace(SampleOptions, parser.parse_args(argv))

An options class is a frozen, keyword-only section (common/schema.py) whose field `x_y` is the flag
`--x-y`: a `bool` field is a switch (default false), a `tuple[str, ...]` field a repeatable flag, an
`int`/`float` field takes the text as a number (so `--window 2.5` reaches the section, which refuses
it naming the flag), a `Literal` one of its values, a string the text verbatim. argparse requires
nothing and applies no default: a flag not given keeps the field's default, and the section reports
a missing required option, so `--describe` and `--help` work alone. Errors read
`--flag: what is valid, got VALUE` and are the `error` class given to `options` (an `Error`).
The fields of a class are grouped in `--help` and `--describe` by the class that declares them
(its `option_group`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Literal, get_args, get_origin

from .schema import _field_info, _literal_choices, _nullable, _unwrap, field_rows, flag_name, format_rows, section

__all__ = ["options", "add_flags", "from_namespace", "describe_options"]


def options(name: str, *, error: type | None = None):
    """Class decorator: a frozen, keyword-only section of command-line options (errors name flags)."""
    return section(name, frozen=True, kw_only=True, flags=True, error=error)


def _base_type(fi):
    ann = fi.annotation
    if _nullable(ann):
        rest = [a for a in get_args(ann) if a is not type(None)]
        ann = rest[0] if len(rest) == 1 else None
    return _unwrap(ann)


def _repeatable(fi) -> bool:
    t = _base_type(fi)
    return get_origin(t) in (tuple, list)


def _number(text: str):
    """A flag's text as a number when it reads as one (the section checks the type and range)."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _group(cls, key: str) -> str:
    """The `option_group` of the first class (base first) that declares `key`."""
    for c in reversed(cls.__mro__):
        if key in vars(c).get("__annotations__", {}):
            return getattr(c, "option_group", None) or "options"
    return "options"


def _help(row) -> str:
    _, typ, default, desc = row
    if typ == "switch":
        return desc.replace("%", "%%")
    shown = "" if default in ("-", "()") else f"; default {default}"
    return f"{desc} [{typ}{shown}]".replace("%", "%%")


def add_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per field of `cls`, in argparse groups by declaring class."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f, row in zip(dataclasses.fields(cls), option_rows(cls)):
        fi = _field_info(cls, f.name)
        title = _group(cls, f.name)
        g = groups.get(title) or groups.setdefault(title, parser.add_argument_group(title))
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=_help(row))
        extra = fi.json_schema_extra if isinstance(fi.json_schema_extra, dict) else {}
        if "metavar" in extra:
            kw["metavar"] = extra["metavar"]
        t = _base_type(fi)
        if t is bool:
            if fi.default is not False:
                raise TypeError(f"{cls.__name__}.{f.name}: a switch must default to false")
            kw["action"] = "store_true"
        elif _repeatable(fi):
            kw["action"] = "append"
        elif t in (int, float):
            kw["type"] = _number
        elif get_origin(t) is Literal:
            kw.setdefault("metavar", "{" + ",".join(map(str, _literal_choices(fi.annotation))) + "}")
        g.add_argument(flag_name(f.name), **kw)


def from_namespace(cls, ns: argparse.Namespace):
    """The options `cls` from parsed flags (repeatable flags as tuples; other attributes ignored)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(ns).items() if k in names}
    return cls(**values)


def option_rows(cls) -> list[tuple[str, str, str, str]]:
    """(flag, type and valid values, default, description) per field; an unset default reads `-`."""
    rows = []
    for flag, typ, default, desc in field_rows(cls, None):
        typ = "switch" if typ == "bool" else typ.removesuffix(" or null")
        if typ.startswith("list of "):
            typ = typ.removeprefix("list of ") + ", repeatable"
        rows.append((flag, typ, "-" if default in ("null", "()") else default, desc))
    return rows


def describe_options(cls, title: str) -> str:
    """`setdlm ... --describe`: every option with its type, range and default, grouped as in --help."""
    by_group: dict[str, list] = {}
    for f, row in zip(dataclasses.fields(cls), option_rows(cls)):
        by_group.setdefault(_group(cls, f.name), []).append(row)
    lines = [f"{title} (flag, type and valid values, default, description; '-': not set):"]
    for group, rows in by_group.items():
        lines += ["", *format_rows(group, rows)]
    return "\n".join(lines)
