"""Sampling configuration (a typed section), prompts with a masked span (infilling), per-sequence
outputs, and `SamplingError` for a request `generate` cannot decode."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from common.errors import Error
from common.schema import ConfigError, Field, section

from .. import families
from ..config import CACHE_ORDERS

FAMILIES = families.names()
# The SW-SetDLM window when neither the config nor the model gives one: D = 4, the set size of the
# paper's OWT and GSM8K models (from_objective replaces it with the trained model's D).
DEFAULT_WINDOW = 4
REMASKING = ("confidence", "random")
# The floors that keep logits finite (processors.py): a temperature below TEMPERATURE_FLOOR decodes
# greedily (vLLM's threshold for greedy sampling, too); a repetition penalty lies in REPETITION_PENALTY_RANGE.
TEMPERATURE_FLOOR = 1e-5
REPETITION_PENALTY_RANGE = (1e-6, 1e6)  # [min, max] of a CTRL-style penalty (1: off)


class SamplingError(Error):
    """Prompts, ids or a model that `generate` cannot decode (the message names the argument)."""


@dataclass
class Infill:
    """A prompt with a masked span: `prefix` + `length` MASK positions + `suffix` (token ids).

    The span is filled exactly (no early stopping); prefix and suffix are never changed. SetDLM,
    BD3-LM and MDLM see prefix and suffix (both are put in the KV cache where there is one); AR
    conditions on the prefix only.
    """

    prefix: list[int]
    length: int
    suffix: list[int] = field(default_factory=list)


@section("sampling")
class SamplingConfig:
    """How `generate` decodes: a typed section (common/schema.py), so a bad value fails on construction
    (or assignment) with one line naming it (`sampling.window: must be an integer >= 1, got 2.5`)."""

    family: Literal[FAMILIES] = Field(families.SETDLM.name, description="sampler family (model/families)")
    max_new_tokens: int = Field(128, ge=0, description="plain prompts: positions generated after the prompt")
    window: int | None = Field(None, ge=1, description=(
        "SW-SetDLM window of masked positions from the leftmost one (null: DEFAULT_WINDOW = 4; use the model's D, as "
        "from_objective does; the paper uses S_max for infilling)"))
    threshold: float | None = Field(None, ge=0.0, description=(
        "SetDLM / BD3-LM / MDLM: also accept every position whose confidence is >= this; null or >= 1: no "
        "extra tokens (SetDLM: one token per step), 0: every active position"))
    block_size: int = Field(4, ge=1, description="BD3-LM block size")
    steps_per_block: int | None = Field(None, ge=1, description="BD3-LM denoising steps per block (null: block_size)")
    steps: int | None = Field(None, ge=1, description="MDLM denoising steps over the span (null: its length)")
    remasking: Literal[REMASKING] = Field("confidence", description=(
        "MDLM: unmask the most confident positions, or uniformly random ones (ancestral order)"))
    temperature: float = Field(0.0, ge=0.0, description=(
        "0: greedy (argmax); otherwise sampled (below TEMPERATURE_FLOOR, 1e-5: greedy)"))
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0: off)")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="nucleus: smallest set with this probability (1: off)")
    repetition_penalty: float = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1],
                                      description=(
        "CTRL-style penalty on tokens present (positive logits / p, negative * p; 1: off; within "
        "REPETITION_PENALTY_RANGE, 1e-6 to 1e6, so logits stay finite)"))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "OpenAI's: subtracted from the logit of every token the output already holds (0: off)"))
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "OpenAI's: subtracted from a token's logit once per occurrence in the output so far (0: off)"))
    logit_bias: dict[int, float] = Field(default_factory=dict, description=(
        "token id -> value added to its logit (-100 to 100; OpenAI's logit_bias)"))
    logprobs: int | None = Field(None, ge=0, le=20, description=(
        "record each output token's log-probability under the step that committed it, and the k most likely "
        "tokens of that step at its position (null: off; docs/sampling.md)"))
    seed: int | None = Field(None, description="seeds a generator on the model's device when none is passed")
    stop_on_eos: bool = Field(True, description="plain prompts: stop at the first EOS (infilling fills the span)")
    stop_token_ids: list[int] = Field(default_factory=list, description="more token ids that end a sequence")
    stop: list[str] = Field(default_factory=list, description="stop strings (need a tokenizer)")
    stop_regex: str | None = Field(None, description="an RE2 regular expression searched in the generated text")
    check_every: int = Field(1, ge=1, description="host synchronisation (finished rows, stop strings) every N steps")
    compact: bool = Field(True, description="drop finished rows from the batch once no prompt is waiting")
    max_batch: int | None = Field(None, ge=1, description=(
        "continuous batching: rows decoded at once; a finished row's slot takes the next prompt (null: all)"))
    adaptive_window: bool = Field(False, description=(
        "SW-SetDLM: each row's window becomes clamp(2 * accepted, window_min, window_max) after each step"))
    window_min: int = Field(1, ge=1, description="adaptive window: lower bound")
    window_max: int | None = Field(None, ge=1, description=(
        "adaptive window: upper bound (null: 2 * window, capped at s_max)"))
    cache_order: Literal[CACHE_ORDERS] | None = Field(None, description=(
        "SW-SetDLM: order in which one step's accepted tokens enter the KV cache (and attend among themselves): "
        "position, or first_hitting (the reference's setdlm_fht_cache_order, the paper's GSM8K mode); null: the "
        "model's recorded mode (objective.cache_order of its run), else position"))
    s_max: int | None = Field(None, ge=1, description=(
        "SW-SetDLM: the model's S_max (2D, the most positions one step was trained on; from_objective sets it): "
        "window and window_max may not exceed it, and the default window_max is capped at it (null: no cap)"))
    compile: bool = Field(False, description=(
        "compiled decode step (SetDLM, BD3-LM, AR): fixed shapes per batch bucket and window, torch.compile; "
        "same greedy tokens as eager"))
    cuda_graphs: bool = Field(True, description="with compile on CUDA and greedy decoding: replay the step as a CUDA graph")

    def __post_init__(self):
        self.validate()

    @classmethod
    def from_objective(cls, objective, **overrides) -> "SamplingConfig":
        """Defaults matching a trained objective (ObjectiveConfig or its dict): its family's
        (FamilySpec.sampling_defaults: family, w = D, block size, S_max), then `overrides`."""
        name = objective.get("name") if isinstance(objective, dict) else getattr(objective, "name", None)
        spec = families.get(name or families.SETDLM.name)
        kw = {**spec.sampling_defaults(objective), **overrides}
        if kw.get("family") != spec.name and "cache_order" not in overrides:
            kw.pop("cache_order", None)  # another family's sampler: the objective's cache order does not apply
        return cls(**kw)

    @property
    def spec(self):
        """The FamilySpec of `family`."""
        return families.get(self.family, "sampling.family")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or below TEMPERATURE_FLOOR (the limit of sampling as it goes to 0)."""
        return self.temperature < TEMPERATURE_FLOOR

    @property
    def window_size(self) -> int:
        return int(self.window) if self.window is not None else DEFAULT_WINDOW

    @property
    def max_window(self) -> int:
        """Query slots of a SetDLM step: the window, or the adaptive window's upper bound."""
        if not self.adaptive_window:
            return self.window_size
        if self.window_max is not None:
            return int(self.window_max)
        return min(2 * self.window_size, self.s_max or 2 * self.window_size)

    @property
    def initial_window(self) -> int:
        if not self.adaptive_window:
            return self.window_size
        return min(max(self.window_size, self.window_min), self.max_window)

    def validate(self) -> None:
        """The checks across fields (each field's own type and range is checked on construction and
        assignment); runs on construction, and again in `generate` after assignments."""
        if self.adaptive_window and self.max_window < self.window_min:
            raise ConfigError(f"sampling.window_max: must be >= window_min={self.window_min}, got {self.max_window}")
        self.spec.validate_sampling(self)
        for t, v in self.logit_bias.items():
            if t < 0 or not -100.0 <= v <= 100.0:
                raise ConfigError(f"sampling.logit_bias: token ids >= 0 and values in [-100, 100], got {t}: {v}")
        if self.compile and self.logprobs is not None:
            raise ConfigError("sampling.logprobs: recorded by the eager step only; set compile: false")
        if any(not s for s in self.stop):
            raise ConfigError("sampling.stop: stop strings must be non-empty")
        if self.stop_regex is not None:
            from .stop_regex import StopRegexError, compile_stop_regex

            try:
                compile_stop_regex(self.stop_regex)
            except StopRegexError as e:
                raise ConfigError(f"sampling.stop_regex: {e}") from None


