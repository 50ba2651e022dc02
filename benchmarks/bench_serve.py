"""`setdlm serve` under offered load: throughput and latency percentiles per arrival rate.

    .venv/bin/python benchmarks/bench_serve.py [--checkpoint RUN] [--rates 1,2,4,8] [--duration 20]
        [--max-batch 8] [--max-tokens 32] [--threshold none|0.5|0] [--stream 0.5]
    .venv/bin/python benchmarks/bench_serve.py --stream-cost 1000 [--checkpoint RUN]
    .venv/bin/python benchmarks/bench_serve.py --heavy-bodies [--clients 8] [--body-mb 4] [--checkpoint RUN]

Starts `setdlm serve` in its own process on loopback (the client does not share its interpreter),
then for each rate sends requests with Poisson arrivals (open loop: a slow server does not slow the
arrivals) for `--duration` seconds and waits for the last answer. Requests are greedy, one of a few
prompts each, `--max-tokens` new tokens with EOS ignored (so every request costs the same whatever
the weights), a fraction `--stream` of them streamed. Per rate it prints the achieved request and
token rates, latency p50/p95/p99 (send to last byte), the streams' time to first text, and from
/metrics the batched forwards and tokens per step. Without --checkpoint it trains the quickstart
shape for 2 steps into a temporary directory (decoding costs the same on trained weights).

`--stream-cost N` runs no server: it decodes one prompt for N new tokens (one per step, EOS ignored)
with the engine's step events, then times what a stream does with them on the server's event loop
(serve/streaming.py: the text of each step, the final-text hold-back) over those events, per step and
in total, for the first and the last hundred steps: the cost of streaming a long output, which grows
with the output when each step decodes the whole prefix again.

`--heavy-bodies` is the acceptance check `serve-heavy-bodies`: `--clients` clients each send a body of
`--body-mb` MB at once (a completion prompt of that size; then the same as one chat message), while
/health is polled every 50 ms and, 0.2 s after they start, a small greedy completion is sent; then
`temperature` and `setdlm.repetition_penalty` of 1e-300. It prints the slowest and median /health
answer, how long the small completion took, what the heavy bodies got, the two statuses and the
server's peak resident memory. The
check passes when /health always answers within 1 s, the small completion within 5 s, and neither
1e-300 request gets a 500.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["The for statement", "A class definition", "Lists implement all of the common", "The import system",
           "Exceptions are raised", "A function definition defines"]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="run directory to serve (default: a 2-step quickstart-shape model)")
    p.add_argument("--rates", default="1,2,4,8", help="offered loads, requests per second")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per rate")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threshold", default="none", help="setdlm threshold (none: one token per step)")
    p.add_argument("--stream", type=float, default=0.5, help="fraction of requests streamed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-cost", type=int, default=0, metavar="N",
                   help="no server: time the stream's text handling over the events of one N-token output")
    p.add_argument("--heavy-bodies", action="store_true", help="the acceptance check serve-heavy-bodies (above)")
    p.add_argument("--clients", type=int, default=8, help="--heavy-bodies: clients sending a heavy body at once")
    p.add_argument("--body-mb", type=float, default=4.0, help="--heavy-bodies: megabytes of each body")
    return p.parse_args(argv)


def env() -> dict:
    e = dict(os.environ, PYTHONPATH=str(REPO), WANDB_MODE="disabled", HF_HUB_OFFLINE="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        e.pop(k, None)
    return e


def default_checkpoint(tmp: Path) -> Path:
    cmd = [sys.executable, "-m", "launch.cli", "pretrain", "--config", str(REPO / "configs/quickstart.yaml"),
           "--out", str(tmp), "train.max_steps=2", "train.save_every=2", "train.eval_every=2", "train.eval_batches=1",
           "train.sample_at_end=false", "train.log_every=1"]
    subprocess.run(cmd, cwd=REPO, env=env(), check=True, stdout=subprocess.DEVNULL)
    return tmp / "quickstart"


def start_server(checkpoint: Path, max_batch: int, log: Path):
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "serve", "--checkpoint", str(checkpoint), "--port", "0",
                             "--max-batch", str(max_batch), "--device", "cpu"], cwd=REPO, env=env(), stdout=out,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        m = re.search(r"listening on (http://\S+)", log.read_text())
        if m:
            return proc, m.group(1)
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("bench_serve: the server did not start")


async def metrics(session, url) -> dict:
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    return {m[0]: float(m[1]) for m in re.findall(r"^(setdlm_\w+) (\S+)$", text, re.M)}


async def one(session, url, body, stream: bool):
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/v1/completions", json={**body, "stream": stream}) as r:
        if r.status != 200:
            return None
        if not stream:
            data = await r.json()
            return time.perf_counter() - t0, None, data["usage"]["completion_tokens"]
        tokens = 0
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            ch = json.loads(line[6:])["choices"][0]
            if ch["text"] and first is None:
                first = time.perf_counter() - t0
            if ch["finish_reason"] is not None:
                tokens = len(ch["setdlm"]["tokens"])
    return time.perf_counter() - t0, first, tokens


async def run_rate(url, rate: float, args, rng: random.Random) -> dict:
    import aiohttp

    ext = {"ignore_eos": True} | ({} if args.threshold == "none" else {"threshold": float(args.threshold)})
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        before = await metrics(session, url)
        tasks, t0, t = [], time.perf_counter(), 0.0
        while True:
            t += rng.expovariate(rate)
            if t > args.duration:
                break
            await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
            body = {"prompt": rng.choice(PROMPTS), "max_tokens": args.max_tokens, "temperature": 0, "setdlm": ext}
            tasks.append(asyncio.create_task(one(session, url, body, rng.random() < args.stream)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        after = await metrics(session, url)
    ok = [r for r in results if r is not None]
    lat = sorted(r[0] for r in ok)
    ttft = [r[1] for r in ok if r[1] is not None]
    q = lambda p: lat[min(len(lat) - 1, int(p * len(lat)))] if lat else float("nan")  # noqa: E731
    gen = after["setdlm_generated_tokens_total"] - before["setdlm_generated_tokens_total"]
    fwd = after["setdlm_forwards_total"] - before["setdlm_forwards_total"]
    return {"rate": rate, "sent": len(results), "ok": len(ok), "req_s": len(ok) / wall, "tok_s": sum(r[2] for r in ok) / wall,
            "p50": q(0.5), "p95": q(0.95), "p99": q(0.99), "ttft": sum(ttft) / len(ttft) if ttft else float("nan"),
            "forwards": fwd, "rows_per_forward": gen / fwd if fwd else 0.0}


async def heavy_bodies(url, clients: int, mb: float, chat: bool) -> dict:
    """One round of the acceptance check serve-heavy-bodies (module docstring)."""
    import aiohttp

    text = ("The quick brown fox jumps over the lazy dog. " * (int(mb * 2**20) // 45 + 1))[: int(mb * 2**20) - 100]
    path, key = ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}) if chat else \
        ("/v1/completions", {"prompt": text})
    heavy = json.dumps({**key, "max_tokens": 16, "temperature": 0}).encode()
    health, stop = [], asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def watch():
            while not stop.is_set():
                t0 = time.perf_counter()
                async with session.get(url + "/health") as r:
                    await r.read()
                health.append(time.perf_counter() - t0)
                await asyncio.sleep(0.05)

        async def post(path, data: bytes, delay: float = 0.0):
            await asyncio.sleep(delay)
            t0 = time.perf_counter()
            async with session.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                await r.read()
                return r.status, time.perf_counter() - t0

        small = json.dumps({"prompt": "The for statement", "max_tokens": 16, "temperature": 0}).encode()
        watcher = asyncio.create_task(watch())
        *big, little = await asyncio.gather(*(post(path, heavy) for _ in range(clients)),
                                            post("/v1/completions", small, 0.2))
        stop.set()
        await watcher
        tiny = [await post("/v1/completions", json.dumps(b).encode()) for b in (
            {"prompt": "The for statement", "temperature": 1e-300, "max_tokens": 4},
            {"prompt": "The for statement", "max_tokens": 4, "setdlm": {"repetition_penalty": 1e-300}})]
    health.sort()
    return {"kind": "chat message" if chat else "completion prompt", "health_max": health[-1],
            "health_p50": health[len(health) // 2], "polls": len(health), "small": little[1], "small_status": little[0],
            "heavy": sorted({s for s, _ in big}), "heavy_s": max(t for _, t in big), "tiny": [s for s, _ in tiny]}


def stream_cost(ckpt: Path, n: int) -> None:
    """Decode one prompt for `n` tokens with step events, then time serve/streaming.py over them."""
    import torch

    sys.path.insert(0, str(REPO))
    from model.sampling import SamplingConfig, generate
    from pretrain.checkpoint.inference import load_model
    from serve.streaming import ChoiceText

    torch.set_num_threads(1)
    model, tok, recipe = load_model(ckpt, ema=True, device="cpu")
    cfg = SamplingConfig.from_objective(recipe.objective, max_new_tokens=n, stop_on_eos=False)
    events = []
    [out] = generate(model, [tok.encode(PROMPTS[0])], cfg, tokenizer=tok, on_step=events.append)
    text = ChoiceText(tok, ["\n\nQuestion:", "</s>"], None)
    times = []
    for ev in events:
        t0 = time.perf_counter()
        text.step(ev)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    text.finish(out)
    times.append(time.perf_counter() - t0)
    ms = lambda xs: 1e3 * sum(xs) / len(xs)  # noqa: E731
    print(f"{datetime.date.today()}, {platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f}: one {len(out.tokens)}-token output, {len(events)} step events, "
          f"2 stop strings\n")
    print("| steps | ms per step | total ms |\n|---|---|---|")
    print(f"| first 100 | {ms(times[:100]):.3f} | {1e3 * sum(times[:100]):.1f} |")
    print(f"| last 100 | {ms(times[-100:]):.3f} | {1e3 * sum(times[-100:]):.1f} |")
    print(f"| all {len(times)} | {ms(times):.3f} | {1e3 * sum(times):.1f} |")


def main(argv=None) -> int:
    args = parse(argv)
    rng = random.Random(args.seed)
    if args.stream_cost:
        with tempfile.TemporaryDirectory() as tmp:
            stream_cost(Path(args.checkpoint) if args.checkpoint else default_checkpoint(Path(tmp)), args.stream_cost)
        return 0
    if args.heavy_bodies:
        return heavy_main(args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = Path(args.checkpoint) if args.checkpoint else default_checkpoint(tmp)
        proc, url = start_server(ckpt, args.max_batch, tmp / "serve.log")
        try:
            asyncio.run(run_rate(url, 2.0, argparse.Namespace(**{**vars(args), "duration": 2.0}), rng))  # warm-up
            rows = [asyncio.run(run_rate(url, float(r), args, rng)) for r in args.rates.split(",")]
        finally:
            proc.terminate()
            proc.wait(120)
    import torch

    print(f"{datetime.date.today()}, {platform.machine()} ({os.cpu_count()} cores), torch {torch.__version__}, "
          f"checkpoint {ckpt.name if args.checkpoint else 'quickstart shape (2 steps)'}, --max-batch {args.max_batch}, "
          f"{args.max_tokens} new tokens per request (EOS ignored), threshold {args.threshold}, "
          f"{args.stream:.0%} streamed, {args.duration:g} s of Poisson arrivals per rate\n")
    print("| offered (req/s) | sent | answered | req/s | tokens/s | p50 (s) | p95 (s) | p99 (s) | stream TTFT (s) | "
          "forwards | tokens per forward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate']:g} | {r['sent']} | {r['ok']} | {r['req_s']:.2f} | {r['tok_s']:.0f} | {r['p50']:.2f} | "
              f"{r['p95']:.2f} | {r['p99']:.2f} | {r['ttft']:.2f} | {r['forwards']:.0f} | {r['rows_per_forward']:.2f} |")
    return 0


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM), in MB; NaN where /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return float("nan")


def heavy_main(args) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = Path(args.checkpoint) if args.checkpoint else default_checkpoint(tmp)
        proc, url = start_server(ckpt, args.max_batch, tmp / "serve.log")
        try:
            load, rows = os.getloadavg()[0], []
            for chat in (False, True):
                rows.append(asyncio.run(heavy_bodies(url, args.clients, args.body_mb, chat)))
                rows[-1]["rss"] = peak_rss_mb(proc.pid)
            load = max(load, os.getloadavg()[0])
        finally:
            proc.terminate()
            proc.wait(120)
    print(f"{datetime.date.today()}, {platform.machine()} ({os.cpu_count()} cores), load average up to {load:.1f}: "
          f"{args.clients} clients x {args.body_mb:g} MB bodies at once, /health polled every 50 ms, a small "
          f"16-token completion sent 0.2 s after them\n")
    print("| heavy body | /health slowest (s) | /health median (s) | polls | small completion (s) | heavy bodies got | "
          "slowest heavy answer (s) | temperature / repetition_penalty 1e-300 | server peak RSS so far (MB) |")
    print("|---|---|---|---|---|---|---|---|---|")
    ok = True
    for r in rows:
        print(f"| {r['kind']} | {r['health_max']:.3f} | {r['health_p50']:.3f} | {r['polls']} | {r['small']:.2f} "
              f"({r['small_status']}) | {', '.join(map(str, r['heavy']))} | {r['heavy_s']:.2f} | "
              f"{' / '.join(map(str, r['tiny']))} | {r['rss']:.0f} |")
        ok &= r["health_max"] < 1.0 and r["small"] < 5.0 and r["small_status"] == 200 and 500 not in r["tiny"]
    print(f"\nserve-heavy-bodies: {'pass' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
