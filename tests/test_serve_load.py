"""Load on loopback: concurrent clients, mixed lengths, streaming and not, some disconnecting mid-stream,
a few bad requests; bounded in request count and time. Every request completes with the output it
would have alone, or gets its clear error; none is lost or duplicated; a disconnect frees its slot."""

import asyncio
import json
import re
import time

import httpx
import pytest

aiohttp = pytest.importorskip("aiohttp", reason="setdlm serve needs aiohttp (the serve extra)")


PROMPTS = ["The for statement", "A class", "import os", "def f(x):", "Lists implement", "while True", "Return the",
           "x = [1, 2"]
LENGTHS = [4, 9, 16, 30]
REQUESTS, CLIENTS, DEADLINE_S = 160, 16, 60.0






def plan(i: int) -> dict:
    """Request i of the run: its body and what the client does."""
    ext = {"threshold": 0.0} if i % 3 == 0 else {}
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": LENGTHS[(i * 7) % len(LENGTHS)], "temperature": 0,
            "setdlm": ext}
    kind = "stream" if i % 2 == 0 else "plain"
    if i % 8 == 2:
        kind, body["max_tokens"] = "disconnect", 30
    if i % 16 == 5:
        kind, body["max_tokens"] = "bad", 200
    return {"body": body, "kind": kind}


def reference(served, body) -> tuple[str, list[int]]:
    """The same request decoded alone by `generate` (no server)."""
    from model.sampling import SamplingConfig, generate

    cfg = SamplingConfig.from_objective(served.recipe.objective, max_new_tokens=body["max_tokens"], **body["setdlm"])
    out = generate(served.model, [served.tokenizer.encode(body["prompt"])], cfg, tokenizer=served.tokenizer)[0]
    return out.text, out.tokens


async def one(session: aiohttp.ClientSession, url: str, job: dict):
    body, kind = job["body"], job["kind"]
    if kind in ("plain", "bad"):
        async with session.post(url, json=body) as r:
            data = await r.json()
            if r.status != 200:
                return ("error", r.status, data["error"]["param"])
            ch = data["choices"][0]
            return ("ok", ch["text"], ch["setdlm"]["tokens"], data["id"])
    text, final, events, rid = "", None, 0, None
    async with session.post(url, json={**body, "stream": True}) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])
            rid, ch = c["id"], c["choices"][0]
            text += ch["text"]
            events += 1
            if ch["finish_reason"] is not None:
                final = ch["setdlm"]["tokens"]
            if kind == "disconnect" and events == 2:
                r.close()  # drop the connection mid-stream
                return ("disconnected",)
    return ("ok", text, final, rid)


async def load(url: str, jobs: list[dict]):
    results: dict[int, tuple] = {}
    todo = list(range(len(jobs)))
    t_end = time.monotonic() + DEADLINE_S

    async def client(session):
        while todo and time.monotonic() < t_end:
            i = todo.pop(0)
            assert i not in results
            results[i] = await one(session, url, jobs[i])

    timeout = aiohttp.ClientTimeout(total=DEADLINE_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(CLIENTS)))
    return results


