"""Validation of a training run: val/nll (and per-source rows of a mixture) on the EMA weights when there
are any, and the unigram baseline the first validation is compared with. The trainer owns one
`Validation` and calls it at its evaluation steps."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from data_pipeline.mixture import source_configs
from model.noise import VAL
from model.objectives import summarize

from .pipeline import add_metrics


class Validation:
    """Scores the trainer's model on the validation split(s) with its step runner and loaders."""

    def __init__(self, trainer):
        self.t = trainer
        self._val_noted = False

    @torch.no_grad()
    def unigram_nll(self, max_train_batches: int = 32) -> float:
        """Cross-entropy (nats/token) on the evaluated validation batches of a unigram model fitted to
        (up to `max_train_batches` global batches of) the training split with add-1/2 smoothing: the baseline a model
        that uses context must beat."""
        cfg = self.t.cfg
        V = cfg.model.vocab_size

        def count(loader, limit: int) -> torch.Tensor:
            c = torch.zeros(V, dtype=torch.float64)
            for i, batch in enumerate(loader):
                if limit and i >= limit:
                    break
                ids = batch["input_ids"]
                keep = torch.ones_like(ids, dtype=torch.bool)
                if "valid_mask" in batch:  # prompt/answer rows: the answer tokens, which validation scores
                    keep &= batch["valid_mask"] & ~batch.get("context_mask", torch.zeros_like(keep))
                if "pad_row" in batch:  # the filler rows of a padded last val batch are not scored
                    keep &= ~batch["pad_row"][:, None]
                c += torch.bincount(ids[keep], minlength=V)[:V].double()
            if dist.get_world_size(self.t.data_group) > 1:  # one rank per CP group: each row counted once
                dist.all_reduce(c, group=self.t.data_group)
            return c

        accum = cfg.grad_accum(self.t.world)
        train = count(self.t._loader("train"), max_train_batches * accum)
        logp = ((train + 0.5) / (train.sum() + 0.5 * V)).log()
        nll = 0.0
        for _, share, loader in self._val_loaders():  # a mixture: the weighted mean, as val/nll
            val = count(loader, cfg.train.eval_batches * accum)
            nll += share * float(-(val * logp).sum() / val.sum().clamp(min=1))
        return nll

    @torch.no_grad()
    def validate(self) -> dict:
        """val/nll, val/bpt, val/ppl over the rows of the val split it covers (val/rows: all of them
        unless train.eval_batches stops earlier) and val/tokens. The last global batch is padded with
        weight-0 filler rows (the loader's pad_last), so every rank and stage runs full batches. A mixture
        adds val/nll/NAME and val/tokens/NAME per source (each source's val split scored as a one-source
        run scores it) and its totals are the weighted means."""
        parts = self._val_loaders()
        ema = self.t.ema.applied() if self.t.ema is not None else contextlib.nullcontext()
        with ema:  # validate the EMA weights, as they are the ones exported
            self.t.model.eval()
            totals = [self._score(loader) for _, _, loader in parts]
            self.t.model.train()
        self._note_val_rows(sum(int(t.get("rows", 0)) for t in totals), sum(ld.num_samples for _, _, ld in parts),
                            sum(ld.pad_samples for _, _, ld in parts))
        rows = sum(int(t.get("rows", 0)) for t in totals)
        if len(parts) == 1 and parts[0][0] is None:
            total = totals[0]
            s = summarize(total)
            return {"val/nll": s.get("nll"), "val/bpt": s.get("bpt"), "val/ppl": s.get("ppl"),
                    "val/tokens": total.get("nll_tokens", 0.0), "val/rows": rows}
        out, nll = {}, 0.0
        for (name, share, _), total in zip(parts, totals):
            s = summarize(total)
            out[f"val/nll/{name}"], out[f"val/tokens/{name}"] = s.get("nll"), total.get("nll_tokens", 0.0)
            nll = None if nll is None or s.get("nll") is None else nll + share * s["nll"]
        return {"val/nll": nll, "val/bpt": None if nll is None else nll / math.log(2),
                "val/ppl": None if nll is None else math.exp(min(nll, 50.0)),
                "val/tokens": sum(out[f"val/tokens/{n}"] for n, _, _ in parts), "val/rows": rows, **out}

    def _note_val_rows(self, rows: int, n: int, padded: int) -> None:
        """Once per run: which rows val/nll covers."""
        if self._val_noted or not hasattr(self.t, "logger"):
            return
        self._val_noted = True
        self.t.logger.write(f"validation: all {n} rows of the val split" + (
            f", the last batch padded with {padded} weight-0 rows" if padded else "")
            if rows == n else f"validation: {rows} of the {n} rows of the val split (train.eval_batches = "
            f"{self.t.cfg.train.eval_batches} global batches, or bad shards skipped)")

    def _score(self, loader) -> dict:
        """Summed objective metrics (and `rows`: the real rows scored) of (train.eval_batches global
        batches of) a validation loader."""
        limit = self.t.cfg.train.eval_batches * self.t.cfg.grad_accum(self.t.world)  # eval_batches global batches
        acc: dict = {}
        micro = []
        for i, batch in enumerate(loader):
            if limit and i >= limit:
                break
            rows = int((~batch["pad_row"]).sum()) if "pad_row" in batch else len(batch["input_ids"])
            add_metrics(acc, {"rows": rows if self.t.counts_rows else 0})  # CP peers read the same rows
            micro.append(self.t._prepare(batch, VAL, bound=True))
            if len(micro) == 16:  # bounded memory on long validation splits
                add_metrics(acc, self.t.stepper.eval_step(micro))
                micro = []
        add_metrics(acc, self.t.stepper.eval_step(micro))
        return self.t.stepper.reduce(acc)

    def _val_loaders(self) -> list[tuple[str | None, float, object]]:
        """(name, share, val loader with pad_last): one source (name None), or each source of a mixture."""
        if not self.t.cfg.data.mixture:
            return [(None, 1.0, self.t._loader("val", pad_last=True))]
        return [(name, share, self.t._loader("val", one, pad_last=True)) for name, share, one in source_configs(self.t.cfg.data)]

