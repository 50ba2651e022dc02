"""The HTTP routes (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, /tokenize,
/detokenize, /tokenizer_info, /health, /metrics.

A request's body is read, parsed, checked against the model and turned into a Job (params.py) off
this event loop (intake.py: a byte budget across the bodies in flight, bounded thread pools, chat
templates rendered in processes under a time limit), so no body, however large, delays /health,
/metrics or another request by more than reading its bytes from the socket. The job is handed to the
decode loop (scheduler.py) and answered from the messages the loop posts back into this event loop:
one JSON body, or server-sent events as the steps land (streaming.py). A handler that ends before
its job did (the client disconnected: aiohttp cancels the handler, or a write fails) cancels the job,
which frees its slots at once. While the server drains (SIGTERM) new requests get 503 and the running
ones finish; those still running or waiting at the drain timeout are answered 503 (a stream: an error
event). With `--max-waiting N`, a request whose outputs would make more than N wait for a slot gets
429 with Retry-After, and /health says "overloaded" while the next output would.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

from aiohttp import web

from .auth import auth_middleware
from .intake import MAX_BODY, Intake
from .params import CHAT_RENDER_SECONDS, chat_ids, check_request, encode, plan, render_chat
from .responses import Ids, chunk, full, logprobs, usage_chunk
from .scheduler import Job
from .schema import ChatRequest, CompletionRequest, DetokenizeRequest, RequestError, TokenizeRequest, read_body
from .streaming import DONE, ChoiceText, finish_reason, sse

log = logging.getLogger("setdlm.serve")
SERVER = web.AppKey("server", object)


class Server:
    def __init__(self, served, scheduler, metrics, api_key: str | None = None, max_waiting: int | None = None,
                 intake: Intake | None = None):
        self.served, self.scheduler, self.metrics, self.api_key = served, scheduler, metrics, api_key
        self.max_waiting = max_waiting  # outputs that may wait for a slot (None: no limit)
        self.outstanding = 0  # outputs of the requests being answered (event loop only)
        self.draining = False
        self.intake = intake or Intake()
        self.expired: asyncio.Event | None = None  # set when the drain timeout has passed (event loop only)
        self.inboxes: set[asyncio.Queue] = set()  # of the requests whose jobs are in the decode loop

    def expire(self) -> None:
        """The drain timeout has passed: every request still being answered ends now with a 503 (a
        stream: an error event), its job cancelled."""
        self._expired().set()
        for inbox in self.inboxes:
            inbox.put_nowait(("expired", None))

    def _expired(self) -> asyncio.Event:
        if self.expired is None:
            self.expired = asyncio.Event()
        return self.expired

    async def unless_expired(self, aw):
        """`await aw`, or a 503 once the drain timeout passes first."""
        expired = self._expired()
        if expired.is_set():
            raise shut_down()
        work, wait = asyncio.ensure_future(aw), asyncio.ensure_future(expired.wait())
        try:
            await asyncio.wait({work, wait}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # expired, or this handler cancelled (its client went away): stop waiting for the work
            wait.cancel()
            late = not work.done()
            if late:
                work.cancel()  # the intake's own task goes on (shielded) and gives its bytes back when done
        if late:
            raise shut_down()
        return work.result()

    @property
    def waiting(self) -> int:
        """Outputs of the requests being answered that have no slot (or will not have one at once)."""
        return max(0, self.outstanding - self.scheduler.max_batch)

    def room(self, outputs: int) -> bool:
        """Whether `outputs` more may be queued without more than max_waiting waiting."""
        return self.max_waiting is None or self.outstanding + outputs - self.scheduler.max_batch <= self.max_waiting

    def retry_after(self, outputs: int) -> int:
        """Seconds until `outputs` more would likely fit: the waiting outputs' share of the slots times
        the mean latency so far (1 s before any), within [1, 60]."""
        mean = self.metrics.mean_latency() or 1.0
        return int(min(60, max(1, math.ceil(mean * (self.waiting + outputs) / self.scheduler.max_batch))))


def shut_down() -> RequestError:
    return RequestError(None, "the server shut down before this request finished (its drain timeout passed); "
                              "retry on another replica", 503, "unavailable")


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
        return web.json_response(e.body(), status=e.status, headers=e.headers)
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
    """{"status": ok | overloaded | draining | decode loop stopped, "waiting", "max_waiting", "in_flight"};
    200 only when ok (a readiness probe: "overloaded" means the next output would be refused with 429)."""
    srv = request.app[SERVER]
    status = ("draining" if srv.draining else "decode loop stopped" if not srv.scheduler.alive
              else "ok" if srv.room(1) else "overloaded")
    body = {"status": status, "waiting": srv.waiting, "max_waiting": srv.max_waiting,
            "in_flight": srv.metrics.in_flight}
    return web.json_response(body, status=200 if status == "ok" else 503)


async def models(request: web.Request) -> web.Response:
    s = request.app[SERVER].served
    return web.json_response({"object": "list", "data": [{
        "id": s.name, "object": "model", "created": int(request.app[SERVER].metrics.started), "owned_by": "setdlm",
        "max_model_len": s.max_len, "family": s.recipe.objective.name, "s_max": s.s_max}]})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[SERVER].metrics.render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8",
                        headers={"X-Content-Type-Options": "nosniff"})


async def _intake(request: web.Request, kind, then=None):
    """The body of `request` validated as `kind` (RequestError naming what is wrong), then
    `await then(req, body size)` when given: all of it within the byte budget and off this event
    loop (intake.py); a 503 when the drain timeout passes first."""
    srv: Server = request.app[SERVER]

    async def work(raw: bytes):
        req = await srv.intake.run(len(raw), read_body, kind, raw, srv.served.max_len)
        return await then(req, len(raw)) if then is not None else req

    return await srv.unless_expired(srv.intake.admit(request, work))


async def _render(srv: Server, messages, generation_prompt: bool = True):
    """The chat rendered by a template process (None for the plain format, which params renders itself)."""
    if srv.served.chat is None:
        return None
    return await srv.intake.chat.run(
        lambda worker: render_chat(srv.served, messages, generation_prompt, worker=worker,
                                   time_limit_s=CHAT_RENDER_SECONDS))


def _check_model(req, served) -> None:
    if req.model is not None and req.model != served.name:
        raise RequestError("model", f"unknown model {req.model!r}; this server serves {served.name!r}", 404,
                           "not_found_error")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's /tokenize: the ids the server decodes from, for a prompt or for chat messages (rendered as
    /v1/chat/completions renders them). No special tokens are added either way."""
    srv: Server = request.app[SERVER]
    served = srv.served

    async def then(req, size):
        _check_model(req, served)
        if req.messages is None:
            return await srv.intake.run(size, encode, served, req.prompt), req
        chat = await _render(srv, req.messages, req.add_generation_prompt)
        if chat is None:  # the plain format
            chat = await srv.intake.run(size, render_chat, served, req.messages, req.add_generation_prompt)
        return await srv.intake.run(size, chat_ids, chat, served), req

    ids, req = await _intake(request, TokenizeRequest, then)
    tok = served.tokenizer
    strs = [tok.id_to_token(t) for t in ids] if req.return_token_strs else None
    return web.json_response({"count": len(ids), "max_model_len": served.max_len, "tokens": ids,
                              "token_strs": strs}, dumps=lambda o: json.dumps(o, ensure_ascii=False))


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's /detokenize: {"tokens": [...]} -> {"prompt": text}."""
    srv: Server = request.app[SERVER]
    vocab = srv.served.model.cfg.vocab_size

    async def then(req, size):
        _check_model(req, srv.served)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("tokens", f"token id {bad} is outside the vocabulary of {vocab}")
        return await srv.intake.run(size, srv.served.tokenizer.decode, req.tokens)

    text = await _intake(request, DetokenizeRequest, then)
    return web.json_response({"prompt": text}, dumps=lambda o: json.dumps(o, ensure_ascii=False))


