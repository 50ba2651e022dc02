"""`DataConfig`: the recipe's ``data:`` section (typed and validated; see common/schema.py)."""
from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Literal

from pydantic import BeforeValidator, model_validator

from common.schema import ConfigError, Field, Text, check_keys, section

from .corpus import BUILTIN_TEXTS

PACKINGS = {
    "wrapped": "documents joined with EOS after each one, cut into seq_len chunks (OWT convention)",
    "wrapped_bos_eos": "each document framed as BOS ... EOS ([CLS] ... [SEP] for BERT), concatenated "
                       "and cut into seq_len chunks (LM1B convention)",
    "padded": "prompt/answer examples, one per row, padded (shards with context and valid masks; prompt_answer.py)",
    "packed": "prompt/answer examples packed whole into rows (none split across rows), the rest padded",
}
EXAMPLE_PACKINGS = ("padded", "packed")  # made only by `setdlm data prepare --format prompt_answer|chat|marker`


EXHAUSTED = {
    "repeat": "a source that runs out starts its next epoch (its own reshuffled order; epochs logged)",
    "stop": "the run ends cleanly (saved) before the first optimizer step that would reread a source",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@section("data.mixture[]")
class MixtureEntry:
    """One source of a weighted mixture (`data.mixture`, data_pipeline/mixture.py)."""

    source: Text = Field(min_length=1, description=(
        "directory/URL of prepared shards with manifest.json (or 'builtin:NAME')"))
    weight: float = Field(gt=0.0, description="relative share of the training samples (normalised over the mixture)")
    name: Text | None = Field(None, min_length=1, description=(
        "name in metrics (val/nll/NAME) and records (null: the directory's last path component)"))

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        tail = self.source.rstrip("/").rsplit("/", 1)[-1]
        return tail.split(":", 1)[-1] if self.source.startswith("builtin:") else tail


def _mixture_entries(value):
    """A recipe's list of mappings -> MixtureEntry objects; errors name the entry (`data.mixture[1].weight`)."""
    if not isinstance(value, (list, tuple)):
        return value  # pydantic's own "must be a list"
    out = []
    for i, e in enumerate(value):
        if isinstance(e, dict):
            try:
                e = MixtureEntry(**e)
            except ConfigError as err:
                raise ValueError(f"data.mixture[{i}]{str(err)[len('data.mixture[]'):]}") from None
        elif not isinstance(e, MixtureEntry):
            raise ValueError(f"data.mixture[{i}]: must be a mapping {{source: DIR, weight: W, name: NAME}}, got {e!r}")
        out.append(e)
    return out


@section("data")
class DataConfig:
    """Where training/validation sequences come from and how they are read.

    ``source`` is ``"builtin:NAME"`` (tokenized in memory; quickstart and tests) or the directory/URL
    of prepared shards holding ``manifest.json`` (local path, ``file://``, or any fsspec/webdataset
    URL such as ``s3://...``; ``pipe:`` sources are not supported for the manifest). For shard
    sources ``tokenizer``, ``seq_len`` and ``packing`` must match the manifest (checked at start).
    ``mixture`` (a list of {source, weight, name}) takes the place of ``source``: every source's
    manifest must match them too, and the training samples interleave by weight (mixture.py).
    """

    source: Text | None = Field("builtin:pydoc_topics", min_length=1, description=(
        "'builtin:NAME' (in-memory corpus) or the directory/URL of prepared shards with manifest.json "
        "(null with data.mixture)"))
    mixture: Annotated[list[MixtureEntry], BeforeValidator(_mixture_entries)] = Field(default_factory=list, description=(
        "weighted sources [{source: DIR, weight: W, name: NAME}, ...] in place of data.source (docs/data.md)"))
    on_exhausted: Literal[tuple(EXHAUSTED)] = Field("repeat", description=(
        "mixture: a source that runs out repeats (epoch logged) or stops the run (saved, naming it)"))
    allow_reweight: bool = Field(False, description=(
        "mixture: on resume, weights that differ from the checkpoint's start a new schedule at the resume step "
        "(false: refused)"))
    tokenizer: Text = Field("gpt2", min_length=1, description=(
        "'gpt2', 'bert-base-uncased', 'qwen3' or a tokenizer directory (shards: must match the manifest)"))
    add_mask_token: bool = Field(False, description="append <|mask|> when the tokenizer has no mask token")
    seq_len: int = Field(128, ge=2, description="tokens per sequence (shards: must equal the manifest's)")
    packing: Literal[tuple(PACKINGS)] = Field("wrapped", description=(
        "how documents become sequences: wrapped (EOS-joined, OWT), wrapped_bos_eos (BOS..EOS, LM1B); "
        "padded / packed: prompt/answer shards (docs/finetune.md)"))
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description=(
        "builtin sources: the last fraction of sequences is the validation split"))
    num_workers: int = Field(0, ge=0, description="loader worker processes per rank (0: read in the training process)")
    shuffle: bool = Field(True, description="shuffle shards and samples of the train split (val is never shuffled)")
    shuffle_window: int = Field(4, ge=1, description=(
        "shards read together and shuffled as one pool (memory: this many per worker and mixture source)"))
    skip_bad_shards: bool = Field(False, description="skip (count and log) unreadable or corrupt shards instead of stopping")
    verify_checksums: bool = Field(True, description="check each shard's sha256 against the manifest when it is read")
    prefetch_factor: int = Field(2, ge=1, description="batches each worker prepares ahead (num_workers > 0 only)")
    with_sample_ids: bool = Field(False, description="add sample_id and epoch tensors to each batch (data-order audits)")

    @model_validator(mode="before")
    @classmethod
    def _mixture_replaces_source(cls, data):
        """A mixture without `source` leaves it null; both given is refused (checked at construction)."""
        kwargs = getattr(data, "kwargs", None)  # construction (ArgsKwargs); assignments pass a dict: validate()
        if kwargs and kwargs.get("mixture"):
            if kwargs.get("source") is not None:
                raise ValueError(_BOTH)
            if "source" not in kwargs:
                kwargs["source"] = None
        return data

    @classmethod
    def from_dict(cls, d: dict | None) -> "DataConfig":
        """Build from a recipe's ``data:`` mapping; unknown keys are an error naming them."""
        d = dict(d or {})
        check_keys(cls, "data", d)
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def is_builtin(self) -> bool:
        return isinstance(self.source, str) and self.source.startswith("builtin:")

    @property
    def is_mixture(self) -> bool:
        return bool(self.mixture)

    def validate(self) -> None:
        """Checks beyond each field's type and range (those are enforced on construction)."""
        if self.mixture:
            self._validate_mixture()
        elif self.source is None:
            raise ConfigError("data.source: is null; set a source ('builtin:pydoc_topics' or a directory of prepared "
                             "shards) or data.mixture")
        elif not self.source.strip():
            raise ConfigError("data.source: is empty; use 'builtin:pydoc_topics' or a directory of prepared shards")
        elif self.is_builtin and self.source[len("builtin:"):] not in BUILTIN_TEXTS:
            raise ConfigError(f"data.source: unknown builtin corpus {self.source!r}; valid: "
                             + ", ".join("builtin:" + n for n in BUILTIN_TEXTS))
        if not self.tokenizer.strip():
            raise ConfigError("data.tokenizer: is empty; use 'gpt2', 'bert-base-uncased' or a tokenizer directory")

    def _validate_mixture(self) -> None:
        if self.source is not None:
            raise ConfigError(_BOTH)
        seen: dict = {}
        for i, e in enumerate(self.mixture):
            label = e.label
            if not _NAME.match(label):
                raise ConfigError(f"data.mixture[{i}].name: {label!r} cannot name metrics (val/nll/NAME); use letters, "
                                  "digits, '_', '.', '-'")
            if label in seen:
                raise ConfigError(f"data.mixture[{i}].name: {label!r} already names data.mixture[{seen[label]}]; give "
                                  "each source its own name")
            seen[label] = i
            if e.source.startswith("builtin:") and e.source[len("builtin:"):] not in BUILTIN_TEXTS:
                raise ConfigError(f"data.mixture[{i}].source: unknown builtin corpus {e.source!r}; valid: "
                                  + ", ".join("builtin:" + n for n in BUILTIN_TEXTS))


_BOTH = ("data.source: set together with data.mixture; a mixture takes the place of data.source "
         "(set data.source=null, or drop data.mixture)")