@dataclass
class SampleOutput:
    """One generated sequence.

    tokens: the generated tokens (the span for infilling), cut at a stop (EOS excluded; a stop
    string's or regex match's tokens included); text: their decoding when a tokenizer was given
    (cut exactly before a stop string / after a regex match); steps: decoding steps (forwards) this
    sequence took part in, prefill excluded; tokens_per_step = len(tokens) / steps; seconds: wall time
    from the start of `generate` (prefill included) until this sequence finished; stopped_early: a
    stop criterion fired before the span was full, stop_reason: "length" (span full), "eos",
    "stop_string", "regex" or "regex_timeout" (the stop regex used up its time, model/sampling/stopping.py:
    the output ends at its decoded prefix); masks_dropped: positions still masked when it stopped (dropped);
    commit_step: for each output token the step that committed it (1-based); prompt_tokens: visible
    context tokens; sequence: the whole decoded sequence as the model saw it (prompt + tokens, or
    prefix + span + suffix), cut at a stop like `tokens`; with `SamplingConfig.logprobs` set, logprobs:
    per token its log-probability under the step that committed it, top_logprobs: per token the k
    (id, log-probability) pairs most likely at its position in that step. With continuous batching (`max_batch`)
    `seconds` runs from the row's admission into a slot (its prefill) until it finished.
    """

    tokens: list[int]
    text: str | None = None
    steps: int = 0
    tokens_per_step: float = 0.0
    seconds: float = 0.0
    stopped_early: bool = False
    stop_reason: str = "length"
    masks_dropped: int = 0
    commit_step: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    sequence: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("tokens", "text", "steps", "tokens_per_step", "seconds",
                                              "stopped_early", "stop_reason", "masks_dropped", "prompt_tokens")}
