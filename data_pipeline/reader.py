"""Reading micro-batches at global positions: what loader.py's `TokenLoader` runs, in its process or
in each DataLoader worker.

A `Plan` (picklable) says what to read; `batches(plan, start, first, stride)` yields this rank's
micro-batches ``first, first + stride, ...`` of the global order from position `start`
(`order.rank_positions`). A `Reader` maps positions to (unit, row) through the split's order, or, for
a mixture's train split, through the schedule (blend.py) and each source's own order, and keeps the
units of the latest windows in memory; bad units are skipped and counted under ``skip_bad_shards``.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from common.log import get_logger

from . import order
from .sources import ShardError

log = get_logger("data")


@dataclass
class Plan:
    """Everything a reader needs (picklable, sent to worker processes)."""
    source: object
    split: str
    micro_batch: int
    global_batch: int
    dp_rank: int
    dp_size: int
    n_workers: int  # >= 1 (0 workers means one reader in the main process)
    seed: int
    shuffle: bool
    window: int
    skip_bad: bool
    with_ids: bool
    n_batches: int | None  # val: batches per rank in one pass; train: None (infinite) or where a mixture stops
    blend: object = None  # a mixture's train split: its schedule (blend.Blend); None: one source
    pad_from: int | None = None  # val with pad_last: positions from here on are filler rows


@dataclass
class Stats:
    shards: int = 0
    samples: int = 0
    names: list = field(default_factory=list)


class Reader:
    """Reads rows at global positions, keeping the units of the latest windows in memory."""

    def __init__(self, plan: Plan, stats: Stats):
        self.plan, self.stats = plan, stats
        counts = plan.source.counts(plan.split)
        self.counts, self.first = counts, plan.source.first_ids(plan.split)
        # one order per stream: the split, or (a mixture's train split) each source's units, read through plan.blend
        parts = plan.source.parts(plan.split) if plan.blend is not None else [(0, counts)]
        self.orders = [(offset, order.GlobalOrder(c, plan.seed, plan.shuffle, plan.window)) for offset, c in parts]
        self.cache: OrderedDict = OrderedDict()  # unit -> rows (None: bad unit)
        self.bad: set = set()
        self._step = None  # (step, its positions of this rank, what `locate` says of them)

    def locate(self, positions: np.ndarray):
        """(epoch in its source, unit, row in unit, source) of each global position."""
        if self.plan.blend is None:
            epochs, _, units, rows = self.orders[0][1].locate(positions)
            return epochs, units, rows, np.zeros_like(positions)
        sources, index = self.plan.blend.locate(positions)
        epochs, units, rows = (np.empty_like(positions) for _ in range(3))
        for s, (offset, o) in enumerate(self.orders):
            sel = sources == s
            if sel.any():
                epochs[sel], _, units[sel], rows[sel] = o.locate(index[sel])
                units[sel] += offset
        return epochs, units, rows, sources

    def _unit(self, u: int):
        if u in self.cache:
            self.cache.move_to_end(u)
            return self.cache[u]
        rows = None
        if u not in self.bad:
            try:
                rows = self.plan.source.read_unit(self.plan.split, u)
                if len(rows) != int(self.counts[u]):
                    raise ShardError(f"{self.plan.source.unit_name(self.plan.split, u)}: holds {len(rows)} samples, "
                                     f"the manifest says {int(self.counts[u])}")
            except ShardError as e:
                if not self.plan.skip_bad:
                    raise
                self.bad.add(u)
                self.stats.shards += 1
                self.stats.samples += int(self.counts[u])
                self.stats.names.append(self.plan.source.unit_name(self.plan.split, u))
                log.warning("skipping bad shard (data.skip_bad_shards=true; %d shards, %d samples skipped so far "
                            "by this reader): %s", self.stats.shards, self.stats.samples, e)
                rows = None
        self.cache[u] = rows
        while len(self.cache) > (2 * self.plan.window + 2) * len(self.orders):  # the latest windows of each stream
            self.cache.popitem(last=False)
        return rows

    def any_good(self) -> bool:
        """Whether some unit of the split is readable (reads units until one is: all bad means all read)."""
        return any(u not in self.bad and self._unit(u) is not None for u in range(len(self.counts)))

    def locate_step(self, start: int, j: int):
        """`locate` for micro-batch `j` (from `start`), found once for the rank's whole step slice: the
        per-call cost of the arithmetic is paid once per optimizer step, not once per micro-batch."""
        p = self.plan
        step, m = divmod(j, p.global_batch // (p.micro_batch * p.dp_size))
        if self._step is None or self._step[0] != step:
            first = int(order.rank_positions(j - m, start, p.global_batch, p.micro_batch, p.dp_rank, p.dp_size)[0])
            span = np.arange(first, first + p.global_batch // p.dp_size, dtype=np.int64)
            self._step = (step, span, self.locate(span))
        _, span, located = self._step
        cut = slice(m * p.micro_batch, (m + 1) * p.micro_batch)
        return span[cut], tuple(a[cut] for a in located)

    def batch(self, start: int, j: int):
        """(rows, and for each: position, sample id, epoch, source) of the readable samples of micro-batch
        `j`; then the epochs of all of them."""
        positions, (epochs, units, rows_in, sources) = self.locate_step(start, j)
        keep, rows = [], []
        for i, (u, r) in enumerate(zip(units.tolist(), rows_in.tolist())):
            data = self._unit(u)
            if data is not None:
                keep.append(i)
                rows.append(data[r])
        keep = np.array(keep, dtype=np.int64)
        return rows, positions[keep], (self.first[units] + rows_in)[keep], epochs[keep], sources[keep], epochs


def batches(plan: Plan, start: int, first: int, stride: int):
    """Micro-batches (tensors, meta) of this rank: batches first, first + stride, ... (from `start`)."""
    stats = Stats()
    reader = Reader(plan, stats)
    j = first
    while plan.n_batches is None or j < plan.n_batches:
        rows, pos, ids, epochs, sources, wanted_epochs = reader.batch(start, j)
        if not rows and not reader.any_good():
            raise ShardError(f"data.skip_bad_shards: every shard of the {plan.split} split of {plan.source.description} "
                             f"is bad ({len(reader.bad)} skipped, e.g. {stats.names[0] if stats.names else '?'}); "
                             "nothing is left to read: prepare the data again")
        tokens = np.stack(rows) if rows else np.zeros((0, plan.source.seq_len))  # all in bad shards: empty
        if tokens.ndim == 3:  # prompt/answer shards: (ids, context mask, valid mask) per row
            batch = {"input_ids": torch.from_numpy(tokens[:, 0].astype(np.int64)),
                     "context_mask": torch.from_numpy(tokens[:, 1] != 0),
                     "valid_mask": torch.from_numpy(tokens[:, 2] != 0)}
        else:
            batch = {"input_ids": torch.from_numpy(tokens.astype(np.int64))}
        batch["sample_index"] = torch.from_numpy(pos.copy())
        if plan.pad_from is not None:  # the filler rows of a padded last validation batch
            pad = pos >= plan.pad_from
            batch["pad_row"] = torch.from_numpy(pad)
            epochs = np.where(pad, 0, epochs)
        if plan.with_ids:
            batch["sample_id"] = torch.from_numpy(ids.astype(np.int64))
            batch["epoch"] = torch.from_numpy(epochs.astype(np.int64))
            if plan.blend is not None:
                batch["source"] = torch.from_numpy(sources.astype(np.int64))  # index in data.mixture
        epoch = int(epochs.max()) if len(epochs) else int(wanted_epochs.max())
        yield batch, {"batch": j, "epoch": epoch, "bad": sorted(reader.bad)}
        j += stride


def fill_rows(batch: dict, rows: int) -> dict:
    """`batch` with filler rows appended up to `rows` (a micro-batch shortened by skipped bad shards, empty
    if all its samples were bad), marked in ``pad_row`` as a padded validation batch's filler rows are:
    the objectives give them weight 0 in the loss, the NLL and the token counts (model/objectives/base.py).
    So every micro-batch keeps its shape on every data-parallel rank and pipeline stage (megatron's
    schedule sends activations of one shape; each rank runs the same forwards and collectives) while
    the step's totals are those of its real rows. A full batch is returned as it is."""
    n = len(batch["input_ids"])
    if n >= rows:
        return batch
    pad = batch.get("pad_row", torch.zeros(n, dtype=torch.bool))
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v) and v.dim() and len(v) == n and k != "pad_row":
            # a filler row is all valid and all context (as pad_row makes it): nothing predicted, and no
            # row of attention without a key to attend to
            fill = torch.ones if v.dtype == torch.bool else torch.zeros
            v = torch.cat((v, fill((rows - n, *v.shape[1:]), dtype=v.dtype)))
        out[k] = v
    out["pad_row"] = torch.cat((pad, torch.ones(rows - n, dtype=torch.bool)))
    return out


class WorkerStreams(torch.utils.data.IterableDataset):
    """DataLoader dataset: DataLoader worker i builds the rank's batches first + i, first + i + n, ..."""

    def __init__(self, plan: Plan, start: int, first: int):
        self.plan, self.start, self.first = plan, start, first

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        i = 0 if info is None else info.id
        return batches(self.plan, self.start, self.first + i, self.plan.n_workers)


def clean_worker_errors(it):
    """Re-raise a worker's ShardError with its own message (not torch's traceback dump)."""
    try:
        yield from it
    except ShardError as e:
        msg = str(e)
        if "Original Traceback" in msg:
            msg = msg.rstrip().splitlines()[-1].split("ShardError: ", 1)[-1]
        raise ShardError(msg) from None
