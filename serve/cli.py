"""`setdlm serve`: an OpenAI-compatible HTTP server for a trained checkpoint (docs/serve.md).

    setdlm serve --checkpoint RUN [--host 127.0.0.1] [--port 8000] [--max-batch 8] [--api-key KEY]
                 [--max-waiting N] [--max-total-tokens N]

Binds loopback unless told otherwise. Every option is checked before the checkpoint is read, except
--max-total-tokens, whose KV cache at --max-batch must fit in the device's free memory (checked once
the model's shape is known, before listening). With `--api-key` (or SETDLM_API_KEY, which keeps the key out
of the process list) every /v1 request needs `Authorization: Bearer KEY`. Prints one line when it
listens (`setdlm serve: listening on http://HOST:PORT ...`; `--port 0` picks a free port). SIGTERM or
Ctrl-C stops accepting requests, lets the running ones finish (up to --drain-timeout seconds; those
left then get 503, a stream an error event) and exits 0, also when nobody reads its stdout any more.
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
    p.add_argument("--max-waiting", type=int, default=None, help=(
        "outputs that may wait for a slot; a request past it gets 429 with Retry-After (default: no limit)"))
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
    try:  # first, so that even --help says what is missing in one line
        import aiohttp  # noqa: F401
        import prometheus_client  # noqa: F401
    except ModuleNotFoundError as e:
        raise UsageError(f"setdlm serve needs {e.name}: pip install 'setdlm[serve]' (or '.[serve]' in a checkout)"
                         ) from None
    from common.device import check_device

    from .auth import ENV

    args = build_parser().parse_args(argv)
    if args.max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_waiting is not None and args.max_waiting < 0:
        raise UsageError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.model_name is not None and not args.model_name.strip():
        raise UsageError("--model-name: empty name (leave it out to use the run's name)")
    if not args.drain_timeout >= 0 or args.drain_timeout == float("inf"):
        raise UsageError(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout:g}")
    check_device(args.device)
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
    check_cache_fits(served, args.max_batch, "--max-total-tokens" if args.max_total_tokens else None)
    return asyncio.run(serve(served, host=args.host, port=args.port, max_batch=args.max_batch, api_key=key,
                             drain_timeout=args.drain_timeout, max_waiting=args.max_waiting))


def cache_bytes(served, slots: int) -> int:
    """Bytes the decode loop's KV caches and canvases can reach: `slots` rows (plus one idle lane's) of
    the output budget (`max_total`), plus the widest step's scratch entries (within the model's
    positions), K and V in every layer, and the per-position state of each row."""
    cfg = served.model.cfg
    item = next(served.model.parameters()).element_size()
    entries = served.max_total + served.max_len
    per_entry = 2 * cfg.n_layers * cfg.kv_heads * cfg.dim_head * item + 8  # K, V; its position
    state = 8 * 4 + 4 * (1 + 2 * 20) + 8 * 20  # canvas, todo, steps, ...; logprobs with 20 alternatives
    return (slots + 1) * entries * (per_entry + state)


def free_bytes(device) -> tuple[int, str]:
    """(free bytes, where) of the model's device: CUDA's free memory, or the host's MemAvailable."""
    import torch

    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free), f"free on {device}"
    try:
        with open("/proc/meminfo") as f:
            avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(avail), "available on this host"


def check_cache_fits(served, max_batch: int, flag: str | None) -> None:
    """Refuse (one line, before listening) an output budget whose caches cannot fit in memory."""
    need = cache_bytes(served, max_batch)
    free, where = free_bytes(next(served.model.parameters()).device)
    if need <= free:
        return
    per_token = need / (served.max_total + served.max_len)
    fits = int(free // per_token) - served.max_len
    gib = lambda b: f"{b / 2**30:.3g} GiB"  # noqa: E731
    name = f"{flag} {served.max_total}" if flag else f"the default --max-total-tokens ({served.max_total})"
    raise UsageError(f"{name}: the KV cache of --max-batch {max_batch} slots of {served.max_total} tokens needs "
                     f"{gib(need)}, more than the {gib(free)} {where}; "
                     + (f"at most {fits} tokens per output fit, or lower --max-batch" if fits >= 2 else
                        "lower --max-batch or use a device with more memory"))


async def start(served, *, host: str, port: int, max_batch: int, api_key: str | None, drain_timeout: float,
                max_waiting: int | None = None):
    """Check the chat template, listen and start the decode loop; (runner, server, (host, port)). Stop
    with `stop(runner, server, drain_timeout)`."""
    from aiohttp import web

    from .app import Server, make_app
    from .intake import Intake
    from .metrics import Metrics
    from .params import chat_template
    from .schema import RequestError
    from .scheduler import Scheduler

    metrics = Metrics()
    intake = Intake()
    try:  # once, before listening: a failing template is remembered, and chat requests are refused
        await asyncio.get_running_loop().run_in_executor(None, chat_template, served, intake.chat.workers[0])
    except RequestError:
        pass  # chat_template logged it and remembers it as failing: chat requests get a 400, completions are served
    scheduler = Scheduler(served, max_batch=max_batch, metrics=metrics)
    server = Server(served, scheduler, metrics, api_key, max_waiting, intake)
    runner = web.AppRunner(make_app(server), handle_signals=False, handler_cancellation=True,
                           shutdown_timeout=drain_timeout + 1, access_log_format='%a "%r" %s %b %Tfs')
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        intake.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen ({e.strerror or e})") from None
    scheduler.start()
    return runner, server, tuple(runner.addresses[0][:2])


async def stop(runner, server, drain_timeout: float = 60.0) -> None:
    """Drain: refuse new requests (503) and stop listening; let the running and waiting ones finish for
    up to `drain_timeout` seconds, then answer those left with 503 (a stream: an error event); end the
    decode loop."""
    server.draining = True
    log.info("setdlm serve: stopping: no new requests; %d running finish first", server.metrics.in_flight)
    cleanup = asyncio.ensure_future(runner.cleanup())  # stops listening, closes idle connections, waits for handlers
    done, _ = await asyncio.wait({cleanup}, timeout=drain_timeout)
    if not done:
        left = server.metrics.in_flight
        server.expire()
        log.warning("setdlm serve: drain timeout (%gs): %d request(s) still running or waiting answered with 503",
                    drain_timeout, left)
        await cleanup
    server.scheduler.stop(timeout=1.0)
    server.intake.close()


def say(line: str) -> None:
    """Print a line for whoever reads stdout; when nobody does any more (a closed pipe), say nothing
    and send the rest of stdout to /dev/null, so neither this line nor the exit's flush fails."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


async def serve(served, *, host: str, port: int, max_batch: int, api_key: str | None, drain_timeout: float,
                max_waiting: int | None = None) -> int:
    runner, server, bound = await start(served, host=host, port=port, max_batch=max_batch, api_key=api_key,
                                        drain_timeout=drain_timeout, max_waiting=max_waiting)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    if host not in ("127.0.0.1", "::1", "localhost") and not api_key:
        log.warning("setdlm serve: listening on %s without --api-key: anyone who reaches it can use the model", host)
    say(f"setdlm serve: listening on http://{bound[0]}:{bound[1]} (model {served.name!r}, "
        f"{served.recipe.objective.name}, {served.max_len} positions, up to {served.max_total} tokens per output, "
        f"{max_batch} slots{f', at most {max_waiting} waiting' if max_waiting is not None else ''}"
        f"{', bearer token required' if api_key else ''})")
    await done.wait()
    await stop(runner, server, drain_timeout)
    log.info("setdlm serve: stopped")
    say("setdlm serve: stopped")
    return 0
