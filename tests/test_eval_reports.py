"""What `setdlm eval gsm8k` reports: the decoded-token budget per problem is printed at start and in the
result line, recorded in the spec and metrics, and a budget below what the reference solutions take
is a warning (console, metrics.json, summary.md); examples.jsonl has one schema for both backends and
every prompt format (docs/eval.md: `prompt` text, `tokens` a list of ids, skipped problems are not
rows); summary.md says the numbers metrics.json holds (no blank, the same skipped count)."""

from __future__ import annotations

import json
import re

import pytest

from helpers import REPO, eval_result

from eval.cli import main as eval_main
from eval.cli import run_task

DATA = REPO / "tests" / "fixtures" / "eval" / "gsm8k_test.jsonl"
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
# The row of every backend and prompt format (docs/eval.md, "examples.jsonl")
ROW = {"key": str, "question": str, "gold": str, "prediction": (str, type(None)), "rule": str, "correct": bool,
       "generation": str, "prompt": str, "tokens": list, "n_tokens": int, "steps": int, "tokens_per_step": float,
       "seconds": float, "batch_seconds": float, "stop_reason": str, "prompt_tokens": int, "prompt_cut": int,
       "unit": int}




def test_the_decoding_budget_is_printed_recorded_and_warned_about(random_gpt2_run, tmp_path, capsys):
    from data_pipeline.tokenizers import load_tokenizer

    tok = load_tokenizer("gpt2")
    lengths = sorted(len(tok.encode(json.loads(line)["answer"])) for line in DATA.read_text().splitlines()[:3])
    median = lengths[1]
    out = tmp_path / "o"
    assert eval_main(["gsm8k", "--checkpoint", str(random_gpt2_run), "--data", str(DATA), "--out", str(out), "--limit", "3",
                      "--backend", "direct", "--max-new-tokens", "2"]) == 0
    cap = capsys.readouterr()
    assert f"decoding budget: 2 new tokens per problem (--max-new-tokens); the reference solutions take {median} " \
           "tokens (median)" in cap.err
    warn = f"2 new tokens per problem (--max-new-tokens) is below what an answer needs: the reference solutions take " \
           f"{median} tokens (median)"
    assert f"warning: {warn}" in cap.err  # at start, before any decoding
    assert "max_new_tokens 2" in cap.out and f"gsm8k: warning: {warn}" in cap.out  # the result lines
    m, spec, recs = eval_result(out)
    assert spec["max_new_tokens"] == m["max_new_tokens"] == 2 and m["answer_tokens_median"] == median
    assert m["max_new_tokens_warning"].startswith(warn) and m["stopped_at_budget"] == sum(
        r["stop_reason"] == "length" for r in recs.values())
    summary = (out / "summary.md").read_text()
    assert f"**WARNING** (max_new_tokens_warning): {warn}" in summary and "| max_new_tokens | 2 |" in summary
    # a budget above the median: no warning
    out2 = tmp_path / "o2"
    assert eval_main(["gsm8k", "--checkpoint", str(random_gpt2_run), "--data", str(DATA), "--out", str(out2), "--limit", "3",
                      "--backend", "direct", "--max-new-tokens", str(median)]) == 0
    assert "warning" not in capsys.readouterr().err and "max_new_tokens_warning" not in eval_result(out2)[0]


def _rows(out) -> list[dict]:
    return [json.loads(line) for line in (out / "examples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_examples_jsonl_has_one_schema_for_every_backend_and_prompt_format(random_gpt2_run, tmp_path):
    pytest.importorskip("lm_eval")
    tpl = tmp_path / "chat.jinja"
    tpl.write_text(TEMPLATE)
    q = json.loads(DATA.read_text().splitlines()[0])["question"]
    runs = {}
    for backend in ("direct", "lm-eval"):
        for fmt in ("plain", "tokenizer"):
            out = tmp_path / f"{backend}-{fmt}"
            extra = ["--chat-template", str(tpl)] if fmt == "tokenizer" else []
            run_task("gsm8k", ["--checkpoint", str(random_gpt2_run), "--data", str(DATA), "--out", str(out), "--limit", "2",
                               "--backend", backend, "--max-new-tokens", "2", "--prompt-format", fmt, *extra])
            runs[(backend, fmt)] = _rows(out)
    for (backend, fmt), rows in runs.items():
        assert len(rows) == 2
        for r in rows:
            assert set(r) == set(ROW), (backend, fmt, set(r) ^ set(ROW))
            for k, t in ROW.items():
                assert isinstance(r[k], t), (backend, fmt, k, r[k])
            assert all(isinstance(t, int) for t in r["tokens"]) and len(r["tokens"]) == r["n_tokens"]
    # the prompt is the text decoded from: the template's rendering for chat, the Q/A text for plain
    # (lm-eval's chat task is its own gsm8k, whose user turn is "Question: ...\nAnswer:")
    assert runs[("direct", "tokenizer")][0]["prompt"] == f"user: {q}\nassistant:"
    assert runs[("lm-eval", "tokenizer")][0]["prompt"] == f"user: Question: {q}\nAnswer:\nassistant:"
    assert runs[("direct", "plain")][0]["prompt"] == runs[("lm-eval", "plain")][0]["prompt"] == \
        f"Question: {q}\nAnswer:"


def _table(summary: str) -> dict[str, str]:
    return dict(re.findall(r"^\| ([^|]+?)(?: \(%\))? \| ([^|]*) \|$", summary, re.M))


def test_summary_md_says_what_metrics_json_holds_when_the_harness_skips(random_gpt2_run, tmp_path):
    """Problems skipped at run time (lm-eval builds the prompts): the SKIPPED line names the count and
    max_seq_len of metrics.json, the settings carry no count of their own, skipped problems are not rows."""
    pytest.importorskip("lm_eval")
    from data_pipeline.tokenizers import load_tokenizer

    from eval.tasks.gsm8k import TEMPLATE as QA

    tok = load_tokenizer("gpt2")
    long = sorted(str(i) for i, line in enumerate(DATA.read_text().splitlines()[:6])
                  if len(tok.encode(QA.format(question=json.loads(line)["question"]))) + 33 > 64)
    assert 0 < len(long) < 6
    out = tmp_path / "lm"
    m = run_task("gsm8k", ["--checkpoint", str(random_gpt2_run), "--out", str(out), "--data", str(DATA), "--backend", "lm-eval",
                           "--max-new-tokens", "33", "--family", "mdlm", "--steps", "4", "--limit", "6"])["metrics"]
    doc = json.loads((out / "metrics.json").read_text())
    assert doc["metrics"]["skipped_overlong"] == len(long) and sorted(doc["metrics"]["skipped_keys"]) == long
    summary = (out / "summary.md").read_text()
    assert f"**SKIPPED**: {len(long)} examples do not fit the model's max_seq_len 64 " in summary
    table = _table(summary)
    assert "" not in table.values() and table["skipped_overlong"] == str(len(long)) and table["n"] == str(m["n"])
    assert '"skipped": 0' not in summary and '"skipped"' not in json.dumps(doc["spec"]["overlong"])
    assert sorted(r["key"] for r in _rows(out)) == sorted(set(map(str, range(6))) - set(long))
