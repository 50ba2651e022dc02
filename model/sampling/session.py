"""An open-ended decode for a server: prompts join a running batch, each step is reported, rows cancel.

`generate` decodes a list known in advance. A `Session` keeps one decoder of a family and config
running for prompts that arrive while it runs: `submit` queues a prompt (with its own span length and
stop strings) and returns its row id, `step` admits waiting prompts into free slots (the same
`Decoder.admit` continuous batching uses) and runs one decoding step, returning the step's events
for watched rows (`StepEvent`, observe.py) and the rows that finished (`SampleOutput`, stop_reason
"cancelled" for a cancelled one). `cancel` frees a row's slot at once.

The decoder is sized for the model's longest sequence (`max_len`) and `slots` rows. The batch grows
to admit waiting prompts (new rows are copies of a slot, reset by `admit`) and shrinks to the live
rows once they are half of it or fewer, so an idle session steps no empty rows. The step, the
admission and the stopping rules are those of `generate`, so a greedy row decodes the same tokens as
`generate` decoding it alone, whatever else is in flight.

One row's failure stays its own: the logits of a row that are not usable (NaN, +inf, or no finite
value at a position to decide) are replaced, for that step, by zeros, so the batched token choice
never fails on them (`torch.multinomial` refuses a row with NaN and fails the whole batch); the row
ends after that step with stop_reason "error" and no tokens, and the other rows, whose logits and
choices are computed row by row, decode exactly as they would have without it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import torch

from common.errors import UsageError

from .api import decoder_class
from .config import SampleOutput, SamplingConfig
from .engine import Request, to_requests
from .observe import StepEvent, StepObserver
from .stopping import StopChecker


class Session:
    def __init__(self, model, cfg: SamplingConfig, *, slots: int, max_len: int, mask_id: int,
                 eos_id: int | None = None, tokenizer=None, generator: torch.Generator | None = None):
        from .compiled import DecodeStepRunner

        cfg = dataclasses.replace(cfg, compact=False, check_every=1, compile=False, max_batch=slots)
        cfg.validate()
        self.cfg, self.max_len, self.slots = cfg, int(max_len), int(slots)
        self.mask_id, self.eos_id, self.tokenizer = int(mask_id), eos_id, tokenizer
        if generator is None and cfg.seed is not None and not cfg.greedy:
            generator = torch.Generator(device=next(model.parameters()).device).manual_seed(int(cfg.seed))
        shape = [Request([], self.max_len, [], False)]  # sizes the canvas and the cache; one row to start
        dec = decoder_class(cfg.family)(model, shape, cfg, mask_id=mask_id, eos_id=eos_id, tokenizer=tokenizer,
                                        generator=generator)
        dec.reqs, dec.outputs, dec.checked, dec.t_admit, dec.stop_reason, dec.stop_text = {}, {}, {}, {}, {}, {}
        dec.queue, dec.pending_rows = deque(), 0
        dec.runner = DecodeStepRunner(dec)
        self._unusable: torch.Tensor | None = None  # [B] rows whose logits were unusable in this step
        dec.choose = self._guarded(dec.choose)
        self.dec = dec
        self.watched: set[int] = set()
        self.events: list[StepEvent] = []
        dec.observer = StepObserver(dec, self.events.append, rows=self.watched)
        self.open: set[int] = set()  # submitted, not yet returned by step()
        self.next_row = 0
        self.forwards = 0  # decoding steps run (each one batched forward)

    def reseed(self) -> None:
        """Restart the seeded generator (config.seed): an idle session reused for a new request
        samples as a fresh one would."""
        if self.cfg.seed is not None and self.dec.generator is not None:
            self.dec.generator.manual_seed(int(self.cfg.seed))

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, prompt, *, max_new_tokens: int | None = None, stop: list[str] | None = None,
               stop_regex: str | None = None, watch: bool = False) -> int:
        """Queue one prompt (token ids or an Infill); its row id. watch: report its steps."""
        cfg = self.cfg if max_new_tokens is None else dataclasses.replace(self.cfg, max_new_tokens=int(max_new_tokens))
        [req] = to_requests([prompt], cfg, self.mask_id, self.dec.vocab, self.eos_id)
        if req.length > self.max_len:
            raise UsageError(f"prompt: {len(req.visible)} prompt tokens + {req.span} new tokens exceed the "
                             f"session's {self.max_len} positions")
        dec, row = self.dec, self.next_row
        self.next_row += 1
        dec.reqs[row], dec.outputs[row], dec.checked[row] = req, None, 0
        dec.t_admit[row] = time.perf_counter()
        if stop or stop_regex:
            dec.row_stoppers[row] = StopChecker(self.tokenizer, list(stop or []), stop_regex)
        if watch:
            self.watched.add(row)
        dec.queue.append(row)
        self.open.add(row)
        return row

    def cancel(self, row: int) -> None:
        """Stop a row now: a waiting one leaves the queue, a running one frees its slot (its decoded
        left-to-right prefix is returned by the next step(), stop_reason "cancelled")."""
        dec = self.dec
        if row not in self.open or dec.outputs.get(row) is not None:
            return
        dec.stop_reason[row] = "cancelled"
        if row in dec.queue:
            dec.queue.remove(row)
            dec.outputs[row] = SampleOutput(tokens=[], stop_reason="cancelled", stopped_early=True,
                                            prompt_tokens=len(dec.reqs[row].visible))
            return
        b = dec.rows.index(row)
        if bool(dec.todo[b].any()):  # keep the decoded left-to-right prefix, drop what lies past a gap
            dec.span_end[b] = torch.minimum(dec.span_end[b], dec.todo[b].int().argmax())
        dec.todo[b] = False
        dec.can_stop[b] = False
        dec.check(time.perf_counter())  # retires it and refills the slot with a waiting prompt

    # -- state --------------------------------------------------------------------------------------
    @property
    def live(self) -> int:
        """Rows in slots."""
        return sum(r >= 0 for r in self.dec.rows)

    @property
    def waiting(self) -> int:
        return len(self.dec.queue)

    @property
    def busy(self) -> bool:
        return bool(self.open)

    # -- failures -----------------------------------------------------------------------------------
    def _guarded(self, choose):
        """The decoder's token choice, with rows whose logits [B, N, V] are unusable zeroed and recorded."""

        def guarded(logits: torch.Tensor, confidence: bool = True):
            top = logits.detach().amax(-1)  # NaN where a NaN is, +inf where one is, -inf where nothing is possible
            bad = ~torch.isfinite(top).all(-1)
            if bool(bad.any()):  # one read of B flags (a session reads the device back every step anyway)
                logits = logits.masked_fill(bad[:, None, None], 0.0)
                self._unusable = bad if self._unusable is None else self._unusable | bad
            return choose(logits, confidence)

        return guarded

    def _fail_unusable(self) -> None:
        """End the rows whose logits were unusable in the step just run (stop_reason "error", no tokens)."""
        bad, self._unusable = self._unusable, None
        if bad is None or not bool(bad.any()):
            return
        dec = self.dec
        for b in torch.nonzero(bad).flatten().tolist():
            row = dec.rows[b]
            if row < 0:
                continue
            dec.stop_reason[row] = "error"
            self.watched.discard(row)  # what the step wrote for it is not reported
            dec.span_end[b] = dec.span_start[b]
            dec.todo[b] = False
            dec.can_stop[b] = False

    # -- decoding -----------------------------------------------------------------------------------
    def step(self) -> tuple[list[StepEvent], list[tuple[int, SampleOutput]]]:
        """Admit waiting prompts, run one step if any row is live; (events, finished rows)."""
        dec = self.dec
        self._admit(time.perf_counter())
        if self.live:
            dec.observer.before_step()
            self._unusable = None
            dec.runner()
            self.forwards += 1
            dec.after_step()
            self._fail_unusable()
            dec.check(time.perf_counter())
            self._shrink()
        events, self.events[:] = list(self.events), []
        return events, self._collect()

    def _admit(self, now: float) -> None:
        dec = self.dec
        free = [b for b, r in enumerate(dec.rows) if r < 0]
        need = min(len(dec.queue), self.slots - self.live) - len(free)
        if need > 0:  # grow: copies of slot 0, reset by admit() below
            keep = torch.tensor(list(range(len(dec.rows))) + [0] * need, device=dec.device)
            dec.rows = dec.rows + [-1] * need
            dec.select_rows(keep)
            dec.runner.reset()
            free = [b for b, r in enumerate(dec.rows) if r < 0]
        take = free[: len(dec.queue)]
        if take:
            dec.admit(take, [dec.queue.popleft() for _ in take], now)

    def _shrink(self) -> None:
        dec = self.dec
        live = [b for b, r in enumerate(dec.rows) if r >= 0]
        if dec.queue or len(dec.rows) == 1 or len(live) > len(dec.rows) // 2:
            return
        keep = live or [0]
        dec.rows = [dec.rows[b] for b in keep]
        dec.select_rows(torch.tensor(keep, device=dec.device))
        dec.runner.reset()

    def _collect(self) -> list[tuple[int, SampleOutput]]:
        dec, out = self.dec, []
        for row in sorted(r for r in self.open if dec.outputs.get(r) is not None):
            out.append((row, dec.outputs.pop(row)))
            self.open.discard(row)
            self.watched.discard(row)
            dec.observer.forget(row)
            for d in (dec.reqs, dec.checked, dec.t_admit, dec.stop_reason, dec.stop_text, dec.row_stoppers):
                d.pop(row, None)
        return out
