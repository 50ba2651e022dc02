"""The decoding trace page: `setdlm sample --trace` and the same page from a `setdlm serve` stream,
self-contained, and drawn by a real headless Chromium (skipped without one)."""

import json
import re
import shutil
import subprocess

import httpx
import pytest

from serve_helpers import ThreadServer, train_tiny

ROWS = [{"prompt": "The for statement"}, {"prompt": "def f(", "suffix": ") return x", "infill_length": 8}]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, model_parallel):
    return train_tiny(tmp_path_factory.mktemp("trace"))


@pytest.fixture(scope="module")
def sampled(run_dir, tmp_path_factory):
    """`setdlm sample --trace` over a plain prompt and an infill one; (page path, JSON outputs)."""
    from eval.sample import main

    tmp = tmp_path_factory.mktemp("trace_out")
    src = tmp / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out, page = tmp / "out.jsonl", tmp / "trace.html"
    assert main(["--checkpoint", str(run_dir), "--prompts-file", str(src), "--out", str(out), "--max-new-tokens", "14",
                 "--threshold", "0", "--device", "cpu", "--trace", str(page)]) == 0
    return page, [json.loads(x) for x in out.read_text().splitlines()]


def test_sample_trace_page_is_self_contained_and_complete(sampled):
    from eval.trace_html import colour

    page, outs = sampled
    html = page.read_text()
    assert html.startswith("<!doctype html>") and "<script" not in html.lower()
    assert not re.search(r"""(src|href)\s*=|url\(|@import|https?://""", html, re.I)  # nothing fetched
    assert "def f(" in html and ") return x" in html and "(infill)" in html
    for o in outs:
        last = o["steps"]
        assert f"{len(o['tokens'])} tokens in {last} steps" in html
        assert colour(1, last) in html and colour(last, last) in html
    assert html.count("<svg") == 2 * len(outs)  # a decoding map and a bar chart per output


def test_the_stream_gives_the_same_trace(run_dir, sampled):
    """The server's streamed steps draw the same record as the engine's own step events."""
    from eval.trace import from_stream, sample_rows
    from eval.trace_html import render
    from model.sampling import Infill, SamplingConfig, generate
    from serve.loading import load_served

    served = load_served(run_dir, device="cpu")
    srv = ThreadServer(served, max_batch=2)
    try:
        body = {"prompt": "def f(", "temperature": 0, "stream": True,
                "setdlm": {"threshold": 0.0, "infill": {"suffix": ") return x", "length": 8}}}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    finally:
        srv.close()
    tok, events = served.tokenizer, []
    cfg = SamplingConfig.from_objective(served.recipe.objective, window=served.s_max, threshold=0.0)
    outs = generate(served.model, [Infill(tok.encode("def f("), 8, tok.encode(") return x"))], cfg, tokenizer=tok,
                    on_step=events.append)
    [want] = sample_rows([ROWS[1]], outs, events, tok)
    [row] = from_stream(chunks, "def f(", ") return x")["rows"]
    assert row == want and len(row["tokens"]) == 8 and row["infill"] and all(s["window"] for s in row["steps"])
    assert sum(s["count"] for s in row["steps"]) == 8 and len(row["steps"]) < 8  # threshold 0: several per step
    assert render({"title": "t", "settings": "", "rows": [row]}).count("<svg") == 2


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian package chromium; scripts/install.sh --test)")
def test_chromium_draws_the_page(sampled, tmp_path):
    pil = pytest.importorskip("PIL.Image")
    from eval.trace_html import colour

    page, outs = sampled
    shot = tmp_path / "trace.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic",
                    f"--user-data-dir={tmp_path / 'profile'}", "--hide-scrollbars", "--window-size=1000,1400",
                    f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120, check=True)
    img = pil.open(shot).convert("RGB")
    assert img.size == (1000, 1400)
    seen = set(img.get_flattened_data()) if hasattr(img, "get_flattened_data") else set(img.getdata())
    last = outs[0]["steps"]
    for step in (1, last):  # the first and the last step's colours were painted
        want = tuple(int(colour(step, last)[k : k + 2], 16) for k in (1, 3, 5))
        assert any(sum(abs(a - b) for a, b in zip(px, want)) <= 6 for px in seen), (step, want)
    assert len(seen) > 50  # text, map and bars, not a blank or error page
