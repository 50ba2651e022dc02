"""Recomputing reference decoders: one sequence at a time, no KV cache, plain Python lists.

Each step re-runs the model over every committed token (in commit order, with the attention the
cached decoder gives them) plus the step's queries. They define what the cached, batched decoders
must produce (greedy: the same tokens) and serve as the "recompute" baseline of the benchmark. They
share only the token choice and acceptance rules (processors.py) with the fast decoders.

Context overflow, stated from the reference implementation's semantics (its `SetDLM.generate` crops
the KV cache when cache + the step's tokens would exceed the model's length): before the forward of
step s, if the live context (committed tokens forwarded before s and not dropped) plus the step's
tokens (those committed by this forward plus its queries) exceed `max_seq_len`, the live tokens with
the lowest positions are dropped until it fits. A dropped token is never attended again; every
token keeps what it saw when it was forwarded, so the recomputation gives each committed token only
the tokens that were live at its own forward.

Cache order (`SamplingConfig.cache_order`): a step's accepted tokens join the committed list in
position order, or in descending first-hitting time (first_hitting.py; plain prompts only, as in the
reference implementation, whose infilling caches in position order).
"""

from __future__ import annotations

import math
import time

import torch

from ..transformer import full_logits
from .first_hitting import for_decode as first_hitting_times
from .config import SampleOutput, SamplingConfig
from .engine import Request, to_requests
from .processors import accept_top1, accept_top_k, choose, presence
from .stopping import StopChecker


class _Row:
    def __init__(self, r: Request, mask_id: int):
        self.r = r
        n = len(r.prefix)
        self.canvas = r.prefix + [mask_id] * r.span + r.suffix
        self.start, self.end, self.end0 = n, n + r.span, n + r.span
        self.commit_step = [0] * len(self.canvas)
        self.committed: list[tuple[int, int, int]] = []  # (token, position, group)
        self.fwd: list[int] = []  # the step whose forward put each committed token in the context (0: prefill)
        self.dropped: list[float] = []  # the step before whose forward it was dropped (inf: live)
        self.steps = 0
        self.reason = None
        self.text = None
        self.checked = 0

    def todo(self, p: int) -> bool:
        return self.start <= p < self.end and self.commit_step[p] == 0


def _forward(model, ids, pos, mask, n_out):
    ids_t = torch.tensor([ids], dtype=torch.long, device=next(model.parameters()).device)
    pos_t = torch.tensor([pos], dtype=torch.long, device=ids_t.device)
    logits = model(ids_t, pos_t, mask.to(ids_t.device), logits_slice=slice(len(ids) - n_out, len(ids)))
    return full_logits(model, logits)


