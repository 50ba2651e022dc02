"""Token shards: webdataset ``.tar`` files of fixed-length token arrays, plus ``manifest.json``.

Layout of a prepared directory::

    manifest.json                 # written last (atomically): the directory is complete
    manifest.partial.json         # progress of an unfinished `prepare` (lets a re-run resume)
    tokenizer/                    # the tokenizer the shards were made with (`Tokenizer.save`)
    train/shard-000000.tar ...    # samples "<10-digit sample index>.input_ids.npy"
    val/shard-000000.tar ...

Each sample is one ``.npy`` array of ``seq_len`` tokens of the manifest's dtype, so
``webdataset.WebDataset(url).decode()`` reads the shards too. Prompt/answer shards (manifest
``masks: [context_mask, valid_mask]``, data_pipeline/prompt_answer.py) add per sample
``context_mask.npy`` (1 = prompt token) and ``valid_mask.npy`` (0 = padding), uint8 of ``seq_len``.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
from urllib.parse import urlparse

import numpy as np

from common.errors import InputFileError
from common.io import atomic_write_json
from common.schema import ConfigError

from .sources import ShardError

MANIFEST = "manifest.json"
PARTIAL = "manifest.partial.json"
FORMAT = "setdlm-token-shards"
VERSION = 1
FIELD = "input_ids.npy"


# -- URLs -------------------------------------------------------------------------------------------
def is_local(url: str) -> bool:
    scheme = urlparse(str(url)).scheme
    return scheme in ("", "file") or len(scheme) == 1


def local_path(url: str) -> str:
    return urlparse(url).path if str(url).startswith("file:") else str(url)


def join_url(base: str, rel: str) -> str:
    return os.path.join(local_path(base), rel) if is_local(base) else base.rstrip("/") + "/" + rel


def read_bytes(url: str) -> bytes:
    """Whole file at a local path or ``file://`` URL, else through fsspec (s3://, gs://, http...:
    needs the matching fsspec backend), else through webdataset's gopen (``pipe:`` commands etc.)."""
    if is_local(url):
        with open(local_path(url), "rb") as f:
            return f.read()
    if not url.startswith("pipe:"):
        import fsspec

        try:
            fs_open = fsspec.open(url, "rb")
        except (ImportError, ValueError):  # no fsspec backend for this protocol: try webdataset's
            fs_open = None
        if fs_open is not None:
            with fs_open as f:
                return f.read()
    from webdataset.gopen import gopen

    with gopen(url, "rb") as f:
        return f.read()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- encoding ---------------------------------------------------------------------------------------
def _npy_header(seq_len: int, dtype) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.zeros(seq_len, dtype=dtype))
    return buf.getvalue()[: -seq_len * np.dtype(dtype).itemsize]


MASK_FIELDS = ("context_mask", "valid_mask")  # prompt/answer shards: uint8 per token (data_pipeline/prompt_answer.py)


def encode_shard(rows: np.ndarray, first_sample: int, masks: dict | None = None) -> bytes:
    """A reproducible tar (fixed mtime/owner) with one ``.npy`` member per row, plus one uint8 ``.npy``
    member per row for each of `masks` ({"context_mask": [n, L], "valid_mask": [n, L]}) when given."""
    import webdataset as wds

    header = _npy_header(rows.shape[1], rows.dtype)
    mheader = _npy_header(rows.shape[1], np.uint8)
    out = io.BytesIO()
    with wds.TarWriter(out, encoder=False, mtime=0, user="setdlm", group="setdlm", mode=0o444) as w:
        for i, row in enumerate(rows):
            sample = {"__key__": f"{first_sample + i:010d}", FIELD: header + np.ascontiguousarray(row).tobytes()}
            for k, m in (masks or {}).items():
                sample[f"{k}.npy"] = mheader + np.ascontiguousarray(m[i], dtype=np.uint8).tobytes()
            w.write(sample)
    return out.getvalue()


