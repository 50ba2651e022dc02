"""Sampling configuration, prompts with a masked span (infilling) and per-sequence outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

FAMILIES = ("setdlm", "bd3lm", "mdlm", "ar")
REMASKING = ("confidence", "random")


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


@dataclass
class SamplingConfig:
    family: str = "setdlm"  # setdlm | bd3lm | mdlm | ar
    max_new_tokens: int = 128  # plain prompts: positions generated after the prompt
    # SW-SetDLM: window of masked positions from the leftmost one; None: 4 (set it to the model's D,
    # or use from_objective()). The paper uses w = S_max for infilling.
    window: int | None = None
    # SetDLM / BD3-LM / MDLM: besides the step's required tokens, accept every position whose
    # confidence (probability of its chosen token) is >= threshold. None or >= 1.0: no extra tokens
    # (SetDLM then commits exactly one token per step); 0.0 accepts every active position.
    threshold: float | None = None
    # BD3-LM: block size and denoising steps per block (None: block_size, one token per step).
    block_size: int = 4
    steps_per_block: int | None = None
    # MDLM: denoising steps over the whole span (None: span length, one token per step) and how
    # positions are chosen (most confident, or uniformly at random as in ancestral sampling).
    steps: int | None = None
    remasking: str = "confidence"
    # Token choice. temperature 0: greedy (argmax); otherwise sampled from the processed distribution.
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    repetition_penalty: float = 1.0  # 1.0: off (CTRL-style: positive logits / p, negative * p)
    seed: int | None = None  # seeds a generator on the model's device when none is passed
    # Stopping (plain prompts only; infilling always fills the span).
    stop_on_eos: bool = True  # stop at the first EOS (eos_id argument or tokenizer.eos_id)
    stop_token_ids: list[int] = field(default_factory=list)  # more token ids that end a sequence
    stop: list[str] = field(default_factory=list)  # stop strings (need a tokenizer)
    stop_regex: str | None = None  # a regular expression searched in the generated text
    # Engine knobs.
    check_every: int = 1  # host synchronisation (finished rows, stop strings) every N steps
    compact: bool = True  # drop finished rows from the batch once no prompt is waiting
    # Continuous batching: rows decoded at once (slots). A finished row's slot is refilled with the
    # next waiting prompt, so any number of prompts decode with at most max_batch rows (and KV cache
    # rows) in flight. None: every prompt at once.
    max_batch: int | None = None
    # SW-SetDLM adaptive window: each row's window starts at `window` and after each step becomes
    # clamp(2 * accepted, window_min, window_max) (grows while the threshold accepts more than half
    # of it, shrinks when it does not). window_max None: 2 * window (S_max = 2D when window = D).
    adaptive_window: bool = False
    window_min: int = 1
    window_max: int | None = None
    # Compiled decode step (SetDLM, BD3-LM, AR): fixed shapes per (batch bucket, window), the whole
    # preallocated cache attended (masked), the step run through torch.compile; on CUDA with greedy
    # decoding it is also captured in a CUDA graph (`cuda_graphs`). Same greedy tokens as eager.
    compile: bool = False
    cuda_graphs: bool = True  # with compile on CUDA: replay the step as a CUDA graph (greedy only)

    @classmethod
    def from_objective(cls, objective, **overrides) -> "SamplingConfig":
        """Defaults matching a trained objective (ObjectiveConfig or its dict): family, w = D, block size."""
        get = (lambda k, d=None: objective.get(k, d)) if isinstance(objective, dict) else (
            lambda k, d=None: getattr(objective, k, d))
        kw = dict(family=get("name", "setdlm"), window=int(get("set_size", 4) or 4),
                  block_size=int(get("block_size", 4) or 4))
        kw.update(overrides)
        return cls(**kw)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def window_size(self) -> int:
        return int(self.window) if self.window is not None else 4

    @property
    def max_window(self) -> int:
        """Query slots of a SetDLM step: the window, or the adaptive window's upper bound."""
        if not self.adaptive_window:
            return self.window_size
        return int(self.window_max) if self.window_max is not None else 2 * self.window_size

    @property
    def initial_window(self) -> int:
        if not self.adaptive_window:
            return self.window_size
        return min(max(self.window_size, self.window_min), self.max_window)

    def validate(self) -> None:
        def bad(name, msg):
            raise ValueError(f"sampling.{name}: {msg}")

        if self.family not in FAMILIES:
            bad("family", f"unknown family {self.family!r}; valid: {', '.join(FAMILIES)}")
        if self.max_new_tokens < 0:
            bad("max_new_tokens", f"must be >= 0, got {self.max_new_tokens}")
        if self.window is not None and self.window < 1:
            bad("window", f"must be >= 1, got {self.window}")
        if self.threshold is not None and not 0.0 <= self.threshold:
            bad("threshold", f"must be >= 0 (or None for no threshold), got {self.threshold}")
        if self.block_size < 1:
            bad("block_size", f"must be >= 1, got {self.block_size}")
        if self.steps_per_block is not None and not 1 <= self.steps_per_block:
            bad("steps_per_block", f"must be >= 1, got {self.steps_per_block}")
        if self.steps is not None and self.steps < 1:
            bad("steps", f"must be >= 1, got {self.steps}")
        if self.remasking not in REMASKING:
            bad("remasking", f"unknown strategy {self.remasking!r}; valid: {', '.join(REMASKING)}")
        if self.temperature < 0:
            bad("temperature", f"must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            bad("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            bad("repetition_penalty", f"must be > 0 (1 = off), got {self.repetition_penalty}")
        if self.check_every < 1:
            bad("check_every", f"must be >= 1, got {self.check_every}")
        if self.max_batch is not None and self.max_batch < 1:
            bad("max_batch", f"must be >= 1 (or None: every prompt at once), got {self.max_batch}")
        if self.window_min < 1:
            bad("window_min", f"must be >= 1, got {self.window_min}")
        if self.adaptive_window and self.max_window < self.window_min:
            bad("window_max", f"must be >= window_min={self.window_min}, got {self.max_window}")
        if self.compile and self.family == "mdlm":
            bad("compile", "the compiled step exists for setdlm, bd3lm and ar (MDLM decodes eagerly); set compile: false")
        if isinstance(self.stop, str):
            bad("stop", "must be a list of strings, not a string")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if self.stop_regex is not None:
            import re

            try:
                re.compile(self.stop_regex)
            except re.error as e:
                bad("stop_regex", f"invalid regular expression {self.stop_regex!r}: {e}")


@dataclass
class SampleOutput:
    """One generated sequence.

    tokens: the generated tokens (the span for infilling), cut at a stop (EOS excluded; a stop
    string's or regex match's tokens included); text: their decoding when a tokenizer was given
    (cut exactly before a stop string / after a regex match); steps: decoding steps (forwards) this
    sequence took part in, prefill excluded; tokens_per_step = len(tokens) / steps; seconds: wall time
    from the start of `generate` (prefill included) until this sequence finished; stopped_early: a
    stop criterion fired before the span was full, stop_reason: "length" (span full), "eos",
    "stop_string" or "regex"; masks_dropped: positions still masked when it stopped (dropped);
    commit_step: for each output token the step that committed it (1-based); prompt_tokens: visible
    context tokens; sequence: the whole decoded sequence as the model saw it (prompt + tokens, or
    prefix + span + suffix), cut at a stop like `tokens`. With continuous batching (`max_batch`)
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

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("tokens", "text", "steps", "tokens_per_step", "seconds",
                                              "stopped_early", "stop_reason", "masks_dropped", "prompt_tokens")}
