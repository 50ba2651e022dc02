"""Small built-in text corpora that need nothing installed (quickstart, tests, benchmarks)."""
from __future__ import annotations

from common.schema import ConfigError

BUILTIN_TEXTS = ("pydoc_topics",)


def builtin_text(name: str) -> list[str]:
    """Documents of a built-in corpus.

    ``"pydoc_topics"``: the help topics shipped with Python (``pydoc_data/topics.py``, about 465k
    characters), one document per topic, in sorted topic order.
    """
    if name == "pydoc_topics":
        from pydoc_data.topics import topics

        return [topics[k] for k in sorted(topics) if topics[k].strip()]
    raise ConfigError(f"unknown builtin corpus {name!r}; valid: {', '.join(BUILTIN_TEXTS)}")
