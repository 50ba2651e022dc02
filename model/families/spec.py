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
- exports and imports: its inference traits (the attention an export's forward uses by default and the
  export's decoding mode, both written into config.json so that the exported modeling code reads them
  and names no family), the schedule fields config.json records, the model card's rows, whether a
  stock architecture can hold it, the names the reference implementation uses for it.

Adding a family is one module here and one line in the registry (docs/architecture.md, "Adding a
family"); tests/test_family_contract.py checks every registered family.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from common.schema import ConfigError

# The inference traits an export's modeling code knows (model/convert/hf_code/configuration_setdlm.py
# holds the same two lists; tests/test_family_contract.py keeps them equal):
# the attention of one stream that an export's forward uses when no mask is given
INFERENCE_MASKS = ("causal", "bidirectional", "block_causal")
# how the export's set_diffusion_generate decodes:
#   next_token     one token per step after the prompt, KV cache (causal)
#   set_window     a window of masked positions from the leftmost one per step; the most confident plus
#                  every one over the threshold accepted and cached (causal among themselves) after each step
#   block          blocks of set_diffusion.block_size left to right; in a block, the k most confident per
#                  step (bidirectional inside the block); a completed block enters the cache
#   full_sequence  no cache: every step re-reads the whole sequence (bidirectional) and unmasks the k most
#                  confident positions of the span
DECODING_MODES = ("next_token", "set_window", "block", "full_sequence")


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
    inference_mask: str = "causal"  # INFERENCE_MASKS: an export's forward without a mask; a prompt's prefill
    decoding: str = "next_token"  # DECODING_MODES: how an export decodes (config.json's set_diffusion.decoding)
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
    stock_export: bool = False  # a stock Hugging Face causal LM can hold it (no custom decoding)
    card_usage: str = ""  # the model card's words on the export's decoding ("": card.py's words for its decoding mode)
    reference_step: str = ""  # method of model/sampling/reference.py's recomputing decoder for one step
    reference_names: tuple[str, ...] = ()  # words naming it in the reference implementation's configs

    @property
    def next_token(self) -> bool:
        """Decodes the next token from the previous one (an empty prompt starts at EOS)."""
        return self.decoding == "next_token"

    @property
    def rereads_sequence(self) -> bool:
        """No KV cache: every step re-reads prompt + span, which must fit max_seq_len."""
        return self.decoding == "full_sequence"

    def check(self) -> None:
        """What the registry checks of a spec when it registers it (one line naming the field)."""
        where = f"model/families: {type(self).__name__}"
        if not self.name or not self.name.isidentifier() or self.name != self.name.lower():
            raise ValueError(f"{where}.name: a lower-case identifier (objective.name), got {self.name!r}")
        for field in ("objective_path", "decoder_path"):
            module, _, attr = getattr(self, field).partition(":")
            if not module or not attr:
                raise ValueError(f"{where}.{field}: 'module:Class', got {getattr(self, field)!r}")
        for field, valid in (("inference_mask", INFERENCE_MASKS), ("decoding", DECODING_MODES)):
            if getattr(self, field) not in valid:
                raise ValueError(f"{where}.{field}: one of {', '.join(valid)} (what an export's modeling code "
                                 f"knows), got {getattr(self, field)!r}")

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
    def inference_traits(self) -> dict:
        """What an export's modeling code reads instead of the family's name (config.json's set_diffusion)."""
        return {"inference_mask": self.inference_mask, "decoding": self.decoding}

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
