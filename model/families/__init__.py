"""The family registry: one FamilySpec per set-schedule family (spec.py), registered here once.

    from model import families
    spec = families.get(recipe.objective.name)   # ConfigError naming the valid names if unknown
    spec.layout(seq_len, objective).tokens_in    # 2L for the two-stream families

Adding a family: a module beside these with a FamilySpec subclass and its SPEC, and the module's name
added to MODULES (one line); tests/test_family_contract.py then checks it like every other family
(docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

import importlib

from common.schema import ConfigError

from .spec import DECODING_MODES, INFERENCE_MASKS, FamilySpec, Layout

# The family modules of this package, one per line, the default first: each defines SPEC.
MODULES = (
    "setdlm",
    "bd3lm",
    "mdlm",
    "ar",
)


def _spec_of(module: str) -> FamilySpec:
    spec = getattr(importlib.import_module(f"{__name__}.{module}"), "SPEC", None)
    if not isinstance(spec, FamilySpec):
        raise ValueError(f"model/families/{module}.py: SPEC must be a FamilySpec instance, got {spec!r}")
    return spec


REGISTERED: tuple[FamilySpec, ...] = tuple(_spec_of(m) for m in MODULES)
DEFAULT = REGISTERED[0]  # objective.name and sampling.family when none is given


def _index(specs) -> dict[str, FamilySpec]:
    """name -> spec, each spec checked first (FamilySpec.check: a registration mistake is one line at import)."""
    out: dict[str, FamilySpec] = {}
    for spec in specs:
        spec.check()
        if spec.name in out:
            raise ValueError(f"model/families: two registered families are named {spec.name!r}")
        out[spec.name] = spec
    return out


_BY_NAME = _index(REGISTERED)

# The specs by constant, for code that means one family (the reference's releases, benchmarks).
SETDLM = _BY_NAME["setdlm"]
BD3LM = _BY_NAME["bd3lm"]
MDLM = _BY_NAME["mdlm"]
AR = _BY_NAME["ar"]


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
    case-insensitive substring), or None. Registration order decides between specs that both match
    (the default family's names are tried first)."""
    w = str(word).lower()
    for spec in REGISTERED:
        if spec.named_in_reference(w):
            return spec
    return None


__all__ = ["FamilySpec", "Layout", "MODULES", "REGISTERED", "DEFAULT", "DECODING_MODES", "INFERENCE_MASKS", "names", "get",
           "from_reference_name"]
