"""A decoding trace record (trace.py) -> one self-contained HTML page: inline CSS and SVG, no script,
no font or image fetched, so it opens offline and prints.

Per output: the text, each generated token on the colour of the step that committed it (prompt and
infill suffix in grey); a decoding map, one line per step (top to bottom) over the span's positions
(left to right): the step's window as an outlined band, the tokens it committed in their step's
colour, those committed earlier in light grey; and the tokens committed per step as bars.
"""

from __future__ import annotations

from html import escape

RAMP = ((68, 1, 84), (59, 82, 139), (33, 145, 140), (94, 201, 98), (253, 231, 37))  # viridis: step 1 -> last
MAP_WIDTH = 900

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#1d1d1f;margin:24px;max-width:960px}
h1{font-size:20px;margin:0 0 4px}h2{font-size:15px;margin:28px 0 8px}
.meta{color:#666;margin:0 0 12px}
.text{font:13px/1.9 ui-monospace,"DejaVu Sans Mono",monospace;white-space:pre-wrap;word-break:break-all;
border:1px solid #ddd;border-radius:6px;padding:10px 12px;background:#fafafa}
.ctx{color:#8a8a8a}.ctx.suffix{border-bottom:2px dotted #bbb}.tok{border-radius:3px;padding:1px 0;margin-right:1px}
.tag{font:11px system-ui,sans-serif;color:#fff;background:#9a9a9a;border-radius:3px;padding:0 4px;margin:0 4px}
.legend{display:flex;align-items:center;gap:8px;margin:10px 0;font-size:12px;color:#555}
.ramp{height:12px;width:240px;border-radius:3px}
figure{margin:12px 0}figcaption{font-size:12px;color:#555;margin-bottom:4px}
svg text{font:10px ui-monospace,"DejaVu Sans Mono",monospace;fill:#555}
"""


def colour(step: int, last: int) -> str:
    x = 0.0 if last <= 1 else (step - 1) / (last - 1)
    i = min(int(x * (len(RAMP) - 1)), len(RAMP) - 2)
    f = x * (len(RAMP) - 1) - i
    r, g, b = (round(a + (c - a) * f) for a, c in zip(RAMP[i], RAMP[i + 1]))
    return f"#{r:02x}{g:02x}{b:02x}"


def _ink(hex_colour: str) -> str:
    r, g, b = (int(hex_colour[k : k + 2], 16) for k in (1, 3, 5))
    return "#000" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#fff"


def _piece(text: str) -> str:
    return escape(text).replace("\n", "\u21b5\n") or "\u2205"


def _text(row: dict, last: int) -> str:
    out = ['<div class="text">', f'<span class="ctx">{escape(row["prompt"])}</span>']
    if row["infill"]:
        out.append('<span class="tag">fill</span>')
    for t in row["tokens"]:
        c = colour(t["step"], last)
        out.append(f'<span class="tok" style="background:{c};color:{_ink(c)}" title="step {t["step"]}">'
                   f'{_piece(t["text"])}</span>')
    if row["infill"]:
        out.append(f'<span class="tag">suffix</span><span class="ctx suffix">{escape(row["suffix"])}</span>')
    out.append("</div>")
    return "".join(out)


def _legend(last: int) -> str:
    stops = ",".join(colour(k, last) for k in range(1, last + 1)) if last > 1 else f"{colour(1, 1)},{colour(1, 1)}"
    return (f'<div class="legend">step 1<div class="ramp" style="background:linear-gradient(90deg,{stops})"></div>'
            f"step {last}</div>")


def _map(row: dict, last: int) -> str:
    n = max(len(row["tokens"]), max((s["window"][1] for s in row["steps"] if s["window"]), default=0), 1)
    cell = max(4.0, min(18.0, (MAP_WIDTH - 40) / n))
    left, top, h = 34, 16, max(4.0, min(14.0, cell))
    width, height = left + n * cell + 8, top + len(row["steps"]) * h + 6
    commit = {o: t["step"] for o, t in enumerate(row["tokens"])}
    out = [f'<svg width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img">']
    for o in range(0, n, 4 if cell >= 10 else 8 if cell >= 6 else 16):
        out.append(f'<text x="{left + o * cell:.1f}" y="10">{o}</text>')
    for j, s in enumerate(row["steps"]):
        y = top + j * h
        if j % max(1, round(12 / h)) == 0:
            out.append(f'<text x="0" y="{y + h - 2:.1f}">{s["step"]}</text>')
        for o, k in commit.items():
            if k < s["step"]:
                out.append(f'<rect x="{left + o * cell:.1f}" y="{y:.1f}" width="{cell - 1:.1f}" height="{h - 1:.1f}" '
                           f'fill="#e6e6e6"/>')
            elif k == s["step"]:
                out.append(f'<rect x="{left + o * cell:.1f}" y="{y:.1f}" width="{cell - 1:.1f}" height="{h - 1:.1f}" '
                           f'fill="{colour(k, last)}"/>')
        if s["window"]:
            a, b = s["window"]
            out.append(f'<rect x="{left + a * cell - 0.5:.1f}" y="{y - 0.5:.1f}" width="{(b - a) * cell:.1f}" '
                       f'height="{h:.1f}" fill="none" stroke="#d6336c" stroke-width="1"/>')
    out.append("</svg>")
    return "".join(out)


def _bars(row: dict, last: int) -> str:
    steps = row["steps"]
    peak = max((s["count"] for s in steps), default=1) or 1
    bw = max(3.0, min(24.0, (MAP_WIDTH - 40) / max(len(steps), 1)))
    left, ph = 34, 90
    width, height = left + len(steps) * bw + 8, ph + 22
    out = [f'<svg width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img">',
           f'<line x1="{left - 2}" y1="{ph + 2}" x2="{width:.0f}" y2="{ph + 2}" stroke="#999"/>']
    for v in sorted({0, peak, max(1, peak // 2)}):
        y = ph + 2 - v / peak * (ph - 8)
        out.append(f'<text x="4" y="{y + 3:.1f}">{v}</text>')
    for j, s in enumerate(steps):
        bh = s["count"] / peak * (ph - 8)
        out.append(f'<rect x="{left + j * bw:.1f}" y="{ph + 2 - bh:.1f}" width="{bw - 1:.1f}" height="{bh:.1f}" '
                   f'fill="{colour(s["step"], last)}"><title>step {s["step"]}: {s["count"]} tokens</title></rect>')
        if j % max(1, round(30 / bw)) == 0:
            out.append(f'<text x="{left + j * bw:.1f}" y="{ph + 16}">{s["step"]}</text>')
    out.append("</svg>")
    return "".join(out)


def render(record: dict) -> str:
    parts = [f'<!doctype html><html lang="en"><head><meta charset="utf-8"><title>{escape(record["title"])}</title>'
             f"<style>{CSS}</style></head><body><h1>{escape(record['title'])}</h1>"]
    if record.get("settings"):
        parts.append(f'<p class="meta">{escape(record["settings"])}</p>')
    for i, row in enumerate(record["rows"], 1):
        last = max((s["step"] for s in row["steps"]), default=max((t["step"] for t in row["tokens"]), default=1)) or 1
        n, steps = len(row["tokens"]), len(row["steps"])
        rate = f"{n / steps:.2f} tokens/step" if steps else "no steps"
        parts.append(f"<section><h2>Output {i}{' (infill)' if row['infill'] else ''}: {n} tokens in {steps} steps, "
                     f"{rate}, stop: {escape(row['stop_reason'])}</h2>")
        parts.append(_text(row, last) + _legend(last))
        parts.append("<figure><figcaption>Decoding map: one line per step (top to bottom) over the generated "
                     "positions; outline: the step's window; colour: tokens it committed; grey: committed before"
                     f"</figcaption>{_map(row, last)}</figure>")
        parts.append(f"<figure><figcaption>Tokens committed per step</figcaption>{_bars(row, last)}</figure></section>")
    parts.append("</body></html>\n")
    return "".join(parts)
