"""`build_loader` and `TokenLoader`: deterministic, resumable micro-batches of token ids.

The order is defined in `order.py`: one global sequence of samples per split (a function of the seed
and the data only); data-parallel rank ``r`` reads its slice of every global batch as micro-batches.
With workers, torch's `DataLoader` hands batches out round-robin over its workers: worker ``i`` builds
the rank's batches ``j0 + i, j0 + i + n, ...``, so the batches, and which samples they hold, do not
depend on ``data.num_workers``. A loader's state is a start position and a batch count; a loader
restored from it, under any data-parallel size, micro-batch or worker count, continues the global
order exactly where it stopped (at an optimizer-step boundary when the layout changed). A mixture
(`data.mixture`) is one source whose train positions go through its schedule (blend.py,
mixture_state.py): the state then also holds the schedule and the samples consumed per source.
"""
from __future__ import annotations

import dataclasses

import torch

from common.log import get_logger
from common.errors import Error
from common.schema import ConfigError

from . import order
from .config import DataConfig
from .mixture import MixtureSource, open_source
from .mixture_state import MixtureSchedule
from .reader import Plan, WorkerStreams, batches, clean_worker_errors
from .sources import check_split


class LoaderStateError(Error):
    """A saved data-loader state (from a checkpoint) that this loader cannot continue from."""


log = get_logger("data")
STATE_VERSION = 2


