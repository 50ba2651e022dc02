"""The paper-in-miniature reasoning task: two-step arithmetic word problems in GSM8K's format, and
the small word-and-digit tokenizer its models use (benchmarks/paper_miniature.py).

A problem (seeded, `problem(rng)`):

    question: "Ann has 47 apples. Ann buys 38 and then loses 19. How many apples does Ann have?"
    answer:   "47+38=85.\\n85-19=66.\\n#### 66"

Two operations, each + or - (drawn first, uniformly) with one of three verbs (buys / finds / gets,
sells / loses / gives away), one of six names and six objects, and three operands a, b, c drawn from
10-99 until every result is in 10-99 too: every number is two digits, so each digit has a fixed
place. The answer is a worked solution, one line per step, and GSM8K's final ``#### n`` line, so
`setdlm eval gsm8k` scores it as it scores GSM8K.

The tokenizer (`build_tokenizer`) is a word-level `tokenizers.Tokenizer`: every digit is its own
token, every word and digit may carry one leading space (" 4", " apples"), punctuation and "####"
are tokens, and it has EOS, pad, MASK and unknown tokens: 90 tokens, against GPT-2's 50,258 whose
output head would be about 94% of a 2 x 128 model. Its pieces are fused back without separators, so
decoding gives the text exactly. It is written as a tokenizer directory `load_tokenizer` reads.

The infilling task (`infill_example`): the whole text of a problem with its second solution step
masked; the prefix (question, first step) and the suffix (the final ``#### n`` line) fix it: the
prefix gives the running value and the second operation, the suffix the result.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eve", "Finn")
OBJECTS = ("apples", "books", "coins", "cards", "pens", "shells")
PLUS = ("buys", "finds", "gets")
MINUS = ("sells", "loses", "gives away")
OTHER_WORDS = ("Question", "Answer", "has", "and", "then", "How", "many", "does", "have")
PUNCT = ("+", "-", "=", ".", "?", ":", "\n", " ", "####", " ####")
EOS, PAD, MASK, UNK = "<|endoftext|>", "<|pad|>", "<|mask|>", "<|unk|>"
PIECE = r" ?####| ?[A-Za-z]+| ?[0-9]|\n|[^ A-Za-z0-9\n]| "  # how text is cut before the word-level lookup
GENERATOR = {"operands": [10, 99], "results": [10, 99], "operations": 2, "ops": ["+", "-"], "names": list(NAMES),
             "objects": list(OBJECTS), "plus_verbs": list(PLUS), "minus_verbs": list(MINUS)}


def vocabulary() -> list[str]:
    """Every token, in id order (specials last)."""
    words = sorted({w for p in (NAMES, OBJECTS, PLUS, OTHER_WORDS) for w in p} | {"sells", "loses", "gives", "away"})
    digits = [str(d) for d in range(10)]
    toks = list(PUNCT) + digits + [" " + d for d in digits] + words + [" " + w for w in words]
    return toks + [EOS, PAD, MASK, UNK]


def build_tokenizer(directory) -> str:
    """Write the task's tokenizer directory (data_pipeline's `Tokenizer.save`); returns its path."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    from data_pipeline.tokenizer import Tokenizer

    vocab = {t: i for i, t in enumerate(vocabulary())}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (EOS, PAD, MASK, UNK)])
    tok = Tokenizer(backend, name="miniature-arith", mask_id=vocab[MASK], eos_id=vocab[EOS], pad_id=vocab[PAD])
    tok.save(directory)
    return str(directory)


def problem(rng: random.Random) -> dict:
    """One problem: {"question", "answer", "steps": [(x, op, y, result), ...]}."""
    lo, hi = GENERATOR["operands"]
    ops = [rng.choice("+-") for _ in range(2)]
    while True:  # the operations first, then operands until every result is 2-digit too
        a, b, c = (rng.randint(lo, hi) for _ in range(3))
        steps, value = [], a
        for op, y in zip(ops, (b, c)):
            new = value + y if op == "+" else value - y
            steps.append((value, op, y, new))
            value = new
        if all(lo <= s[3] <= hi for s in steps):
            break
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    verbs = [rng.choice(PLUS if op == "+" else MINUS) for op in ops]
    question = (f"{name} has {a} {obj}. {name} {verbs[0]} {b} and then {verbs[1]} {c}. "
                f"How many {obj} does {name} have?")
    answer = "\n".join(f"{x}{op}{y}={r}." for x, op, y, r in steps) + f"\n#### {value}"
    return {"question": question, "answer": answer, "steps": steps}


def make_splits(out_dir, *, seed: int, train: int, test: int) -> dict:
    """train.jsonl (the last rows of it are the trainer's validation split) and test.jsonl (problems whose
    question appears in no train row), drawn with `random.Random(seed)`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    seen, rows = set(), {"train": [], "test": []}
    for split, n in (("train", train), ("test", test)):
        while len(rows[split]) < n:
            p = problem(rng)
            if p["question"] in seen:
                continue
            seen.add(p["question"])
            rows[split].append({"question": p["question"], "answer": p["answer"]})
    paths = {}
    for split, rs in rows.items():
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in rs))
    return {k: str(v) for k, v in paths.items()}


def infill_example(row: dict, tokenizer) -> dict:
    """The infilling version of a test row: prefix (prompt and first step), the masked second step,
    suffix (the final line and EOS), as token ids; "span" is the masked text."""
    lines = row["answer"].split("\n")  # [step 1, step 2, "#### n"]
    prefix = f"Question: {row['question']}\nAnswer: {lines[0]}\n"
    span, suffix = lines[1], "\n" + lines[2]
    ids = tokenizer.encode
    p, s, m = ids(prefix), ids(suffix) + [tokenizer.eos_id], ids(span)
    if tokenizer.encode(prefix + span + suffix) != p + m + s[:-1]:
        raise ValueError(f"infill_example: the span does not tokenize on its own: {span!r}")
    return {"prefix": p, "span": m, "suffix": s, "span_text": span}
