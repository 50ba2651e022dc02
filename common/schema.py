"""Typed recipe sections: pydantic dataclasses whose errors are one line naming the field.

A recipe section is declared like this (model/config.py, data_pipeline/config.py, pretrain/config.py)::

    @section("train")
    class TrainConfig:
        max_steps: int = Field(1000, ge=1, description="optimizer steps to train for")
        lr_schedule: Literal["constant", "cosine"] = Field("constant", description="LR after warm-up")

Every field has a type, a range (``ge``/``gt``/``le``/``lt``) or a choice set (``Literal``) and a
one-line ``description`` (printed by ``setdlm pretrain --describe``). Validation is strict: an
``int`` field refuses ``2.5``, ``"3"`` and ``true``; a ``bool`` field takes only ``true``/``false``;
a ``float`` field takes integers too. ``Text`` is a string field that also takes a bare number
(``run.name: 12345``, a Slurm job id); ``PathText`` a string that also takes a ``pathlib.Path``;
``TextList`` a tuple of strings that also takes a list. Unknown keys, NaN and infinities are
refused. Assignments are validated too. Any error is a :class:`ConfigError` (a ``ValueError``)
whose message reads ``section.key: what is valid, got VALUE``.

The same machinery types the options of the command lines that are not recipes (``SamplingConfig``,
the options of ``setdlm sample`` and of every ``setdlm eval`` task; common/options.py makes their
flags): ``section(name, frozen=True, kw_only=True, flags=True, error=...)`` names a key by its flag
(``--max-new-tokens: ...``) and raises the given `Error` subclass. ``like(cls, key, ...)`` declares a
field with the type constraints and description of another section's field (a command-line default
of its own, one source of its range). Checks across fields go in ``__post_init__`` (it runs on
construction, not on assignment) or ``validate()``, with messages that start with the dotted key
(``sampling.window_max: ...``) or the flag.
"""

from __future__ import annotations

from .errors import Error

import dataclasses
import functools
import os
import types
from typing import Annotated, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as _pydantic_dataclass

__all__ = ["ConfigError", "Field", "Literal", "Text", "PathText", "TextList", "section", "like", "format_validation_error",
           "field_rows", "format_rows", "type_text", "check_keys", "flag_name"]

SECTION_CONFIG = ConfigDict(strict=True, extra="forbid", validate_assignment=True, allow_inf_nan=False)
FROZEN_CONFIG = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)  # frozen: nothing to assign


class ConfigError(Error):
    """An invalid recipe value. The message is one line that starts with the dotted field name."""


