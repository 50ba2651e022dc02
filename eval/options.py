"""The typed options of `setdlm eval TASK` and `setdlm sample`, and the SamplingConfig they give.

Every task declares its options as a class of this kind (next to the task: `LikelihoodOptions`,
`GSM8KOptions`, ...) on top of the ones here: `RunOptions` (checkpoint, output, sharding: every
task), `DecodingOptions` (the sampler's knobs, ranges and descriptions taken from
`model.sampling.SamplingConfig`; `setdlm sample` has them too) and `GenerationOptions` (both, for the
tasks that decode). The flags, `--help` and `--describe` are generated from the classes
(common/options.py); `eval.api` builds the same objects from keywords. A wrong type or value, a
missing required option or an impossible combination raises `OptionError` naming the flag
(`--window (sampling.window): expected an integer >= 1, got 2.5`) before anything is loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from common.options import options
from common.schema import Field, PathText, like
from model.config import CACHE_ORDERS
from model.sampling.config import FAMILIES, REMASKING, SamplingConfig

from .errors import OptionError
from .overlong import POLICIES

__all__ = ["eval_options", "RunOptions", "DecodingOptions", "GenerationOptions", "sampling_config", "infill_window",
           "decoding_fields"]


def eval_options(name: str):
    """Class decorator: the typed options of `name` (`setdlm eval gsm8k`, `setdlm sample`)."""
    return options(name, error=OptionError)


@eval_options("setdlm eval")
class RunOptions:
    option_group = "run"

    checkpoint: PathText | None = Field(None, description="run directory (newest checkpoint), RUN:best / RUN:STEP, or a checkpoints/step_* folder")
    out: PathText = Field(description="output directory (per-rank records, metrics.json, summary.md)")
    seed: int = Field(0, description="base seed (per-example seeds derive from it)")
    limit: int = Field(0, ge=0, description="evaluate only the first N examples (0: all)")
    shard: str | None = Field(None, description=("I/N: this process is shard I of N (e.g. from a Slurm array); "
                                                 "default: the launcher's rank and world size"))
    overwrite: bool = Field(False, description="delete earlier results in --out first")
    no_ema: bool = Field(False, description="use the raw weights instead of the EMA weights")
    device: str | None = Field(None, description="torch device (default: cuda:LOCAL_RANK when available, else cpu)")
    no_merge: bool = Field(False, description="do not merge at the end (run `setdlm eval merge` later)")
    merge_timeout: float = Field(0.0, ge=0.0, description=(
        "rank 0: seconds to wait for the other ranks before merging (0: until they finish)"))


@eval_options("setdlm eval")
class DecodingOptions:
    """The sampler's options; unset ones follow the checkpoint's objective (family, w = D, block size)."""

    option_group = "decoding (unset: from the checkpoint's objective)"

    family: Literal[FAMILIES] | None = like(SamplingConfig, "family", None, "sampler (default: the checkpoint's objective)")
    window: int | None = like(SamplingConfig, "window", None, "SW-SetDLM window w (default: D, the objective's set size)")
    threshold: float | None = like(SamplingConfig, "threshold", None, (
        "confidence threshold for extra tokens per step; 1 or more: none"))
    block_size: int | None = like(SamplingConfig, "block_size", None, "BD3-LM block size (default: the objective's)")
    cache_order: Literal[CACHE_ORDERS] | None = like(SamplingConfig, "cache_order", None, (
        "SW-SetDLM: position or first_hitting order of a step's commits in the cache (default: the checkpoint's)"))
    steps: int | None = like(SamplingConfig, "steps", None, "MDLM denoising steps (default: one token per step)")
    steps_per_block: int | None = like(SamplingConfig, "steps_per_block", None, "BD3-LM steps per block (default: block size)")
    remasking: Literal[REMASKING] = like(SamplingConfig, "remasking")
    temperature: float = like(SamplingConfig, "temperature")
    top_k: int = like(SamplingConfig, "top_k")
    top_p: float = like(SamplingConfig, "top_p")
    repetition_penalty: float = like(SamplingConfig, "repetition_penalty")
    max_new_tokens: int = like(SamplingConfig, "max_new_tokens", description="new tokens per prompt")


@eval_options("setdlm eval")
class GenerationOptions(DecodingOptions, RunOptions):
    """The options of a task that decodes: the run's and the sampler's."""

    option_group = "decoding (unset: from the checkpoint's objective)"

    batch_size: int = Field(1, ge=1, description="examples decoded together (as in the paper)")
    overlong: Literal[POLICIES] = Field("skip", description=(
        "examples that do not fit the model's max_seq_len with the decoded tokens: skip (left out, counted in the "
        "summary), truncate (cut to fit), error (refuse the run); eval/overlong.py"))


def decoding_fields() -> tuple[str, ...]:
    """The SamplingConfig fields an option of `DecodingOptions` sets."""
    return tuple(f.name for f in dataclasses.fields(DecodingOptions))


def infill_window(objective) -> int | None:
    """The decoding window for infilling of the objective's family (SW-SetDLM: S_max, as in the paper;
    None: the sampling default)."""
    return objective.family.infill_window(objective)


def sampling_config(objective, opts, *, window: int | None = None, **fixed) -> SamplingConfig:
    """The SamplingConfig of a checkpoint's `objective` under decoding options `opts`: the options
    that are set, else the objective's family, w = D (`window` replaces D, e.g. S_max for infilling)
    and block size; `fixed` are the settings of a task or command (stop strings, ...)."""
    chosen = {k: getattr(opts, k) for k in decoding_fields() if getattr(opts, k) is not None}
    if window is not None:
        chosen.setdefault("window", window)
    return SamplingConfig.from_objective(objective, **{**chosen, **fixed})
