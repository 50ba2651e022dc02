"""One policy for examples that do not fit the model's context (`--overlong skip|truncate|error`):
infilling on a Story Cloze validation CSV with over-length stories, GSM8K prompts, summaries and
throughput prompts, each skipped and counted by default, cut under truncate, refused under error."""

import pytest

from helpers import REPO
from helpers import eval_result as _out

from eval.cli import main as eval_main
from eval.cli import run_task

FIX = REPO / "tests" / "fixtures" / "eval"
CLOZE = FIX / "cloze_test_val__spring2016.csv"  # the Story Cloze validation CSV's format; 8 stories
LONG = ["c05", "c06", "c07"]  # over 64 tokens as prefix + span + suffix (c07: its span alone is 77 tokens)


@pytest.fixture(scope="module")
def run_dir(tiny_run, one_thread):
    """A tiny SW-SetDLM (max_seq_len 64) trained for 4 steps (conftest.py, shared)."""
    return tiny_run[1]


def _sizes(tok, span="3"):
    from eval.data import load_rocstories
    from eval.tasks.infill import split_story

    out = {}
    for st in load_rocstories(str(CLOZE)):
        a, m, b = split_story(st["sentences"], span)
        out[st["id"]] = (len(tok.encode(a)), len(tok.encode(m)), len(tok.encode(b)))
    return out


def test_infill_on_the_cloze_csv_skips_over_length_stories_by_default_and_counts_them(run_dir, tmp_path, capsys):
    from data_pipeline.tokenizers import load_tokenizer

    sizes = _sizes(load_tokenizer("gpt2"))
    assert sorted(k for k, v in sizes.items() if sum(v) > 64) == LONG  # the fixture is what this test says
    out = tmp_path / "inf"
    assert eval_main(["infill", "--checkpoint", str(run_dir), "--out", str(out), "--data", str(CLOZE)]) == 0
    m, spec, recs = _out(out)
    assert m["n"] == 5 and m["skipped_overlong"] == 3 and m["overlong_policy"] == "skip" and m["prompts_cut"] == 0
    assert sorted(recs) == ["c01", "c02", "c03", "c04", "c08"]
    assert spec["overlong"]["skipped_keys"] == LONG and spec["overlong"]["max_seq_len"] == 64
    summary = (out / "summary.md").read_text()
    assert "**SKIPPED**: 3 examples do not fit the model's max_seq_len 64" in summary and "c05" in summary
    # --limit counts stories of the file; the over-length ones among them are skipped, not refused
    assert eval_main(["infill", "--checkpoint", str(run_dir), "--out", str(tmp_path / "lim"), "--data", str(CLOZE),
                      "--limit", "6"]) == 0
    m, _, _ = _out(tmp_path / "lim")
    assert m["n"] == 4 and m["skipped_overlong"] == 2


def test_infill_truncate_cuts_the_context_far_from_the_span(run_dir, tmp_path):
    from data_pipeline.tokenizers import load_tokenizer

    sizes = _sizes(load_tokenizer("gpt2"))
    out = tmp_path / "cut"
    run_task("infill", ["--checkpoint", str(run_dir), "--out", str(out), "--data", str(CLOZE), "--overlong", "truncate"])
    m, spec, recs = _out(out)
    assert m["n"] == 7 and m["skipped_overlong"] == 1 and spec["overlong"]["skipped_keys"] == ["c07"]  # cannot fit
    assert m["prompts_cut"] == 2 and m["prompt_tokens_cut"] == sum(sum(sizes[k]) - 64 for k in ("c05", "c06"))
    for key, r in recs.items():
        a, n, b = sizes[key]
        assert r["span_tokens"] == n and r["n_tokens"] == n
        assert r["prompt_tokens"] + n == min(a + n + b, 64) and r["prompt_cut"] == max(0, a + n + b - 64)


def test_infill_error_refuses_before_the_model_loads(run_dir, tmp_path, capsys, monkeypatch):
    import eval.models as models

    monkeypatch.setattr(models.Checkpoint, "model", property(lambda self: (_ for _ in ()).throw(AssertionError("loaded"))))
    out = tmp_path / "err"
    assert eval_main(["infill", "--checkpoint", str(run_dir), "--out", str(out), "--data", str(CLOZE),
                      "--overlong", "error"]) == 2
    err = capsys.readouterr().err
    assert "--data: 3 of 8 stories" in err and "'c05'" in err and "--overlong skip" in err and "Traceback" not in err
    assert not out.exists()


