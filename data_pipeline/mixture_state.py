"""A mixture loader's schedule over a run: per-source consumption, its record, resume and running out.

`MixtureSchedule` holds the current `blend.Blend` of a mixture's train split. From a global position
(at an optimizer-step boundary) it knows, by arithmetic, how many samples of each source were consumed
before it, their tokens and each source's completed epochs (`record`); what a checkpoint keeps of it
(`state`, inside the loader state) and how a resumed loader continues (`restore`): the same schedule,
or, for other weights (`data.allow_reweight`) or another global batch, a new one starting at the
resume position with the counts consumed so far. `stop_step` finds where `data.on_exhausted: stop`
ends the run: before the first step that would read a source past its train split.
"""
from __future__ import annotations

from common.schema import ConfigError

from .blend import Blend


class MixtureSchedule:
    def __init__(self, source, global_batch: int, seq_len: int):
        self.source, self.seq_len = source, seq_len
        self.names = list(source.names)
        self.sizes = [int(c.sum()) for _, c in source.parts("train")]  # train samples of each source
        self.blend = Blend(source.weights, global_batch)

    def consumed(self, position: int) -> list[int]:
        return [int(c) for c in self.blend.counts_at(position)]

    def epochs(self, position: int) -> dict[str, int]:
        """Completed passes over each source's train split before `position`."""
        return {n: c // size for n, c, size in zip(self.names, self.consumed(position), self.sizes)}

    def record(self, position: int) -> dict:
        """What a checkpoint records of the data read before `position` (meta.json's `data`)."""
        out = {}
        for i, (n, c) in enumerate(zip(self.names, self.consumed(position))):
            out[n] = {"source": self.source.dirs[i], "weight": self.source.raw_weights[i],
                      "share": self.source.shares[i], "samples": c, "tokens": c * self.seq_len,
                      "epochs": c // self.sizes[i], "train_samples": self.sizes[i]}
        return out

    def state(self, position: int) -> dict:
        b = self.blend
        return {"names": self.names, "weights": [int(m) for m in b.m], "raw_weights": self.source.raw_weights,
                "global_batch": b.G, "start": b.start, "start_counts": [int(c) for c in b.start_counts],
                "consumed": dict(zip(self.names, self.consumed(position)))}

    def check_sources(self, saved) -> None:
        """Refuse a loader state of other sources (by name), before anything else is compared."""
        was = saved.get("names") if isinstance(saved, dict) else None
        if was != self.names:
            was = f"the sources {was}" if was else "one source (data.source)"
            raise ConfigError(f"data.mixture: the checkpoint's loader read {was}, this recipe names {self.names}; "
                              "resuming would repeat or skip data (use a new run.name for another mixture)")

    def restore(self, saved: dict, position: int, at_boundary: bool, allow_reweight: bool) -> list[str]:
        """Continue the saved schedule from `position`; returns notes (a new schedule started)."""
        self.check_sources(saved)
        old = Blend(saved["weights"], saved["global_batch"], saved["start"], saved["start_counts"])
        now = self.blend
        if list(old.m) == list(now.m) and old.G == now.G:
            self.blend = old
            return []
        reweight = list(old.m) != list(now.m)
        if reweight and not allow_reweight:
            i = next(i for i, (a, b) in enumerate(zip(old.m / old.D, now.m / now.D)) if a != b)
            was = saved.get("raw_weights", saved["weights"])[i]
            raise ConfigError(
                f"data.mixture[{i}].weight: {self.source.raw_weights[i]} ({self.names[i]}: share {now.m[i] / now.D:.4g}), "
                f"the checkpoint trained with {was} (share {old.m[i] / old.D:.4g}); set data.allow_reweight=true to start "
                "the new weights at the resume step, or restore the checkpoint's weights")
        if not at_boundary:
            raise ConfigError("data.mixture: the loader state was saved in the middle of an optimizer step; it resumes "
                              "only with the checkpoint's weights and global batch")
        counts = old.counts_at(position)
        self.blend = Blend(list(now.m), now.G, position, counts)
        what = "weights" if reweight else f"global batch {old.G} -> {now.G}"
        return [f"data.mixture: new schedule ({what}) from global position {position}, after "
                + ", ".join(f"{n} {int(c)}" for n, c in zip(self.names, counts)) + " samples"]

    def stop_step(self, position: int) -> tuple[int, str]:
        """(steps from `position` the run can still take without rereading a source, that source's name)."""
        b = self.blend
        k0 = (position - b.start) // b.G
        k, i = b.first_batch_exceeding(self.sizes, from_batch=k0)
        return k - k0, self.names[i]
