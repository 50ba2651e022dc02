"""`data.mixture`: several prepared sources read as one (`MixtureSource`), and opening any configured source.

A mixture's units (shards) are its sources' units end to end, so the loader's unit cache, bad-shard
accounting and the validation split (every source's val split, in mixture order: what `setdlm eval`
reads from a mixture checkpoint) work as for one source. Its train split is read through the
schedule of blend.py: position -> (source, index in that source's own order). Every source must
match the recipe's tokenizer, sequence length and packing; the first that does not is refused by
its index and name before anything is read.
"""
from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from common.schema import ConfigError

from .blend import integer_weights
from .sources import BuiltinSource


def open_source(cfg, tokenizer):
    """The source `cfg` names: a builtin corpus, prepared shards, or a `MixtureSource` of `cfg.mixture`."""
    if cfg.mixture:
        return MixtureSource.open(cfg, tokenizer)
    if cfg.is_builtin:
        from .config import EXAMPLE_PACKINGS

        if cfg.packing in EXAMPLE_PACKINGS:
            raise ConfigError(f"data.packing: {cfg.packing!r} rows come from prompt/answer shards (setdlm data prepare "
                              "--format prompt_answer); builtin corpora are packed 'wrapped' or 'wrapped_bos_eos'")
        return BuiltinSource(cfg.source[len("builtin:"):], tokenizer, cfg.seq_len, cfg.packing, float(cfg.val_fraction))
    from .shards import ShardSource

    return ShardSource.open(cfg, tokenizer)


def source_configs(cfg) -> list[tuple[str, float, object]]:
    """(name, share of the training samples, one-source DataConfig) of each source of a mixture."""
    m = integer_weights([e.weight for e in cfg.mixture])
    return [(e.label, mi / sum(m), dataclasses.replace(cfg, source=e.source, mixture=[]))
            for e, mi in zip(cfg.mixture, m)]


class MixtureSource:
    """The sources of a mixture as one source; `parts(split)` tells the loader where each one's units are."""

    def __init__(self, names: list[str], sources: list, weights: list[float], dirs: list[str]):
        self.names, self.sources, self.dirs = list(names), list(sources), list(dirs)
        self.raw_weights = [float(w) for w in weights]
        self.weights = integer_weights(self.raw_weights)
        self.seq_len, self.packing = sources[0].seq_len, sources[0].packing
        self.description = "mixture of " + ", ".join(f"{n} ({s.description})" for n, s in zip(names, sources))
        h = hashlib.sha256(b"mixture\n")
        for n, s in zip(names, sources):
            h.update(f"{n}={s.fingerprint}\n".encode())
        self.fingerprint = h.hexdigest()  # the data, not the weights (resume checks those by name)

    @classmethod
    def open(cls, cfg, tokenizer) -> MixtureSource:
        sources = []
        for i, (e, (name, _, one)) in enumerate(zip(cfg.mixture, source_configs(cfg))):
            try:
                sources.append(open_source(one, tokenizer))
            except ValueError as err:  # the one that differs, by index and name
                raise ConfigError(f"data.mixture[{i}] ({name}): {err}") from None
        return cls([e.label for e in cfg.mixture], sources, [e.weight for e in cfg.mixture],
                   [e.source for e in cfg.mixture])

    @property
    def shares(self) -> list[float]:
        return [m / sum(self.weights) for m in self.weights]

    def parts(self, split: str) -> list[tuple[int, np.ndarray]]:
        """(offset of its first unit, unit sample counts) per source."""
        out, offset = [], 0
        for s in self.sources:
            c = s.counts(split)
            out.append((offset, c))
            offset += len(c)
        return out

    def _where(self, split: str, u: int) -> tuple[int, int]:
        for i, (offset, c) in enumerate(self.parts(split)):
            if u < offset + len(c):
                return i, u - offset
        raise IndexError(f"unit {u} is beyond the mixture's {split} units")

    def counts(self, split: str) -> np.ndarray:
        return np.concatenate([s.counts(split) for s in self.sources])

    def first_ids(self, split: str) -> np.ndarray:
        return np.concatenate([s.first_ids(split) for s in self.sources])

    def unit_name(self, split: str, u: int) -> str:
        i, local = self._where(split, u)
        return self.sources[i].unit_name(split, local)

    def read_unit(self, split: str, u: int) -> np.ndarray:
        i, local = self._where(split, u)
        return self.sources[i].read_unit(split, local)
