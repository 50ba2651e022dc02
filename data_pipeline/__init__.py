"""data_pipeline: raw text -> tokens -> packed sequences -> webdataset shards + manifest, and a
deterministic, resumable streaming loader. See docs/data.md.

Public API (imported lazily so tokenizer-only users do not import torch):
`load_tokenizer`, `Tokenizer`, `builtin_text`, `DataConfig`, `build_loader`, `TokenLoader`.
"""
import importlib

_EXPORTS = {
    "Tokenizer": "tokenizers", "load_tokenizer": "tokenizers", "TokenizerError": "tokenizers",
    "builtin_text": "corpus", "DataConfig": "config", "PACKINGS": "config",
    "build_loader": "loader", "TokenLoader": "loader", "ShardError": "sources",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
