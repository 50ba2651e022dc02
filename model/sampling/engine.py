"""Shared decoding machinery: slots, continuous batching, the step loop, stopping and outputs.

The decoder runs a fixed number of *slots* (`SamplingConfig.max_batch`, default: every prompt at
once). Each slot holds one prompt on a *canvas* row [L + 1] (column L is a junk slot that absorbs
writes of rejected positions, so scatters never collide): visible tokens (prompt; or prefix and
suffix) at their true positions and MASK on the span to generate, with span_start, span_end (shrinks
when EOS or a stop fires) and todo (span positions still masked). When a row finishes, its output is
recorded and the next waiting prompt is prefilled into its slot (`admit`): the KV cache is
slot-indexed, so the new row joins the running batch without touching the others. With no prompt left
waiting, finished rows are dropped from the batch (`compact`).

Subclasses implement `reset_slots()`, `prefill()` and `device_step()`. A step is device tensor ops
only, updating the state tensors in place (so it can be compiled or captured in a CUDA graph, see
compiled.py); the loop reads the device back every `check_every` steps to retire finished rows, admit
waiting ones and look for stop strings, nothing else.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from ..transformer import full_logits
from .config import Infill, SampleOutput, SamplingConfig, SamplingError
from .processors import adjust, bias_vector, choose, counts, presence, token_logprobs
from .stopping import StopChecker, StopRegexTimeout


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
                raise SamplingError(f"prompts[{i}]: Infill.length must be >= 0, got {p.length}")
            r = Request(list(map(int, p.prefix)), int(p.length), list(map(int, p.suffix)), True)
            if cfg.spec.next_token:
                r = Request(r.prefix, r.span, [], True)  # AR conditions on the prefix only
        else:
            if isinstance(p, str):
                raise TypeError(f"prompts[{i}]: a string; encode it first (or use eval.sample / a tokenizer)")
            if hasattr(p, "tolist"):
                p = p.tolist()
            r = Request(list(map(int, p)), int(cfg.max_new_tokens), [], False)
        for t in r.visible:
            if not 0 <= t < vocab or t == mask_id:
                raise SamplingError(f"prompts[{i}]: token id {t} is not a visible token id (vocabulary {vocab}, "
                                 f"MASK {mask_id})")
        if cfg.spec.next_token and not r.prefix and eos_id is not None:
            r = Request([int(eos_id)], r.span, r.suffix, r.infill)  # GPT-2 convention: start from EOS
        if cfg.spec.next_token and not r.prefix:
            raise SamplingError(f"prompts[{i}]: AR decoding needs at least one prompt token (start with BOS, or pass eos_id)")
        reqs.append(r)
    return reqs


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class Decoder:
    """Base decoder: subclasses set `uses_cache` and implement reset_slots(), prefill(), device_step()."""

    uses_cache = True
    compilable = True  # the step may run under torch.compile / CUDA graphs

    def __init__(self, model, requests: list[Request], cfg: SamplingConfig, *, mask_id: int,
                 eos_id: int | None, tokenizer=None, generator: torch.Generator | None = None):
        self.model, self.cfg, self.reqs = model, cfg, requests
        self.mask_id, self.tokenizer, self.generator = int(mask_id), tokenizer, generator
        p = next(model.parameters())
        self.device = p.device
        self.vocab = model.cfg.vocab_size
        self.stopper = StopChecker(tokenizer, cfg.stop, cfg.stop_regex)
        self.row_stoppers: dict[int, StopChecker] = {}  # a request's own stop strings (session.py)
        self.observer = None  # reports each step's commits (observe.py); None: nothing is read back for it
        self.bias = bias_vector(cfg.logit_bias, self.vocab, self.device)  # logit_bias as a [V] tensor (or None)
        self.step_lp = None  # with cfg.logprobs: the last choose()'s (logprob, top ids, top logprobs), [B, N(, k)]
        ids = list(cfg.stop_token_ids)
        if cfg.stop_on_eos and eos_id is not None:
            ids.append(int(eos_id))
        self.stop_ids = torch.tensor(sorted(set(ids)), dtype=torch.long, device=self.device) if ids else None
        self.static = bool(cfg.compile) and self.compilable  # fixed shapes: attend to the whole cache
        # on a CPU the output head and the token choice run eagerly on the active slots only (head_choose)
        self.cpu_head = self.device.type == "cpu"
        n = len(requests)
        self.S = max(1, min(n, cfg.max_batch or n))
        L = max((r.length for r in requests), default=0)
        cap = max((self.cache_need(r) for r in requests), default=0)
        self.need = cap  # most entries one request commits (before rounding)
        self.limit = int(getattr(model.cfg, "max_seq_len", 0) or 0)  # the model's context (0: none)
        self.drops = False  # set by new_slot_cache: requests can outgrow the context
        if self.static:  # fewer distinct shapes (each is a compile / a graph)
            L, cap = _round_up(max(L, 1), 64), _round_up(max(cap, 1), 64)
        self.L, self.capacity = L, max(cap, 1)
        self._alloc(self.S)

    def cache_need(self, r: Request) -> int:
        """KV entries one request can commit (visible context + span)."""
        return len(r.visible) + r.span

    def new_slot_cache(self, extra: int):
        """The slot-indexed KV cache, for forwards of up to `extra` uncommitted tokens. When a request
        can outgrow the model's context (committed entries + one forward > max_seq_len), its entries
        carry positions and each step drops the oldest (`fit_context`)."""
        self.drops = bool(self.limit) and self.need + extra > self.limit
        if self.drops and extra >= self.limit:
            raise SamplingError(f"generate: a {self.cfg.family} step forwards up to {extra} tokens, which leaves no "
                                f"room for context in the model's max_seq_len {self.limit}; lower the window or block size")
        cache = self.model.new_cache(self.S, self.capacity, extra=extra, positions=self.drops)
        cache.static = self.static
        return cache

    def fit_context(self, incoming: torch.Tensor) -> None:
        """Context overflow (as the reference implementation decodes past its context): before a forward
        of `incoming` [B] tokens per row, drop each row's lowest-position cache entries so that cache +
        forward fit in max_seq_len. A no-op unless a request can outgrow it."""
        if self.drops:
            self.cache.drop_oldest(self.limit, incoming)

    # -- layout ----------------------------------------------------------------------------------
    def _alloc(self, S: int) -> None:
        dev, L = self.device, self.L
        self.canvas = torch.full((S, L + 1), self.mask_id, dtype=torch.long, device=dev)
        self.todo = torch.zeros(S, L + 1, dtype=torch.bool, device=dev)
        self.span_start = torch.zeros(S, dtype=torch.long, device=dev)
        self.span_end = torch.zeros(S, dtype=torch.long, device=dev)
        self.row_len = torch.zeros(S, dtype=torch.long, device=dev)
        self.can_stop = torch.zeros(S, dtype=torch.bool, device=dev)
        self.commit_step = torch.zeros(S, L + 1, dtype=torch.int32, device=dev)
        self.steps = torch.zeros(S, dtype=torch.long, device=dev)
        if self.cfg.logprobs is not None:  # per position: logprob of the committed token, the step's top k
            k = self.cfg.logprobs
            self.logprob = torch.zeros(S, L + 1, device=dev)
            self.top_ids = torch.zeros(S, L + 1, k, dtype=torch.long, device=dev)
            self.top_lp = torch.zeros(S, L + 1, k, device=dev)
        self.rows = [-1] * S  # request index held by each slot (-1: free)
        self.len_ub = np.zeros(S, dtype=np.int64)  # host upper bound on each slot's cached entries
        self.grown = 0  # entries every slot may have gained since len_ub was last brought up to date
        self.ub_max = 0  # max(len_ub) (kept by the host: the cache's own bound also counts uncommitted tokens)
        self.arange_L = torch.arange(L + 1, device=dev)

    def admit(self, slots: list[int], idx: list[int], now: float) -> None:
        """Put requests `idx` into the free `slots`: fresh canvas rows, family state, prefill."""
        reqs = [self.reqs[i] for i in idx]
        n, L = len(reqs), self.L
        canvas = torch.full((n, L + 1), self.mask_id, dtype=torch.long)
        todo = torch.zeros(n, L + 1, dtype=torch.bool)
        for b, r in enumerate(reqs):  # host-side, once per request
            k = len(r.prefix)
            canvas[b, :k] = torch.tensor(r.prefix, dtype=torch.long)
            if r.suffix:
                canvas[b, k + r.span : r.length] = torch.tensor(r.suffix, dtype=torch.long)
            todo[b, k : k + r.span] = True
        dev = self.device
        st = torch.tensor(slots, dtype=torch.long, device=dev)
        self.canvas[st] = canvas.to(dev)
        self.todo[st] = todo.to(dev)
        self.span_start[st] = torch.tensor([len(r.prefix) for r in reqs], dtype=torch.long, device=dev)
        self.span_end[st] = torch.tensor([len(r.prefix) + r.span for r in reqs], dtype=torch.long, device=dev)
        self.row_len[st] = torch.tensor([r.length for r in reqs], dtype=torch.long, device=dev)
        self.can_stop[st] = torch.tensor([not r.infill for r in reqs], dtype=torch.bool, device=dev)
        self.commit_step[st] = 0
        self.steps[st] = 0
        for s, i in zip(slots, idx):
            self.rows[s] = i
            self.t_admit[i] = now
        self.reset_slots(st, reqs)
        self.prefill(st, slots, reqs)

    def prefilled(self, r: Request) -> tuple[list[int], list[int]]:
        """(tokens, positions) of a request's context that its prefill puts in the cache: its visible
        tokens (prefix then suffix); a family leaves some to its steps (AR the last, BD3-LM a partial block)."""
        return r.visible, r.visible_positions

    def visible_batch(self, reqs: list[Request], left_pad: bool = True):
        """Prefill inputs: each request's `prefilled` tokens left-padded to the longest. Returns ids,
        positions, valid [n, V] (V may be 0)."""
        vis = [self.prefilled(r) for r in reqs]
        V = max((len(t) for t, _ in vis), default=0)
        n = len(reqs)
        ids = torch.full((n, V), self.mask_id, dtype=torch.long)
        pos = torch.zeros(n, V, dtype=torch.long)
        valid = torch.zeros(n, V, dtype=torch.bool)
        for b, (t, q) in enumerate(vis):
            if t:
                sl = slice(V - len(t), V) if left_pad else slice(0, len(t))
                ids[b, sl] = torch.tensor(t)
                pos[b, sl] = torch.tensor(q)
                valid[b, sl] = True
        return ids.to(self.device), pos.to(self.device), valid.to(self.device)

    def prefill_cache(self, st: torch.Tensor, slots: list[int], ids, pos, mask, valid) -> None:
        """Forward visible tokens into the KV cache rows of `slots` (through a scratch cache unless every
        slot is being filled), leaving the other slots untouched."""
        cache = self.cache
        cache.reset_rows(st)
        if ids.shape[1] == 0:
            return
        if len(slots) == cache.batch:
            static, cache.static, cache.bound = cache.static, False, 0
            self.model(ids, pos, mask, cache=cache, commit=valid, logits_slice=slice(0, 0))
            cache.static = static
        else:
            tmp = self.model.new_cache(len(slots), ids.shape[1], positions=cache.pos is not None)
            self.model(ids, pos, mask, cache=tmp, commit=valid, logits_slice=slice(0, 0))
            cache.load_rows(st, tmp)

    # -- shared step pieces ----------------------------------------------------------------------
    def logits(self, *args, **kw) -> torch.Tensor:
        return full_logits(self.model, self.model(*args, **kw))

    @torch.compiler.disable  # a compiled step is two graphs around this (inductor's head and choice are slower on a CPU)
    def head_choose(self, hidden: torch.Tensor, active: torch.Tensor | None = None, confidence: bool = True):
        """CPU path: the output head and token choice on the final hidden states [B, N, H] of the slots
        to decide, with `active` [B, N] on the active ones only (packed left; the widest row sets the
        count, read back: free on a CPU, where the head is compute bound). Returns tokens and
        confidence [B, N] (inactive slots: confidence -1). A GPU keeps the head in the step (fixed
        shapes, no host read; there the few extra rows of a memory-bound head cost little)."""
        n = hidden.shape[1] if active is None else int(active.sum(1).max())
        slots = None
        if n < hidden.shape[1]:
            slots = torch.sort((~active).to(torch.int8), dim=1, stable=True).indices[:, :n]
            hidden = hidden.gather(1, slots[..., None].expand(-1, -1, hidden.shape[-1]))
        tok, conf = self.choose(full_logits(self.model, self.model.output_logits(hidden)), confidence)
        if slots is None:
            return tok, conf
        if self.step_lp is not None:  # back to the slots' layout (inactive ones are never written)
            lp, ids, top = self.step_lp
            k = ids.shape[-1]
            wide = slots[..., None].expand(-1, -1, k)
            self.step_lp = (torch.zeros(active.shape, dtype=lp.dtype, device=lp.device).scatter_(1, slots, lp),
                            ids.new_zeros(*active.shape, k).scatter_(1, wide, ids),
                            top.new_zeros(*active.shape, k).scatter_(1, wide, top))
        tok = torch.zeros_like(active, dtype=tok.dtype).scatter_(1, slots, tok)
        if conf is not None:
            conf = torch.full(active.shape, -1.0, dtype=conf.dtype, device=conf.device).scatter_(1, slots, conf)
        return tok, conf

    def choose(self, logits: torch.Tensor, confidence: bool = True):
        """Token choice over logits [B, N, V] of the slots' rows (processors.py); with cfg.logprobs it also
        leaves the chosen tokens' log-probabilities in `step_lp` for `write`."""
        cfg = self.cfg
        present = presence(self.canvas[:, : self.L], self.vocab) if cfg.repetition_penalty != 1.0 else None
        seen = self.output_counts() if cfg.frequency_penalty or cfg.presence_penalty else None
        logits = adjust(logits.float(), cfg, present, seen, self.bias)
        tok, conf = choose(logits, cfg, self.generator, None, confidence)
        if cfg.logprobs is not None:
            self.step_lp = token_logprobs(logits, tok, cfg.logprobs)
        return tok, conf

    def output_counts(self) -> torch.Tensor:
        """[B, V] occurrences of each token among the output's committed tokens (its span, not the prompt):
        what OpenAI's presence and frequency penalties count."""
        L = self.L
        col = self.arange_L[None, :L]
        out = (col >= self.span_start[:, None]) & (col < self.span_end[:, None]) & ~self.todo[:, :L]
        return counts(self.canvas[:, :L], out, self.vocab)

    def write(self, pos: torch.Tensor, tok: torch.Tensor, accept: torch.Tensor) -> None:
        """Write accepted tokens [B, N] at positions [B, N], stamped with each row's own step count;
        stop-token truncation on the device."""
        dest = torch.where(accept, pos, torch.full_like(pos, self.L))
        self.canvas.scatter_(1, dest, tok)
        self.todo.scatter_(1, dest, False)
        self.commit_step.scatter_(1, dest, self.steps.to(torch.int32)[:, None].expand_as(dest))
        if self.cfg.logprobs is not None:
            lp, ids, top = self.step_lp
            wide = dest[..., None].expand(-1, -1, ids.shape[-1])
            self.logprob.scatter_(1, dest, lp)
            self.top_ids.scatter_(1, wide, ids)
            self.top_lp.scatter_(1, wide, top)
        if self.stop_ids is not None:
            hit = accept & torch.isin(tok, self.stop_ids) & self.can_stop[:, None]
            first = torch.where(hit, pos, torch.full_like(pos, self.L + 1)).amin(1)
            self.truncate(torch.minimum(self.span_end, first))

    def truncate(self, new_end: torch.Tensor) -> None:
        self.span_end.copy_(new_end)
        self.todo &= self.arange_L[None, :] < self.span_end[:, None]

    def grow_bound(self, n: int) -> None:
        """Host bookkeeping after a step: each slot's cache grew by at most n entries (one integer update;
        len_ub catches up when it is next used)."""
        if self.uses_cache and not self.static:
            self.grown += n
            self.ub_max = min(self.ub_max + n, self.capacity)
            self.cache.bound = self.ub_max

    def sync_len_ub(self) -> np.ndarray:
        """The per-slot upper bounds, brought up to date."""
        if self.grown:
            self.len_ub = np.minimum(self.len_ub + self.grown, self.capacity)
            self.grown = 0
        return self.len_ub

    def set_cached(self, slots: list[int], lengths: list[int]) -> None:
        """After a prefill: `slots` hold `lengths` cached entries; the attended key range follows."""
        self.sync_len_ub()[slots] = lengths
        self.ub_max = self.cache.bound = int(self.len_ub.max())

    # -- family hooks ----------------------------------------------------------------------------
    def reset_slots(self, st: torch.Tensor, reqs: list[Request]) -> None:
        pass

    def prefill(self, st: torch.Tensor, slots: list[int], reqs: list[Request]) -> None:
        raise NotImplementedError

    def device_step(self) -> None:
        raise NotImplementedError

    def after_step(self) -> None:
        """Host-side bookkeeping after each step (outside any compiled region)."""

    def window_bounds(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[start, end) [S] of the positions the next step may commit in each slot (for observers;
        the step itself does not use it). Default: the leftmost masked position alone."""
        start = self.todo.int().argmax(1)
        return start, torch.minimum(start + 1, self.span_end)

    def stopper_for(self, row: int) -> StopChecker:
        """The stop strings of request `row`: its own (a session's request) or the config's."""
        return self.row_stoppers.get(row, self.stopper)

    def select_rows(self, keep: torch.Tensor) -> None:
        """Keep only the given slots (device index tensor). Subclasses extend for their state."""
        names = ["canvas", "todo", "span_start", "span_end", "row_len", "can_stop", "commit_step", "steps"]
        if self.cfg.logprobs is not None:
            names += ["logprob", "top_ids", "top_lp"]
        for name in names:
            setattr(self, name, getattr(self, name)[keep])
        self.len_ub = self.sync_len_ub()[keep.cpu().numpy()]
        self.ub_max = int(self.len_ub.max()) if len(self.len_ub) else 0

    # -- loop ------------------------------------------------------------------------------------
    def run(self) -> list[SampleOutput]:
        from .compiled import DecodeStepRunner

        cfg = self.cfg
        t0 = time.perf_counter()
        n = len(self.reqs)
        self.outputs: list[SampleOutput | None] = [None] * n
        self.stop_reason: dict[int, str] = {}
        self.stop_text: dict[int, str] = {}
        self.checked = [0] * n
        self.t_admit = [t0] * n
        if not self.reqs:
            return []
        self.queue = deque(range(n))
        first = [self.queue.popleft() for _ in range(min(self.S, n))]
        self.admit(list(range(len(first))), first, t0)
        self.runner = DecodeStepRunner(self)
        limit = sum(r.span + 1 for r in self.reqs) + cfg.check_every * (n + 2)
        step = 0
        self.pending_rows = n
        while self.pending_rows:
            step += 1
            if step > limit:
                raise RuntimeError(f"sampling: no progress after {step} steps (a bug in the {cfg.family} sampler)")
            if self.observer is not None:
                self.observer.before_step()
            self.runner()
            self.after_step()
            if step % cfg.check_every == 0 or step >= limit - cfg.check_every:
                self.check(time.perf_counter())
        return self.outputs  # type: ignore[return-value]

    def check(self, now: float) -> None:
        """Host synchronisation: stop strings, retire finished rows, admit waiting prompts, compact."""
        if (self.stopper.enabled or self.row_stoppers) and bool(self.can_stop.any()):
            self._check_stop_strings()
        if self.observer is not None:
            self.observer.after_step()  # before finished rows are retired and their slots refilled
        done = (~self.todo.any(1)).cpu().tolist()
        fresh = [b for b, r in enumerate(self.rows) if r >= 0 and done[b]]
        if fresh:
            self._record(fresh, now)
            for b in fresh:
                self.rows[b] = -1
            self.can_stop[torch.tensor(fresh, device=self.device)] = False
        free = [b for b, r in enumerate(self.rows) if r < 0]
        if free and self.queue:
            take = free[: len(self.queue)]
            self.admit(take, [self.queue.popleft() for _ in take], now)
        elif free and self.cfg.compact:
            live = [b for b, r in enumerate(self.rows) if r >= 0]
            size = len(live)
            if self.static and live:  # batch buckets: powers of two (each size is one compile / graph)
                size = min(len(self.rows), 1 << (len(live) - 1).bit_length())
            if live and size < len(self.rows):
                keep = live + free[: size - len(live)]
                self.rows = [self.rows[b] for b in keep]
                self.select_rows(torch.tensor(keep, device=self.device))
                self.runner.reset()
        self.pending_rows = sum(o is None for o in self.outputs)

    def _record(self, fin: list[int], now: float) -> None:
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
            self.stopper_for(row).forget(row)
            self.outputs[row] = SampleOutput(
                tokens=toks, text=text, steps=n_steps, tokens_per_step=len(toks) / n_steps if n_steps else 0.0,
                seconds=now - self.t_admit[row], stopped_early=reason != "length", stop_reason=reason,
                masks_dropped=dropped, commit_step=commit[i, a:e].tolist(), prompt_tokens=len(r.visible),
                sequence=canvas[i, :e].tolist() + canvas[i, e0 : r.length].tolist())
            if self.cfg.logprobs is not None:
                out = self.outputs[row]
                out.logprobs = self.logprob[b, a:e].tolist()
                ids, top = self.top_ids[b, a:e].tolist(), self.top_lp[b, a:e].tolist()
                out.top_logprobs = [list(zip(i_, t_)) for i_, t_ in zip(ids, top)]

    def _check_stop_strings(self) -> None:
        todo, canvas = self.todo.cpu(), self.canvas.cpu()
        s0, s1 = self.span_start.cpu(), self.span_end.cpu()
        can = self.can_stop.cpu()
        new_end = s1.clone()
        changed = False
        for b in range(len(self.rows)):
            if not bool(can[b]) or self.rows[b] < 0:
                continue
            row = self.rows[b]
            a, e = int(s0[b]), int(s1[b])
            masked = torch.nonzero(todo[b, a:e]).flatten()
            upto = a + (int(masked[0]) if len(masked) else e - a)
            toks = canvas[b, a:upto].tolist()
            try:
                hit = self.stopper_for(row).check(toks, self.checked[row], row)
            except StopRegexTimeout:  # the row used up its matching time: it ends at its decoded prefix
                hit = (len(toks), self.tokenizer.decode(toks), "regex_timeout")
            self.checked[row] = len(toks)
            if hit is not None:
                n, text, reason = hit
                new_end[b] = a + n
                self.stop_reason[row], self.stop_text[row] = reason, text
                changed = True
        if changed:
            self.truncate(new_end.to(self.device))
            self.can_stop &= (new_end == s1).to(self.device)