async def tokenizer_info(request: web.Request) -> web.Response:
    """vLLM's /tokenizer_info: the special tokens, chat template and length of the served tokenizer
    (lm-eval's `local-completions` finds it and tokenises through /tokenize, no hub tokenizer needed)."""
    from data_pipeline.chat_template import default_chat_template

    s = request.app[SERVER].served
    tok = s.tokenizer
    name = lambda i: tok.id_to_token(i) if i is not None else None  # noqa: E731
    return web.json_response({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": name(tok.eos_id), "bos_token": name(tok.bos_id),
        "pad_token": name(tok.pad_id), "mask_token": name(tok.mask_id), "vocab_size": tok.vocab_size,
        "model_max_length": s.max_len, "max_total_tokens": s.max_total,
        "chat_template": default_chat_template(tok) if s.chat_error is None else None,
        "add_bos_token": False, "add_eos_token": False}, dumps=lambda o: json.dumps(o, ensure_ascii=False))


async def completions(request: web.Request):
    return await _generate(request, CompletionRequest)


async def chat_completions(request: web.Request):
    return await _generate(request, ChatRequest)


async def _generate(request: web.Request, kind):
    srv: Server = request.app[SERVER]
    if srv.draining or not srv.scheduler.alive:
        raise RequestError(None, "the server is shutting down; retry on another replica" if srv.draining else
                           "the decode loop stopped (see the server's log)", 503, "unavailable")

    async def then(req, size):
        check_request(req, srv.served)  # before a chat is rendered or a prompt tokenised
        chat = await _render(srv, req.messages) if isinstance(req, ChatRequest) else None
        return await srv.intake.run(size, plan, req, srv.served, chat)

    pl = await _intake(request, kind, then)
    if srv._expired().is_set():
        raise shut_down()
    loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
    outputs = len(pl.choices)
    if srv.max_waiting is not None and outputs > srv.scheduler.max_batch + srv.max_waiting:
        raise RequestError("n", f"{outputs} outputs in one request are more than this server ever holds (--max-batch "
                                f"{srv.scheduler.max_batch} + --max-waiting {srv.max_waiting}); send fewer at a time")
    if not srv.room(outputs):
        raise RequestError(None, f"the server is overloaded: {srv.waiting} outputs wait for a slot (--max-waiting "
                                 f"{srv.max_waiting}); retry later", 429, "rate_limit_error",
                           headers={"Retry-After": str(srv.retry_after(outputs))})
    job = Job(pl.cfg, pl.choices, post=lambda m: loop.call_soon_threadsafe(inbox.put_nowait, m), watch=pl.stream)
    ids = Ids(pl.chat, srv.served.name)
    t0 = time.perf_counter()
    srv.metrics.in_flight += 1
    srv.outstanding += outputs
    srv.inboxes.add(inbox)
    srv.scheduler.submit(job)
    finished = False
    try:
        if pl.stream:
            resp, ttft = await _stream(request, srv, pl, job, inbox, ids, t0)
        else:
            resp, ttft = await _collect(pl, inbox, ids, srv.served.tokenizer), None
        finished = True
        srv.metrics.finished_request(time.perf_counter() - t0, ttft)
        return resp
    finally:
        srv.metrics.in_flight -= 1
        srv.outstanding -= outputs
        srv.inboxes.discard(inbox)
        if not finished:
            srv.scheduler.cancel(job)


