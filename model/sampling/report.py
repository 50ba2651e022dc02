"""The same prompt decoded at different parallelism, with forwards, tokens/step and tokens/s beside
each sample: what the quickstart (the trainer's end-of-run sample) prints to show set decoding.

Each setting is decoded once untimed (its first call pays one-time costs: allocations, masks and
kernels of its shapes), then `repeats` times with the same seed, so the same tokens; the tokens/s is
the median of those decodes. A loose threshold that decodes exactly as the strict one gets a line
saying so and why: no position besides those the strict one took reached it."""

from __future__ import annotations

import dataclasses
import statistics
import time

from .api import generate
from .config import SamplingConfig

LOOSE_THRESHOLD = 0.1  # low enough to fire on a model trained for a few minutes
REPEATS = 3  # timed decodes per setting, after one untimed


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


def timed_decode(model, ids, cfg, *, mask_id=None, tokenizer=None, repeats: int = REPEATS):
    """(output, median seconds): one untimed decode of `cfg`, then `repeats` timed ones (same seed)."""
    generate(model, [ids], cfg, mask_id=mask_id, tokenizer=tokenizer)
    secs, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = generate(model, [ids], cfg, mask_id=mask_id, tokenizer=tokenizer)[0]
        secs.append(time.perf_counter() - t0)
    return out, statistics.median(secs)


def speed_report(model, tokenizer, prompt: str, base: SamplingConfig, *, mask_id: int | None = None,
                 strict: float | None = None, loose: float = LOOSE_THRESHOLD, repeats: int = REPEATS) -> str:
    """Decode `prompt` per setting of `speed_settings`; returns the printable report."""
    ids = tokenizer.encode(prompt) if prompt else []
    lines, outs = [], {}
    for label, cfg in speed_settings(base, strict, loose):
        out, dt = timed_decode(model, ids, cfg, mask_id=mask_id, tokenizer=tokenizer, repeats=repeats)
        outs[label] = out
        n = len(out.tokens)
        lines.append(f"sample, {label}: {out.steps + 1} forwards (prefill + {out.steps} steps), "
                     f"{out.tokens_per_step:.2f} tokens/step, {n / dt if dt > 0 else 0:.0f} tokens/s "
                     f"(median of {repeats} after a warm-up)\n{prompt}{out.text}")
    s, lo = (next((o for k, o in outs.items() if k.startswith(w)), None) for w in ("strict", "loose"))
    if s is not None and lo is not None and s.tokens == lo.tokens and s.steps == lo.steps:
        lines.append(f"(the loose threshold {loose:g} decoded exactly as the strict one: no other position reached a "
                     f"confidence of {loose:g} in any step)")
    return "\n".join(lines)
