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
(``run.name: 12345``, a Slurm job id). Unknown keys, NaN and infinities are refused. Assignments
are validated too. Any error is a :class:`ConfigError` (a ``ValueError``) whose message reads
``section.key: what is valid, got VALUE``.
"""

from __future__ import annotations

from .errors import Error

import dataclasses
import functools
import types
from typing import Annotated, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass as _pydantic_dataclass

__all__ = ["ConfigError", "Field", "Literal", "Text", "section", "format_validation_error", "field_rows",
           "type_text", "check_keys"]

SECTION_CONFIG = ConfigDict(strict=True, extra="forbid", validate_assignment=True, allow_inf_nan=False)


class ConfigError(Error):
    """An invalid recipe value. The message is one line that starts with the dotted field name."""


def _number_to_text(value):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return value


# A free-form string that also takes a bare YAML number (a run name such as a Slurm job id).
Text = Annotated[str, BeforeValidator(_number_to_text)]


def section(name: str):
    """Class decorator: a validated recipe section called `name` (the prefix of its error messages)."""

    def wrap(cls):
        cls = _pydantic_dataclass(cls, config=SECTION_CONFIG)
        init, setattr_ = cls.__init__, cls.__setattr__

        @functools.wraps(init)
        def __init__(self, *args, **kwargs):
            try:
                init(self, *args, **kwargs)
            except ValidationError as e:
                raise ConfigError(format_validation_error(e, name, type(self))) from None

        @functools.wraps(setattr_)
        def __setattr__(self, key, value):
            try:
                setattr_(self, key, value)
            except ValidationError as e:
                raise ConfigError(format_validation_error(e, name, type(self))) from None

        cls.__init__, cls.__setattr__ = __init__, __setattr__
        cls.__recipe_section__ = name
        return cls

    return wrap


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


def _message(err: dict, fi) -> str:
    kind, ctx, got = err["type"], err.get("ctx") or {}, err.get("input")
    words = {
        "int_type": "must be an integer", "int_from_float": "must be an integer",
        "int_parsing": "must be an integer", "float_type": "must be a number", "float_parsing": "must be a number",
        "bool_type": "must be true or false", "bool_parsing": "must be true or false",
        "string_type": "must be a string", "finite_number": "must be a finite number",
        "none_required": "must be null",
    }
    if kind in words:
        msg = words[kind]
        bound = _bound_text(fi)
        if bound and kind.startswith(("int", "float")):
            msg += f" {bound}"
        if fi is not None and _nullable(fi.annotation):
            msg += " (or null)"
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


def format_validation_error(error: ValidationError, prefix: str, cls) -> str:
    """One line: `prefix.key: what is valid, got VALUE`, plus how many other fields are wrong."""
    errors = error.errors()
    first = errors[0]
    loc = [str(p) for p in first["loc"] if not isinstance(p, int)]
    key = loc[0] if loc else ""
    name = ".".join([prefix, *loc]) if prefix else ".".join(loc)
    if first["type"] in ("unexpected_keyword_argument", "unexpected_positional_argument"):
        text = f"{name}: unknown key; valid keys: {_valid_keys(cls)}"
    elif first["type"] == "missing_argument" or first["type"] == "missing":
        text = f"{name}: required"
    elif first["type"] == "value_error":  # a validator's own message; it names its field
        text = str((first.get("ctx") or {}).get("error", first["msg"]))
        if not text.startswith(f"{prefix}."):
            text = f"{name}: {text}"
    else:
        text = f"{name}: {_message(first, _field_info(cls, key))}"
    others = sorted({".".join([prefix, *[str(p) for p in e["loc"] if not isinstance(p, int)]]) for e in errors[1:]} - {name})
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
    else:
        text = getattr(ann, "__name__", str(ann))
        bound = _bound_text(fi)
        if bound:
            text += f" {bound}" if bound != "non-empty" else " (non-empty)"
    return text + (" or null" if nullable else "")


def _default_text(fi) -> str:
    if fi.default_factory is not None:
        return "(section)"
    d = fi.default
    if d is None:
        return "null"
    if isinstance(d, bool):
        return "true" if d else "false"
    if isinstance(d, str):
        return repr(d) if d == "" or d.strip() != d else d
    return str(d)


def field_rows(cls, prefix: str) -> list[tuple[str, str, str, str]]:
    """(dotted key, type and valid values, default, description) for every field of a section."""
    rows = []
    for f in dataclasses.fields(cls):
        fi = _field_info(cls, f.name)
        rows.append((f"{prefix}.{f.name}", type_text(fi), _default_text(fi), fi.description or ""))
    return rows


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

