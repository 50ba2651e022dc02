"""`setdlm pretrain --describe [SECTION]` / `--schema`: every recipe key with its type, valid values,
default and description, read from the typed sections themselves (so it cannot go stale)."""

from __future__ import annotations

import json

from common.schema import ConfigError, field_rows, format_rows

from .config import _CLASSES, REQUIRED_SECTIONS, LoRAConfig, RecipeConfig

# mappings inside a section (their keys are described as `section.key.sub`)
_NESTED = {"train": (("lora", LoRAConfig),)}


def _rows(name: str) -> list:
    rows = field_rows(_CLASSES[name], name)
    for key, cls in _NESTED.get(name, ()):
        rows += field_rows(cls, f"{name}.{key}")
    return rows

__all__ = ["describe", "json_schema"]


def describe(section: str | None = None) -> str:
    """One line per key (key, type and valid values, default, description), grouped by section;
    `section` limits it to one section, or to one key (`train.lr`)."""
    key = None
    if section and "." in section:
        section, key = section.split(".", 1)
    if section and section not in _CLASSES:
        raise ConfigError(f"--describe: unknown section {section!r}; valid sections: {', '.join(_CLASSES)}")
    names = [section] if section else list(_CLASSES)
    out = []
    if not section:
        out.append("Recipe keys (YAML sections; any key can be overridden as section.key=value). "
                   f"A recipe file must set the sections {', '.join(REQUIRED_SECTIONS)}.")
    for name in names:
        rows = _rows(name)
        if key is not None:
            rows = [r for r in rows if r[0] == f"{name}.{key}" or r[0].startswith(f"{name}.{key}.")]
            if not rows:
                valid = ", ".join(r[0].split(".", 1)[1] for r in _rows(name))
                raise ConfigError(f"--describe: {name}.{key}: unknown key; valid keys: {valid}")
        out += ["", *format_rows(name, rows)]
    return "\n".join(out).lstrip("\n")


def json_schema() -> str:
    """The JSON schema of a whole recipe (pydantic), e.g. for editor completion of recipe YAML."""
    from pydantic import TypeAdapter

    return json.dumps(TypeAdapter(RecipeConfig).json_schema(), indent=1)
