"""`DataConfig`: the recipe's ``data:`` section (typed and validated; see common/schema.py)."""
from __future__ import annotations

import dataclasses
from typing import Literal

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


@section("data")
class DataConfig:
    """Where training/validation sequences come from and how they are read.

    ``source`` is ``"builtin:NAME"`` (tokenized in memory; quickstart and tests) or the directory/URL
    of prepared shards holding ``manifest.json`` (local path, ``file://``, or any fsspec/webdataset
    URL such as ``s3://...``; ``pipe:`` sources are not supported for the manifest). For shard
    sources ``tokenizer``, ``seq_len`` and ``packing`` must match the manifest (checked at start).
    """

    source: Text = Field("builtin:pydoc_topics", min_length=1, description=(
        "'builtin:NAME' (in-memory corpus) or the directory/URL of prepared shards with manifest.json"))
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
    shuffle_window: int = Field(4, ge=1, description="shards read together and shuffled as one pool (memory: this many per worker)")
    skip_bad_shards: bool = Field(False, description="skip (count and log) unreadable or corrupt shards instead of stopping")
    verify_checksums: bool = Field(True, description="check each shard's sha256 against the manifest when it is read")
    prefetch_factor: int = Field(2, ge=1, description="batches each worker prepares ahead (num_workers > 0 only)")
    with_sample_ids: bool = Field(False, description="add sample_id and epoch tensors to each batch (data-order audits)")

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

    def validate(self) -> None:
        """Checks beyond each field's type and range (those are enforced on construction)."""
        if not self.source.strip():
            raise ConfigError("data.source: is empty; use 'builtin:pydoc_topics' or a directory of prepared shards")
        if self.is_builtin and self.source[len("builtin:"):] not in BUILTIN_TEXTS:
            raise ConfigError(f"data.source: unknown builtin corpus {self.source!r}; valid: "
                              + ", ".join("builtin:" + n for n in BUILTIN_TEXTS))
        if not self.tokenizer.strip():
            raise ConfigError("data.tokenizer: is empty; use 'gpt2', 'bert-base-uncased' or a tokenizer directory")
