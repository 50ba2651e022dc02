"""The family registry: one FamilySpec per set-schedule family (spec.py), registered here once.

    from model import families
    spec = families.get(recipe.objective.name)   # ConfigError naming the valid names if unknown
    spec.layout(seq_len, objective).tokens_in    # 2L for the two-stream families

Adding a family: a module beside these with a FamilySpec subclass and its SPEC, one line in
REGISTERED, and its tests (docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

from common.schema import ConfigError

from . import ar, bd3lm, mdlm, setdlm
from .spec import FamilySpec, Layout

REGISTERED: tuple[FamilySpec, ...] = (setdlm.SPEC, bd3lm.SPEC, mdlm.SPEC, ar.SPEC)  # the default first
SETDLM, BD3LM, MDLM, AR = REGISTERED  # the specs by constant, for code that names one (benchmarks, defaults)
_BY_NAME = {s.name: s for s in REGISTERED}


def names() -> tuple[str, ...]:
    """Every registered family name, in registration order."""
    return tuple(_BY_NAME)


def get(name: str, key: str = "objective.name") -> FamilySpec:
    """The spec of family `name`; an unknown name is a ConfigError naming `key` and the valid names."""
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise ConfigError(f"{key}: unknown family {name!r}; valid: {', '.join(_BY_NAME)}") from None


def from_reference_name(word: str) -> FamilySpec | None:
    """The family a reference-implementation config names (model_type, architecture or algo name,
    case-insensitive substring), or None."""
    w = str(word).lower()
    for spec in REGISTERED:  # SW-SetDLM's names before BD3-LM's before MDLM's before AR's
        if spec.named_in_reference(w):
            return spec
    return None


__all__ = ["FamilySpec", "Layout", "REGISTERED", "AR", "MDLM", "BD3LM", "SETDLM", "names", "get", "from_reference_name"]
