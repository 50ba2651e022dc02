"""`setdlm serve` on loopback: greedy outputs equal `setdlm sample` (alone and under 8 concurrent
clients), streaming events, bad requests as 4xx naming the field, the openai client, auth, metrics."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serve_helpers import ThreadServer

PROMPTS = ["The for statement", "A class", "import os", "def f(x):", "Lists implement", "while True", "Return the",
           "x = [1, 2"]
KEY = "sk-test-5f0c9e1d"








def sample_cli(run_dir, capsys, *args) -> list[dict]:
    """`setdlm sample --json` (its main, in this process)."""
    from eval.sample import main

    capsys.readouterr()
    assert main(["--checkpoint", str(run_dir), "--json", "--device", "cpu", *map(str, args)]) == 0
    return [json.loads(x) for x in capsys.readouterr().out.splitlines()]


def post(srv, body, path="/v1/completions", headers=None) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=headers, timeout=120)


def stream(srv, body, path="/v1/completions") -> list[dict]:
    chunks = []
    with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    return chunks
                chunks.append(json.loads(line[6:]))
    raise AssertionError("stream ended without [DONE]")


def streamed_result(chunks) -> dict:
    """Text from the deltas, the final payload, and the tokens rebuilt from the step events."""
    text, tokens, final = "", {}, None
    for c in chunks:
        for ch in c["choices"]:
            text += ch.get("text", ch.get("delta", {}).get("content", "")) or ""
            ext = ch.get("setdlm", {})
            for span in ext.get("spans", []):
                assert ext["window"][0] <= span["offset"] and span["offset"] + len(span["tokens"]) <= ext["window"][1]
                tokens.update({span["offset"] + k: t for k, t in enumerate(span["tokens"])})
            if ch["finish_reason"] is not None:
                final = ext
    assert final is not None
    rebuilt = [tokens[o] for o in range(len(final["tokens"]))]
    return {"text": text, "tokens": final["tokens"], "rebuilt": rebuilt, "steps": final["steps"]}


def _request(srv, prompt, ext, streaming):
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "setdlm": ext}
    if streaming:
        r = streamed_result(stream(srv, body))
        assert r["rebuilt"] == r["tokens"]
        return r["text"], r["tokens"]
    resp = post(srv, body)
    assert resp.status_code == 200, resp.text
    ch = resp.json()["choices"][0]
    return ch["text"], ch["setdlm"]["tokens"]


def test_greedy_equals_setdlm_sample_alone_and_with_8_concurrent_clients(serve_run, server, capsys):
    settings = [({}, []), ({"threshold": 0.0}, ["--threshold", "0"])]
    want = {}
    for ext, flags in settings:
        ref = sample_cli(serve_run, capsys, "--max-new-tokens", 12, *flags, *[a for p in PROMPTS for a in ("--prompt", p)])
        for p, r in zip(PROMPTS, ref):
            want[(p, json.dumps(ext))] = (r["text"], r["tokens"])
    assert len({v[0] for v in want.values()}) > len(PROMPTS)  # outputs depend on prompt and setting
    for p in PROMPTS[:3]:  # one at a time
        for ext, _ in settings:
            assert _request(server, p, ext, streaming=False) == want[(p, json.dumps(ext))]
    jobs = [(p, ext, i % 2 == 0) for i, (p, (ext, _)) in enumerate((p, s) for p in PROMPTS for s in settings)]
    with ThreadPoolExecutor(8) as pool:  # 8 clients, 16 requests, two settings, 4 slots: rows join running batches
        got = list(pool.map(lambda j: _request(server, *j), jobs))
    assert got == [want[(p, json.dumps(ext))] for p, ext, _ in jobs]


def test_infill_and_stop_strings_equal_setdlm_sample(serve_run, server, capsys):
    [ref] = sample_cli(serve_run, capsys, "--prompt", "def f(", "--infill", 6, "--suffix", ") return x")
    body = {"prompt": "def f(", "temperature": 0, "setdlm": {"infill": {"suffix": ") return x", "length": 6}}}
    ch = post(server, body).json()["choices"][0]
    assert (ch["text"], ch["setdlm"]["tokens"]) == (ref["text"], ref["tokens"]) and len(ref["tokens"]) == 6
    r = streamed_result(stream(server, body))
    assert (r["text"], r["tokens"], r["rebuilt"]) == (ref["text"], ref["tokens"], ref["tokens"])
    [free] = sample_cli(serve_run, capsys, "--prompt", "A class", "--max-new-tokens", 16)
    stop = free["text"][5:8]
    [cut] = sample_cli(serve_run, capsys, "--prompt", "A class", "--max-new-tokens", 16, "--stop", stop)
    assert cut["stop_reason"] == "stop_string" and stop not in cut["text"]
    body = {"prompt": "A class", "max_tokens": 16, "temperature": 0, "stop": stop}
    ch = post(server, body).json()["choices"][0]
    assert (ch["text"], ch["finish_reason"], ch["setdlm"]["stop_reason"]) == (cut["text"], "stop", "stop_string")
    assert streamed_result(stream(server, body))["text"] == cut["text"]  # the stop string is never streamed


def test_max_tokens_past_the_model_positions_decode_as_setdlm_sample(serve_run, server, capsys):
    """Prompt + max_tokens past the model's 64 positions: decoded as `setdlm sample` decodes it (the cache
    drops its oldest entries), up to the server's budget of 128 tokens per output."""
    [ref] = sample_cli(serve_run, capsys, "--prompt", "The for statement", "--max-new-tokens", 90, "--ignore-eos")
    body = {"prompt": "The for statement", "max_tokens": 90, "temperature": 0, "setdlm": {"ignore_eos": True}}
    resp = post(server, body)
    assert resp.status_code == 200, resp.text
    ch = resp.json()["choices"][0]
    assert (ch["text"], ch["setdlm"]["tokens"]) == (ref["text"], ref["tokens"]) and len(ref["tokens"]) == 90
    room = 128 - resp.json()["usage"]["prompt_tokens"]
    err = post(server, {**body, "max_tokens": room + 1}).json()["error"]
    assert err["param"] == "max_tokens" and err["message"].endswith(f"this server's 128 tokens per output; at most {room}")


