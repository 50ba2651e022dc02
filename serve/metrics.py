"""Server counters and the /metrics page (Prometheus text format, through prometheus_client).

Latencies are histograms (cumulative `_bucket{le=...}` counters with `_sum` and `_count`), so the
replicas of a deployment add up and any quantile is `histogram_quantile` of their sum. Each server
has its own registry (tests run several in one process). The decode thread and the HTTP handlers
both update it; prometheus_client's metrics are thread-safe.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: from a short greedy answer on a GPU to a long sampled one on a loaded CPU
LATENCY_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0)
FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0)


class Metrics:
    def __init__(self):
        self.started = time.time()
        self.in_flight = 0  # HTTP requests being answered (event loop only)
        self.slots = 0
        self._totals = (0, 0)  # generated tokens, row steps (for tokens_per_step)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("setdlm_requests", "HTTP requests by endpoint and outcome (status code or "
                                "'disconnected')", ["endpoint", "outcome"], registry=r)
        self.prompt_tokens = Counter("setdlm_prompt_tokens", "prompt tokens of finished outputs", registry=r)
        self.generated_tokens = Counter("setdlm_generated_tokens", "tokens generated (finished outputs)", registry=r)
        self.forwards = Counter("setdlm_forwards", "batched decoding steps (model forwards, prefill excluded)",
                                registry=r)
        self.row_steps = Counter("setdlm_row_steps", "decoding steps summed over finished outputs", registry=r)
        self.cancelled = Counter("setdlm_cancelled", "outputs stopped because their client disconnected", registry=r)
        self.queue_depth = Gauge("setdlm_queue_depth", "outputs waiting for a slot", registry=r)
        self.slots_busy = Gauge("setdlm_slots_busy", "slots decoding an output", registry=r)
        Gauge("setdlm_slots", "slots (--max-batch)", registry=r).set_function(lambda: self.slots)
        Gauge("setdlm_requests_in_flight", "HTTP requests being answered", registry=r).set_function(
            lambda: self.in_flight)
        Gauge("setdlm_tokens_per_step", "generated tokens per decoding step of an output, since start",
              registry=r).set_function(self._tokens_per_step)
        self.latency = Histogram("setdlm_request_latency_seconds", "request latency (received to last byte)",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("setdlm_time_to_first_token_seconds", "streamed requests: time to the first "
                                     "text", buckets=FIRST_TOKEN_BUCKETS, registry=r)

    def _tokens_per_step(self) -> float:
        gen, steps = self._totals
        return gen / steps if steps else 0.0

    def count(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(endpoint, outcome).inc()

    def finished_request(self, seconds: float, first_token: float | None = None) -> None:
        self.latency.observe(seconds)
        if first_token is not None:
            self.first_token.observe(first_token)

    def mean_latency(self) -> float | None:
        """Mean request latency since start (None before the first request)."""
        count = total = 0.0
        for metric in self.latency.collect():
            for s in metric.samples:
                if s.name.endswith("_count"):
                    count = s.value
                elif s.name.endswith("_sum"):
                    total = s.value
        return total / count if count else None

    def output(self, tokens: int, prompt_tokens: int, steps: int, cancelled: bool) -> None:
        self.generated_tokens.inc(tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.row_steps.inc(steps)
        self._totals = (self._totals[0] + tokens, self._totals[1] + steps)  # the decode thread only
        if cancelled:
            self.cancelled.inc()

    def loop_state(self, forwards: int, queue_depth: int, slots_busy: int) -> None:
        if forwards:
            self.forwards.inc(forwards)
        self.queue_depth.set(queue_depth)
        self.slots_busy.set(slots_busy)

    def render(self) -> bytes:
        return generate_latest(self.registry)
