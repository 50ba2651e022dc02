"""Raw text in: a Hugging Face dataset name, local parquet/json/jsonl/txt files, a directory of them,
a directory written by `datasets`' save_to_disk (hf_inputs.py), or a builtin corpus. Everything
becomes a `TextSource`: an indexable list of documents, read a slice at a time (Arrow, memory-mapped)."""
from __future__ import annotations

import glob
import hashlib
import os

from common.errors import InputFileError, UsageError

from .corpus import BUILTIN_TEXTS, builtin_text
from .hf_inputs import is_saved_dataset, load_hub, load_saved

FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text",
                 ".json.gz": "json", ".jsonl.gz": "json", ".txt.gz": "text"}
TXT_UNITS = ("line", "paragraph", "document")


class TextSource:
    """Documents ``[0, len)``; `texts(a, b)` returns a slice as a list of strings."""

    def __init__(self, docs, description: str, fingerprint: str, field: str | None = None):
        self._docs, self._field = docs, field
        self.description, self.fingerprint = description, fingerprint

    def __len__(self) -> int:
        return len(self._docs)

    def texts(self, start: int, stop: int) -> list[str]:
        if self._field is None:
            return list(self._docs[start:stop])
        return [t if isinstance(t, str) else "" for t in self._docs[start:stop][self._field]]

    def select(self, start: int, stop: int, what: str) -> "TextSource":
        docs = self._docs[start:stop] if self._field is None else self._docs.select(range(start, stop))
        return TextSource(docs, f"{self.description}, {what}", f"{self.fingerprint}:{start}:{stop}", self._field)


def _builder_for(path: str) -> str | None:
    for ext in sorted(FILE_BUILDERS, key=len, reverse=True):
        if path.endswith(ext):
            return FILE_BUILDERS[ext]
    return None


def _local_files(path: str) -> list[str]:
    if os.path.isdir(path):
        files = sorted(f for f in glob.glob(os.path.join(path, "**", "*"), recursive=True)
                       if os.path.isfile(f) and _builder_for(f))
        if not files:
            raise InputFileError(f"--input: directory {path!r} holds no {'/'.join(sorted(FILE_BUILDERS))} files")
        return files
    files = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]
    if not files or not all(os.path.isfile(f) for f in files):
        raise InputFileError(f"--input: no such file {path!r}")
    for f in files:
        if not _builder_for(f):
            raise InputFileError(f"--input: {f!r} is not a supported file (use {', '.join(sorted(FILE_BUILDERS))})")
    return files


def check_text_files(files: list[str]) -> None:
    """Name the first input file that is empty or (text/JSON) not UTF-8, before any work starts.
    One streaming pass with an incremental decoder (tokenizing the files reads them anyway)."""
    import codecs
    import gzip

    for f in files:
        builder = _builder_for(f)
        opener = gzip.open if f.endswith(".gz") else open
        if os.path.getsize(f) == 0:
            raise InputFileError(f"--input: {f}: empty file (0 bytes); remove it or point --input elsewhere")
        if builder == "parquet":
            continue
        decoder, offset, size = codecs.getincrementaldecoder("utf-8")(), 0, 0
        try:
            with opener(f, "rb") as fh:
                while chunk := fh.read(1 << 20):
                    decoder.decode(chunk)
                    offset += len(chunk)
                    size += len(chunk.strip())
                decoder.decode(b"", final=True)
        except UnicodeDecodeError as e:
            raise InputFileError(f"--input: {f}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                                 f"{offset + e.start}); convert it first, e.g. iconv -f latin1 -t utf-8") from None
        except (OSError, EOFError) as e:  # a damaged .gz
            raise InputFileError(f"--input: {f}: cannot be read ({type(e).__name__}: {e})") from None
        if size == 0:
            raise InputFileError(f"--input: {f}: holds no text (only whitespace); remove it or point --input elsewhere")


def _check(ds, field: str, desc: str):
    if field not in ds.column_names:
        raise UsageError(f"--text-field: {desc} has no column {field!r} (columns: {', '.join(ds.column_names)})")
    if len(ds) == 0:
        raise InputFileError(f"--input: {desc} holds no documents")
    return ds


def open_text(spec: str, *, text_field: str = "text", split: str = "train", txt_unit: str = "line",
              name: str | None = None) -> TextSource:
    """Open `spec` (see module docstring); `split` and `name` (config) apply to hub datasets."""
    if spec.startswith("builtin:"):
        corpus = spec[len("builtin:"):]
        if corpus not in BUILTIN_TEXTS:
            raise UsageError(f"--input: unknown builtin corpus {corpus!r}; valid: "
                             + ", ".join("builtin:" + n for n in BUILTIN_TEXTS))
        if split not in ("train", None):
            raise UsageError(f"--split: builtin corpora have only a 'train' split, not {split!r}")
        docs = builtin_text(corpus)
        fp = hashlib.sha256("\x00".join(docs).encode()).hexdigest()
        return TextSource(docs, spec, fp)
    import datasets

    if is_saved_dataset(os.path.expanduser(spec)):
        path = os.path.expanduser(spec)
        ds = load_saved(path, split, "--input")
        desc = f"datasets directory {spec}" + (f" split {split!r}" if split not in (None, "train") else "")
        return TextSource(_check(ds, text_field, desc), desc, f"{ds._fingerprint}|{split}", text_field)
    if os.path.exists(spec) or any(c in spec for c in "*?[") or spec.startswith((".", "/", "~")):
        files = _local_files(os.path.expanduser(spec))
        builders = {_builder_for(f) for f in files}
        if len(builders) > 1:
            raise UsageError(f"--input: {spec!r} mixes file types ({', '.join(sorted(builders))}); use one type")
        builder = builders.pop()
        check_text_files(files)
        kw = {"sample_by": txt_unit} if builder == "text" else {}
        if txt_unit not in TXT_UNITS:
            raise UsageError(f"--txt-unit: {txt_unit!r}; valid: {', '.join(TXT_UNITS)}")
        try:
            ds = datasets.load_dataset(builder, data_files=files, split="train", **kw)
        except Exception as e:  # noqa: BLE001
            raise InputFileError(f"--input: cannot read {spec!r} as {builder} ({type(e).__name__}: {e})") from None
        stat = "|".join(f"{f}:{os.path.getsize(f)}:{os.path.getmtime(f)}" for f in files)
        fp = hashlib.sha256(f"{builder}|{txt_unit}|{stat}".encode()).hexdigest()
        desc = f"{len(files)} {builder} file(s) at {spec}"
        field = "text" if builder == "text" else text_field
        return TextSource(_check(ds, field, desc), desc, fp, field)
    ds = load_hub(spec, name, split, "--input")
    desc = f"Hugging Face dataset {spec!r}" + (f" config {name!r}" if name else "") + f" split {split!r}"
    return TextSource(_check(ds, text_field, desc), desc, str(getattr(ds, "_fingerprint", spec)), text_field)
