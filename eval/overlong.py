"""One policy for examples that do not fit the model's context (`--overlong`), shared by the eval tasks.

An example does not fit when its tokens (prompt, or prefix + span + suffix for infilling) plus the
tokens it decodes exceed the model's ``max_seq_len``. What happens to it:

- ``skip`` (the default): it is left out before anything runs; the count (and the first keys) go into
  the run's spec, ``skipped_overlong`` in metrics.json and a **SKIPPED** line in summary.md. The
  metrics are over the examples that fit (``n`` of them).
- ``truncate``: the task cuts it to fit when it runs (prompts and articles keep their end or their
  start as the task says; infilling cuts the context farthest from the span); ``prompts_cut`` and
  ``prompt_tokens_cut`` count the cuts. An example that cannot fit even cut (an infilling span longer
  than the context) is skipped and counted.
- ``error``: the run is refused before the model loads, naming the first example.

Skipping everything is refused too (an empty result is not a number). Where the prompts are built
later (GSM8K through lm-evaluation-harness) the same rule runs on them then, and a skipped example is
a record marked ``"skipped": "overlong"`` that the metrics leave out and count. Either way a skipped
example is not a row of examples.jsonl; ``skipped_overlong`` and ``skipped_keys`` (the first 20) in
metrics.json count and name them.
"""

from __future__ import annotations

from .errors import EvalError

POLICIES = ("skip", "truncate", "error")
SKIPPED = "overlong"  # the "skipped" value of a record left out by this policy
KEYS_KEPT = 20  # skipped keys listed in the spec


def sort_overlong(keys: list[str], sizes: list[int], limit: int, policy: str, *, what: str = "examples",
                  option: str = "--data", floors: list[int] | None = None) -> tuple[list[int], dict]:
    """(indices of the examples to run, the spec's record of the policy) for examples of `sizes`
    tokens against `limit`; `floors`: the size of each once truncated as far as the task can."""
    if policy not in POLICIES:
        raise EvalError(f"--overlong: {policy!r} is not one of {', '.join(POLICIES)}")
    over = [i for i, n in enumerate(sizes) if n > limit]
    info = {"policy": policy, "max_seq_len": int(limit), "overlong": len(over), "skipped": 0, "skipped_keys": []}
    if over and policy == "error":
        i = over[0]
        raise EvalError(f"{option}: {len(over)} of {len(sizes)} {what} do not fit the model's max_seq_len {limit} (the "
                        f"first: {keys[i]!r}, {sizes[i]} tokens with the decoded ones); --overlong skip leaves them out "
                        f"and counts them, --overlong truncate cuts them to fit")
    drop = set(over) if policy == "skip" else {i for i in over if floors is not None and floors[i] > limit}
    if drop and len(drop) == len(sizes):
        raise EvalError(f"--overlong {policy}: none of the {len(sizes)} {what} of {option} fits the model's max_seq_len "
                        f"{limit}" + ("; --overlong truncate cuts them to fit" if policy == "skip" else "")
                        + " (or use a model with a longer context)")
    skipped = sorted(drop)
    info.update(skipped=len(skipped), skipped_keys=[keys[i] for i in skipped[:KEYS_KEPT]])
    return [i for i in range(len(sizes)) if i not in drop], info


def skip_record(key: str, tokens: int, **fields) -> dict:
    """The record of an example left out by the policy at run time (lm-eval prompts); `tokens`: what
    it needs (a per-rank record only: examples.jsonl holds the examples that ran)."""
    return {"key": key, "skipped": SKIPPED, "tokens_needed": int(tokens), **fields}


def scored(records: list[dict]) -> list[dict]:
    """The records of examples that ran (not skipped by the policy)."""
    return [r for r in records if r.get("skipped") != SKIPPED]


def overlong_metrics(records: list[dict], spec: dict) -> dict:
    """What the policy did: examples skipped (before the run or at run time) and prompts cut to fit."""
    info = spec.get("overlong") or {}
    cut = [int(r.get("prompt_cut") or 0) for r in records]
    late = [r["key"] for r in records if r.get("skipped") == SKIPPED]
    return {"overlong_policy": info.get("policy"),
            "skipped_overlong": int(info.get("skipped", 0)) + len(late),
            "skipped_keys": [*(info.get("skipped_keys") or []), *late][:KEYS_KEPT],
            "prompts_cut": sum(c > 0 for c in cut), "prompt_tokens_cut": sum(cut)}
