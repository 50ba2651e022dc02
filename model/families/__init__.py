"""The family registry: one FamilySpec per set-schedule family (spec.py), registered here once.

    from model import families
    spec = families.get(recipe.objective.name)   # ConfigError naming the valid names if unknown
    spec.layout(seq_len, objective).tokens_in    # 2L for the two-stream families

Adding a family: a module beside these with a FamilySpec subclass and its SPEC, and that SPEC added to
REGISTERED (one line); tests/test_family_contract.py then checks it like every other family
(docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

from common.schema import ConfigError

from . import ar
from . import bd3lm
from . import mdlm
from . import setdlm
from .spec import DECODING_MODES, INFERENCE_MASKS, FamilySpec, Layout

REGISTERED: tuple[FamilySpec, ...] = (
    setdlm.SPEC,  # the default first
    bd3lm.SPEC,
    mdlm.SPEC,
    ar.SPEC,
)

# The specs by constant, for code that means one family (the reference's releases, benchmarks).
SETDLM = setdlm.SPEC
BD3LM = bd3lm.SPEC
MDLM = mdlm.SPEC
AR = ar.SPEC
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


__all__ = ["FamilySpec", "Layout", "REGISTERED", "DEFAULT", "DECODING_MODES", "INFERENCE_MASKS", "names", "get",
           "from_reference_name"]
