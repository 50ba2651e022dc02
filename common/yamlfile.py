"""Recipe YAML: safe loading (no Python objects), `1e-3` read as a number, errors naming file:line."""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from .schema import ConfigError


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-3` / `5E4` as floats (YAML 1.2 does; PyYAML's 1.1 rules need a dot)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_value(text: str):
    """One scalar/list/mapping written in YAML (a command-line override's value)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass


def load_yaml(path: str | os.PathLike, what: str = "--config"):
    """Read a YAML file; any problem is a one-line ConfigError naming `what`, the file and the line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what}: no such file {str(path)!r}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what}: {path} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror}") from None
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        detail = f"{problem} ({context})" if context else problem
        raise ConfigError(f"{what}: {where}: YAML syntax error: {detail}") from None
