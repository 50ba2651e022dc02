"""The same prompt decoded at different parallelism, with forwards, tokens/step and tokens/s beside
each sample: what the quickstart (the trainer's end-of-run sample) prints to show set decoding."""

from __future__ import annotations

import dataclasses
import time

from .api import generate
from .config import SamplingConfig

LOOSE_THRESHOLD = 0.25  # low enough to fire on a model trained for a few minutes


def speed_settings(base: SamplingConfig, strict: float | None = None, loose: float = LOOSE_THRESHOLD):
    """(label, config) pairs: one token per step (AR order for SetDLM: window 1), a strict and a loose
    confidence threshold. AR has only the first."""
    strict = strict if strict else (base.threshold if base.threshold and base.threshold < 1 else 0.9)
    if base.family == "ar":
        return [("AR, one token per step", base)]
    one = dict(threshold=None, window=1) if base.family == "setdlm" else dict(threshold=None)
    rows = [("one token per step" + (" (AR order)" if base.family == "setdlm" else ""), dataclasses.replace(base, **one)),
            (f"strict threshold {strict:g}", dataclasses.replace(base, threshold=strict)),
            (f"loose threshold {loose:g}", dataclasses.replace(base, threshold=loose))]
    if loose > 0:  # a few-minute model rarely clears even a loose threshold: show the whole-window step too
        rows.append(("threshold 0 (the whole window every step)", dataclasses.replace(base, threshold=0.0)))
    return rows


def speed_report(model, tokenizer, prompt: str, base: SamplingConfig, *, mask_id: int | None = None,
                 strict: float | None = None, loose: float = LOOSE_THRESHOLD) -> str:
    """Decode `prompt` once per setting of `speed_settings`; returns the printable report."""
    ids = tokenizer.encode(prompt) if prompt else []
    generate(model, [ids], base, mask_id=mask_id, tokenizer=tokenizer, max_new_tokens=2)  # warm-up: one-time costs
    lines = []
    for label, cfg in speed_settings(base, strict, loose):
        t0 = time.perf_counter()
        out = generate(model, [ids], cfg, mask_id=mask_id, tokenizer=tokenizer)[0]
        dt = time.perf_counter() - t0
        n = len(out.tokens)
        lines.append(f"sample, {label}: {out.steps + 1} forwards (prefill + {out.steps} steps), "
                     f"{out.tokens_per_step:.2f} tokens/step, {n / dt if dt > 0 else 0:.0f} tokens/s\n{prompt}{out.text}")
    return "\n".join(lines)
