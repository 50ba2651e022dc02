"""The paper-in-miniature reasoning task: two-step arithmetic word problems in GSM8K's format, its
splits, and the small word-and-digit tokenizer its models use (benchmarks/paper_miniature.py).

A problem (seeded, `problem(rng)`):

    question: "Ann has 47 apples. Ann buys 38 and then loses 19. How many apples does Ann have?"
    answer:   "47+38=85.\\n85-19=66.\\n#### 66"

Two operations, each + or - (drawn first, uniformly) with one of three verbs (buys / finds / gets,
sells / loses / gives away), one of six names and six objects, and three operands a, b, c drawn from
10-99 until every result is in 10-99 too: every number is two digits, so each digit has a fixed
place. The answer is a worked solution, one line per step ("x+y=r."), and GSM8K's final ``#### n``
line, so `setdlm eval gsm8k` scores it as it scores GSM8K. A problem's *tuple* is its operands and
operators (a, op1, b, op2, c); its *steps* are its two lines as (x, op, y).

The splits (`make_splits`), all drawn from one `random.Random(seed)`:

- held-out steps (`held_out_steps`): a seeded 10% of the 6,480 possible steps (x op y = r, every
  number 10-99). No training problem contains one;
- ``test.jsonl`` (the claims' test set): problems with no held-out step, whose tuples are distinct
  and appear in no training problem (so no test problem is a training problem with other words);
- ``test_heldout.jsonl`` (composition): problems with at least one held-out step: a solution line
  the models never saw, which they must compute from the digits;
- ``test_reworded.jsonl`` (robustness): problems drawn as ``test.jsonl``'s, the question sentence
  first ("How many apples does Ann have? Ann has 47 apples. Ann buys 38 and then loses 19."), every
  word one the tokenizer has;
- ``train.jsonl``: `setdlm data prepare --format prompt_completion` rows. Most are the problem as a
  prompt ("Question: {question}\\nAnswer:", the prompt `setdlm eval gsm8k` builds) and the worked
  answer as the completion, whose tokens alone are predicted. A fixed share (``full_text``) is the
  whole text with only "Question:" as the prompt, so the models also learn to write questions: what
  infilling a number of the question needs. The last ``val`` rows (the trainer's validation split)
  are all of the first kind, so the validation bound is over answer tokens; ``val.jsonl`` holds the
  first PILOT_ROWS of them as questions and answers (what the schedule's pilot is scored on, so that
  it never reads a test set).

The tokenizer (`build_tokenizer`) is a word-level `tokenizers.Tokenizer`: every digit is its own
token, every word and digit may carry one leading space (" 4", " apples"), punctuation and "####"
are tokens, and it has EOS, pad, MASK and unknown tokens: 90 tokens, against GPT-2's 50,258 whose
output head would be about 94% of a 2 x 128 model. Its pieces are fused back without separators, so
decoding gives the text exactly. It is written as a tokenizer directory `load_tokenizer` reads.

The infilling task (`infill_example`): the whole text of a test problem with the question's last
operand c masked. The prefix (the question up to c) leaves c open (any value keeping the second
result in 10-99: a 1-in-60-or-so guess); the suffix (the rest of the question and the worked
solution) fixes it, in "85-19=66." and through the final answer.
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
HELD_OUT_SHARE = 0.10  # of the possible solution steps, never in training
PILOT_ROWS = 300  # validation problems val.jsonl holds (the first of them)
GENERATOR = {"operands": [10, 99], "results": [10, 99], "operations": 2, "ops": ["+", "-"], "names": list(NAMES),
             "objects": list(OBJECTS), "plus_verbs": list(PLUS), "minus_verbs": list(MINUS),
             "held_out_steps": HELD_OUT_SHARE, "format": "prompt_completion"}


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


def all_steps() -> list[tuple[int, str, int]]:
    """Every possible solution step (x, op, y): x, y and the result all in 10-99 (6,480)."""
    lo, hi = GENERATOR["operands"]
    return [(x, op, y) for x in range(lo, hi + 1) for op in "+-" for y in range(lo, hi + 1)
            if lo <= (x + y if op == "+" else x - y) <= hi]


def held_out_steps(seed: int) -> frozenset:
    """The seeded share HELD_OUT_SHARE of `all_steps()` that no training problem contains."""
    steps = all_steps()
    return frozenset(random.Random(seed * 7919 + 1).sample(steps, round(HELD_OUT_SHARE * len(steps))))


def problem(rng: random.Random, reworded: bool = False) -> dict:
    """One problem: {"question", "answer", "steps": [(x, op, y, result), ...], "tuple": (a, op1, b, op2, c)}."""
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
    facts = f"{name} has {a} {obj}. {name} {verbs[0]} {b} and then {verbs[1]} {c}."
    ask = f"How many {obj} does {name} have?"
    question = f"{ask} {facts}" if reworded else f"{facts} {ask}"
    answer = "\n".join(f"{x}{op}{y}={r}." for x, op, y, r in steps) + f"\n#### {value}"
    return {"question": question, "answer": answer, "steps": steps, "tuple": (a, ops[0], b, ops[1], c)}


def _held(p: dict, held: frozenset) -> bool:
    return any((x, op, y) in held for x, op, y, _ in p["steps"])


def make_splits(out_dir, *, seed: int, train: int, val: int, test: int, heldout: int, reworded: int,
                full_text: float) -> dict:
    """The files of the module docstring, drawn with `random.Random(seed)`; returns their paths and
    counts. `train` rows are followed by `val` validation rows in train.jsonl."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    held = held_out_steps(seed)
    tuples: set = set()
    rows: dict[str, list] = {"test": [], "test_heldout": [], "test_reworded": []}
    for split, n, want_held, rew in (("test", test, False, False), ("test_heldout", heldout, True, False),
                                     ("test_reworded", reworded, False, True)):
        while len(rows[split]) < n:
            p = problem(rng, reworded=rew)
            if _held(p, held) != want_held or p["tuple"] in tuples:
                continue
            tuples.add(p["tuple"])
            rows[split].append({"question": p["question"], "answer": p["answer"]})
    seen, train_rows, rows["val"] = set(), [], []
    while len(train_rows) < train + val:
        p = problem(rng)
        if _held(p, held) or p["tuple"] in tuples or p["question"] in seen:
            continue
        seen.add(p["question"])
        if len(train_rows) < train and rng.random() < full_text:
            train_rows.append({"prompt": "Question:", "completion": f" {p['question']}\nAnswer: {p['answer']}"})
        else:
            train_rows.append({"prompt": f"Question: {p['question']}\nAnswer:", "completion": f" {p['answer']}"})
        if train < len(train_rows) <= train + PILOT_ROWS:
            rows["val"].append({"question": p["question"], "answer": p["answer"]})
    rows["train"] = train_rows
    paths = {}
    for split, rs in rows.items():
        paths[split] = out / f"{split}.jsonl"
        paths[split].write_text("".join(json.dumps(r) + "\n" for r in rs))
    return {"paths": {k: str(v) for k, v in paths.items()}, "held_out_steps": len(held),
            "full_text_rows": sum(r["prompt"] == "Question:" for r in train_rows)}


def infill_example(row: dict, tokenizer) -> dict:
    """The infilling version of a test row (module docstring): prefix (the question up to its last
    operand), the masked operand, suffix (the rest of the question, the worked solution and EOS), as
    token ids; "span" is the masked text."""
    c = row["answer"].split("\n")[1].split("=")[0][3:]  # "85-19=66." -> "19"
    q = row["question"]
    cut = q.index(f" {c}.", q.index(" then "))
    prefix = f"Question: {q[:cut]}"
    span = f" {c}"
    suffix = f"{q[cut + len(span):]}\nAnswer: {row['answer']}"
    ids = tokenizer.encode
    p, s, m = ids(prefix), ids(suffix) + [tokenizer.eos_id], ids(span)
    if tokenizer.encode(prefix + span + suffix) != p + m + s[:-1]:
        raise ValueError(f"infill_example: the span does not tokenize on its own: {span!r}")
    return {"prefix": p, "span": m, "suffix": s, "span_text": span}