def decode_shard(data: bytes, name: str, entry: dict, seq_len: int, dtype, fields=(FIELD,)) -> np.ndarray:
    """Rows of a shard, checked against its manifest entry (count, keys, dtype, shape): [count, seq_len]
    token ids, or [count, 1 + len(MASK_FIELDS), seq_len] (ids, context mask, valid mask) for shards
    whose manifest lists the mask fields."""
    from webdataset.tariterators import tar_file_iterator

    fields = tuple(fields)
    members = sorted(fields)  # TarWriter writes a sample's members in sorted order
    headers = {f: _npy_header(seq_len, dtype if f == FIELD else np.uint8) for f in fields}
    sizes = {f: seq_len * (np.dtype(dtype).itemsize if f == FIELD else 1) for f in fields}
    first, count = int(entry["first_sample"]), int(entry["num_samples"])
    out = np.empty((count, len(fields), seq_len), dtype=dtype)
    i = j = 0
    try:
        for member in tar_file_iterator(io.BytesIO(data)):
            f = members[j]
            want = f"{first + i:010d}.{f}"
            if member["fname"] != want:
                raise ShardError(f"{name}: member {i} is {member['fname']!r}, expected {want!r}")
            b, header = member["data"], headers[f]
            if len(b) != len(header) + sizes[f] or not b.startswith(header):
                raise ShardError(f"{name}: sample {first + i} {f} is not a {seq_len}-token array of its dtype")
            if i >= count:
                raise ShardError(f"{name}: holds more than the {count} samples of its manifest entry")
            out[i, fields.index(f)] = np.frombuffer(b, dtype=dtype if f == FIELD else np.uint8, offset=len(header))
            j += 1
            if j == len(members):
                i, j = i + 1, 0
    except ShardError:
        raise
    except Exception as e:  # noqa: BLE001 - tarfile raises several types for truncated/corrupt data
        raise ShardError(f"{name}: corrupt or truncated tar after {i} samples ({type(e).__name__}: {e})") from None
    if i != count or j:
        raise ShardError(f"{name}: holds {i} samples, its manifest entry says {count} (truncated?)")
    return out[:, 0] if len(fields) == 1 else out