def _number_to_text(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


def _path_to_text(value):
    return os.fspath(value) if isinstance(value, os.PathLike) else value


# A free-form string that also takes a bare YAML number (a run name such as a Slurm job id).
Text = Annotated[str, BeforeValidator(_number_to_text)]
# A path: a string, or an os.PathLike (pathlib.Path) given through a Python API, stored as its string.
PathText = Annotated[str, BeforeValidator(_path_to_text)]
# Strings (a repeatable flag): a tuple or a list of strings, stored as a tuple (frozen options stay hashable).
TextList = Annotated[tuple[str, ...], BeforeValidator(lambda v: tuple(v) if isinstance(v, list) else v)]


def flag_name(key: str) -> str:
    """The command-line flag of an option field: `max_new_tokens` -> `--max-new-tokens`."""
    return "--" + key.replace("_", "-")


def section(name: str, *, frozen: bool = False, kw_only: bool = False, flags: bool = False, error: type = None):
    """Class decorator: a validated section called `name` (the prefix of its error messages).

    frozen: instances cannot be changed (`dataclasses.replace` makes a new, validated one);
    kw_only: keyword-only construction, so a subclass may add required fields after defaults;
    flags: keys are command-line flags, errors read `--key-name: expected ...`; error: the `Error`
    subclass raised (default ConfigError)."""
    error = error or ConfigError

    def wrap(cls):
        cls = _pydantic_dataclass(cls, config=FROZEN_CONFIG if frozen else SECTION_CONFIG, frozen=frozen,
                                  kw_only=kw_only)
        init, setattr_ = cls.__init__, cls.__setattr__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            try:
                init(self, *args, **kwargs)
            except ValidationError as e:
                raise error(format_validation_error(e, name, type(self), flags=flags)) from None

        @functools.wraps(setattr_)
        def __setattr__(self, key, value):
            try:
                setattr_(self, key, value)
            except ValidationError as e:
                raise error(format_validation_error(e, name, type(self), flags=flags)) from None

        cls.__init__, cls.__setattr__ = __init__, __setattr__
        cls.__recipe_section__ = name
        cls.__section_flags__ = flags
        return cls

    return wrap


_KEEP = object()


def like(cls, key: str, default=_KEEP, description: str | None = None):
    """A field with the constraints (range, length) and description of `cls.key`, and its own default
    (and description): one source for a value's range where a command line offers another default.
    Write the annotation at the use (it may differ: `int | None` where None means "from the checkpoint")."""
    fi = _field_info(cls, key)
    if fi is None:
        raise TypeError(f"like: {cls.__name__} has no field {key!r}")
    default = (fi.default if fi.default_factory is None else dataclasses.MISSING) if default is _KEEP else default
    kw = {"default_factory": fi.default_factory} if default is dataclasses.MISSING else {"default": default}
    extra = dict(fi.json_schema_extra) if isinstance(fi.json_schema_extra, dict) else {}
    if not getattr(cls, "__section_flags__", False):  # errors name the section key it mirrors too
        extra["same_as"] = f"{getattr(cls, '__recipe_section__', cls.__name__)}.{key}"
    new = Field(**kw, description=description if description is not None else fi.description,
                json_schema_extra=extra or None)
    new.metadata = list(fi.metadata)
    return new


# ----------------------------------------------------------------------------------------- errors
def _field_info(cls, key):
    return getattr(cls, "__pydantic_fields__", {}).get(key)


def _valid_keys(cls) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def check_keys(cls, prefix: str, values: dict) -> None:
    """Refuse keys that are not fields of `cls`, naming the first and listing the valid ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in values if k not in names]
    if unknown:
        raise ConfigError(f"{prefix}.{unknown[0]}: unknown key; valid keys: {_valid_keys(cls)}")


def _bound_text(fi) -> str:
    """'>= 1', 'in (0, 1]' ... from a field's constraints (empty when it has none)."""
    lo = hi = None
    for m in fi.metadata if fi is not None else ():
        if isinstance(m, at.Ge):
            lo = f"[{m.ge}"
        elif isinstance(m, at.Gt):
            lo = f"({m.gt}"
        elif isinstance(m, at.Le):
            hi = f"{m.le}]"
        elif isinstance(m, at.Lt):
            hi = f"{m.lt})"
        elif isinstance(m, at.MinLen) and m.min_length == 1:
            return "non-empty"
    if lo and hi:
        return f"in {lo}, {hi}"
    if lo:
        return (">= " if lo[0] == "[" else "> ") + lo[1:]
    if hi:
        return ("<= " if hi[-1] == "]" else "< ") + hi[:-1]
    return ""


def _message(err: dict, fi, flags: bool = False) -> str:
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    words = {
        "int_type": "must be an integer", "int_from_float": "must be an integer",
        "int_parsing": "must be an integer", "float_type": "must be a number", "float_parsing": "must be a number",
        "bool_type": "must be true or false", "bool_parsing": "must be true or false",
        "string_type": "must be a string", "finite_number": "must be a finite number",
        "none_required": "must be null", "list_type": "must be a list", "tuple_type": "must be a list",
    }
    if kind in words:
        msg = words[kind]
        bound = _bound_text(fi)
        if bound and kind.startswith(("int", "float")):
            msg += f" {bound}"
        if fi is not None and _nullable(fi.annotation) and not flags:
            msg += " (or null)"
        if flags:  # `--orders: expected an integer >= 1, got '2'`
            msg = msg.replace("must be ", "expected ", 1)
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        bound = _bound_text(fi) or {"greater_than_equal": f">= {ctx.get('ge')}", "greater_than": f"> {ctx.get('gt')}",
                                    "less_than_equal": f"<= {ctx.get('le')}", "less_than": f"< {ctx.get('lt')}"}[kind]
        msg = f"must be {bound}"
    elif kind == "literal_error":
        choices = _literal_choices(fi.annotation) if fi is not None else None
        msg = f"must be one of {', '.join(map(str, choices)) if choices else ctx.get('expected')}"
    elif kind == "string_too_short":
        msg = "must not be empty"
    elif kind == "string_pattern_mismatch":
        msg = (fi.description if fi is not None and fi.description else "has an invalid form")
        msg = f"invalid value ({msg})"
    else:
        msg = err["msg"][:1].lower() + err["msg"][1:]
    return f"{msg}, got {got!r}"


def _literal_choices(annotation):
    for a in (annotation, *get_args(annotation)):
        a = _unwrap(a)
        if get_origin(a) is Literal:
            return get_args(a)
    return None


def _nullable(annotation) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


def _key_name(prefix: str, loc: list[str], cls, flags: bool) -> str:
    """How an error names a key: `prefix.key`; with flags `--key` (and the section field it mirrors)."""
    if not flags:
        return ".".join([prefix, *loc]) if prefix else ".".join(loc)
    if not loc:
        return prefix
    fi = _field_info(cls, loc[0])
    same = (fi.json_schema_extra or {}).get("same_as") if fi is not None and isinstance(fi.json_schema_extra, dict) else None
    return flag_name(loc[0]) + (f" ({same})" if same else "")


def _missing(err: dict) -> bool:
    return err["type"] in ("missing_argument", "missing")


def format_validation_error(error: ValidationError, prefix: str, cls, *, flags: bool = False) -> str:
    """One line: `prefix.key: what is valid, got VALUE` (flags: `--key: ...`), plus the other wrong keys.
    A wrong value is named before a missing one (flags: `--window 2.5` is the news, not `--out`)."""
    errors = sorted(error.errors(), key=_missing) if flags else error.errors()
    first = errors[0]
    loc = [str(p) for p in first["loc"] if not isinstance(p, int)]
    key = loc[0] if loc else ""
    name = _key_name(prefix, loc, cls, flags)
    if first["type"] in ("unexpected_keyword_argument", "unexpected_positional_argument"):
        text = f"{name}: unknown key; valid keys: {_valid_keys(cls)}"
    elif _missing(first):
        fi = _field_info(cls, key)
        text = f"{name}: required" + (f" ({fi.description})" if flags and fi is not None and fi.description else "")
    elif first["type"] == "value_error":  # a validator's own message; it names its field
        text = str((first.get("ctx") or {}).get("error", first["msg"]))
        if not text.startswith(f"{prefix}.") and not (flags and text.startswith("--")):
            text = f"{name}: {text}"
    else:
        text = f"{name}: {_message(first, _field_info(cls, key), flags)}"
    names = {_key_name(prefix, [str(p) for p in e["loc"] if not isinstance(p, int)], cls, flags) for e in errors[1:]}
    others = sorted(names - {name})
    if others:
        text += f" (also invalid: {', '.join(others)})"
    return text


# --------------------------------------------------------------------------------------- describe
def _unwrap(annotation):
    if get_origin(annotation) is Annotated:
        return get_args(annotation)[0]
    return annotation


def type_text(fi) -> str:
    """A field's type and valid values in a few words: 'int >= 1', 'constant | cosine', 'float or null'."""
    ann = fi.annotation
    nullable = _nullable(ann)
    if nullable:
        rest = [a for a in get_args(ann) if a is not type(None)]
        ann = rest[0] if len(rest) == 1 else Union[tuple(rest)]
    ann = _unwrap(ann)
    if get_origin(ann) is Literal:
        text = " | ".join(str(v) for v in get_args(ann))
    elif get_origin(ann) in (list, tuple):  # list[int], tuple[str, ...], list[Literal[...]]
        item = _unwrap(get_args(ann)[0]) if get_args(ann) else str
        if get_origin(item) is Literal:
            text = "list of " + " | ".join(str(v) for v in get_args(item))
        else:
            text = f"list of {getattr(item, '__name__', str(item))}"
    elif hasattr(ann, "__recipe_section__"):  # a nested section: its keys are listed as key.sub
        text = "mapping"
    else:
        text = getattr(ann, "__name__", str(ann))
        bound = _bound_text(fi)
        if bound:
            text += f" {bound}" if bound != "non-empty" else " (non-empty)"
    return text + (" or null" if nullable else "")


def _default_text(fi) -> str:
    if fi.default_factory is not None:  # a nested section, or an empty list
        return "(section)" if dataclasses.is_dataclass(fi.default_factory) else repr(fi.default_factory())
    d = fi.default
    if d is None:
        return "null"
    if isinstance(d, bool):
        return "true" if d else "false"
    if isinstance(d, str):
        return repr(d) if d == "" or d.strip() != d or not d.isprintable() else d
    return str(d)


def field_rows(cls, prefix: str | None) -> list[tuple[str, str, str, str]]:
    """(dotted key, type and valid values, default, description) for every field of a section;
    prefix None: the key is the field's flag (`--max-new-tokens`)."""
    rows = []
    for f in dataclasses.fields(cls):
        fi = _field_info(cls, f.name)
        key = flag_name(f.name) if prefix is None else f"{prefix}.{f.name}"
        default = "required" if fi.is_required() else _default_text(fi)
        rows.append((key, type_text(fi), default, fi.description or ""))
    return rows


def format_rows(title: str, rows: list[tuple[str, str, str, str]]) -> list[str]:
    """`title:` and one aligned line per row (key, type and valid values, default, description)."""
    w_key = max(len(r[0]) for r in rows)
    w_type = min(max(len(r[1]) for r in rows), 24)
    w_def = min(max(len(r[2]) for r in rows), 12)
    return [f"{title}:", *(f"  {k:<{w_key}}  {typ:<{w_type}}  {default:<{w_def}}  {desc}".rstrip()
                           for k, typ, default, desc in rows)]


def annotation_is_text(cls, key: str) -> bool:
    """True when `cls.key` is a free-form string (so a command-line value is taken verbatim)."""
    fi = _field_info(cls, key)
    if fi is None:
        return False
    ann = fi.annotation
    if _nullable(ann):
        rest = [a for a in get_args(ann) if a is not type(None)]
        ann = rest[0] if len(rest) == 1 else None
    return _unwrap(ann) is str


def annotation_is_nullable(cls, key: str) -> bool:
    fi = _field_info(cls, key)
    return fi is not None and _nullable(fi.annotation)

