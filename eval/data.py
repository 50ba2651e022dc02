"""Readers for the evaluation data formats, with schema checks that name the file and what is wrong.

- GSM8K: JSONL with ``question`` and ``answer`` (the answer ends with ``#### <number>``); or ``hub``
  (``openai/gsm8k``, config ``main``, through `datasets`, needs the network).
- ROCStories: the Story Cloze CSV (``InputStoryid, InputSentence1..4, RandomFifthSentenceQuiz1,
  RandomFifthSentenceQuiz2, AnswerRightEnding``; the fifth sentence is the right ending) or the
  ROCStories story CSV (``storyid, storytitle, sentence1..5``).
- CNN/DailyMail: CSV or JSONL with ``article``, ``highlights`` and ``id``.
- Plain text: ``.txt`` (documents separated by blank lines) or ``.jsonl`` with a ``text`` field.
"""

from __future__ import annotations

import csv
from pathlib import Path

from common.jsonl import read_jsonl

from .errors import EvalError

CLOZE_COLUMNS = ["InputStoryid", "InputSentence1", "InputSentence2", "InputSentence3", "InputSentence4",
                 "RandomFifthSentenceQuiz1", "RandomFifthSentenceQuiz2", "AnswerRightEnding"]
STORY_COLUMNS = ["storyid", "storytitle", "sentence1", "sentence2", "sentence3", "sentence4", "sentence5"]
CNNDM_COLUMNS = ["article", "highlights", "id"]


def _path(path, option: str) -> Path:
    if not path:
        raise EvalError(f"{option}: required")
    p = Path(path)
    if not p.is_file():
        raise EvalError(f"{option}: {p}: no such file")
    return p


def read_csv(path: Path, option: str) -> tuple[list[str], list[dict]]:
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        cols = [c.strip() for c in (reader.fieldnames or [])]
        rows = [{(k or "").strip(): v for k, v in r.items()} for r in reader]
    return cols, rows


def _require(cols, want, path, option, what) -> None:
    missing = [c for c in want if c not in cols]
    if missing:
        raise EvalError(f"{option}: {path} is not a {what} file: missing columns {missing}; expected {want}, "
                        f"found {list(cols)}")


# ------------------------------------------------------------------------------------------ GSM8K
def load_gsm8k(path: str, option: str = "--data", split: str = "test") -> list[dict]:
    """[{"id", "question", "answer"}] in file order."""
    if path == "hub":
        try:
            import datasets

            ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
        except Exception as e:  # noqa: BLE001 - offline, missing dataset, ...
            raise EvalError(f"{option}: hub: cannot load openai/gsm8k ({type(e).__name__}: {e}); offline, give a "
                            f"local JSONL with question/answer") from None
        rows = [dict(r) for r in ds]
        src = f"hub openai/gsm8k:{split}"
    else:
        p = _path(path, option)
        rows = read_jsonl(p, option, error=EvalError)
        src = str(p)
    out = []
    for i, r in enumerate(rows):
        for k in ("question", "answer"):
            if not isinstance(r.get(k), str):
                raise EvalError(f"{option}: {src}: example {i} has no string field {k!r} (GSM8K rows need "
                                f"'question' and 'answer'; found keys {sorted(r)})")
        if "####" not in r["answer"]:
            raise EvalError(f"{option}: {src}: example {i}: the answer does not end with '#### <number>'")
        out.append({"id": str(r.get("id", i)), "question": r["question"], "answer": r["answer"]})
    if not out:
        raise EvalError(f"{option}: {src}: no examples")
    return out


