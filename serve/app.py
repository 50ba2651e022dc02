"""The HTTP routes (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

A completion request is parsed (schema.py), checked against the model and turned into a Job
(params.py), handed to the decode loop (scheduler.py), and answered from the messages the loop posts
back into this event loop: one JSON body, or server-sent events as the steps land (streaming.py). A
handler that ends before its job did (the client disconnected: aiohttp cancels the handler, or a
write fails) cancels the job, which frees its slots at once. While the server drains (SIGTERM) new
requests get 503 and the running ones finish.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from aiohttp import web

from .auth import auth_middleware
from .params import plan
from .responses import Ids, chunk, full, usage_chunk
from .scheduler import Job
from .schema import ChatRequest, CompletionRequest, RequestError, parse
from .streaming import DONE, ChoiceText, finish_reason, sse

log = logging.getLogger("setdlm.serve")
SERVER = web.AppKey("server", object)


class Server:
    def __init__(self, served, scheduler, metrics, api_key: str | None = None):
        self.served, self.scheduler, self.metrics, self.api_key = served, scheduler, metrics, api_key
        self.draining = False


@web.middleware
async def errors(request: web.Request, handler):
    """Every failure as an OpenAI-style JSON error; every request counted by endpoint and status."""
    metrics = request.app[SERVER].metrics
    outcome = "500"
    try:
        resp = await handler(request)
        outcome = str(resp.status)
        return resp
    except RequestError as e:
        outcome = str(e.status)
        return web.json_response(e.body(), status=e.status)
    except web.HTTPException as e:
        outcome = str(e.status)
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return web.json_response({"error": {"message": f"{request.method} {request.path}: {e.reason}", "type": kind,
                                            "param": None, "code": None}}, status=e.status)
    except (asyncio.CancelledError, ConnectionResetError):
        outcome = "disconnected"
        raise
    except Exception:
        log.exception("setdlm serve: internal error on %s", request.path)
        return web.json_response({"error": {"message": "internal server error (see the server's log)",
                                            "type": "server_error", "param": None, "code": None}}, status=500)
    finally:
        route = request.match_info.route.resource
        metrics.count(route.canonical if route is not None else "unmatched", outcome)


async def health(request: web.Request) -> web.Response:
    srv = request.app[SERVER]
    status = "draining" if srv.draining else "ok" if srv.scheduler.alive else "decode loop stopped"
    return web.json_response({"status": status}, status=200 if status == "ok" else 503)


async def models(request: web.Request) -> web.Response:
    s = request.app[SERVER].served
    return web.json_response({"object": "list", "data": [{
        "id": s.name, "object": "model", "created": int(request.app[SERVER].metrics.started), "owned_by": "setdlm",
        "max_model_len": s.max_len, "family": s.recipe.objective.name, "s_max": s.s_max}]})


async def metrics(request: web.Request) -> web.Response:
    text = request.app[SERVER].metrics.render()
    return web.Response(text=text, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def completions(request: web.Request):
    return await _generate(request, CompletionRequest)


async def chat_completions(request: web.Request):
    return await _generate(request, ChatRequest)


async def _generate(request: web.Request, kind):
    srv: Server = request.app[SERVER]
    if srv.draining or not srv.scheduler.alive:
        raise RequestError(None, "the server is shutting down; retry on another replica" if srv.draining else
                           "the decode loop stopped (see the server's log)", 503, "unavailable")
    try:
        body = await request.json(loads=json.loads)
    except (ValueError, UnicodeDecodeError):
        raise RequestError("body", "not valid JSON") from None
    pl = plan(parse(kind, body), srv.served)
    loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
    job = Job(pl.cfg, pl.choices, post=lambda m: loop.call_soon_threadsafe(inbox.put_nowait, m), watch=pl.stream)
    ids = Ids(pl.chat, srv.served.name)
    t0 = time.perf_counter()
    srv.metrics.in_flight += 1
    srv.scheduler.submit(job)
    finished = False
    try:
        if pl.stream:
            resp, ttft = await _stream(request, srv, pl, job, inbox, ids, t0)
        else:
            resp, ttft = await _collect(pl, inbox, ids), None
        finished = True
        srv.metrics.finished_request(time.perf_counter() - t0, ttft)
        return resp
    finally:
        srv.metrics.in_flight -= 1
        if not finished:
            srv.scheduler.cancel(job)


async def _collect(pl, inbox: asyncio.Queue, ids: Ids) -> web.Response:
    outputs = [None] * len(pl.choices)
    while any(o is None for o in outputs):
        msg = await inbox.get()
        if msg[0] == "error":
            raise RuntimeError(msg[1])
        if msg[0] == "done":
            outputs[msg[1]] = msg[2]
    return web.json_response(full(ids, pl, outputs), dumps=lambda o: json.dumps(o, ensure_ascii=False))


async def _stream(request, srv: Server, pl, job, inbox: asyncio.Queue, ids: Ids, t0: float):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    texts = [ChoiceText(srv.served.tokenizer, c.stop, c.stop_regex) for c in pl.choices]
    outputs, ttft = [None] * len(pl.choices), None
    if pl.chat:
        for i in range(len(pl.choices)):
            await resp.write(sse(chunk(ids, i, "", None, first=True)))
    while any(o is None for o in outputs):
        msg = await inbox.get()
        if msg[0] == "error":
            log.error("setdlm serve: %s", msg[1])
            await resp.write(sse({"error": {"message": "decoding failed (see the server's log)", "type": "server_error",
                                            "param": None, "code": None}}))
            await resp.write_eof()
            return resp, None
        i = msg[1]
        if msg[0] == "step":
            text, payload = texts[i].step(msg[2])
            await resp.write(sse(chunk(ids, i, text, payload)))
        else:
            outputs[i] = msg[2]
            text, payload = texts[i].finish(msg[2])
            await resp.write(sse(chunk(ids, i, text, payload, finish=finish_reason(msg[2]))))
        if text and ttft is None:
            ttft = time.perf_counter() - t0
    if pl.include_usage:
        await resp.write(sse(usage_chunk(ids, pl, outputs)))
    await resp.write(DONE)
    await resp.write_eof()
    return resp, ttft


def make_app(server: Server) -> web.Application:
    app = web.Application(middlewares=[errors, auth_middleware(server.api_key)], client_max_size=4 << 20)
    app[SERVER] = server
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app
