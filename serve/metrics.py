"""Server counters and the /metrics page (Prometheus text exposition format 0.0.4).

Written by hand: the format is a few lines of text, and the official Python client's Summary has
no quantiles, which this page reports (latency and time to first token, p50/p95/p99 over the last
`WINDOW` requests). The decode thread and the HTTP handlers both update it, under one lock.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

import numpy as np

WINDOW = 1000  # requests the latency quantiles are computed over
QUANTILES = (0.5, 0.95, 0.99)


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.started = time.time()
        self.requests: Counter = Counter()  # (endpoint, outcome) -> count
        self.prompt_tokens = self.generated_tokens = 0
        self.forwards = 0  # batched decoding steps (each one forward of the model)
        self.row_steps = 0  # decoding steps summed over finished outputs (tokens per step = generated / row_steps)
        self.cancelled = 0  # outputs cut short because their client went away
        self.queue_depth = self.slots_busy = self.in_flight = 0
        self.slots = 0
        self.latency: deque = deque(maxlen=WINDOW)
        self.first_token: deque = deque(maxlen=WINDOW)
        self.totals = {"latency": [0, 0.0], "first_token": [0, 0.0]}  # cumulative count and sum

    def count(self, endpoint: str, outcome: str) -> None:
        with self.lock:
            self.requests[(endpoint, outcome)] += 1

    def finished_request(self, seconds: float, first_token: float | None = None) -> None:
        with self.lock:
            self.latency.append(seconds)
            self.totals["latency"][0] += 1
            self.totals["latency"][1] += seconds
            if first_token is not None:
                self.first_token.append(first_token)
                self.totals["first_token"][0] += 1
                self.totals["first_token"][1] += first_token

    def output(self, tokens: int, prompt_tokens: int, steps: int, cancelled: bool) -> None:
        with self.lock:
            self.generated_tokens += tokens
            self.prompt_tokens += prompt_tokens
            self.row_steps += steps
            self.cancelled += int(cancelled)

    def loop_state(self, forwards: int, queue_depth: int, slots_busy: int) -> None:
        with self.lock:
            self.forwards += forwards
            self.queue_depth, self.slots_busy = queue_depth, slots_busy

    def snapshot(self) -> dict:
        with self.lock:
            return {"requests": dict(self.requests), "prompt_tokens": self.prompt_tokens,
                    "generated_tokens": self.generated_tokens, "forwards": self.forwards,
                    "row_steps": self.row_steps, "cancelled": self.cancelled, "queue_depth": self.queue_depth,
                    "slots_busy": self.slots_busy, "slots": self.slots, "in_flight": self.in_flight,
                    "latency": list(self.latency), "first_token": list(self.first_token),
                    "totals": {k: list(v) for k, v in self.totals.items()}}

    def render(self) -> str:
        s = self.snapshot()
        out = []

        def metric(name, kind, help_, rows):
            out.append(f"# HELP setdlm_{name} {help_}")
            out.append(f"# TYPE setdlm_{name} {kind}")
            for labels, value in rows:
                lab = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                out.append(f"setdlm_{name}{lab} {value:g}" if isinstance(value, float) else f"setdlm_{name}{lab} {value}")

        metric("requests_total", "counter", "HTTP requests by endpoint and outcome",
               [({"endpoint": e, "outcome": o}, n) for (e, o), n in sorted(s["requests"].items())])
        metric("prompt_tokens_total", "counter", "prompt tokens of finished outputs", [({}, s["prompt_tokens"])])
        metric("generated_tokens_total", "counter", "tokens generated (finished outputs)", [({}, s["generated_tokens"])])
        metric("forwards_total", "counter", "batched decoding steps (model forwards, prefill excluded)",
               [({}, s["forwards"])])
        metric("tokens_per_step", "gauge", "generated tokens per decoding step of an output, since start",
               [({}, float(s["generated_tokens"] / s["row_steps"]) if s["row_steps"] else 0.0)])
        metric("cancelled_total", "counter", "outputs stopped because their client disconnected", [({}, s["cancelled"])])
        metric("queue_depth", "gauge", "outputs waiting for a slot", [({}, s["queue_depth"])])
        metric("slots_busy", "gauge", "slots decoding an output", [({}, s["slots_busy"])])
        metric("slots", "gauge", "slots (--max-batch)", [({}, s["slots"])])
        metric("requests_in_flight", "gauge", "HTTP requests being answered", [({}, s["in_flight"])])
        for name, key, help_ in (("request_latency_seconds", "latency", "request latency"),
                                 ("time_to_first_token_seconds", "first_token", "streamed requests: time to the first text")):
            values, (count, total) = s[key], s["totals"][key]
            rows = [({"quantile": str(q)}, float(np.quantile(values, q)) if values else 0.0) for q in QUANTILES]
            metric(name, "summary", f"{help_} (quantiles over the last {WINDOW} requests)", rows)
            out.append(f"setdlm_{name}_count {count}")
            out.append(f"setdlm_{name}_sum {total:g}")
        return "\n".join(out) + "\n"