def test_stream_carries_spans_windows_prefix_and_usage(server):
    body = {"prompt": "import os", "max_tokens": 10, "temperature": 0, "setdlm": {"threshold": 0.0},
            "stream_options": {"include_usage": True}}
    chunks = stream(server, body)
    steps = [c["choices"][0]["setdlm"] for c in chunks if c["choices"] and "step" in c["choices"][0].get("setdlm", {})]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert any(len(sp["tokens"]) > 1 for s in steps for sp in s["spans"])  # threshold 0: several per step
    decoded = [s["decoded"] for s in steps]
    assert decoded == sorted(decoded) and all(s["window"][1] - s["window"][0] <= 4 for s in steps)
    sent = ""
    for c in chunks[:-1]:  # the final text streamed so far is a prefix of the decoded prefix
        ch = c["choices"][0]
        sent += ch["text"]
        assert "step" not in ch["setdlm"] or ch["setdlm"]["prefix"].startswith(sent)
    usage = chunks[-1]["usage"]
    r = streamed_result(chunks[:-1])
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == len(r["tokens"]) == 10
    assert usage["prompt_tokens"] == 2 and usage["setdlm"]["steps"] == r["steps"] == len(steps) < 10


def test_list_prompts_and_n(server):
    resp = post(server, {"prompt": ["A class", "import os"], "n": 2, "max_tokens": 5, "temperature": 0}).json()
    texts = [c["text"] for c in resp["choices"]]
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2, 3] and texts[0] == texts[1] and texts[2] == texts[3]
    assert texts[0] != texts[2] and resp["usage"]["completion_tokens"] == 20 and resp["usage"]["prompt_tokens"] == 4
    body = {"prompt": "A class", "n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 5}
    sampled = [c["text"] for c in post(server, body).json()["choices"]]
    assert len(set(sampled)) > 1  # n samples, not one repeated
    assert [c["text"] for c in post(server, body).json()["choices"]] == sampled  # the seed, alone: the same again
    assert [c["text"] for c in post(server, {**body, "seed": 6}).json()["choices"]] != sampled


BAD = [  # (body, HTTP status, the field the error names)
    ({"prompt": "x " * 70}, 400, "prompt"),  # longer than the model's 64 positions
    ({"prompt": "The", "max_tokens": 200}, 400, "max_tokens"),  # beyond the budget (2 x 64 tokens per output)
    ({"prompt": "The", "max_tokens": 70, "setdlm": {"family": "mdlm"}}, 400, "max_tokens"),  # MDLM: the 64 positions
    ({"prompt": "The", "bogus": 1}, 400, "bogus"),  # unknown field
    ({"prompt": "The", "setdlm": {"windw": 4}}, 400, "setdlm.windw"),
    ({"prompt": "The", "max_tokens": "8"}, 400, "max_tokens"),  # wrong type
    ({"prompt": "The", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),  # empty
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": "The", "setdlm": {"window": 9}}, 400, "setdlm.window"),  # above S_max = 8
    ({"prompt": "The", "setdlm": {"infill": {"suffix": "x", "length": 200}}}, 400, "setdlm.infill.length"),
    ({"prompt": "The", "top_p": 0}, 400, "top_p"),
    ({"prompt": "The", "stop": [""]}, 400, "stop"),
    ({"prompt": [[1, 50257]]}, 400, "prompt"),  # the MASK id
    ({"prompt": "The", "model": "gpt-4"}, 404, "model"),
    ({"max_tokens": 3}, 400, "prompt"),  # missing
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_are_4xx_json_naming_the_field(server, body, status, param):
    resp = post(server, body)
    assert resp.status_code == status and resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: ") and len(err["message"]) > len(param) + 10


def test_other_bad_input(server):
    resp = httpx.post(server.url + "/v1/completions", content=b"{not json", timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "body"
    chat = post(server, {"messages": []}, "/v1/chat/completions")
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    role = post(server, {"messages": [{"role": "robot", "content": "hi"}]}, "/v1/chat/completions")
    assert role.status_code == 400 and role.json()["error"]["param"] == "messages.0.role"
    assert httpx.get(server.url + "/v1/nothing", timeout=30).status_code == 404
    assert httpx.get(server.url + "/v1/completions", timeout=30).status_code == 405


def test_openai_client_completions_streams_and_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    full = client.completions.create(model="tiny", prompt="while True", max_tokens=8, temperature=0)
    parts = client.completions.create(model="tiny", prompt="while True", max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in parts) == full.choices[0].text and full.usage.completion_tokens == 8
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6,
                                          temperature=0)
    pieces = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 6
    with pytest.raises(openai.BadRequestError, match="setdlm.window"):
        client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"setdlm": {"window": 99}})


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok", "waiting": 0, "max_waiting": None,
                                                                    "in_flight": 0}
    m = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
    assert (m["id"], m["max_model_len"], m["s_max"]) == ("tiny", 64, 8)
    post(server, {"prompt": "Return the", "max_tokens": 6, "temperature": 0, "setdlm": {"threshold": 0.0}})
    text = httpx.get(server.url + "/metrics", timeout=30).text
    rows = {m[0]: float(m[1]) for m in re.findall(r"^(setdlm_\S+) (\S+)$", text, re.M)}
    assert rows['setdlm_requests_total{endpoint="/v1/completions",outcome="200"}'] >= 1
    assert rows["setdlm_generated_tokens_total"] >= 6 and rows["setdlm_forwards_total"] >= 2
    assert rows["setdlm_tokens_per_step"] >= 1 and rows["setdlm_slots"] == 4 and rows["setdlm_queue_depth"] == 0
    assert all(line.startswith("#") or re.match(r"^setdlm_\w+(\{[^}]*\})? \S+$", line) for line in text.splitlines())
    # latency is a histogram (aggregatable across replicas): cumulative buckets ending in +Inf = count
    assert "# TYPE setdlm_request_latency_seconds histogram" in text
    assert "# TYPE setdlm_time_to_first_token_seconds histogram" in text
    buckets = [(m[0], float(m[1])) for m in re.findall(
        r'^setdlm_request_latency_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)]
    counts = [c for _, c in buckets]
    assert buckets[-1][0] == "+Inf" and counts == sorted(counts) and counts[-1] == rows["setdlm_request_latency_seconds_count"] >= 1
    assert rows["setdlm_request_latency_seconds_sum"] > 0


def test_bearer_token(served):
    srv = ThreadServer(served, max_batch=1, api_key=KEY)
    try:
        body = {"prompt": "A class", "max_tokens": 2}
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            resp = post(srv, body, headers=headers)
            assert resp.status_code == 401 and resp.json()["error"]["type"] == "authentication_error"
            assert KEY not in resp.text
        assert post(srv, body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
        assert httpx.get(srv.url + "/health", timeout=30).status_code == 200  # probes need no token
    finally:
        srv.close()


def test_checkpoint_selectors_as_the_other_commands(serve_run):
    """`--checkpoint RUN:latest` / `RUN:STEP` load (named after the run); `RUN:best` of a run that kept no best
    says so in one line (it used to say 'no such directory')."""
    from common.errors import Error
    from serve.loading import load_served

    s = load_served(f"{serve_run}:latest", device="cpu")
    assert s.name == serve_run.name and s.max_len == 64
    assert load_served(f"{serve_run}:2", device="cpu").name == serve_run.name
    with pytest.raises(Error, match="best") as e:
        load_served(f"{serve_run}:best", device="cpu")
    assert "no such directory" not in str(e.value)
