"""`setdlm serve`: an OpenAI-compatible HTTP server for a trained checkpoint (docs/serve.md).

    setdlm serve --checkpoint RUN [--host 127.0.0.1] [--port 8000] [--max-batch 8] [--api-key KEY]

Binds loopback unless told otherwise. With `--api-key` (or SETDLM_API_KEY, which keeps the key out
of the process list) every /v1 request needs `Authorization: Bearer KEY`. Prints one line when it
listens (`setdlm serve: listening on http://HOST:PORT ...`; `--port 0` picks a free port). SIGTERM or
Ctrl-C stops accepting requests, lets the running ones finish (up to --drain-timeout seconds) and
exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from common.cli import ArgumentParser
from common.errors import UsageError

log = logging.getLogger("setdlm.serve")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="setdlm serve", description="Serve a checkpoint over OpenAI-compatible HTTP.")
    p.add_argument("--checkpoint", required=True, help="run directory or checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0: any free port)")
    p.add_argument("--max-batch", type=int, default=8, help="slots: outputs decoded at once (default 8)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: $SETDLM_API_KEY)")
    p.add_argument("--model-name", default=None, help="the model id clients pass (default: the run's name)")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="seconds running requests get after SIGTERM")
    p.add_argument("--max-total-tokens", type=int, default=None, help=(
        "most prompt + new tokens of one output (default: twice the model's positions; it sizes each slot's KV "
        "cache); SW-SetDLM, BD3-LM and AR decode past the positions by dropping the oldest cached tokens, MDLM never "
        "(docs/serve.md)"))
    p.add_argument("--no-ema", action="store_true", help="use the raw weights instead of the EMA")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    return p


def main(argv: list[str] | None = None) -> int:
    from .auth import ENV

    args = build_parser().parse_args(argv)
    try:
        import aiohttp  # noqa: F401
    except ModuleNotFoundError:
        raise UsageError("setdlm serve needs aiohttp: pip install 'setdlm[serve]' (or '.[serve]' in a checkout)") from None
    if args.max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_total_tokens is not None and args.max_total_tokens < 2:
        raise UsageError(f"--max-total-tokens must be >= 2, got {args.max_total_tokens}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    key = args.api_key if args.api_key is not None else os.environ.get(ENV) or None
    if args.api_key is not None and not args.api_key:
        raise UsageError("--api-key: empty key")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)

    from .loading import load_served

    served = load_served(args.checkpoint, name=args.model_name, device=args.device, dtype=args.dtype,
                         ema=not args.no_ema, max_total=args.max_total_tokens)
    return asyncio.run(serve(served, host=args.host, port=args.port, max_batch=args.max_batch, api_key=key,
                             drain_timeout=args.drain_timeout))


async def start(served, *, host: str, port: int, max_batch: int, api_key: str | None, drain_timeout: float):
    """Listen and start the decode loop; (runner, server, (host, port)). Stop with `stop(runner, server)`."""
    from aiohttp import web

    from .app import Server, make_app
    from .metrics import Metrics
    from .scheduler import Scheduler

    metrics = Metrics()
    scheduler = Scheduler(served, max_batch=max_batch, metrics=metrics)
    server = Server(served, scheduler, metrics, api_key)
    runner = web.AppRunner(make_app(server), handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=drain_timeout, access_log_format='%a "%r" %s %b %Tfs')
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise UsageError(f"--host {host} --port {port}: cannot listen ({e.strerror or e})") from None
    scheduler.start()
    return runner, server, tuple(runner.addresses[0][:2])


async def stop(runner, server, drain_timeout: float = 60.0) -> None:
    """Drain: refuse new requests (503), stop listening, let running ones finish, end the decode loop."""
    server.draining = True
    log.info("setdlm serve: stopping: no new requests; %d running finish first", server.metrics.in_flight)
    await runner.cleanup()  # stops listening, closes idle connections, waits for running handlers
    server.scheduler.stop(timeout=drain_timeout)


async def serve(served, *, host: str, port: int, max_batch: int, api_key: str | None, drain_timeout: float) -> int:
    runner, server, bound = await start(served, host=host, port=port, max_batch=max_batch, api_key=api_key,
                                        drain_timeout=drain_timeout)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    if host not in ("127.0.0.1", "::1", "localhost") and not api_key:
        log.warning("setdlm serve: listening on %s without --api-key: anyone who reaches it can use the model", host)
    print(f"setdlm serve: listening on http://{bound[0]}:{bound[1]} (model {served.name!r}, "
          f"{served.recipe.objective.name}, {served.max_len} positions, up to {served.max_total} tokens per output, "
          f"{max_batch} slots"
          f"{', bearer token required' if api_key else ''})", flush=True)
    await done.wait()
    await stop(runner, server, drain_timeout)
    print("setdlm serve: stopped", flush=True)
    return 0