# ------------------------------------------------------------------------------------------ ROCStories
def load_rocstories(path: str, option: str = "--data") -> list[dict]:
    """[{"id", "sentences": [s1..s5]}]; from the cloze CSV the right ending is the fifth sentence."""
    p = _path(path, option)
    cols, rows = read_csv(p, option)
    out = []
    if all(c in cols for c in CLOZE_COLUMNS):
        for n, r in enumerate(rows):
            right = (r.get("AnswerRightEnding") or "").strip()
            if right not in ("1", "2"):
                raise EvalError(f"{option}: {p}: row {n + 2}: AnswerRightEnding must be 1 or 2, got {right!r}")
            s = [r[f"InputSentence{i}"] for i in range(1, 5)] + [r[f"RandomFifthSentenceQuiz{right}"]]
            out.append({"id": r["InputStoryid"], "sentences": [x.strip() for x in s]})
    elif all(c in cols for c in STORY_COLUMNS[:1] + STORY_COLUMNS[2:]):
        for r in rows:
            out.append({"id": r["storyid"], "sentences": [r[f"sentence{i}"].strip() for i in range(1, 6)]})
    else:
        missing = [c for c in CLOZE_COLUMNS if c not in cols]
        raise EvalError(f"{option}: {p} is not a ROCStories CSV: missing columns {missing}; expected the Story Cloze "
                        f"columns {CLOZE_COLUMNS} (or the story columns {STORY_COLUMNS}), found {cols}")
    for n, ex in enumerate(out):
        if any(not s for s in ex["sentences"]):
            raise EvalError(f"{option}: {p}: story {ex['id']!r} (row {n + 2}) has an empty sentence")
    if not out:
        raise EvalError(f"{option}: {p}: no stories")
    return out


# ------------------------------------------------------------------------------------------ CNN/DM
def load_cnndm(path: str, option: str = "--data") -> list[dict]:
    p = _path(path, option)
    if p.suffix in (".jsonl", ".json"):
        rows = read_jsonl(p, option, error=EvalError)
        cols = sorted(set().union(*(r.keys() for r in rows))) if rows else []
        for i, r in enumerate(rows):
            missing = [c for c in CNNDM_COLUMNS if c not in r]
            if missing:
                raise EvalError(f"{option}: {p}: line {i + 1} lacks fields {missing}; CNN/DailyMail rows need "
                                f"{CNNDM_COLUMNS}, found {sorted(r)}")
    else:
        cols, rows = read_csv(p, option)
        _require(cols, CNNDM_COLUMNS, p, option, "CNN/DailyMail")
    out = [{"id": str(r["id"]), "article": str(r["article"]), "highlights": str(r["highlights"])} for r in rows]
    if not out:
        raise EvalError(f"{option}: {p}: no articles")
    return out


# ------------------------------------------------------------------------------------------ text
def load_texts(path: str, option: str = "--text", field: str = "text") -> list[str]:
    """Documents of a .txt (blank-line separated) or .jsonl (`field`) file."""
    p = _path(path, option)
    if p.suffix in (".jsonl", ".json"):
        rows = read_jsonl(p, option, error=EvalError)
        docs = []
        for i, r in enumerate(rows):
            if not isinstance(r.get(field), str):
                raise EvalError(f"{option}: {p}: line {i + 1} has no string field {field!r} (found {sorted(r)})")
            docs.append(r[field])
    else:
        text = p.read_text(encoding="utf-8")
        docs = [d.strip() for d in text.split("\n\n") if d.strip()]
    if not docs:
        raise EvalError(f"{option}: {p}: no text")
    return docs


def load_prompts(path: str, option: str = "--prompts") -> list[str]:
    """Prompts from .txt (one per line) or .jsonl (field prompt, question or text)."""
    p = _path(path, option)
    if p.suffix in (".jsonl", ".json"):
        out = []
        for i, r in enumerate(read_jsonl(p, option, error=EvalError)):
            for k in ("prompt", "question", "text"):
                if isinstance(r.get(k), str):
                    out.append(r[k])
                    break
            else:
                raise EvalError(f"{option}: {p}: line {i + 1} has none of the fields prompt/question/text")
        return out
    return [line.rstrip("\n") for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