class Reference:
    def __init__(self, model, cfg: SamplingConfig, *, mask_id, eos_id, tokenizer, generator):
        self.model, self.cfg, self.mask_id = model, cfg, mask_id
        many = cfg.threshold is not None and cfg.threshold < 1.0  # more than one commit per step: an order
        self.fht = first_hitting_times(cfg, model, generator) if many else None
        self.tokenizer, self.generator = tokenizer, generator
        ids = list(cfg.stop_token_ids) + ([eos_id] if cfg.stop_on_eos and eos_id is not None else [])
        self.stop_ids = set(ids)
        self.stopper = StopChecker(tokenizer, cfg.stop, cfg.stop_regex)
        self.vocab = model.cfg.vocab_size
        self.limit = int(getattr(model.cfg, "max_seq_len", 0) or 0)

    def choose(self, row: _Row, logits, confidence: bool = True):
        present = None
        if self.cfg.repetition_penalty != 1.0:
            present = presence(torch.tensor([row.canvas], device=logits.device), self.vocab)
        return choose(logits, self.cfg, self.generator, present, confidence)

    def write(self, row: _Row, pos: list[int], tok: list[int], acc: list[bool], step: int) -> None:
        for p, t, a in zip(pos, tok, acc):
            if a:
                row.canvas[p], row.commit_step[p] = t, step
                if not row.r.infill and t in self.stop_ids:
                    row.end = min(row.end, p)
        if self.stopper.enabled and not row.r.infill and row.reason is None:
            upto = row.start
            while upto < row.end and not row.todo(upto):
                upto += 1
            toks = row.canvas[row.start:upto]
            hit = self.stopper.check(toks, row.checked)
            row.checked = len(toks)
            if hit is not None:
                n, row.text, row.reason = hit
                row.end = row.start + n

    def done(self, row: _Row) -> bool:
        return not any(row.todo(p) for p in range(row.start, row.end))

    def output(self, row: _Row, seconds: float) -> SampleOutput:
        toks = row.canvas[row.start:row.end]
        reason = row.reason or ("eos" if row.end < row.end0 else "length")
        dropped = sum(1 for p in range(row.end, row.end0) if row.commit_step[p] == 0)
        text = None
        if self.tokenizer is not None:
            text = row.text if row.text is not None else self.tokenizer.decode(toks)
        return SampleOutput(tokens=toks, text=text, steps=row.steps,
                            tokens_per_step=len(toks) / row.steps if row.steps else 0.0, seconds=seconds,
                            stopped_early=reason != "length", stop_reason=reason, masks_dropped=dropped,
                            commit_step=row.commit_step[row.start:row.end], prompt_tokens=len(row.r.visible),
                            sequence=row.canvas[:row.end] + row.canvas[row.end0:])

    # -- context ----------------------------------------------------------------------------------
    def commit(self, row: _Row, entries, fwd: int) -> None:
        """Append (token, position, group) entries that the forward of step `fwd` puts in the context."""
        for e in entries:
            row.committed.append(e)
            row.fwd.append(fwd)
            row.dropped.append(math.inf)

    def fit(self, row: _Row, step: int, n_queries: int) -> None:
        """Before the forward of `step`: drop the lowest-position live tokens while the live context plus
        this forward's tokens (those it commits, plus `n_queries`) exceed max_seq_len."""
        live = [i for i, f in enumerate(row.fwd) if f < step and row.dropped[i] == math.inf]
        incoming = sum(1 for f in row.fwd if f == step) + n_queries
        over = len(live) + incoming - self.limit if self.limit else 0
        for i in sorted(live, key=lambda i: row.committed[i][1])[: max(over, 0)]:
            row.dropped[i] = step

    def seen(self, row: _Row) -> torch.Tensor:
        """[c, c] bool: committed token j was live when token i was forwarded."""
        fwd = torch.tensor(row.fwd, dtype=torch.float64)
        dropped = torch.tensor(row.dropped, dtype=torch.float64)
        return dropped[None, :] > fwd[:, None]

    def live(self, row: _Row) -> torch.Tensor:
        """[c] bool: committed tokens live now (what the step's queries see)."""
        return torch.tensor([d == math.inf for d in row.dropped], dtype=torch.bool)

    # -- families ---------------------------------------------------------------------------------
    def run(self, r: Request) -> SampleOutput:
        t0 = time.perf_counter()
        row = _Row(r, self.mask_id)
        spec = self.cfg.spec
        if not spec.reference_step:
            raise ValueError(f"no recomputing reference for family {spec.name!r}")
        family_step = getattr(self, spec.reference_step)
        if self.fht is not None and not r.infill and r.span:
            t = self.fht.times(r.span).tolist()
            row.fht = {len(r.prefix) + j: t[j] for j in range(r.span)}
        context = list(zip(r.visible, r.visible_positions))
        if spec.reference_step == "bd3lm_step" and r.span:  # a partial last prompt block is decoded with the span
            lo = len(r.prefix) - len(r.prefix) % self.cfg.block_size
            context = [(t, p) for t, p in context if not lo <= p < len(r.prefix)]
        self.commit(row, [(t, p, 0) for t, p in context], 0)
        if spec.next_token:  # the engine forwards the prompt's last token at the first step
            row.fwd[-1] = 1
        step = 0
        while not self.done(row):
            step += 1
            family_step(row, step)
        return self.output(row, time.perf_counter() - t0)

    def setdlm_step(self, row: _Row, step: int) -> None:
        cfg = self.cfg
        w = getattr(row, "win", cfg.initial_window)  # fixed window, or this row's adaptive window
        start = next(p for p in range(row.start, row.end) if row.todo(p))
        q = [p for p in range(start, min(start + w, row.end)) if row.todo(p)]
        self.fit(row, step, len(q))
        c = len(row.committed)
        n = c + len(q)
        mask = torch.zeros(n, n, dtype=torch.bool)
        mask[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril() & self.seen(row)  # committed: causal in commit order
        mask[c:, :c] = self.live(row)
        mask[c:, c:] = torch.eye(len(q), dtype=torch.bool)
        ids = [t for t, _, _ in row.committed] + [self.mask_id] * len(q)
        pos = [p for _, p, _ in row.committed] + q
        logits = _forward(self.model, ids, pos, mask, len(q))
        tok, conf = self.choose(row, logits)
        acc = accept_top1(conf, torch.ones_like(conf, dtype=torch.bool), self.cfg.threshold)[0].tolist()
        tok = tok[0].tolist()
        row.steps += 1
        if cfg.adaptive_window:  # the documented rule: twice the tokens accepted, within the bounds
            row.win = min(max(2 * sum(acc), cfg.window_min), cfg.max_window)
        self.write(row, q, tok, acc, step)
        entries = [(t, p, step) for t, p, a in zip(tok, q, acc) if a and p < row.end]
        fht = getattr(row, "fht", None)
        if fht is not None:  # first-hitting cache order: latest first-hitting time first
            entries.sort(key=lambda e: -fht[e[1]])
        self.commit(row, entries, step + 1)

    def bd3lm_step(self, row: _Row, step: int) -> None:
        B = self.cfg.block_size
        spb = self.cfg.steps_per_block or B
        start = next(p for p in range(row.start, row.end) if row.todo(p))
        blk = start // B
        if getattr(row, "block", None) != blk:
            row.block, row.block_steps = blk, 0
        lo = row.start - row.start % B  # the span's first block starts with the prompt's uncached tail
        slots = [p for p in range(blk * B, (blk + 1) * B) if lo <= p < row.end]
        active = [row.todo(p) for p in slots]
        self.fit(row, step, len(slots))
        c = len(row.committed)
        n = c + len(slots)
        cpos = [p for _, p, _ in row.committed]
        grp = torch.tensor([g for _, _, g in row.committed], dtype=torch.long)
        blk = torch.tensor(cpos, dtype=torch.long) // B
        gi, gj = grp[:, None], grp[None, :]
        mask = torch.zeros(n, n, dtype=torch.bool)
        # token i sees token j of an earlier group; within the prefill (group 0) block-causally, within a
        # completed block (later groups) bidirectionally
        mask[:c, :c] = ((gj < gi) | ((gj == gi) & ((gi > 0) | (blk[None, :] <= blk[:, None])))) & self.seen(row)
        mask[c:, :c] = self.live(row)
        mask[c:, c:] = True
        ids = [t for t, _, _ in row.committed] + [row.canvas[p] for p in slots]
        logits = _forward(self.model, ids, cpos + slots, mask, len(slots))
        tok, conf = self.choose(row, logits)
        act = torch.tensor([active])
        k = math.ceil(sum(active) / max(spb - row.block_steps, 1))
        acc = accept_top_k(conf, act, torch.tensor([k]), self.cfg.threshold)[0].tolist()
        row.block_steps += 1
        row.steps += 1
        self.write(row, slots, tok[0].tolist(), acc, step)
        if not any(row.todo(p) for p in slots):  # block complete: commit its span tokens
            self.commit(row, [(row.canvas[p], p, step) for p in slots if p < row.end], step + 1)

    def ar_step(self, row: _Row, step: int) -> None:
        p = next(p for p in range(row.start, row.end) if row.todo(p))
        self.fit(row, step, 0)  # the step forwards the previous token (committed now), no query
        c = len(row.committed)
        ids = [t for t, _, _ in row.committed]
        mask = torch.ones(c, c, dtype=torch.bool).tril() & self.seen(row)
        logits = _forward(self.model, ids, [q for _, q, _ in row.committed], mask, 1)
        tok, _ = self.choose(row, logits, confidence=False)
        row.steps += 1
        tok = tok[0].tolist()
        self.write(row, [p], tok, [True], step)
        self.commit(row, [(tok[0], p, step)], step + 1)


def generate_reference(model, prompts, config: SamplingConfig | None = None, *, mask_id=None, eos_id=None,
                       tokenizer=None, generator=None, **overrides) -> list[SampleOutput]:
    """The recomputing reference, with generate()'s signature (one prompt at a time)."""
    import dataclasses

    cfg = dataclasses.replace(config or SamplingConfig(), **overrides)
    cfg.validate()
    if mask_id is None:
        mask_id = tokenizer.mask_id if tokenizer is not None else model.cfg.mask_id
    if eos_id is None and tokenizer is not None:
        eos_id = tokenizer.eos_id
    if generator is None and cfg.seed is not None:
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(int(cfg.seed))
    reqs = to_requests(prompts, cfg, mask_id, model.cfg.vocab_size, eos_id)
    ref = Reference(model, cfg, mask_id=mask_id, eos_id=eos_id, tokenizer=tokenizer, generator=generator)
    was = model.training
    model.eval()
    try:
        with torch.inference_mode():
            return [ref.run(r) for r in reqs]
    finally:
        model.train(was)
