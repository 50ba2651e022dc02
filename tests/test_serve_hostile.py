"""Hostile input and overload on loopback: bodies that once crashed a handler are 4xx naming what is
wrong, a catastrophic stop regex stalls nothing, values the server cannot honour are refused naming
the field, and past --max-waiting requests get 429 with Retry-After (a bounded load test)."""

import asyncio
import json
import threading
import time

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="setdlm serve needs aiohttp (the serve extra)")
httpx = pytest.importorskip("httpx", reason="the serving tests need httpx")

from serve_helpers import ThreadServer  # noqa: E402

C, CHAT = "/v1/completions", "/v1/chat/completions"


def raw(srv, path, body: bytes) -> httpx.Response:
    return httpx.post(srv.url + path, content=body, headers={"Content-Type": "application/json"}, timeout=120)


HOSTILE = [  # (name, path, raw body, the field the 4xx names) : each gave a 500 before
    ("deep JSON", C, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body"),
    ("negative id", C, b'{"prompt": [[5, -1]]}', "prompt"),
    ("id 10**12", C, b'{"prompt": [1000000000000]}', "prompt"),
    ("seed 2**64", C, b'{"prompt": "x", "temperature": 1, "seed": 18446744073709551616}', "seed"),
    ("seed -2**64", C, b'{"prompt": "x", "temperature": 1, "seed": -18446744073709551616}', "seed"),
    ("lone surrogate, prompt", C, b'{"prompt": "ab\\ud800c"}', "prompt"),
    ("lone surrogate, chat", CHAT, b'{"messages": [{"role": "user", "content": "hi \\udc00"}]}', "messages.0.content"),
    ("block_size 100000", C, b'{"prompt": "x", "setdlm": {"family": "bd3lm", "block_size": 100000}}', "setdlm.block_size"),
    ("max_tokens 10**12", C, b'{"prompt": "x", "max_tokens": 1000000000000}', "max_tokens"),
    ("max_tokens 10**12, chat", CHAT, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1000000000000}',
     "max_tokens"),
    ("steps 10**30", C, b'{"prompt": "x", "setdlm": {"family": "mdlm", "steps": 1000000000000000000000000000000}}',
     "setdlm.steps"),
    ("window 10**9, another family", C, b'{"prompt": "x", "setdlm": {"family": "ar", "window": 1000000000}}',
     "setdlm.window"),
    ("NaN", C, b'{"prompt": "x", "temperature": NaN}', "body"),
    ("logit_bias id past the vocabulary", C, b'{"prompt": "x", "logit_bias": {"99999999": 1}}', "logit_bias"),
    ("logit_bias on MASK", C, b'{"prompt": "x", "logit_bias": {"50257": 1}}', "logit_bias"),
    ("not UTF-8", C, b'{"prompt": "\xff"}', "body"),
    ("100 nested lists in a prompt", C, b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}", "body"),
]


