"""likelihood: NLL, bits per token and perplexity (bound) of a checkpoint on held-out data.

Per objective, exactly what training validation computes (`Trainer.validate`; both draw with
`prepare(bound=True)`): SW-SetDLM the order-sampled bound (one generation order per sequence from the
sliding-window schedule), MDLM and BD3-LM an unbiased estimate of the continuous-time NELBO (its exact
discrete form, see model/objectives/mdlm.py), normalised by the tokens, AR the exact NLL. The data, batches and
randomness follow the training validation: order 0 of a val-split sample draws its orders / noise
from (seed, its global position in the val order) as the trainer does (model/noise.py), so with the
recipe's seed, global batch and number of batches (`--match-training`) the value equals `val/nll` in
the run's metrics.jsonl -- whatever the layout of the run or the number of evaluation ranks. Every
row of the val split is scored (up to `--max-batches`): as in training validation, the last global
batch is filled with weight-0 filler rows, and `sequences` counts the real rows. `--text`
batches draw from the generator seeded `seed + 7919`, replayed over the batches a rank skips. `--orders K` adds K-1 orders per
sequence, each from its own seeded generator; the reported bound is their mean (and, for SetDLM,
the tighter importance-weighted bound -log mean_k p(x | order_k)).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch

from common.schema import Field, PathText
from model import families

from ..errors import EvalError, OptionError
from ..options import RunOptions, eval_options
from ..scoring import autocast, text_rows
from ..units import Unit, seed_for
from .base import Task


@eval_options("setdlm eval likelihood")
class LikelihoodOptions(RunOptions):
    option_group = "likelihood"

    seed: int | None = Field(None, description="base seed (default: the recipe's run.seed, as training validation)")
    data: str | None = Field(None, description=("held-out data: a prepared shard directory or builtin:NAME (default: the "
                                                "checkpoint's data.source); its val split is used"))
    text: PathText | None = Field(None, description=("held-out text instead: .txt (documents separated by blank lines) "
                                                     "or .jsonl (field 'text'), tokenized and packed as in training"))
    batch_size: int | None = Field(None, ge=1, description="sequences per batch (default: the recipe's train.micro_batch)")
    max_batches: int = Field(0, ge=0, description=(
        "batches per virtual rank (0: all; the recipe's train.eval_batches reproduces training)"))
    orders: int = Field(1, ge=1, description="orders (SetDLM) / noise draws (MDLM, BD3-LM) per sequence")
    dp: int = Field(1, ge=1, description="reproduce the validation of a run with this many data-parallel ranks")
    precision: Literal["auto", "fp32", "bf16"] | None = Field(None, description="default: the recipe's train.precision")
    match_training: bool = Field(False, description=(
        "exactly the run's validation: its micro-batch, train.eval_batches and data-parallel size"))

    def __post_init__(self):
        if self.match_training and (self.text or self.data or self.batch_size or self.max_batches or self.dp != 1):
            raise OptionError("--match-training: sets the data, --batch-size, --max-batches and --dp from the run; "
                              "do not give them too")
        if self.text and self.data:
            raise OptionError("--data and --text: give one")
        if self.text and self.dp != 1:
            raise OptionError("--dp: only with shard/builtin data (--text has no training layout to reproduce)")


class LikelihoodTask(Task):
    name = "likelihood"
    help = "NLL / bits per token / perplexity bound on held-out shards or text"
    headline = ("nll", "bpt", "ppl", "tokens", "sequences")
    options = LikelihoodOptions

    def __init__(self, args, shard, predictor=None):
        super().__init__(args, shard, predictor)
        cfg = self.ckpt.cfg
        self.cfg = cfg
        self.seed = cfg.run.seed if args.seed is None else args.seed
        self.batch_size, self.max_batches, self.dp = args.batch_size or cfg.train.micro_batch, args.max_batches, args.dp
        if args.match_training:
            self.batch_size = cfg.train.micro_batch
            self.dp = int((self.ckpt.meta.get("layout") or {}).get("dp", 1))
            # train.eval_batches counts global batches; the run's validation set does not depend on its layout
            self.max_batches = cfg.train.eval_batches * cfg.train.global_batch // (self.batch_size * self.dp)
        self.global_batch = cfg.train.global_batch if args.match_training else None
        self.precision = args.precision or cfg.train.precision
        self.data_cfg = self._data_cfg()
        self._stream = None
        self._objectives: dict = {}

    # -- data --------------------------------------------------------------------------------
    def _data_cfg(self):
        d = dataclasses.replace(self.cfg.data, num_workers=0, with_sample_ids=True)
        if self.args.data:
            d.mixture, d.source = [], self.args.data  # one source in place of the run's (or its mixture)
        if not d.is_builtin and not d.mixture and not self.args.text:  # a mixture: every source's val split
            from data_pipeline.shards import read_manifest, tokenizer_mismatch

            try:
                m = read_manifest(d.source)
            except ValueError as e:
                raise EvalError(f"--data: {e}") from None
            tok = self.ckpt.tokenizer
            why = tokenizer_mismatch(m, tok, d.source, name=self.ckpt.meta.get("tokenizer") or tok.name)
            if why:
                raise EvalError(f"--data: tokenizer mismatch: the checkpoint {self.ckpt.path}'s tokenizer {why}; "
                                "evaluate on data tokenized with the checkpoint's tokenizer")
            d.seq_len, d.packing = int(m["seq_len"]), m["packing"]
        if d.seq_len > self.cfg.model.max_seq_len:
            raise EvalError(f"--data: sequences of {d.seq_len} tokens exceed the model's max_seq_len "
                            f"{self.cfg.model.max_seq_len}")
        return d

    def _loader(self, k: int):
        from data_pipeline.loader import build_loader

        try:
            return build_loader(self.data_cfg, split="val", tokenizer=self.ckpt.tokenizer, micro_batch=self.batch_size,
                                dp_rank=k, dp_size=self.dp, seed=self.seed, global_batch=self.global_batch,
                                pad_last=True)
        except ValueError as e:
            raise EvalError(f"--data: {e}") from None

    def _text_batches(self) -> list[dict]:
        from ..data import load_texts

        tok = self.ckpt.tokenizer
        docs = load_texts(self.args.text)
        rows = text_rows(tok.encode_batch(docs), tok, self.data_cfg.packing, self.data_cfg.seq_len)
        n = len(rows["input_ids"])
        if n == 0:
            raise EvalError(f"--text: {self.args.text} gives no tokens")
        batches = []
        for i in range(0, n, self.batch_size):
            b = {k: v[i:i + self.batch_size] for k, v in rows.items() if k != "valid_mask"}
            v = rows["valid_mask"][i:i + self.batch_size]
            if not bool(v.all()):
                b["valid_mask"] = v
            batches.append(b)
        if self.max_batches:
            batches = batches[: self.max_batches]
        return batches

    def _layout(self) -> list[tuple[int, int, int]]:
        """(virtual rank k, batch j, rows) of every batch."""
        if self.args.text:
            self._texts = self._text_batches()
            return [(0, j, len(b["input_ids"])) for j, b in enumerate(self._texts)]
        out = []
        for k in range(self.dp):
            loader = self._loader(k)
            n = len(loader)
            if self.max_batches:
                n = min(n, self.max_batches)
            rows = [loader.batch_rows(j) for j in range(n)]  # the last batch: its real rows (the rest is filler)
            out += [(k, j, r) for j, r in enumerate(rows) if r]
        return out

    def spec(self) -> dict:
        s = super().spec()
        d = self.data_cfg
        s.update(objective=self.cfg.objective.name, data=self.args.text or d.source, data_kind="text" if self.args.text else "val split",
                 seq_len=d.seq_len, packing=d.packing, batch_size=self.batch_size, max_batches=self.max_batches,
                 orders=self.args.orders, dp=self.dp, precision=self.precision,
                 objective_config=dataclasses.asdict(self.cfg.objective), estimator=self.cfg.objective.family.estimator)
        return s

    def units(self) -> list[Unit]:
        return [Unit(i, [f"{k}/{j}/{r}" for r in range(rows)], (k, j))
                for i, (k, j, rows) in enumerate(self._layout())]

    # -- compute -----------------------------------------------------------------------------
    def objective(self, seq_len: int):
        if seq_len not in self._objectives:
            from model.objectives import build_objective

            self._objectives[seq_len] = build_objective(self.cfg.objective, self.cfg.model, seq_len)
        return self._objectives[seq_len]

    def _batch(self, k: int, j: int, device) -> tuple[dict, torch.Generator]:
        """Batch (k, j) on `device` and the order-0 generator positioned for it (replaying skipped batches)."""
        st = self._stream
        if st is None or st["k"] != k or st["j"] > j:
            gen = torch.Generator(device=device).manual_seed(self.seed + 7919 * (k + 1))
            it = iter(self._texts) if self.args.text else iter(self._loader(k))
            st = self._stream = {"k": k, "j": 0, "it": it, "gen": gen}
        while True:
            batch = next(st["it"])
            batch = {key: v.to(device) if torch.is_tensor(v) else v for key, v in batch.items()}
            jj = st["j"]
            st["j"] += 1
            if jj == j:
                if "sample_index" in batch:  # val split: per-sample draws keyed as in Trainer.validate
                    from model.noise import VAL, SampleNoise

                    g = self.global_batch or self.batch_size * self.dp
                    return batch, SampleNoise(self.seed, batch["sample_index"], g, VAL)
                return batch, st["gen"]
            if "sample_index" in batch:
                continue
            self.objective(batch["input_ids"].shape[1]).prepare(batch, st["gen"], bound=True)  # replay the draws

    @torch.no_grad()
    def run_unit(self, unit: Unit) -> list[dict]:
        from model.layers import vocab_cross_entropy

        model = self.ckpt.model
        device = next(model.parameters()).device
        k, j = unit.payload
        batch, gen0 = self._batch(k, j, device)
        obj = self.objective(batch["input_ids"].shape[1])
        x, valid, context = obj._batch_masks(batch)
        per_order, batch_nll, batch_tokens = [], [], None
        for o in range(self.args.orders):
            gen = gen0 if o == 0 else torch.Generator(device=device).manual_seed(seed_for(self.seed, "order", k, j, o))
            inputs = obj.prepare(batch, gen, bound=True)
            with autocast(self.precision, device):
                logits = model(inputs.input_ids, inputs.position_ids, inputs.attn_mask, logits_slice=inputs.logits_slice)
            # per-sequence CE first, on a copy: megatron's vocab-parallel CE works in place on its input
            ce = vocab_cross_entropy(logits.float().clone(), inputs.targets)
            per_order.append((ce * inputs.nll_weight).sum(-1).double().cpu().tolist())
            _, m = obj.loss(logits, inputs)  # the batch sums exactly as Trainer.validate computes them
            batch_nll.append(float(m["nll_sum"]))
            if o == 0:
                batch_tokens = float(m["nll_tokens"])
            if o == 0:
                if obj.family.bound_masks_subset:
                    row_tokens = (valid & ~context).sum(-1)
                else:
                    row_tokens = (inputs.nll_weight > 0).sum(-1)
                row_tokens = row_tokens.cpu().tolist()
        sid = batch.get("sample_id")
        recs = []
        for r, key in enumerate(unit.keys):
            recs.append({"key": key, "virtual_rank": k, "batch": j, "row": r,
                         "sample_id": int(sid[r]) if sid is not None else None, "tokens": int(row_tokens[r]),
                         "nll": [per_order[o][r] for o in range(self.args.orders)],
                         "batch_nll": batch_nll, "batch_tokens": batch_tokens})
        return recs

    # -- metrics -----------------------------------------------------------------------------
    @staticmethod
    def aggregate(records, spec, out=None) -> dict:
        from model.objectives import summarize

        K = int(spec.get("orders", 1))
        firsts, seen = [], set()
        for r in records:  # one per batch, in unit (= training) order
            b = (r["virtual_rank"], r["batch"])
            if b not in seen:
                seen.add(b)
                firsts.append(r)
        totals = [0.0] * K
        tokens = 0.0
        for r in firsts:  # the trainer's accumulation: python floats, batch by batch
            for o in range(K):
                totals[o] = totals[o] + r["batch_nll"][o]
            tokens = tokens + r["batch_tokens"]
        s = summarize({"nll_sum": sum(totals) / K, "nll_tokens": tokens})
        m = {"nll": s.get("nll"), "bpt": s.get("bpt"), "ppl": s.get("ppl"), "tokens": int(tokens),
             "sequences": len(records), "batches": len(firsts), "orders": K, "objective": spec.get("objective"),
             "bound": families.get(spec["objective"]).bound if spec.get("objective") in families.names() else ""}
        if K > 1:
            per = [t / tokens for t in totals]
            m["nll_per_order"] = per
            mu = sum(per) / K
            m["nll_std_over_orders"] = math.sqrt(sum((p - mu) ** 2 for p in per) / (K - 1))
            if spec.get("objective") in families.names() and families.get(spec["objective"]).order_mixture:
                iw = 0.0
                for r in records:  # -log mean_k exp(-nll_k), per sequence
                    a = [-v for v in r["nll"]]
                    mx = max(a)
                    iw += -(mx + math.log(sum(math.exp(v - mx) for v in a) / K))
                m["nll_iw"] = iw / tokens
                m["ppl_iw"] = math.exp(min(m["nll_iw"], 50.0))
        return m