class TokenLoader:
    """Iterable of ``{"input_ids": LongTensor[micro_batch, seq_len], "sample_index": LongTensor[micro_batch]}``
    for one data-parallel rank; ``sample_index`` is each sample's global position in the split's order
    (the key of its per-sample randomness, the same under every layout).

    ``global_batch`` (default ``micro_batch * dp_size``) is the number of sequences of one optimizer
    step over all ranks; this rank reads its ``global_batch / dp_size`` of each, as
    ``global_batch / (micro_batch * dp_size)`` micro-batches. ``split="train"`` is infinite (epochs follow
    each other inside the global sequence); ``split="val"`` is one pass over the first
    ``num_samples // global_batch * global_batch`` samples, in the same order every time (``len(loader)``
    batches per rank, all full; ``loader.dropped_samples`` are left out), so every layout evaluates the
    same samples. With ``pad_last=True`` a val pass covers every sample: the last global batch is
    filled up to full size with ``loader.pad_samples`` filler rows (copies of the split's first
    samples, at positions ``num_samples, num_samples + 1, ...``), and every val batch carries
    ``pad_row`` (bool [micro_batch], True for a filler row). The objectives give a filler row weight 0
    in the loss, the NLL and the token count (model/objectives/base.py), so the batch shape stays
    fixed on every rank and stage while the totals are those of the real rows. ``epoch`` is the
    epoch of the latest sample delivered. Bad shards skipped under ``skip_bad_shards`` are counted in
    ``skipped_shards`` / ``skipped_samples`` and logged; their samples are left out of their
    micro-batches (a shorter batch, empty if all its samples were bad; the trainer fills it up with
    filler rows, reader.py `fill_rows`). A mixture's
    train loader has ``mixture`` (its schedule), ``record()`` (per-source samples and tokens),
    ``source_epochs()``; under ``data.on_exhausted: stop`` it ends before the first step that would
    reread a source and names it in ``exhausted``.
    """

    def __init__(self, source, cfg: DataConfig, *, split: str, micro_batch: int, dp_rank: int,
                 dp_size: int, seed: int, global_batch: int | None = None, pad_last: bool = False):
        global_batch = micro_batch * dp_size if global_batch is None else global_batch
        order.check_layout(global_batch, micro_batch, dp_size)
        self.source, self.cfg, self.split = source, cfg, split
        self.micro_batch, self.dp_rank, self.dp_size, self.seed = micro_batch, dp_rank, dp_size, seed
        self.global_batch = global_batch
        self.accum = global_batch // (micro_batch * dp_size)
        self.seq_len = source.seq_len
        self.num_workers = cfg.num_workers
        counts = source.counts(split)
        self._counts = counts
        self.num_samples = int(counts.sum())
        n_batches = None
        pad_from = None
        self.pad_samples = self.dropped_samples = 0
        if split == "val" and pad_last:
            n_eval = -(-self.num_samples // global_batch) * global_batch  # whole global batches, the last padded
            n_batches = n_eval // global_batch * self.accum
            self.pad_samples, pad_from = n_eval - self.num_samples, self.num_samples
        elif split == "val":
            n_eval = order.val_samples(self.num_samples, global_batch)
            if n_eval == 0:
                raise ConfigError(f"micro_batch: the val split of {source.description} has {self.num_samples} "
                                  f"sequences, fewer than one global batch (micro_batch x dp_size x accumulation = "
                                  f"{global_batch}); lower the batch or use a larger validation split")
            n_batches = n_eval // global_batch * self.accum
            self.dropped_samples = self.num_samples - n_eval
        # a mixture's train split: which source each position reads (its val split: the sources' end to end)
        self.mixture = MixtureSchedule(source, global_batch, self.seq_len) \
            if isinstance(source, MixtureSource) and split == "train" else None
        self._plan = Plan(source, split, micro_batch, global_batch, dp_rank, dp_size, max(1, cfg.num_workers), seed,
                           cfg.shuffle and split == "train", cfg.shuffle_window, cfg.skip_bad_shards,
                           cfg.with_sample_ids, n_batches, pad_from=pad_from)
        self._num_batches = n_batches
        self._start = 0  # global position of this loader's step 0
        self._batches = 0
        self.epoch = 0
        self._bad: set = set()  # units found bad (skip_bad_shards)
        self._resume_pending = False
        self.exhausted: str | None = None  # data.on_exhausted=stop: the source that ran out (iteration ended)
        self.notes: list[str] = []  # what a resume changed (a new mixture schedule)

    @property
    def skipped_shards(self) -> int:
        return len(self._bad)

    @property
    def skipped_samples(self) -> int:
        return int(sum(int(self._counts[u]) for u in self._bad))

    @property
    def position(self) -> int:
        """Global position of the next optimizer step's first sample (exact at step boundaries)."""
        return self._start + self._batches // self.accum * self.global_batch

    def batch_rows(self, j: int) -> int:
        """Real (not filler) samples in this rank's val batch `j` of a pass (bad shards not counted out)."""
        pos = order.rank_positions(j, 0, self.global_batch, self.micro_batch, self.dp_rank, self.dp_size)
        return int((pos < self.num_samples).sum())

    def __len__(self) -> int:
        if self.split != "val":
            raise TypeError("the train split is infinite; len() is defined for split='val' only")
        return self._num_batches

    def __iter__(self):
        if self.split == "val" and not self._resume_pending:  # every pass starts from the beginning
            self._batches = 0
        self._resume_pending = False
        first = self._batches
        plan, stop = self._plan, None
        if self.mixture is not None:
            plan = dataclasses.replace(plan, blend=self.mixture.blend)
            if self.cfg.on_exhausted == "stop":
                steps, stop = self.mixture.stop_step(self._start)
                plan.n_batches = steps * self.accum
        if self.cfg.num_workers == 0:
            it = batches(plan, self._start, first, 1)
        else:
            it = iter(torch.utils.data.DataLoader(
                WorkerStreams(plan, self._start, first), batch_size=None,
                num_workers=self.cfg.num_workers, prefetch_factor=self.cfg.prefetch_factor,
                persistent_workers=False,
                # its own generator: the workers' base seed must not draw from the global RNG, or the
                # training's dropout would depend on num_workers and on when the iterator was made
                generator=torch.Generator().manual_seed(self.seed)))
        for batch, meta in clean_worker_errors(it):
            self._batches = meta["batch"] + 1
            self.epoch = meta["epoch"]
            new = set(meta["bad"]) - self._bad
            if new:
                self._bad |= new
                log.warning("data loader (rank %d, split %s): %d bad shards / %d samples skipped so far",
                            self.dp_rank, self.split, self.skipped_shards, self.skipped_samples)
            yield batch
        if stop is not None:
            self.exhausted = stop

    # -- what was read -----------------------------------------------------------------------------
    def record(self) -> dict:
        """Per source: samples and tokens consumed before `position`, completed epochs (meta.json's `data`)."""
        pos = self.position
        if self.mixture is not None:
            sources = self.mixture.record(pos)
        else:
            n = int(self._counts.sum())
            sources = {"data": {"source": self.cfg.source, "weight": 1.0, "share": 1.0, "samples": pos,
                                "tokens": pos * self.seq_len, "epochs": pos // n, "train_samples": n}}
        return {"position": pos, "seq_len": self.seq_len, "sources": sources}

    def source_epochs(self) -> dict[str, int]:
        """A mixture's completed epochs per source at `position` ({} for one source)."""
        return self.mixture.epochs(self.position) if self.mixture is not None else {}

    # -- checkpointing -----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "split": self.split, "source": self.source.fingerprint,
                "seq_len": self.seq_len, "seed": self.seed, "shuffle": self._plan.shuffle,
                "shuffle_window": self._plan.window, "dp_size": self.dp_size, "num_workers": self.num_workers,
                "micro_batch": self.micro_batch, "global_batch": self.global_batch, "rank": self.dp_rank,
                "start": self._start, "batches": self._batches, "epoch": self.epoch,
                "skipped_shards": self.skipped_shards, "skipped_samples": self.skipped_samples,
                "bad_units": sorted(int(u) for u in self._bad),
                **({"mixture": self.mixture.state(self.position)} if self.mixture is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (call before iterating). Seed, shuffling and data must match the saved
        run. Any rank's state restores any rank. Under another layout (dp_size, micro_batch,
        global_batch) the state must be at an optimizer-step boundary (as the trainer saves it); the
        number of workers never matters."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise LoaderStateError(f"data loader state: not a version-{STATE_VERSION} TokenLoader state (saved by an "
                                   "older setdlm, whose order depended on the layout); start without it to restart "
                                   "the data order")

        def refuse(what, saved, now, hint=""):
            raise LoaderStateError(f"data loader state was saved with {what}={saved!r}, this loader has {what}={now!r}; "
                                   f"resuming would repeat or skip data{hint}")

        if self.mixture is not None:  # names first: a clearer message than the fingerprint's
            self.mixture.check_sources(state.get("mixture"))
        for key, now in (("split", self.split), ("source", self.source.fingerprint), ("seq_len", self.seq_len),
                         ("seed", self.seed), ("shuffle", self._plan.shuffle),
                         ("shuffle_window", self._plan.window)):
            if state.get(key) != now:
                refuse(key, state.get(key), now)
        start, batches = int(state["start"]), int(state["batches"])
        layout = (int(state["global_batch"]), int(state["micro_batch"]), int(state["dp_size"]))
        saved_accum = layout[0] // (layout[1] * layout[2])
        if self.split == "val" and layout[0] != self.global_batch:
            refuse("global_batch", layout[0], self.global_batch)
        if batches % saved_accum == 0:  # a step boundary: continue the global order from its position
            if self.split == "val":  # a pass always starts at position 0
                batches = batches // saved_accum * self.accum
            else:
                start, batches = start + batches // saved_accum * layout[0], 0
        elif layout != (self.global_batch, self.micro_batch, self.dp_size):
            raise LoaderStateError(
                f"data loader state was saved in the middle of an optimizer step (micro-batch {batches} of "
                f"{saved_accum} per step); it can only resume under the same global_batch, micro_batch and "
                f"dp_size ({layout[0]}, {layout[1]}, {layout[2]}), not ({self.global_batch}, "
                f"{self.micro_batch}, {self.dp_size})")
        if self.mixture is not None:
            self.notes = self.mixture.restore(state["mixture"], start + batches // self.accum * self.global_batch,
                                              batches % self.accum == 0, self.cfg.allow_reweight)
        self._start, self._batches = start, batches
        self._resume_pending = True
        self._bad = {int(u) for u in state.get("bad_units", [])}
        self.epoch = int(state.get("epoch", 0))


def build_loader(cfg: DataConfig, *, split: str, tokenizer, micro_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, global_batch: int | None = None,
                 pad_last: bool = False) -> TokenLoader:
    """The loader of `split` ("train" or "val") for data-parallel rank `dp_rank` of `dp_size`; `global_batch`
    (sequences per optimizer step over all ranks) defaults to micro_batch * dp_size. `pad_last` (val):
    cover every sample, the last global batch filled with weight-0 filler rows (see TokenLoader)."""
    cfg.validate()
    check_split(split)
    for name, v, lo in (("micro_batch", micro_batch, 1), ("dp_size", dp_size, 1), ("dp_rank", dp_rank, 0),
                        ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}: must be an integer >= {lo}, got {v!r}")
    if dp_rank >= dp_size:
        raise ValueError(f"dp_rank: {dp_rank} is not below dp_size {dp_size}")
    source = open_source(cfg, tokenizer)
    return TokenLoader(source, cfg, split=split, micro_batch=micro_batch, dp_rank=dp_rank, dp_size=dp_size,
                       seed=seed, global_batch=global_batch, pad_last=pad_last)
