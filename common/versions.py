"""Format versions of what the stack writes and reads back later (checkpoint metadata with its
recipe, Hugging Face exports): every record carries its version, and a loader migrates an older
record step by step to the current version before it validates it, so renaming a key never makes
old checkpoints unreadable. A record of a newer version than this code knows is refused in one line.

    migrate(meta, key="format_version", current=2, migrations={1: to_v2}, what="checkpoint meta.json", error=CheckpointError)

A migration takes the record of version v and returns it at version v + 1 (`rename_key` moves a
dotted recipe key). A record without the key is version 0 (written before versions were recorded).
Weights renamed between versions (a refactor of a model's module names) travel by a conversion map in
the same chain: `rename_weights(state, {"old.name": "new.name", "old_prefix.": "new_prefix."})`.
"""

from __future__ import annotations

from typing import Callable

from .errors import Error

__all__ = ["migrate", "rename_key", "rename_weights"]


def migrate(record: dict, *, key: str, current: int, migrations: dict[int, Callable[[dict], dict]], what: str,
            error: type[Error] = Error) -> dict:
    """`record` brought to version `current` (a new dict; `record[key]` set to it)."""
    version = record.get(key, 0)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise error(f"{what}: {key} must be a whole number >= 0, got {version!r}")
    if version > current:
        raise error(f"{what}: {key} {version} is newer than this setdlm reads (up to {current}); upgrade setdlm "
                    "to read it")
    out = dict(record)
    while version < current:
        step = migrations.get(version)
        if step is None:
            raise error(f"{what}: {key} {version} is too old for this setdlm (it migrates from "
                        f"{min(migrations, default=current)} on)")
        out = step(out)
        version += 1
    out[key] = current
    return out


def rename_key(section_dicts: dict, old: str, new: str) -> dict:
    """`section_dicts` (a recipe as nested dicts) with dotted key `old` moved to `new` (a copy; absent: unchanged)."""
    *old_path, old_leaf = old.split(".")
    *new_path, new_leaf = new.split(".")
    out = _copy(section_dicts)
    src = out
    for p in old_path:
        src = src.get(p) if isinstance(src, dict) else None
        if src is None:
            return out
    if not isinstance(src, dict) or old_leaf not in src:
        return out
    value = src.pop(old_leaf)
    dst = out
    for p in new_path:
        dst = dst.setdefault(p, {})
    dst[new_leaf] = value
    return out


def rename_weights(state: dict, renames: dict[str, str]) -> dict:
    """`state` ({weight name: value}) with its names converted by `renames`: a key equal to a name in
    `renames` takes its new name; else the longest key of `renames` that ends in "." and starts the name
    (a module prefix) is replaced. Two names that end up equal are refused (a wrong map would otherwise
    drop a weight silently). A new dict; values are not copied."""
    exact = {k: v for k, v in renames.items() if not k.endswith(".")}
    prefixes = sorted((k for k in renames if k.endswith(".")), key=len, reverse=True)
    out: dict = {}
    for name, value in state.items():
        new = exact.get(name)
        if new is None:
            new = next((renames[p] + name[len(p):] for p in prefixes if name.startswith(p)), name)
        if new in out:
            raise ValueError(f"weight renames map two weights to {new!r}")
        out[new] = value
    return out


def _copy(d):
    return {k: _copy(v) for k, v in d.items()} if isinstance(d, dict) else d
