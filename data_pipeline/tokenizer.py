"""The stack's tokenizer: a Hugging Face `tokenizers.Tokenizer` with the special ids set diffusion
needs (MASK always; EOS, BOS, pad when the vocabulary has them) and a content hash.

Text is always encoded *as text*: special-token strings inside a document (``"<|endoftext|>"``)
are not turned into special ids, so raw data cannot forge document boundaries. Building one:
data_pipeline/tokenizers.py (`load_tokenizer`); the built-in vocabularies: builtin_tokenizers.py.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from common.errors import Error
from common.io import atomic_write_text

__all__ = ["Tokenizer", "TokenizerError", "file_sha256", "META_FILE"]

META_FILE = "setdlm_tokenizer.json"


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
    ``chat_template`` is its Jinja chat template when it has one (saved in tokenizer_config.json).
    """

    def __init__(self, backend: _HFTokenizer, *, name: str, mask_id: int, eos_id=None, bos_id=None,
                 pad_id=None, chat_template: str | None = None):
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = True  # "<|endoftext|>" inside a document stays text
        self._tok = backend
        self.name = name
        self.mask_id = int(mask_id)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.bos_id = None if bos_id is None else int(bos_id)
        self.pad_id = None if pad_id is None else int(pad_id)
        self.chat_template = chat_template or None  # Jinja (data_pipeline/chat_template.py); not in sha256
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

    def save(self, directory, chat_template: str | None = None) -> None:
        """Write ``tokenizer.json`` (+ HF config files) so `load_tokenizer(directory)` rebuilds it;
        `chat_template` is written instead of its own one when given. Each file is written atomically
        and the meta file last, so a directory with it is complete; a full disk is a StorageError naming
        the file (common/io.py)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / "tokenizer.json", self._tok.to_str(pretty=True))
        tok = self._tok.id_to_token
        specials = {"mask_token": tok(self.mask_id)}
        if self.eos_id is not None:
            specials["eos_token"] = tok(self.eos_id)
        if self.bos_id is not None:
            specials["bos_token"] = tok(self.bos_id)
        if self.pad_id is not None:
            specials["pad_token"] = tok(self.pad_id)
        atomic_write_text(d / "special_tokens_map.json", json.dumps(specials, indent=2) + "\n")
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials}
        if chat_template or self.chat_template:
            config["chat_template"] = chat_template or self.chat_template
        atomic_write_text(d / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
        atomic_write_text(d / META_FILE, json.dumps(self.meta(), indent=2) + "\n")

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