# -- manifest ---------------------------------------------------------------------------------------
def read_manifest(base: str) -> dict:
    url = join_url(base, MANIFEST)
    try:
        data = read_bytes(url)
    except FileNotFoundError:
        if is_local(base) and not os.path.isdir(local_path(base)):
            raise ConfigError(f"data.source: {base!r} is neither 'builtin:NAME' nor a directory of prepared "
                              f"shards (no such directory)") from None
        if is_local(base) and os.path.exists(join_url(base, PARTIAL)):
            raise ConfigError(f"data.source: preparation of {base!r} is unfinished ({PARTIAL} but no {MANIFEST}); "
                              f"re-run `setdlm data prepare` with the same arguments to complete it") from None
        raise ConfigError(f"data.source: no {MANIFEST} in {base!r}; prepare it with `setdlm data prepare`") from None
    except Exception as e:  # noqa: BLE001
        raise InputFileError(f"data.source: cannot read {url} ({type(e).__name__}: {e})") from None
    try:
        m = json.loads(data)
    except ValueError as e:
        raise InputFileError(f"data.source: {url} is not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise InputFileError(f"data.source: {url} is not a {FORMAT} manifest")
    if m.get("version") != VERSION:
        raise InputFileError(f"data.source: {url} has manifest version {m.get('version')}, this code reads {VERSION}")
    missing = manifest_problems(m)
    if missing:
        raise InputFileError(f"data.source: {url} is not a complete {FORMAT} manifest (" + ", ".join(missing[:3])
                             + "); prepare the directory again with `setdlm data prepare`")
    return m


# what every reader of a manifest uses (data inspect, the loader): key -> type
_MANIFEST_KEYS = {"tokenizer": dict, "seq_len": int, "packing": str, "dtype": str, "splits": dict}
_TOKENIZER_KEYS = {"name": str, "vocab_size": int, "mask_id": int, "sha256": str}
_SPLIT_KEYS = {"shards": list, "num_shards": int, "num_samples": int, "num_tokens": int, "num_documents": int}
_SHARD_KEYS = {"path": str, "num_samples": int, "first_sample": int, "bytes": int, "sha256": str}


def _absent(obj, keys: dict, where: str) -> list[str]:
    return [f"`{where}{k}` ({t.__name__})" for k, t in keys.items()
            if not isinstance(obj.get(k), t) or isinstance(obj.get(k), bool)]


def manifest_problems(m: dict) -> list[str]:
    """The keys a manifest lacks or holds with the wrong type (empty: usable)."""
    out = _absent(m, _MANIFEST_KEYS, "")
    if out:
        return out
    out = _absent(m["tokenizer"], _TOKENIZER_KEYS, "tokenizer.")
    try:
        np.dtype(m["dtype"])
    except TypeError:
        out.append(f"`dtype` ({m['dtype']!r} is not a numpy dtype)")
    for split, info in m["splits"].items():
        if not isinstance(info, dict):
            out.append(f"`splits.{split}` (dict)")
            continue
        out += _absent(info, _SPLIT_KEYS, f"splits.{split}.")
        for i, e in enumerate(info.get("shards") or []):
            bad = [f"`splits.{split}.shards[{i}]` (dict)"] if not isinstance(e, dict) else \
                _absent(e, _SHARD_KEYS, f"splits.{split}.shards[{i}].")
            if bad:
                out += bad
                break
    return out


def tokenizer_mismatch(manifest: dict, tokenizer, source: str, name: str | None = None) -> str | None:
    """The one check that `tokenizer` (shown as `name`) is the one the shards of `source` were prepared
    with, by content hash: None when it is, else the mismatch in words (both names and hashes)."""
    t = manifest["tokenizer"]
    if t["sha256"] == tokenizer.sha256:
        return None
    return (f"{name or tokenizer.name!r} (sha256 {tokenizer.sha256[:12]}...) is not the tokenizer the shards in "
            f"{source!r} were prepared with ({t['name']!r}, sha256 {t['sha256'][:12]}...)")


def write_json_atomic(path: str, obj: dict) -> None:
    atomic_write_json(path, obj, indent=1)


class ShardSource:
    """Prepared shards described by a manifest; one unit per shard."""

    def __init__(self, base: str, manifest: dict, verify: bool):
        self.base, self.manifest, self.verify = base, manifest, verify
        self.seq_len = int(manifest["seq_len"])
        self.packing = manifest["packing"]
        self.dtype = np.dtype(manifest["dtype"])
        self.fields = (FIELD, *(f"{k}.npy" for k in manifest.get("masks", ())))  # prompt/answer shards carry masks
        self.description = f"shards at {base!r}"
        self._counts, self._first = {}, {}
        for split, info in manifest["splits"].items():
            self._counts[split] = np.array([s["num_samples"] for s in info["shards"]], dtype=np.int64)
            self._first[split] = np.array([s["first_sample"] for s in info["shards"]], dtype=np.int64)
        h = hashlib.sha256(json.dumps({k: manifest[k] for k in ("tokenizer", "seq_len", "packing", "dtype")},
                                      sort_keys=True).encode())
        for split in sorted(manifest["splits"]):
            for s in manifest["splits"][split]["shards"]:
                h.update(f"{split}/{s['path']}/{s['sha256']}\n".encode())
        self.fingerprint = h.hexdigest()

    @classmethod
    def open(cls, cfg, tokenizer) -> "ShardSource":
        m = read_manifest(cfg.source)
        why = tokenizer_mismatch(m, tokenizer, cfg.source)
        if why:
            raise ConfigError(f"data.tokenizer: {why}; set data.tokenizer to {m['tokenizer']['name']!r} or to "
                              f"{join_url(cfg.source, 'tokenizer')!r}")
        if int(m["seq_len"]) != cfg.seq_len:
            raise ConfigError(f"data.seq_len: {cfg.seq_len}, but the shards in {cfg.source!r} hold sequences of "
                              f"{m['seq_len']} tokens; set data.seq_len: {m['seq_len']}")
        if m["packing"] != cfg.packing:
            raise ConfigError(f"data.packing: {cfg.packing!r}, but the shards in {cfg.source!r} were packed "
                              f"{m['packing']!r}; set data.packing: {m['packing']}")
        return cls(cfg.source, m, cfg.verify_checksums)

    def _split(self, split: str) -> str:
        if split not in self._counts:
            raise ConfigError(f"split: {self.description} has no {split!r} split (it has: "
                              f"{', '.join(sorted(self._counts))}); prepare one (e.g. --val-docs or --val-split)")
        return split

    def counts(self, split: str) -> np.ndarray:
        return self._counts[self._split(split)]

    def first_ids(self, split: str) -> np.ndarray:
        return self._first[self._split(split)]

    def unit_name(self, split: str, u: int) -> str:
        return join_url(self.base, self.manifest["splits"][split]["shards"][u]["path"])

    def read_unit(self, split: str, u: int) -> np.ndarray:
        entry = self.manifest["splits"][split]["shards"][u]
        url = join_url(self.base, entry["path"])
        try:
            data = read_bytes(url)
        except Exception as e:  # noqa: BLE001
            raise ShardError(f"{url}: cannot read shard ({type(e).__name__}: {e})") from None
        if self.verify:
            if len(data) != entry["bytes"]:
                raise ShardError(f"{url}: {len(data)} bytes, the manifest says {entry['bytes']} (truncated or "
                                 f"replaced shard)")
            if sha256_bytes(data) != entry["sha256"]:
                raise ShardError(f"{url}: sha256 does not match the manifest (corrupt or replaced shard)")
        rows = decode_shard(data, url, entry, self.seq_len, self.dtype, self.fields)
        self._check_ids(rows if rows.ndim == 2 else rows[:, 0], url, entry)
        return rows

    def _check_ids(self, ids: np.ndarray, url: str, entry: dict) -> None:
        """Every token id inside the tokenizer's vocabulary (also without verify_checksums: an id past it
        would index past the embedding, or train the padding rows of a padded vocabulary)."""
        vocab = int(self.manifest["tokenizer"]["vocab_size"])
        if ids.size and (int(ids.max()) >= vocab or int(ids.min()) < 0):
            bad = np.flatnonzero((ids >= vocab) | (ids < 0))[0]
            raise ShardError(f"{url}: token id {int(ids.flat[bad])} of sample {int(entry['first_sample']) + bad // ids.shape[1]} "
                             f"is outside the vocabulary of {self.manifest['tokenizer']['name']!r} (ids 0..{vocab - 1}); "
                             "the shard is corrupt or was not prepared with this tokenizer")