def test_gsm8k_summarize_and_throughput_follow_the_same_policy(run_dir, tmp_path, capsys):
    from data_pipeline.tokenizers import load_tokenizer

    from eval.data import load_gsm8k
    from eval.tasks.gsm8k import TEMPLATE

    tok = load_tokenizer("gpt2")
    # GSM8K zero-shot with 36 new tokens in a 64-token context: SW-SetDLM decodes past max_seq_len (the
    # oldest cache entries dropped, as the reference), so every prompt (22-34 tokens: they fit) runs;
    # MDLM decoding (--family mdlm) re-reads the whole sequence: the prompts over 28 tokens are skipped
    prompt = {e["id"]: len(tok.encode(TEMPLATE.format(question=e["question"])))
              for e in load_gsm8k(str(FIX / "gsm8k_test.jsonl"))}
    need = {k: n + 36 for k, n in prompt.items()}
    assert max(prompt.values()) <= 64
    run_task("gsm8k", ["--checkpoint", str(run_dir), "--out", str(tmp_path / "gsd"), "--data", str(FIX / "gsm8k_test.jsonl"),
                       "--backend", "direct", "--max-new-tokens", "36"])
    m, spec, recs = _out(tmp_path / "gsd")
    assert m["skipped_overlong"] == 0 and m["n"] == len(prompt) and m["prompts_cut"] == 0
    assert all(r["prompt_tokens"] == prompt[k] and r["n_tokens"] <= 36 for k, r in recs.items())
    assert spec["max_new_tokens"] == 36 and "drops the oldest" in spec["context"]
    long = sorted(k for k, n in need.items() if n > 64)
    assert 0 < len(long) < len(need)
    out = tmp_path / "g"
    run_task("gsm8k", ["--checkpoint", str(run_dir), "--out", str(out), "--data", str(FIX / "gsm8k_test.jsonl"),
                       "--backend", "direct", "--max-new-tokens", "36", "--family", "mdlm"])
    m, spec, recs = _out(out)
    assert m["skipped_overlong"] == len(long) and m["n"] == len(need) - len(long) and m["prompts_cut"] == 0
    assert not set(long) & set(recs) and sorted(spec["overlong"]["skipped_keys"]) == long
    # two solved examples in the prompt: nothing fits, so skipping everything is refused; truncate cuts
    few = ["gsm8k", "--checkpoint", str(run_dir), "--data", str(FIX / "gsm8k_test.jsonl"), "--backend", "direct",
           "--fewshot", "2", "--fewshot-data", str(FIX / "gsm8k_train.jsonl"), "--max-new-tokens", "8", "--limit", "2"]
    assert eval_main(few + ["--out", str(tmp_path / "g2")]) == 2
    assert "--overlong skip: none of the 2 problems" in capsys.readouterr().err
    run_task(few[0], few[1:] + ["--out", str(tmp_path / "g3"), "--overlong", "truncate"])
    assert _out(tmp_path / "g3")[0]["prompts_cut"] == 2

    # summaries: the fixture's 3 articles against a 64-token context with 12 new tokens (and "\n\nTL;DR:")
    from eval.data import load_cnndm

    long = sum(len(tok.encode(d["article"])) + len(tok.encode("\n\nTL;DR:")) + 12 > 64
               for d in load_cnndm(str(FIX / "cnndm.csv")))
    assert long == 2
    s = run_task("summarize", ["--checkpoint", str(run_dir), "--out", str(tmp_path / "s"), "--data", str(FIX / "cnndm.csv"),
                               "--max-new-tokens", "12", "--overlong", "truncate"])["metrics"]
    assert s["articles_cut"] == 2 and s["n"] == 3 and s["skipped_overlong"] == 0
    d = run_task("summarize", ["--checkpoint", str(run_dir), "--out", str(tmp_path / "s2"), "--data",
                               str(FIX / "cnndm.csv"), "--max-new-tokens", "12"])["metrics"]
    assert d["skipped_overlong"] == 2 and d["n"] == 1 and d["articles_cut"] == 0

    # throughput prompts from a file: the over-long one is left out of the timing and counted
    prompts = tmp_path / "p.txt"
    prompts.write_text("The for statement\n" + "word " * 80 + "\nLists implement\n")
    t = run_task("throughput", ["--checkpoint", str(run_dir), "--out", str(tmp_path / "t"), "--prompts", str(prompts),
                                "--num-examples", "2", "--max-new-tokens", "4", "--warmup", "0"])["metrics"]
    assert t["skipped_overlong"] == 1 and t["prompts_cut"] == 0
    recs = _out(tmp_path / "t")[2]
    assert all(r["prompt_tokens"] < 10 for r in recs.values())


@pytest.mark.slow
def test_gsm8k_through_lm_eval_skips_the_harness_prompts_that_do_not_fit(run_dir, tmp_path):
    pytest.importorskip("lm_eval")
    from data_pipeline.tokenizers import load_tokenizer

    from eval.data import load_gsm8k
    from eval.tasks.gsm8k import TEMPLATE

    tok = load_tokenizer("gpt2")
    long = sorted(e["id"] for e in load_gsm8k(str(FIX / "gsm8k_test.jsonl"))
                  if len(tok.encode(TEMPLATE.format(question=e["question"]))) + 36 > 64)
    out = tmp_path / "lm"
    m = run_task("gsm8k", ["--checkpoint", str(run_dir), "--out", str(out), "--data", str(FIX / "gsm8k_test.jsonl"),
                           "--backend", "lm-eval", "--max-new-tokens", "36", "--family", "mdlm"])["metrics"]
    _, _, recs = _out(out)
    assert sorted(m["skipped_keys"]) == long and not set(recs) & set(long)  # harness doc ids = file order; not rows
    assert m["skipped_overlong"] == len(long) and m["n"] == 12 - len(long) and "lm_eval/exact_match" in m
    assert "skipped problems as wrong" in m["lm_eval/note"]
