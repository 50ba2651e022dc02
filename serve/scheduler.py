"""The decode loop: one thread owns the model and runs every request through continuous batching.

HTTP handlers `submit` a Job (one or more choices, each one output row) and `cancel` it when their
client goes away; both are messages on a queue, so the model is only touched by this thread. Choices
wait in one first-come queue and are admitted while fewer than `max_batch` rows are decoding. Rows
share a batch when their decoding configuration is the same (a *lane*: one `Session`, keyed by the
SamplingConfig without the per-row span length and stop strings); lanes step in turn. Each finished
row, each step of a streamed row and each failure are posted back to the job's handler with
`job.post`, which must be thread-safe (the app posts into its event loop).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from model.sampling import SamplingConfig

from .params import Choice, total_budget

log = logging.getLogger("setdlm.serve")


@dataclass
class Job:
    cfg: SamplingConfig
    choices: list[Choice]
    post: Callable[[tuple], None]  # ("step", index, StepEvent) | ("done", index, SampleOutput) | ("error", message)
    watch: bool = False  # report every step (streaming)
    cancelled: bool = False
    rows: dict = field(default_factory=dict)  # decode thread only: (lane key, row) -> choice


def lane_key(cfg: SamplingConfig) -> tuple:
    d = dataclasses.asdict(cfg)
    frozen = lambda v: tuple(sorted(v.items())) if isinstance(v, dict) else tuple(v) if isinstance(v, list) else v  # noqa: E731
    return tuple((k, frozen(v)) for k, v in sorted(d.items()))


class Lane:
    def __init__(self, session):
        self.session = session
        self.rows: dict[int, tuple[Job, Choice]] = {}


class Scheduler:
    def __init__(self, served, *, max_batch: int, metrics):
        self.served, self.max_batch, self.metrics = served, int(max_batch), metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.waiting: deque[tuple[Job, Choice]] = deque()
        self.lanes: dict[tuple, Lane] = {}
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="setdlm-decode", daemon=True)
        metrics.slots = self.max_batch

    # -- called from other threads ----------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def stop(self, timeout: float | None = None) -> None:
        self.inbox.put(("stop", None))
        self.thread.join(timeout)

    # -- the decode thread ------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # noqa: BLE001 - a bug in the loop: fail what is in flight, /health says so
            log.exception("setdlm serve: the decode loop stopped")
            jobs = [j for j, _ in self.waiting] + [j for lane in self.lanes.values() for j, _ in lane.rows.values()]
            for job in {id(j): j for j in jobs}.values():
                if not job.cancelled:
                    job.post(("error", f"the decode loop stopped ({type(e).__name__}: {e})"))

    def _loop(self) -> None:
        import torch

        with torch.inference_mode():
            while True:
                self._drain(block=not self._busy() and not self.stopping)
                if self.stopping and not self._busy():
                    return
                self._admit()
                forwards = 0
                for key, lane in list(self.lanes.items()):
                    if lane.session.busy:
                        before = lane.session.forwards
                        self._step(key, lane)
                        forwards += lane.session.forwards - before
                idle = [k for k, lane in self.lanes.items() if not lane.session.busy]
                for k in idle[:-1]:  # keep one idle lane: the next request like it needs no new one
                    del self.lanes[k]
                lanes = self.lanes.values()
                self.metrics.loop_state(forwards, len(self.waiting) + sum(la.session.waiting for la in lanes),
                                        sum(la.session.live for la in lanes))

    def _busy(self) -> bool:
        return bool(self.waiting) or any(lane.session.busy for lane in self.lanes.values())

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, job = self.inbox.get() if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                self.waiting.extend((job, c) for c in job.choices)
            elif kind == "cancel":
                self._cancel(job)
            else:
                self.stopping = True

    def _cancel(self, job: Job) -> None:
        job.cancelled = True
        self.waiting = deque(w for w in self.waiting if w[0] is not job)
        for (key, row) in list(job.rows):
            lane = self.lanes.get(key)
            if lane is not None:
                lane.session.cancel(row)

    def _admit(self) -> None:
        from model.sampling.session import Session

        assigned = sum(len(lane.rows) for lane in self.lanes.values())
        s = self.served
        while self.waiting and assigned < self.max_batch:
            job, choice = self.waiting.popleft()
            if job.cancelled:
                continue
            key = lane_key(job.cfg)
            lane = self.lanes.get(key)
            try:
                if lane is None:
                    # sized for the family's budget: past the model's positions where the cache drops its oldest
                    lane = self.lanes[key] = Lane(Session(s.model, job.cfg, slots=self.max_batch,
                                                          max_len=total_budget(s, job.cfg.spec), mask_id=s.mask_id,
                                                          eos_id=s.eos_id, tokenizer=s.tokenizer))
                elif not lane.session.busy:
                    lane.session.reseed()  # a seeded request alone samples the same each time
                row = lane.session.submit(choice.prompt, max_new_tokens=choice.max_new_tokens, stop=choice.stop,
                                          stop_regex=choice.stop_regex, watch=job.watch)
            except Exception as e:  # noqa: BLE001 - a request the engine refuses fails alone
                log.exception("setdlm serve: a request could not be admitted")
                self._fail(job, f"{type(e).__name__}: {e}")
                continue
            lane.rows[row] = (job, choice)
            job.rows[(key, row)] = choice
            assigned += 1

    def _step(self, key, lane: Lane) -> None:
        try:
            events, finished = lane.session.step()
        except Exception as e:  # noqa: BLE001 - a failing step fails the lane's requests, not the server
            log.exception("setdlm serve: a decoding step failed")
            for job in {id(j): j for j, _ in lane.rows.values()}.values():
                self._fail(job, f"decoding failed ({type(e).__name__}: {e})")
            del self.lanes[key]
            return
        for ev in events:
            job, choice = lane.rows[ev.row]
            if not job.cancelled:
                job.post(("step", choice.index, ev))
        for row, out in finished:
            job, choice = lane.rows.pop(row)
            job.rows.pop((key, row), None)
            self.metrics.output(len(out.tokens), out.prompt_tokens, out.steps, out.stop_reason == "cancelled")
            if out.stop_reason == "error":  # this output alone failed (session.py); its batch-mates go on
                log.error("setdlm serve: an output's logits were not finite (NaN or inf); its request fails")
                self._fail(job, "decoding failed: the model's logits for this output were not finite (NaN or inf)")
            elif not job.cancelled:
                job.post(("done", choice.index, out))

    def _fail(self, job: Job, message: str) -> None:
        if not job.cancelled:
            job.post(("error", message))
        self._cancel(job)
