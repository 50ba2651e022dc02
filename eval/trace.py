"""A decoding trace: which tokens each step committed, the window it had, tokens per step.

One record (plain JSON-able dicts) comes from either source and is drawn by `trace_html.render`:

- `from_events`: `setdlm sample --trace`, from the StepEvents `generate(on_step=...)` reports and the
  outputs;
- `from_stream`: the chunks (decoded JSON of each `data:` line) of a streamed `setdlm serve` response,
  whose `setdlm` keys carry the same steps.

Record: {"title", "settings", "rows": [{"prompt", "suffix", "infill", "tokens": [{"text", "step"}],
"steps": [{"step", "window": [start, end) or None, "count"}], "stop_reason"}]}, offsets counted from
the first generated position.
"""

from __future__ import annotations

from pathlib import Path


def _row(prompt: str, suffix: str, infill: bool, pieces: list[str], commit: list[int], steps: dict, stop_reason: str):
    return {"prompt": prompt, "suffix": suffix, "infill": infill,
            "tokens": [{"text": t, "step": int(s)} for t, s in zip(pieces, commit)],
            "steps": [{"step": k, "window": steps[k][0], "count": steps[k][1]} for k in sorted(steps)],
            "stop_reason": stop_reason}


def from_events(events, outputs, prompts: list[str], suffixes: list[str], infill: list[bool], tokenizer, *,
                title: str = "Set decoding trace", settings: str = "") -> dict:
    """events: StepEvents of `generate(..., on_step=events.append)` (row = the prompt's index)."""
    steps: list[dict] = [{} for _ in outputs]
    for e in events:
        a = e.span[0]
        window = [e.window[0] - a, e.window[1] - a] if e.window is not None else None
        steps[e.row][e.step] = (window, len(e.positions))
    rows = [_row(p, s, f, [tokenizer.decode([t]) for t in o.tokens], o.commit_step, st, o.stop_reason)
            for p, s, f, o, st in zip(prompts, suffixes, infill, outputs, steps)]
    return {"title": title, "settings": settings, "rows": rows}


def sample_rows(rows: list[dict], outputs, events, tokenizer) -> list[dict]:
    """Trace rows of one `setdlm sample` batch (its input rows: "prompt", "suffix", "infill_length")."""
    return from_events(events, outputs, [r["prompt"] for r in rows], [r.get("suffix", "") for r in rows],
                       ["infill_length" in r for r in rows], tokenizer)["rows"]


def settings_line(cfg) -> str:
    """The decoding settings a trace page names."""
    text = cfg.spec.settings_line(cfg)
    text += f", threshold {cfg.threshold}" if cfg.threshold is not None else ", no threshold"
    return text + (f", temperature {cfg.temperature:g}" if not cfg.greedy else ", greedy")


def from_stream(chunks: list[dict], prompt: str, suffix: str = "", *, infill: bool | None = None,
                title: str = "Set decoding trace", settings: str = "") -> dict:
    """chunks: a streamed /v1/completions or /v1/chat/completions response, one dict per event."""
    pieces: dict[int, dict[int, str]] = {}
    steps: dict[int, dict] = {}
    finals: dict[int, dict] = {}
    for c in chunks:
        for ch in c.get("choices", []):
            ext, i = ch.get("setdlm") or {}, ch["index"]
            if "step" in ext:
                steps.setdefault(i, {})[ext["step"]] = (ext["window"], sum(len(s["tokens"]) for s in ext["spans"]))
                for s in ext["spans"]:
                    pieces.setdefault(i, {}).update({s["offset"] + k: p for k, p in enumerate(s["pieces"])})
            if ch.get("finish_reason") is not None:
                finals[i] = ext
    rows = []
    for i in sorted(finals):
        f, got = finals[i], pieces.get(i, {})
        rows.append(_row(prompt, suffix, bool(suffix) if infill is None else infill,
                         [got.get(o, "?") for o in range(len(f["tokens"]))], f["commit_step"], steps.get(i, {}),
                         f["stop_reason"]))
    return {"title": title, "settings": settings, "rows": rows}


def write_sample(path: str | Path, checkpoint, cfg, rows: list[dict]) -> Path:
    """The page of `setdlm sample --trace`."""
    return write(path, {"title": f"Set decoding trace: {Path(checkpoint).name}", "settings": settings_line(cfg),
                        "rows": rows})


def write(path: str | Path, record: dict) -> Path:
    """The record as one self-contained HTML page (trace_html.render)."""
    from common.io import atomic_write_text

    from .trace_html import render

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, render(record))
    return path
