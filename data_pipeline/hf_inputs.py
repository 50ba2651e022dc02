"""`datasets` inputs of `setdlm data prepare`, for every format: a directory written by
``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` (Arrow files, memory-mapped, never copied)
and a Hugging Face hub name (`load_dataset`, which caches it as Arrow on disk). Both are read a
slice at a time, so neither has to fit in memory. Failures are one line naming the option."""

from __future__ import annotations

import os
from pathlib import Path

from common.errors import Error, InputFileError

__all__ = ["is_saved_dataset", "load_hub", "load_saved", "looks_like_hub_name"]

SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


def is_saved_dataset(path) -> bool:
    """Whether `path` is a directory written by `save_to_disk` (a Dataset or a DatasetDict)."""
    p = Path(path)
    return p.is_dir() and any((p / f).is_file() for f in SAVED_MARKERS)


def looks_like_hub_name(spec: str) -> bool:
    """``name`` or ``org/name``, not a path (a missing local file is reported as one)."""
    import re

    return (not spec.startswith((".", "/", "~")) and not os.path.exists(spec)
            and re.fullmatch(r"[\w.-]+(/[\w.-]+)?", spec) is not None
            and not spec.endswith((".jsonl", ".json", ".parquet", ".txt", ".gz", ".arrow")))


def _one_split(ds, split: str | None, what: str, where: str, error: type[Error]):
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        split = split or "train"
        if split not in ds:
            raise error(f"{what}: {where} has no split {split!r} (splits: {', '.join(ds)}); choose one with --split")
        return ds[split]
    if split not in (None, "train"):
        raise error(f"{what}: {where} holds one Dataset, not a DatasetDict with a split {split!r}")
    return ds


def load_saved(path: str, split: str | None, what: str, error: type[Error] = InputFileError):
    """The Dataset saved at `path` (the split `split`, default train, of a saved DatasetDict)."""
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:  # noqa: BLE001 - datasets raises several types
        raise error(f"{what}: {path} cannot be read with datasets.load_from_disk ({type(e).__name__}: {e})") from None
    return _one_split(ds, split, what, str(path), error)


def load_hub(spec: str, name: str | None, split: str | None, what: str, error: type[Error] = InputFileError):
    """Split `split` (default train) of the hub dataset `spec` (config `name`)."""
    import datasets

    split = split or "train"
    try:
        return datasets.load_dataset(spec, name, split=split)
    except Exception as e:  # noqa: BLE001 - report any hub failure the same way
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise error(f"{what}: cannot load Hugging Face dataset {spec!r} (config {name!r}, split {split!r}): "
                    f"{type(e).__name__}: {msg}"
                    + (" [offline mode: HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set]" if offline else "")) from None
