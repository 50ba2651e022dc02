"""Tokenizing long texts in bounded memory.

While it encodes, `tokenizers` holds about 150 bytes per token besides the ids (token strings,
offsets, word ids, the normalized string's alignments), so a 10 MB row took 1.5 GB. A text longer
than `LONG` characters is encoded in pieces of `CHUNK` characters:

* `encode_prefix(backend, text, limit)`: its first `limit` token ids (all of them when fewer), read
  only as far as they reach: what `data prepare --format prompt_answer|chat|...` needs of a row, which
  is cut at ``--seq-len`` anyway;
* `encode_array(backend, text, dtype)`: all its token ids as one array (`data prepare` text);
* `encode_prefix_offsets(backend, text, limit)`: the first `limit` ids and their (start, end)
  character offsets (the chat template's masks).

A piece keeps its tokens up to the start of a word (pre-token) at least `margin` characters before
its end, and the next piece starts at that word: a word's tokens depend only on its characters, and
where the words far enough from the cut begin and end does not depend on the text after it (the
pre-tokenizers and normalizers of BPE/WordPiece tokenizers split by local rules; `margin` also
covers the longest added token). Each restart is checked: the next piece must give the word it
starts with the same tokens the previous piece gave it. A tokenizer that treats the start of a text
specially (a prefix space or ``▁``) fails that check, and the text is then encoded whole.
"""

from __future__ import annotations

import numpy as np

__all__ = ["CHUNK", "LONG", "encode_array", "encode_prefix", "encode_prefix_offsets"]

CHUNK = 1 << 16  # characters per piece
LONG = 1 << 17  # texts up to this many characters are encoded whole


class _Restart(Exception):
    """A piece that restarts at a word gave it other tokens than the text before it did."""


def _margin(backend) -> int:
    added = backend.get_added_tokens_decoder().values()
    return max([64, *(2 * len(t.content) for t in added)])


def _cut(words: list, offsets: list, before: int) -> int | None:
    """Index of the first token of the last word that starts at or before character `before` and
    is not the last word (None when there is none). Tokens without a word (added tokens) are words
    of their own."""
    cut, last_start = None, None
    for i in range(len(words) - 1, 0, -1):
        if words[i] is not None and words[i] == words[i - 1]:
            continue  # inside a word
        if last_start is None:
            last_start = i  # the last word: never kept, it may go on after the cut
            continue
        if offsets[i][0] <= before:
            cut = i
            break
    return cut


def _pieces(backend, text: str, chunk: int, offsets_too: bool = False):
    """Lists of token ids whose concatenation is ``backend.encode(text).ids`` (with `offsets_too`,
    (ids, offsets into `text`) pairs); raises _Restart."""
    margin = _margin(backend)
    size, pos, expect = max(chunk, 4 * margin), 0, None
    while len(text) - pos > 2 * size:
        e = backend.encode(text[pos:pos + size], add_special_tokens=False)
        ids, words, offsets = e.ids, e.word_ids, e.offsets
        if expect is not None and ids[:len(expect)] != expect:
            raise _Restart
        cut = _cut(words, offsets, size - margin)
        if cut is None or offsets[cut][0] == 0:  # one word longer than the piece: take larger pieces
            size *= 2
            continue
        end = cut + 1
        while end < len(ids) and words[end] is not None and words[end] == words[cut]:
            end += 1
        expect = ids[cut:end]
        yield (ids[:cut], [(pos + a, pos + b) for a, b in offsets[:cut]]) if offsets_too else ids[:cut]
        pos += offsets[cut][0]
    e = backend.encode(text[pos:], add_special_tokens=False)
    if expect is not None and e.ids[:len(expect)] != expect:
        raise _Restart
    yield (e.ids, [(pos + a, pos + b) for a, b in e.offsets]) if offsets_too else e.ids


def encode_prefix(backend, text: str, limit: int, *, long: int = LONG, chunk: int = CHUNK) -> list[int]:
    """``backend.encode(text).ids[:limit]``, reading no further into a long text than needed."""
    if len(text) <= long:
        return backend.encode(text, add_special_tokens=False).ids[:limit]
    out = []
    try:
        for piece in _pieces(backend, text, chunk):
            out += piece[: limit - len(out)]
            if len(out) >= limit:
                break
        return out
    except _Restart:
        return backend.encode(text, add_special_tokens=False).ids[:limit]


def encode_prefix_offsets(backend, text: str, limit: int, *, long: int = LONG,
                          chunk: int = CHUNK) -> tuple[list[int], list[tuple[int, int]]]:
    """`encode_prefix` with each token's (start, end) character offsets in `text`."""
    if len(text) > long:
        ids, offsets = [], []
        try:
            for piece, offs in _pieces(backend, text, chunk, offsets_too=True):
                ids += piece[: limit - len(ids)]
                offsets += offs[: limit - len(offsets)]
                if len(ids) >= limit:
                    break
            return ids, offsets
        except _Restart:
            pass
    e = backend.encode(text, add_special_tokens=False)
    return e.ids[:limit], e.offsets[:limit]


def encode_array(backend, text: str, dtype, *, long: int = LONG, chunk: int = CHUNK) -> np.ndarray:
    """All token ids of `text` (``backend.encode(text).ids``) as an array of `dtype`."""
    if len(text) <= long:
        return np.asarray(backend.encode(text, add_special_tokens=False).ids, dtype=dtype)
    try:
        return np.concatenate([np.asarray(p, dtype=dtype) for p in _pieces(backend, text, chunk)])
    except _Restart:
        return np.asarray(backend.encode(text, add_special_tokens=False).ids, dtype=dtype)