@pytest.mark.parametrize("name,path,body,param", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_are_4xx_naming_what_is_wrong(server, name, path, body, param):
    r = raw(server, path, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: "), err


UNSUPPORTED = [  # values the server cannot honour: 400 naming the field
    (C, {"prompt": "x", "best_of": 3}, "best_of"),
    (C, {"prompt": "x", "suffix": "y"}, "suffix"),
    (C, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (C, {"prompt": "x", "stop": ["s"] * 33}, "stop"),
    (C, {"prompt": "x", "setdlm": {"stop_regex": "(?<=a)b"}}, "setdlm.stop_regex"),
    (C, {"prompt": "x", "setdlm": {"stop_regex": "(?:a{1000}){1000}"}}, "setdlm.stop_regex"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": [{"role": "user", "content": "x"}], "store": True}, "store"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages.0.content"),
    (CHAT, {"messages": [{"role": "tool", "content": "x", "tool_call_id": "c"}]}, "messages.0.role"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    (C, {"prompt": "x", "setdlm": {"stop_regex": ""}}, "setdlm.stop_regex"),  # was accepted and ignored
    (C, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    (C, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),  # SamplingConfig's range
    (C, {"prompt": "x", "setdlm": {"repetition_penalty": 1e-300}}, "setdlm.repetition_penalty"),
]


@pytest.mark.parametrize("path,body,param", UNSUPPORTED, ids=[u[2] for u in UNSUPPORTED])
def test_values_the_server_cannot_honour_name_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_catastrophic_stop_regex_stalls_nothing(server, served):
    """`(\\s+)+x` over a whitespace output (forced with logit_bias) backtracks exponentially in Python's
    re; RE2 matches it in linear time off the event loop: /health answers within 2 s throughout and the
    request ends within 30 s."""
    space = served.tokenizer.encode(" ")[0]
    body = {"prompt": "The for statement", "max_tokens": 100, "temperature": 0, "stream": True,
            "logit_bias": {str(space): 100}, "setdlm": {"stop_regex": r"(\s+)+x", "ignore_eos": True}}
    first, done, chunks, took = threading.Event(), threading.Event(), [], []

    def run():
        t0 = time.monotonic()
        with httpx.stream("POST", server.url + C, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
                    first.set()
        took.append(time.monotonic() - t0)
        done.set()

    th = threading.Thread(target=run)
    th.start()
    assert first.wait(30)
    probes = []
    while not done.is_set():
        t0 = time.monotonic()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        probes.append(time.monotonic() - t0)
        time.sleep(0.05)
    th.join(30)
    assert probes and max(probes) < 2.0, probes
    assert took[0] < 30 and chunks[-1] == "[DONE]"
    import json

    final = json.loads(chunks[-2])["choices"][0]["setdlm"]
    assert final["tokens"] == [space] * 100 and final["stop_reason"] == "length"


def test_a_stop_regex_over_its_time_ends_its_request_with_a_400(server, monkeypatch):
    from model.sampling import stopping

    monkeypatch.setattr(stopping, "REGEX_SECONDS", 0.0)  # the first search uses up each output's budget
    body = {"prompt": "A class", "max_tokens": 12, "temperature": 0, "setdlm": {"stop_regex": "zzzz"}}
    r = httpx.post(server.url + C, json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "setdlm.stop_regex"
    with httpx.stream("POST", server.url + C, json={**body, "stream": True}, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert '"param": "setdlm.stop_regex"' in lines[-1]
    monkeypatch.undo()
    assert httpx.post(server.url + C, json=body, timeout=60).status_code == 200


REQUESTS, CLIENTS, DEADLINE_S = 24, 12, 60.0


def test_overload_gets_429_with_retry_after_and_health_says_so(served):
    """2 slots and 2 waiting outputs; 12 clients send 24 requests of 40 tokens (one per step). Those past
    the queue get 429 with Retry-After and retry after it (at most 3 times, waiting at most 2 s); the
    rest are answered in full. /health reports "overloaded" while the queue is full."""
    srv = ThreadServer(served, max_batch=2, max_waiting=2)
    url = srv.url
    statuses, retry_after, health = [], [], []

    async def one(session, i):
        body = {"prompt": "Lists implement", "max_tokens": 40, "temperature": 0, "setdlm": {"ignore_eos": True}}
        for _ in range(4):
            async with session.post(url + C, json=body) as r:
                data = await r.json()
                statuses.append(r.status)
                if r.status != 429:
                    return r.status, len(data["choices"][0]["setdlm"]["tokens"])
                assert data["error"]["type"] == "rate_limit_error" and "--max-waiting 2" in data["error"]["message"]
                retry_after.append(int(r.headers["Retry-After"]))
                await asyncio.sleep(min(retry_after[-1], 2))
        return 429, 0

    async def watch(session, stop):
        while not stop.is_set():
            async with session.get(url + "/health") as r:
                health.append((r.status, await r.json()))
            await asyncio.sleep(0.02)

    async def run():
        todo, results = list(range(REQUESTS)), []
        stop = asyncio.Event()

        async def client(session):
            while todo:
                results.append(await one(session, todo.pop()))

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S)) as session:
            watcher = asyncio.create_task(watch(session, stop))
            await asyncio.gather(*(client(session) for _ in range(CLIENTS)))
            stop.set()
            await watcher
        return results

    try:
        t0 = time.monotonic()
        results = asyncio.run(run())
        assert time.monotonic() - t0 < DEADLINE_S
        assert len(results) == REQUESTS
        assert statuses.count(429) >= 1 and all(1 <= s <= 60 for s in retry_after)
        answered = [n for s, n in results if s == 200]
        assert len(answered) >= 4 and all(n == 40 for n in answered)
        assert all(s in (200, 429) for s in statuses)
        over = [h for s, h in health if h["status"] == "overloaded"]
        assert over and all(s == 503 for s, h in health if h["status"] == "overloaded")
        assert all(h["waiting"] <= 2 for _, h in health)  # never more than --max-waiting outputs wait
        final = httpx.get(url + "/health", timeout=10)
        assert final.status_code == 200 and final.json()["status"] == "ok" and final.json()["waiting"] == 0
        text = httpx.get(url + "/metrics", timeout=10).text
        assert f'setdlm_requests_total{{endpoint="/v1/completions",outcome="429"}} {statuses.count(429)}.0' in text
        never = httpx.post(url + C, json={"prompt": "x", "n": 5, "max_tokens": 2}, timeout=30)  # > 2 slots + 2 waiting
        assert never.status_code == 400 and never.json()["error"]["param"] == "n"
    finally:
        srv.close()


HEALTH_S, SMALL_S = 2.0, 10.0  # the acceptance check's 1 s and 5 s with room for a shared 2-core machine


def test_heavy_bodies_stall_nothing(server, served):
    """The shape of the acceptance check serve-heavy-bodies (benchmarks/bench_serve.py --heavy-bodies runs
    it with its own numbers): 8 clients send a 4 MB body at once (4 completion prompts, 4 chat
    messages) while /health and /metrics are polled and a small completion is sent alongside. Every
    poll answers within HEALTH_S, the small completion ends within SMALL_S with its output alone, each
    heavy body is a 400 naming its field (tokenised only up to the model's positions), and temperature
    or repetition_penalty 1e-300 get 200 (greedy: the temperature-0 output) or a 400 naming the field."""
    text = ("The quick brown fox jumps over the lazy dog. " * 93_000)[: 4 << 20]
    heavy = [json.dumps({"prompt": text, "max_tokens": 4}).encode()] * 4 + \
        [json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4}).encode()] * 4
    small = {"prompt": "The for statement", "max_tokens": 8, "temperature": 0}
    polls, answers = [], {}

    async def run():
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def watch():
                while not stop.is_set():
                    for path in ("/health", "/metrics"):
                        t0 = time.monotonic()
                        async with session.get(server.url + path) as r:
                            await r.read()
                            assert r.status == 200
                        polls.append(time.monotonic() - t0)
                    await asyncio.sleep(0.05)

            async def post(path, data: bytes, delay: float = 0.0):
                await asyncio.sleep(delay)
                t0 = time.monotonic()
                headers = {"Content-Type": "application/json"}
                async with session.post(server.url + path, data=data, headers=headers) as r:
                    return r.status, await r.json(), time.monotonic() - t0

            watcher = asyncio.create_task(watch())
            answers["heavy"] = await asyncio.gather(*(post(CHAT if i >= 4 else C, b) for i, b in enumerate(heavy)),
                                                    post(C, json.dumps(small).encode(), 0.2))
            stop.set()
            await watcher

    asyncio.run(run())
    *big, little = answers["heavy"]
    assert len(polls) >= 4 and max(polls) < HEALTH_S, sorted(polls)[-3:]
    assert little[0] == 200 and little[2] < SMALL_S, little
    alone = httpx.post(server.url + C, json=small, timeout=60).json()
    assert little[1]["choices"][0]["text"] == alone["choices"][0]["text"]
    for i, (status, body, _) in enumerate(big):
        param = "messages" if i >= 4 else "prompt"
        assert status == 400 and body["error"]["param"] == param, body
        assert body["error"]["message"].startswith(f"{param}: more than 64 prompt tokens exceed the model's 64 "
                                                   "positions")
    tiny_t = httpx.post(server.url + C, json={**small, "temperature": 1e-300, "seed": 3}, timeout=60)
    assert tiny_t.status_code == 200 and tiny_t.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    tiny_p = httpx.post(server.url + C, json={**small, "setdlm": {"repetition_penalty": 1e-300}}, timeout=60)
    assert tiny_p.status_code == 400 and tiny_p.json()["error"]["param"] == "setdlm.repetition_penalty", tiny_p.text


def _with_template(served, template: str):
    """`served` whose tokenizer carries the chat template `template` (not yet checked)."""
    import copy
    import dataclasses

    tok = copy.copy(served.tokenizer)
    tok.chat_template = template
    return dataclasses.replace(served, tokenizer=tok, chat=None, chat_error=None, chat_checked=False)


@pytest.mark.slow
def test_a_failing_chat_template_is_checked_at_start_and_remembered(served, monkeypatch):
    """A template that fails a short chat is found when the server starts; every chat request is then a 400
    naming `messages` at once, without rendering it again; completions are served as usual."""
    from data_pipeline.template_worker import TemplateWorker

    renders = []
    real = TemplateWorker.render
    monkeypatch.setattr(TemplateWorker, "render", lambda self, *a, **k: renders.append(1) or real(self, *a, **k))
    srv = ThreadServer(_with_template(served, "{{ raise_exception('this template is broken') }}"))
    try:
        assert renders and srv.server.served.chat_error is not None  # checked before listening
        checked = len(renders)
        for _ in range(3):
            r = httpx.post(srv.url + CHAT, json={"messages": [{"role": "user", "content": "hi"}]}, timeout=60)
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "messages" and "this template is broken" in err["message"]
        assert len(renders) == checked  # never rendered again
        assert httpx.post(srv.url + C, json={"prompt": "A class", "max_tokens": 2}, timeout=60).status_code == 200
    finally:
        srv.close()


@pytest.mark.slow
def test_slow_chat_renders_have_their_own_pool_and_time_limit(served, monkeypatch):
    """A template that loops on some messages (it passes the start-up check): 3 such chats at once end
    with a 400 naming `messages` after the per-request limit (1 s here), while a completion sent beside
    them is answered at once and a normal chat is answered too (rendered by a free or restarted worker)."""
    from serve import app

    monkeypatch.setattr(app, "CHAT_RENDER_SECONDS", 1.0)
    looping = ("{% for m in messages %}{% if m.content == 'loop' %}"
               "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{% endif %}"
               "{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    srv = ThreadServer(_with_template(served, looping))
    took = {}

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def post(name, path, body, delay=0.0):
                await asyncio.sleep(delay)
                t0 = time.monotonic()
                async with session.post(srv.url + path, json=body) as r:
                    took[name] = (r.status, await r.json(), time.monotonic() - t0)

            loop = {"messages": [{"role": "user", "content": "loop"}], "max_tokens": 2}
            await asyncio.gather(*(post(f"loop{i}", CHAT, loop) for i in range(3)),
                                 post("plain", C, {"prompt": "A class", "max_tokens": 4, "temperature": 0}, 0.2),
                                 post("chat", CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                                      0.2))

    try:
        asyncio.run(run())
    finally:
        srv.close()
    for i in range(3):
        status, body, _ = took[f"loop{i}"]
        assert status == 400 and body["error"]["param"] == "messages" and "1 s" in body["error"]["message"], body
    assert took["plain"][0] == 200 and took["plain"][2] < max(took[f"loop{i}"][2] for i in range(3)), took
    assert took["chat"][0] == 200, took["chat"]


def test_cheap_checks_come_before_walking_the_body(server, monkeypatch):
    """700,000 tiny prompts, or one prompt of 2 million token ids: refused naming `n` / `prompt` from the
    counts alone, before anything walks the body (check_text, the model's validation); a body over 4 MiB
    is a 413 from its Content-Length."""
    from serve import schema

    def walked(body):
        raise AssertionError("the body was walked before the cheap checks")

    monkeypatch.setattr(schema, "check_text", walked)
    r = raw(server, C, b'{"prompt": [' + b",".join([b'"x"'] * 700_000) + b"]}")
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert r.json()["error"]["message"] == "n: 700000 prompts x n=1 is more than 64 outputs in one request"
    r = raw(server, C, b'{"prompt": [' + b",".join([b"5"] * 2_000_000) + b"]}")
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "prompt: 2000000 prompt tokens exceed the model's 64 positions"), r.text
    monkeypatch.undo()
    assert raw(server, C, b'{"prompt": "' + b"x" * (5 << 20) + b'"}').status_code == 413
