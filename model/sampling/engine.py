"""Shared decoding machinery: the ragged batch layout, the step loop, stopping and outputs.

Every family decodes a *canvas* [B, L + 1] (column L is a junk slot that absorbs writes of rejected
positions, so scatters never collide): visible tokens (prompt; or prefix and suffix) at their true
positions and MASK on the span to generate. Per row: span_start, span_end (shrinks when EOS or a stop
fires), todo (span positions still masked). Subclasses implement `prefill()` and `step(step)` on
device tensors only; the loop reads the device back every `check_every` steps to retire finished rows
and to look for stop strings, nothing else.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from ..transformer import full_logits
from .config import Infill, SampleOutput, SamplingConfig
from .processors import choose, presence
from .stopping import StopChecker


@dataclass
class Request:
    prefix: list[int]
    span: int
    suffix: list[int]
    infill: bool

    @property
    def visible(self) -> list[int]:
        return self.prefix + self.suffix

    @property
    def visible_positions(self) -> list[int]:
        p = len(self.prefix)
        return list(range(p)) + list(range(p + self.span, p + self.span + len(self.suffix)))

    @property
    def length(self) -> int:
        return len(self.prefix) + self.span + len(self.suffix)


def to_requests(prompts, cfg: SamplingConfig, mask_id: int, vocab: int, eos_id: int | None = None) -> list[Request]:
    if isinstance(prompts, (Infill, str)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        raise TypeError("generate: prompts must be a list of prompts (each a list of token ids or an Infill)")
    reqs = []
    for i, p in enumerate(prompts):
        if isinstance(p, Infill):
            if p.length < 0:
                raise ValueError(f"prompts[{i}]: Infill.length must be >= 0, got {p.length}")
            r = Request(list(map(int, p.prefix)), int(p.length), list(map(int, p.suffix)), True)
            if cfg.family == "ar":
                r = Request(r.prefix, r.span, [], True)  # AR conditions on the prefix only
        else:
            if isinstance(p, str):
                raise TypeError(f"prompts[{i}]: a string; encode it first (or use eval.sample / a tokenizer)")
            if hasattr(p, "tolist"):
                p = p.tolist()
            r = Request(list(map(int, p)), int(cfg.max_new_tokens), [], False)
        for t in r.visible:
            if not 0 <= t < vocab or t == mask_id:
                raise ValueError(f"prompts[{i}]: token id {t} is not a visible token id (vocabulary {vocab}, "
                                 f"MASK {mask_id})")
        if cfg.family == "ar" and not r.prefix and eos_id is not None:
            r = Request([int(eos_id)], r.span, r.suffix, r.infill)  # GPT-2 convention: start from EOS
        if cfg.family == "ar" and not r.prefix:
            raise ValueError(f"prompts[{i}]: AR decoding needs at least one prompt token (start with BOS, or pass eos_id)")
        reqs.append(r)
    return reqs


class Decoder:
    """Base decoder: subclasses set `uses_cache` and implement prefill() and step(step)."""

    uses_cache = True
    stop_in_step = True  # EOS / stop ids handled in `_write`

    def __init__(self, model, requests: list[Request], cfg: SamplingConfig, *, mask_id: int,
                 eos_id: int | None, tokenizer=None, generator: torch.Generator | None = None):
        self.model, self.cfg, self.reqs = model, cfg, requests
        self.mask_id, self.tokenizer, self.generator = int(mask_id), tokenizer, generator
        p = next(model.parameters())
        self.device = p.device
        self.vocab = model.cfg.vocab_size
        self.stopper = StopChecker(tokenizer, cfg.stop, cfg.stop_regex)
        ids = list(cfg.stop_token_ids)
        if cfg.stop_on_eos and eos_id is not None:
            ids.append(int(eos_id))
        self.stop_ids = torch.tensor(sorted(set(ids)), dtype=torch.long, device=self.device) if ids else None
        self._build_layout()

    # -- layout ----------------------------------------------------------------------------------
    def _build_layout(self) -> None:
        reqs, dev = self.reqs, self.device
        B = len(reqs)
        L = max((r.length for r in reqs), default=0)
        self.L = L
        canvas = torch.full((B, L + 1), self.mask_id, dtype=torch.long)
        todo = torch.zeros(B, L + 1, dtype=torch.bool)
        for b, r in enumerate(reqs):  # host-side setup, once
            n = len(r.prefix)
            canvas[b, :n] = torch.tensor(r.prefix, dtype=torch.long)
            if r.suffix:
                canvas[b, n + r.span : r.length] = torch.tensor(r.suffix, dtype=torch.long)
            todo[b, n : n + r.span] = True
        self.canvas, self.todo = canvas.to(dev), todo.to(dev)
        self.span_start = torch.tensor([len(r.prefix) for r in reqs], dtype=torch.long, device=dev)
        self.span_end = torch.tensor([len(r.prefix) + r.span for r in reqs], dtype=torch.long, device=dev)
        self.row_len = torch.tensor([r.length for r in reqs], dtype=torch.long, device=dev)
        self.can_stop = torch.tensor([not r.infill for r in reqs], dtype=torch.bool, device=dev)
        self.commit_step = torch.zeros(B, L + 1, dtype=torch.int32, device=dev)
        self.steps = torch.zeros(B, dtype=torch.long, device=dev)
        self.rows = list(range(B))  # original index of each live row
        self.arange_L = torch.arange(L + 1, device=dev)

    def visible_batch(self, left_pad: bool = True):
        """Prefill inputs: visible tokens (prefix then suffix) left-padded to the longest. Returns
        ids, positions, valid [B, V] (V may be 0)."""
        V = max((len(r.visible) for r in self.reqs), default=0)
        B = len(self.reqs)
        ids = torch.full((B, V), self.mask_id, dtype=torch.long)
        pos = torch.zeros(B, V, dtype=torch.long)
        valid = torch.zeros(B, V, dtype=torch.bool)
        for b, r in enumerate(self.reqs):
            n = len(r.visible)
            if n:
                sl = slice(V - n, V) if left_pad else slice(0, n)
                ids[b, sl] = torch.tensor(r.visible)
                pos[b, sl] = torch.tensor(r.visible_positions)
                valid[b, sl] = True
        return ids.to(self.device), pos.to(self.device), valid.to(self.device)

    # -- shared step pieces ----------------------------------------------------------------------
    def logits(self, *args, **kw) -> torch.Tensor:
        return full_logits(self.model, self.model(*args, **kw))

    def choose(self, logits: torch.Tensor):
        present = presence(self.canvas[:, : self.L], self.vocab) if self.cfg.repetition_penalty != 1.0 else None
        return choose(logits, self.cfg, self.generator, present)

    def write(self, pos: torch.Tensor, tok: torch.Tensor, accept: torch.Tensor, step: int) -> None:
        """Write accepted tokens [B, N] at positions [B, N]; stop-token truncation on the device."""
        dest = torch.where(accept, pos, torch.full_like(pos, self.L))
        self.canvas.scatter_(1, dest, tok)
        self.todo.scatter_(1, dest, False)
        self.commit_step.scatter_(1, dest, torch.full_like(dest, step, dtype=torch.int32))
        if self.stop_ids is not None:
            hit = accept & torch.isin(tok, self.stop_ids) & self.can_stop[:, None]
            first = torch.where(hit, pos, torch.full_like(pos, self.L + 1)).amin(1)
            self.truncate(torch.minimum(self.span_end, first))

    def truncate(self, new_end: torch.Tensor) -> None:
        self.span_end = new_end
        self.todo &= self.arange_L[None, :] < new_end[:, None]

    # -- loop ------------------------------------------------------------------------------------
    def prefill(self) -> None:
        raise NotImplementedError

    def step(self, step: int) -> None:
        raise NotImplementedError

    def max_steps(self) -> int:
        return max((r.span for r in self.reqs), default=0) + 1

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only the given live rows (device index tensor). Subclasses extend for their state."""
        for name in ("canvas", "todo", "span_start", "span_end", "row_len", "can_stop", "commit_step", "steps"):
            setattr(self, name, getattr(self, name)[keep])

    def run(self) -> list[SampleOutput]:
        cfg = self.cfg
        t0 = time.perf_counter()
        self.outputs: list[SampleOutput | None] = [None] * len(self.reqs)
        self.stop_reason: dict[int, str] = {}
        self.stop_text: dict[int, str] = {}
        self.checked = [0] * len(self.reqs)
        if not self.reqs:
            return []
        self.prefill()
        limit = self.max_steps() + cfg.check_every
        step = 0
        self.pending_rows = len(self.reqs)
        while self.pending_rows:
            step += 1
            if step > limit:
                raise RuntimeError(f"sampling: no progress after {step} steps (a bug in the {cfg.family} sampler)")
            self.step(step)
            if step % cfg.check_every == 0 or step >= limit - cfg.check_every:
                self.check(time.perf_counter() - t0)
        return self.outputs  # type: ignore[return-value]

    def check(self, elapsed: float) -> None:
        """Host synchronisation: stop strings, then retire finished rows."""
        if self.stopper.enabled and bool(self.can_stop.any()):
            self._check_stop_strings()
        done = (~self.todo.any(1)).cpu()
        fresh = [b for b in torch.nonzero(done).flatten().tolist() if self.outputs[self.rows[b]] is None]
        if fresh:
            self._record(fresh, elapsed)
        if self.cfg.compact and bool(done.any()):
            keep = torch.nonzero(~done).flatten()
            self.rows = [self.rows[b] for b in keep.tolist()]
            if self.rows:
                self.select_rows(keep.to(self.device))
        self.pending_rows = sum(o is None for o in self.outputs)

    def _record(self, fin: list[int], elapsed: float) -> None:
        idx = torch.tensor(fin, device=self.device)
        canvas, steps = self.canvas[idx].cpu(), self.steps[idx].cpu()
        commit = self.commit_step[idx].cpu()
        s0, s1 = self.span_start[idx].cpu(), self.span_end[idx].cpu()
        for i, b in enumerate(fin):
            row = self.rows[b]
            r = self.reqs[row]
            a, e, e0 = int(s0[i]), int(s1[i]), len(r.prefix) + r.span
            toks = canvas[i, a:e].tolist()
            reason = self.stop_reason.get(row, "eos" if e < e0 else "length")
            dropped = int((commit[i, e:e0] == 0).sum()) if e < e0 else 0
            text = None
            if self.tokenizer is not None:
                text = self.stop_text.get(row)
                if text is None:
                    text = self.tokenizer.decode(toks)
            n_steps = int(steps[i])
            self.outputs[row] = SampleOutput(
                tokens=toks, text=text, steps=n_steps, tokens_per_step=len(toks) / n_steps if n_steps else 0.0,
                seconds=elapsed, stopped_early=reason != "length", stop_reason=reason, masks_dropped=dropped,
                commit_step=commit[i, a:e].tolist(), prompt_tokens=len(r.visible),
                sequence=canvas[i, :e].tolist() + canvas[i, e0 : r.length].tolist())

    def _check_stop_strings(self) -> None:
        todo, canvas = self.todo.cpu(), self.canvas.cpu()
        s0, s1 = self.span_start.cpu(), self.span_end.cpu()
        can = self.can_stop.cpu()
        new_end = s1.clone()
        changed = False
        for b in range(len(self.rows)):
            if not bool(can[b]):
                continue
            row = self.rows[b]
            a, e = int(s0[b]), int(s1[b])
            masked = torch.nonzero(todo[b, a:e]).flatten()
            upto = a + (int(masked[0]) if len(masked) else e - a)
            toks = canvas[b, a:upto].tolist()
            hit = self.stopper.check(toks, self.checked[row])
            self.checked[row] = len(toks)
            if hit is not None:
                n, text, reason = hit
                new_end[b] = a + n
                self.stop_reason[row], self.stop_text[row] = reason, text
                changed = True
        if changed:
            self.truncate(new_end.to(self.device))
            self.can_stop = self.can_stop & (new_end == s1).to(self.device)
