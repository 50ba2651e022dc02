"""FamilySpec: everything the stack needs to know about one set-schedule family, in one object.

AR, MDLM, BD3-LM and SW-SetDLM are schedules of one transformer (SETDLM.md). What differs between
them lives here, one subclass per family in this package, each instance registered once in
`model/families/__init__.py`; the rest of the stack asks the registry (`families.get(name)`) and
never spells a family's name. A spec carries:

- training: the objective class, the objective keys it reads and their checks, its mask kind and
  layout (tokens per sequence through the model and through the head: the FLOP, memory and
  sequence-parallel terms);
- decoding: the decoder class, the sampling defaults for a trained objective, the sampling checks,
  whether a compiled step exists and whether decoding re-reads the whole sequence (no KV cache);
- likelihood: what its bound estimates and how its draws are weighted (eval likelihood, the scorer);
- exports and imports: the schedule fields an export's config.json records, the model card's rows,
  whether a stock architecture can hold it, the names the reference implementation uses for it.

Adding a family is one module here, one line in the registry and its tests (docs/architecture.md,
"Adding a family").
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from common.schema import ConfigError


@dataclass(frozen=True)
class Layout:
    """One training sequence of L tokens as the model sees it."""

    mask_kind: str  # model/masks.py kind of the static training mask
    tokens_in: int  # tokens forwarded through the blocks (2L for the two-stream families)
    tokens_out: int  # tokens through the output head (predictions)
    block_size: int = 0  # the mask's block size (0: none)


def _load(path: str):
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def _getter(objective):
    """Field access for an ObjectiveConfig or its dict form (a saved recipe)."""
    if isinstance(objective, dict):
        return lambda k, d=None: objective.get(k, d)
    return lambda k, d=None: getattr(objective, k, d)


class FamilySpec:
    """A family's defaults; subclasses override what differs."""

    name: str = ""  # objective.name, sampling.family, an export's set_diffusion.family
    title: str = ""  # display name (tables, plots)
    description: str = ""  # the model card's words for it
    objective_path: str = ""  # "module:Class" of its Objective (imported on first use)
    decoder_path: str = ""  # "module:Class" of its Decoder (model/sampling)
    mask_kind: str = "causal"  # training mask (model/masks.py)
    clean_text_mask: str = "causal"  # the mask a forward over clean text alone uses (MAUVE self-features)
    two_stream: bool = False  # 2L tokens through the model (a clean and a query/noisy stream)
    shifted: bool = False  # predicts token i + 1 from tokens <= i (AR: L - 1 predictions)
    blocked_mask: bool = False  # the training mask has blocks of objective.block_size
    objective_keys: tuple[str, ...] = ()  # objective.* keys this family reads besides `name`
    bound: str = ""  # what val/nll and eval likelihood estimate
    estimator: str = ""  # how the bound's draws are taken (records of another estimator are not resumed)
    exact_likelihood: bool = False  # the bound is the exact NLL (one draw suffices)
    order_mixture: bool = False  # per-order likelihoods of one sequence average into a tighter bound (nll_iw)
    bound_masks_subset: bool = False  # the bound draw predicts a masked subset (NELBO): count every predictable token
    cache_orders: tuple[str, ...] = ("position",)  # orders a step's commits may enter the KV cache in
    compiled_decode: bool = True  # sampling.compile has a compiled step for it
    rereads_sequence: bool = False  # no KV cache: every step re-reads prompt + span, which must fit max_seq_len
    next_token: bool = False  # decodes the next token from the previous one (an empty prompt starts at EOS)
    stock_export: bool = False  # a stock Hugging Face causal LM can hold it (no custom decoding)
    card_usage: str = ""  # the model card's words on the export's set_diffusion_generate ("": it has none)
    reference_step: str = ""  # method of model/sampling/reference.py's recomputing decoder for one step
    reference_names: tuple[str, ...] = ()  # words naming it in the reference implementation's configs

    # -- classes ------------------------------------------------------------------------------
    def objective_class(self):
        return _load(self.objective_path)

    def decoder_class(self):
        return _load(self.decoder_path)

    # -- training -----------------------------------------------------------------------------
    def layout(self, seq_len: int, block_size: int = 0) -> Layout:
        """A sequence of `seq_len` tokens as the model sees it; `block_size` (objective.block_size)
        counts only where the mask has blocks."""
        L = int(seq_len)
        return Layout(self.mask_kind, 2 * L if self.two_stream else L, L - 1 if self.shifted else L,
                      int(block_size) if self.blocked_mask else 0)

    def validate(self, objective, seq_len: int) -> None:
        """Checks of the objective's keys against the sequence length (ConfigError naming objective.KEY)."""

    # -- decoding -----------------------------------------------------------------------------
    def sampling_defaults(self, objective) -> dict:
        """SamplingConfig fields that match a model trained with `objective` (an ObjectiveConfig or its dict)."""
        get = _getter(objective)
        return {"family": self.name, "window": int(get("set_size", 4) or 4),
                "block_size": int(get("block_size", 4) or 4)}

    def infill_window(self, objective) -> int | None:
        """The decoding window for infilling (None: the sampling default)."""
        return None

    def served_s_max(self, objective) -> int | None:
        """The most positions one decoding step was trained on (a server's window cap; None: no cap)."""
        return None

    def validate_sampling(self, cfg) -> None:
        """Checks of a SamplingConfig that only this family has (ConfigError naming sampling.KEY)."""
        if cfg.cache_order not in (None, *self.cache_orders):
            raise ConfigError(f"sampling.cache_order: {cfg.cache_order} is not a cache order of the {self.name} sampler "
                              f"(valid: {', '.join(self.cache_orders)}; or leave it unset)")
        if cfg.compile and not self.compiled_decode:
            raise ConfigError(f"sampling.compile: there is no compiled step for {self.name} (it decodes eagerly); "
                              "set compile: false")

    def settings_line(self, cfg) -> str:
        """The decoding settings in words (trace pages)."""
        return f"{self.name} sampler"

    def export_window(self, schedule: dict) -> int:
        """generation_config.json's set_diffusion window of an export whose schedule is `schedule`."""
        return 1

    # -- exports ------------------------------------------------------------------------------
    def schedule_fields(self, objective, seq_len: int) -> dict:
        """This family's part of an export's config.json `set_diffusion` section."""
        return {}

    def objective_from_schedule(self, schedule: dict) -> dict:
        """This family's objective keys read back from an export's `set_diffusion` section (the inverse
        of schedule_fields, for keys beyond name, block_size and eps)."""
        return {}

    def card_rows(self, schedule: dict) -> list[tuple[str, object]]:
        """The model card's "Set schedule" rows of this family (besides family, length and MASK id)."""
        return []

    def named_in_reference(self, text: str) -> bool:
        """Whether a reference-implementation config's names (lower case) name this family."""
        return any(n in text for n in self.reference_names)

    def __repr__(self) -> str:
        return f"FamilySpec({self.name!r})"
