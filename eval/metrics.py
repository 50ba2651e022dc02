"""Scoring functions: GSM8K answer extraction, ROUGE, unigram entropy, MAUVE, perplexity helpers.

All offline: ROUGE through the `rouge-score` package (no NLTK data needed; ROUGE-Lsum gets sentences
split on newlines), MAUVE through `mauve-text` on features we compute ourselves (see featurize.py).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from decimal import Decimal, InvalidOperation

from .errors import EvalError

# ------------------------------------------------------------------------------------------ GSM8K
# Final-answer extraction, in this order (the first rule that finds a number wins):
#   1. "#### <number>"   the GSM8K answer format (the first occurrence; a model fine-tuned on GSM8K
#                        answers ends its solution with it, later text is usually a new question);
#   2. an explicit final-answer phrase: "the answer is <number>", "final answer: <number>",
#      "answer = <number>" (case-insensitive; the last occurrence, so a corrected answer wins);
#   3. "\boxed{<number>}" the LaTeX convention of math models (the last occurrence);
#   4. the last number anywhere in the text (fallback; its share is reported as `extraction`).
# A number may carry a sign, thousands separators, a decimal part, a leading "$" and a trailing
# "." or "%"; it is normalised (separators and "$" removed) and compared numerically, so "1,000",
# "$1000" and "1000.00" all equal 1000.
_NUM = r"-?\$?\s*(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_HASH = re.compile(r"####\s*(" + _NUM + ")")
_BOXED = re.compile(r"\\boxed\{\s*(?:\\text\{)?\s*(" + _NUM + r")\s*\}?\s*\}")
_PHRASE = re.compile(r"\banswer\s*(?:is|:|=)\s*(?:\*\*)?\s*(" + _NUM + ")", re.IGNORECASE)
_ANY = re.compile(_NUM)


def normalize_number(s: str | None) -> str | None:
    """Canonical string of a number ("1,000.50" -> "1000.5", "$-3" -> "-3"), None if not a number."""
    if s is None:
        return None
    t = s.replace(",", "").replace("$", "").replace(" ", "").strip().rstrip(".%")
    if t.startswith("-$"):
        t = "-" + t[2:]
    try:
        d = Decimal(t)
    except InvalidOperation:
        return None
    if d == d.to_integral_value():
        return str(int(d))
    return format(d.normalize(), "f")


def extract_answer(text: str) -> tuple[str | None, str]:
    """(normalised final answer or None, rule used: "####", "phrase", "boxed", "last_number" or "none")."""
    if text is None:
        return None, "none"
    m = _HASH.search(text)
    if m:
        return normalize_number(m.group(1)), "####"
    phrase = _PHRASE.findall(text)
    if phrase:
        return normalize_number(phrase[-1]), "phrase"
    boxed = _BOXED.findall(text)
    if boxed:
        return normalize_number(boxed[-1]), "boxed"
    nums = _ANY.findall(text)
    if nums:
        return normalize_number(nums[-1]), "last_number"
    return None, "none"


def gold_answer(answer_field: str) -> str:
    """The gold number of a GSM8K `answer` (the text after its "####")."""
    if "####" not in answer_field:
        raise EvalError(f"GSM8K answer without '####': {answer_field[-80:]!r}")
    got = normalize_number(answer_field.split("####")[-1].strip())
    if got is None:
        raise EvalError(f"GSM8K answer whose '####' part is not a number: {answer_field[-80:]!r}")
    return got


def gsm8k_correct(generation: str, gold: str) -> bool:
    pred, _ = extract_answer(generation)
    return pred is not None and pred == gold


# ------------------------------------------------------------------------------------------ ROUGE
ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")
_scorers: dict = {}


def require_extra(module: str, package: str, what: str, extra: str = "eval") -> None:
    """EvalError now (before any model loads) when `module` of `package` is missing: one line naming
    the extra that installs it (`scripts/install.sh --all` installs every extra)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent
        found = False
    if not found:
        raise EvalError(f"{what} needs the `{package}` package: pip install 'setdlm[{extra}]' (or bash "
                        f"scripts/install.sh --all)")


def _rouge_scorer(types: tuple[str, ...], stemmer: bool):
    key = (types, stemmer)
    if key not in _scorers:
        try:
            from rouge_score import rouge_scorer
        except ImportError:
            raise EvalError("ROUGE needs the `rouge-score` package: pip install 'setdlm[eval]'") from None
        _scorers[key] = rouge_scorer.RougeScorer(list(types), use_stemmer=stemmer)
    return _scorers[key]


_SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9\"'])")


def split_sentences(text: str) -> str:
    """One sentence per line (for ROUGE-Lsum) with a simple rule, no NLTK data: break after . ! ?
    followed by whitespace and an upper-case letter, digit or quote; existing newlines are kept."""
    lines = []
    for para in text.strip().splitlines():
        lines.extend(s.strip() for s in _SENT.split(para.strip()) if s.strip())
    return "\n".join(lines)


def rouge(prediction: str, reference: str, types=ROUGE_TYPES, stemmer: bool = True) -> dict:
    """F1, precision and recall of each ROUGE type, in [0, 1]: {"rouge1": .., "rouge1_p": .., ...}."""
    types = tuple(types)
    sc = _rouge_scorer(types, stemmer)
    if "rougeLsum" in types:
        prediction, reference = split_sentences(prediction), split_sentences(reference)
    s = sc.score(reference, prediction)
    out = {}
    for t in types:
        out[t] = s[t].fmeasure
        out[t + "_p"] = s[t].precision
        out[t + "_r"] = s[t].recall
    return out


def mean(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


# ------------------------------------------------------------------------------------------ samples
def unigram_entropy(tokens) -> float:
    """Entropy (nats) of the empirical distribution of token ids in one sample: low values flag
    repetition (a sample of 1024 distinct tokens has log(1024) = 6.93)."""
    tokens = list(tokens)
    if not tokens:
        return 0.0
    n = len(tokens)
    return -sum(c / n * math.log(c / n) for c in Counter(tokens).values())


def percentile(xs, q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# ------------------------------------------------------------------------------------------ MAUVE
def mauve_score(p_features, q_features, *, num_buckets="auto", seed: int = 25, scaling: float = 5.0,
                kmeans_explained_var: float = 0.9) -> dict:
    """MAUVE between two feature sets (rows = texts) with the `mauve-text` package; returns
    {"mauve": .., "frontier_integral": .., "num_buckets": ..}. Deterministic for a given seed."""
    import numpy as np

    try:
        import mauve
    except ImportError:
        raise EvalError("MAUVE needs the `mauve-text` package: pip install 'setdlm[eval]'") from None
    p, q = np.asarray(p_features, dtype=np.float32), np.asarray(q_features, dtype=np.float32)
    if len(p) < 2 or len(q) < 2:
        raise EvalError(f"MAUVE needs at least 2 texts per side, got {len(p)} and {len(q)}")
    if num_buckets == "auto":
        num_buckets = max(2, min(len(p), len(q)) // 10)
    out = mauve.compute_mauve(p_features=p, q_features=q, num_buckets=num_buckets, seed=seed,
                              mauve_scaling_factor=scaling, kmeans_explained_var=kmeans_explained_var,
                              device_id=-1, verbose=False)
    return {"mauve": float(out.mauve), "frontier_integral": float(getattr(out, "frontier_integral", float("nan"))),
            "num_buckets": int(num_buckets)}


MAUVE_MIN_SAMPLES = 100  # per side: at least 10 k-means buckets of about 10 texts each


def mauve_report(p_features, q_features, *, num_buckets="auto", seed: int = 25, min_samples: int = MAUVE_MIN_SAMPLES) -> dict:
    """MAUVE for a report: {"mauve", "mauve_buckets"} and, with fewer than `min_samples` texts per side,
    "mauve": None, the value as "mauve_small_sample" and a "mauve_warning". With a few dozen texts the
    k-means histogram says little: 20 identical texts against 20 varied ones score 0.99 with 2
    buckets and two samples of one distribution 0.43 with 10 (measured), so no bucket count is sound."""
    n = min(len(p_features), len(q_features))
    mv = mauve_score(p_features, q_features, num_buckets=num_buckets, seed=seed)
    out = {"mauve": mv["mauve"], "mauve_buckets": mv["num_buckets"]}
    if n < min_samples:
        out.update(mauve=None, mauve_small_sample=mv["mauve"],
                   mauve_warning=f"{n} texts per side are too few for MAUVE (need >= {min_samples}; its authors use "
                                 f"thousands): the value {mv['mauve']:.3f} with {mv['num_buckets']} buckets is not "
                                 f"reported as `mauve`")
    return out