def metric(srv, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=30).text
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def settled(srv, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(metric(srv, k) == 0 for k in ("setdlm_slots_busy", "setdlm_queue_depth", "setdlm_requests_in_flight")):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_load_mixed_clients_with_disconnects(served, server):
    jobs = [plan(i) for i in range(REQUESTS)]
    refs = {}
    for j in jobs:
        key = json.dumps(j["body"], sort_keys=True)
        if j["kind"] in ("plain", "stream") and key not in refs:
            refs[key] = reference(served, j["body"])
    t0 = time.monotonic()
    results = asyncio.run(load(server.url + "/v1/completions", jobs))
    took = time.monotonic() - t0
    assert took < DEADLINE_S + 5 and len(results) >= REQUESTS // 2, (took, len(results))
    kinds = {"ok": 0, "error": 0, "disconnected": 0}
    for i, res in results.items():  # each request got its own answer, or its clear error
        kind = jobs[i]["kind"]
        kinds[res[0]] += 1
        if kind == "bad":
            assert res == ("error", 400, "max_tokens")
        elif kind == "disconnect":
            assert res == ("disconnected",)
        else:
            assert res[0] == "ok" and (res[1], res[2]) == refs[json.dumps(jobs[i]["body"], sort_keys=True)], i
    ids = [res[3] for res in results.values() if res[0] == "ok"]
    assert len(ids) == len(set(ids))  # no response delivered twice
    assert settled(server)  # nothing left decoding, waiting or being answered
    counted = {o: metric(server, f'setdlm_requests_total{{endpoint="/v1/completions",outcome="{o}"}}')
               for o in ("200", "400", "disconnected")}
    # A client that hangs up after two events may do so after the server has written its whole stream
    # (a loaded machine, a short output): the server then counts a 200. Every request is counted once.
    assert counted["400"] == kinds["error"]
    assert counted["200"] + counted["disconnected"] == kinds["ok"] + kinds["disconnected"]
    assert kinds["ok"] <= counted["200"] and counted["disconnected"] <= kinds["disconnected"]
    assert kinds["disconnected"] >= 8 and kinds["error"] >= 4 and counted["disconnected"] >= 1
    assert 1 <= metric(server, "setdlm_cancelled_total") <= counted["disconnected"]


def test_disconnects_free_their_slots(server):
    """Fill the 4 slots with long rows (3 streams, 1 plain), drop the clients while they decode: their
    rows are cancelled (not decoded to the end) and the next request runs."""
    url = server.url + "/v1/completions"
    before = metric(server, "setdlm_cancelled_total")
    body = {"prompt": "Lists implement", "max_tokens": 60, "temperature": 0}  # one token per step: 60 steps

    async def run():
        async with aiohttp.ClientSession() as session:
            full = asyncio.Event()

            async def stream():
                async with session.post(url, json={**body, "stream": True}) as r:
                    async for raw in r.content:
                        if raw.startswith(b"data: "):
                            await full.wait()
                            r.close()
                            return

            async def plain():
                async with session.post(url, json=body) as r:
                    await r.read()

            tasks = [asyncio.create_task(stream()) for _ in range(3)] + [asyncio.create_task(plain())]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                async with session.get(server.url + "/metrics") as r:
                    if re.search(r"^setdlm_slots_busy 4(\.0)?$", await r.text(), re.M):
                        break
                await asyncio.sleep(0.002)
            assert time.monotonic() < deadline, "the 4 rows never decoded together"
            full.set()
            tasks[-1].cancel()  # the plain request's connection is closed before its answer
            await asyncio.gather(*tasks, return_exceptions=True)
            async with session.post(url, json={"prompt": "A class", "max_tokens": 4, "temperature": 0}) as r:
                assert r.status == 200

    asyncio.run(run())
    assert settled(server)
    assert metric(server, "setdlm_cancelled_total") - before == 4


def test_drain_answers_what_is_left_at_the_timeout_with_503(served):
    """SIGTERM's drain (serve.cli.stop) with 1 slot and 6 requests of 120 one-token steps, 3 streamed: at
    the drain timeout (0.5 s) each request still running or waiting is answered, a plain one with 503, a
    stream with an error event, and none gets a closed connection; the drain ends within its timeout
    plus 1 s, the decode loop stopped and the port closed."""
    from serve.cli import stop
    from serve_helpers import ThreadServer

    srv = ThreadServer(served, max_batch=1)
    url = srv.url + "/v1/completions"
    body = {"prompt": "Lists implement", "max_tokens": 120, "temperature": 0, "setdlm": {"ignore_eos": True}}
    got, took = [], []

    async def one(session, stream: bool):
        async with session.post(url, json={**body, "stream": stream}) as r:
            if not stream:
                got.append(("plain", r.status, await r.json()))
                return
            events = [json.loads(raw[6:]) for raw in [line async for line in r.content]
                      if raw.startswith(b"data: {")]
            got.append(("stream", r.status, events[-1]))

    async def run():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            tasks = [asyncio.create_task(one(session, i % 2 == 0)) for i in range(6)]
            deadline = time.monotonic() + 60
            while metric(srv, "setdlm_requests_in_flight") < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(stop(srv.runner, srv.server, 0.5), srv.loop))
            took.append(time.monotonic() - t0)
            await asyncio.gather(*tasks)

    try:
        asyncio.run(run())
    finally:
        srv.loop.call_soon_threadsafe(srv.loop.stop)
        srv.thread.join(30)
    assert took[0] < 0.5 + 1.0, took
    assert len(got) == 6 and not srv.server.scheduler.alive
    left = 0
    for kind, status, last in got:
        done = (kind == "plain" and status == 200 and len(last["choices"][0]["setdlm"]["tokens"]) == 120) or \
            (kind == "stream" and last.get("choices") and last["choices"][0]["finish_reason"] == "length")
        if not done:
            left += 1
            err = last["error"]
            assert (status == 503 if kind == "plain" else status == 200) and err["type"] == "unavailable", last
            assert "drain timeout" in err["message"]
    assert left >= 4  # one slot: at most the first two can have finished
    with pytest.raises(httpx.ConnectError):
        httpx.get(srv.url + "/health", timeout=5)
