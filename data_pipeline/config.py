"""`DataConfig`: the recipe's ``data:`` section."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .corpus import BUILTIN_TEXTS

PACKINGS = {
    "wrapped": "documents joined with EOS after each one, cut into seq_len chunks (OWT convention)",
    "wrapped_bos_eos": "each document framed as BOS ... EOS ([CLS] ... [SEP] for BERT), concatenated "
                       "and cut into seq_len chunks (LM1B convention)",
    "padded": "prompt/answer examples, one per row, padded (shards with context and valid masks; prompt_answer.py)",
    "packed": "prompt/answer examples packed whole into rows (none split across rows), the rest padded",
}
EXAMPLE_PACKINGS = ("padded", "packed")  # made only by `setdlm data prepare --format prompt_answer|chat|marker`


@dataclass
class DataConfig:
    """Where training/validation sequences come from and how they are read.

    source: ``"builtin:NAME"`` (tokenized in memory; quickstart and tests) or the directory/URL of
        prepared shards holding ``manifest.json`` (local path, ``file://``, or any fsspec/webdataset
        URL such as ``s3://...``; ``pipe:`` sources are not supported for the manifest).
    tokenizer: ``"gpt2"``, ``"bert-base-uncased"`` or a tokenizer directory; for shard sources it must
        match the manifest (checked by hash).
    add_mask_token: append ``<|mask|>`` when the tokenizer has no mask token.
    seq_len: tokens per sequence (must equal the manifest's for shard sources).
    packing: how documents become sequences (see `PACKINGS`; must equal the manifest's).
    val_fraction: builtin sources only: the last fraction of sequences is the validation split.
    num_workers: loader worker processes per rank (0: read in the training process).
    shuffle: shuffle shards and samples of the train split (the val split is never shuffled).
    shuffle_window: shards read together and shuffled as one pool (memory: this many shards per worker).
    skip_bad_shards: skip (and count, and log) unreadable or corrupt shards instead of raising.
    verify_checksums: check each shard's sha256 against the manifest when it is read.
    prefetch_factor: batches each worker prepares ahead (num_workers > 0 only).
    with_sample_ids: add ``sample_id`` and ``epoch`` tensors to each batch (data-order audits, tests).
    """

    source: str = "builtin:pydoc_topics"
    tokenizer: str = "gpt2"
    add_mask_token: bool = False
    seq_len: int = 128
    packing: str = "wrapped"
    val_fraction: float = 0.05
    num_workers: int = 0
    shuffle: bool = True
    shuffle_window: int = 4
    skip_bad_shards: bool = False
    verify_checksums: bool = True
    prefetch_factor: int = 2
    with_sample_ids: bool = False

    @classmethod
    def from_dict(cls, d: dict | None) -> "DataConfig":
        """Build from a recipe's ``data:`` mapping; unknown keys are an error naming them."""
        d = dict(d or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ValueError(f"data.{unknown[0]}: unknown field; valid fields: {', '.join(names)}")
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def is_builtin(self) -> bool:
        return isinstance(self.source, str) and self.source.startswith("builtin:")

    def validate(self) -> None:
        def bad(field, msg):
            raise ValueError(f"data.{field}: {msg}")

        def need_type(field, typ, what):
            v = getattr(self, field)
            if isinstance(v, bool) and typ is not bool or not isinstance(v, typ):
                bad(field, f"must be {what}, got {v!r}")

        need_type("source", str, "a string ('builtin:NAME' or a shard directory/URL)")
        if not self.source.strip():
            bad("source", "is empty; use 'builtin:pydoc_topics' or a directory of prepared shards")
        if self.is_builtin and self.source[len("builtin:"):] not in BUILTIN_TEXTS:
            bad("source", f"unknown builtin corpus {self.source!r}; valid: "
                          + ", ".join("builtin:" + n for n in BUILTIN_TEXTS))
        need_type("tokenizer", str, "a tokenizer name or directory")
        if not self.tokenizer.strip():
            bad("tokenizer", "is empty; use 'gpt2', 'bert-base-uncased' or a tokenizer directory")
        for f in ("add_mask_token", "shuffle", "skip_bad_shards", "verify_checksums", "with_sample_ids"):
            need_type(f, bool, "true or false")
        need_type("seq_len", int, "a positive integer")
        if self.seq_len < 2:
            bad("seq_len", f"must be at least 2, got {self.seq_len}")
        if self.packing not in PACKINGS:
            bad("packing", f"unknown packing {self.packing!r}; valid: {', '.join(PACKINGS)}")
        if isinstance(self.val_fraction, bool) or not isinstance(self.val_fraction, (int, float)) \
                or not 0.0 <= float(self.val_fraction) < 1.0:
            bad("val_fraction", f"must be a number in [0, 1), got {self.val_fraction!r}")
        need_type("num_workers", int, "an integer >= 0")
        if self.num_workers < 0:
            bad("num_workers", f"must be >= 0, got {self.num_workers}")
        need_type("shuffle_window", int, "an integer >= 1")
        if self.shuffle_window < 1:
            bad("shuffle_window", f"must be >= 1, got {self.shuffle_window}")
        need_type("prefetch_factor", int, "an integer >= 1")
        if self.prefetch_factor < 1:
            bad("prefetch_factor", f"must be >= 1, got {self.prefetch_factor}")