def _regex_timeout(out) -> RequestError | None:
    if out.stop_reason != "regex_timeout":
        return None
    from model.sampling.stopping import REGEX_SECONDS

    return RequestError("setdlm.stop_regex", f"matching took more than {REGEX_SECONDS:g} s of the server's time on "
                                             f"this output; use a simpler pattern")


async def _collect(pl, inbox: asyncio.Queue, ids: Ids, tokenizer) -> web.Response:
    outputs = [None] * len(pl.choices)
    while any(o is None for o in outputs):
        msg = await inbox.get()
        if msg[0] == "error":
            raise RuntimeError(msg[1])
        if msg[0] == "expired":
            raise shut_down()
        if msg[0] == "done":
            err = _regex_timeout(msg[2])
            if err is not None:
                raise err
            outputs[msg[1]] = msg[2]
    return web.json_response(full(ids, pl, outputs, tokenizer), dumps=lambda o: json.dumps(o, ensure_ascii=False))


async def _stream(request, srv: Server, pl, job, inbox: asyncio.Queue, ids: Ids, t0: float):
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    texts = [ChoiceText(srv.served.tokenizer, c.stop, c.stop_regex) for c in pl.choices]
    outputs, ttft = [None] * len(pl.choices), None
    if pl.chat:
        for i in range(len(pl.choices)):
            await resp.write(sse(chunk(ids, i, "", None, first=True)))
    elif pl.echo:
        for i, c in enumerate(pl.choices):
            await resp.write(sse(chunk(ids, i, c.prompt_text, None)))
    tok = srv.served.tokenizer
    while any(o is None for o in outputs):
        msg = await inbox.get()
        err = _regex_timeout(msg[2]) if msg[0] == "done" else shut_down() if msg[0] == "expired" else None
        if msg[0] == "error" or err is not None:
            if err is None:
                log.error("setdlm serve: %s", msg[1])
            body = err.body() if err is not None else {"error": {
                "message": "decoding failed (see the server's log)", "type": "server_error", "param": None,
                "code": None}}
            await resp.write(sse(body))
            await resp.write_eof()
            if msg[0] == "expired":
                srv.scheduler.cancel(job)  # its rows leave their slots: the decode loop can stop
            return resp, None
        i = msg[1]
        if msg[0] == "step":
            text, payload = texts[i].step(msg[2])
            await resp.write(sse(chunk(ids, i, text, payload)))
        else:  # the choice's last event: the rest of its text, and its logprobs (all of them: see docs/serve.md)
            outputs[i] = msg[2]
            text, payload = texts[i].finish(msg[2])
            lp = logprobs(tok, msg[2], pl.chat, len(pl.choices[i].prompt_text))
            await resp.write(sse(chunk(ids, i, text, payload, finish=finish_reason(msg[2]), lp=lp)))
        if text and ttft is None:
            ttft = time.perf_counter() - t0
    if pl.include_usage:
        await resp.write(sse(usage_chunk(ids, pl, outputs)))
    await resp.write(DONE)
    await resp.write_eof()
    return resp, ttft


def make_app(server: Server) -> web.Application:
    app = web.Application(middlewares=[errors, auth_middleware(server.api_key)], client_max_size=MAX_BODY)
    app[SERVER] = server
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    return app
