"""throughput: decoding speed at batch 1 (and larger batches), and a speed-quality sweep.

For every setting (the command line's, plus one per value of each ``--sweep name=v1,v2,..``) and
every batch size in ``--batch-sizes``, the prompts are decoded in batches after ``--warmup``
untimed decodes (per setting and batch size, per rank). Per example: tokens/s = new tokens / the
seconds from the start of `generate` until that sequence finished (prefill included), latency
(those seconds), decoding steps and tokens per step. Per batch: new tokens / wall time of the batch.
Quality of each setting: generative perplexity of the outputs under ``--scorer`` when given, and
their unigram entropy. The merge writes a table and ``frontier.png`` (tokens/s at the smallest batch
size against quality, one point per setting). Timings are only comparable between runs on the same
hardware; run one rank per GPU.

The adaptive SW-SetDLM window against fixed ones on the same checkpoint (tokens/step, tokens/s and the
quality proxy side by side, one frontier point each):

    setdlm eval throughput --checkpoint RUN --out OUT --threshold 0.9 \
        --sweep window=2,4,8 --sweep adaptive_window=true
"""

from __future__ import annotations

import dataclasses

from common.schema import ConfigError, Field, PathText, TextList, like

from ..errors import EvalError
from ..metrics import mean, percentile, unigram_entropy
from ..models import ModelPredictor
from ..options import GenerationOptions, eval_options
from ..overlong import overlong_metrics
from ..scoring import Scorer
from ..units import Unit
from .base import GenerationTask


def parse_value(v: str):
    if v.lower() in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    if v.lower() in ("true", "false"):
        return v.lower() == "true"
    return v


@eval_options("setdlm eval throughput")
class ThroughputOptions(GenerationOptions):
    option_group = "throughput"

    prompts: PathText | None = Field(None, description=("prompts (.txt one per line, or .jsonl prompt/question/text); "
                                                        "default: the first --prompt-tokens tokens of val sequences"))
    prompt_tokens: int = Field(0, ge=0, description="prompt length taken from val sequences (0: unconditional)")
    num_examples: int = Field(16, ge=1, description="prompts per setting and batch size")
    warmup: int = Field(2, ge=0, description="untimed decodes before timing")
    batch_sizes: str = Field("1", description="comma-separated batch sizes")
    sweep: TextList = Field((), json_schema_extra={"metavar": "NAME=V1,V2,.."}, description=(
        "also run these values of one sampling option (repeatable), e.g. threshold=0.5,0.7,0.9,1.0"))
    scorer: str | None = Field(None, description="quality: generative perplexity under this model (setdlm checkpoint or hf:NAME)")
    no_eos_stop: bool = Field(False, description="always decode --max-new-tokens (ignore EOS)")
    compile: bool = Field(False, description=("compiled decode step (SamplingConfig.compile: torch.compile, CUDA graphs on "
                                              "a GPU); --sweep compile=false,true compares it with eager"))
    max_new_tokens: int = like(GenerationOptions, "max_new_tokens", 256)


class ThroughputTask(GenerationTask):
    name = "throughput"
    help = "tokens/s at batch 1 (prefill included, after warm-up), latency, tokens/step; sweeps and frontier plot"
    headline = ("tokens_per_s", "latency_s", "tokens_per_step")
    options = ThroughputOptions

    def __init__(self, args, shard, predictor=None):
        super().__init__(args, shard, predictor)
        try:
            self.batch_sizes = sorted({int(b) for b in str(args.batch_sizes).split(",") if b.strip()})
        except ValueError:
            raise EvalError(f"--batch-sizes: comma-separated integers, got {args.batch_sizes!r}") from None
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise EvalError(f"--batch-sizes: need integers >= 1, got {args.batch_sizes!r}")
        self.settings = [("base", {})]
        self.base_values: dict = {}
        fields = {f.name for f in dataclasses.fields(self.sampling)} if self.sampling else set()
        for sw in args.sweep:
            if "=" not in sw:
                raise EvalError(f"--sweep: expected NAME=V1,V2,.., got {sw!r}")
            name, vals = sw.split("=", 1)
            name = name.strip().replace("-", "_")
            if self.sampling is not None and name not in fields:
                raise EvalError(f"--sweep: {name!r} is not a sampling option; valid: {', '.join(sorted(fields))}")
            if self.sampling is not None:
                self.base_values[name] = getattr(self.sampling, name)
            for v in vals.split(","):
                val = parse_value(v.strip())
                self.settings.append((f"{name}={val}", {name: val}))
        self._predictors: dict = {}
        for label, ov in self.settings:
            if self.sampling is not None:
                try:
                    sc = dataclasses.replace(self.sampling, **ov)
                except ConfigError as e:  # name the sweep setting too
                    raise EvalError(f"--sweep {label}: {e}") from None
                self._predictors[label] = ModelPredictor(self.ckpt, sc)
            else:
                self._predictors[label] = self.predictor
        self.scorer = Scorer(args.scorer, self.ckpt.device) if args.scorer else None
        self._warm: set = set()
        self._texts = None
        if args.prompts:  # --overlong on the prompt file (val prompts of --prompt-tokens fit: check_fits)
            from ..data import load_prompts

            texts = load_prompts(args.prompts)
            if not texts:
                raise EvalError(f"--prompts: {args.prompts} holds no prompts")
            ids = [self.tokenizer.encode(t) for t in texts]
            kept = self.fit(list(range(len(ids))), [len(p) + args.max_new_tokens for p in ids],
                            what="prompts (+ --max-new-tokens)", option="--prompts", key=lambda i: f"prompt {i + 1}")
            self._texts = [ids[i] for i in kept]

    def sampling_extra(self) -> dict:
        return {"stop_on_eos": not self.args.no_eos_stop, "compile": self.args.compile}

    def prompt_room(self) -> int:
        return 0 if not self.args.prompts and self.args.prompt_tokens == 0 else max(1, self.args.prompt_tokens)

    def prompts(self) -> list[list[int]]:
        n, tok = self.args.num_examples, self.tokenizer
        if self._texts is not None:
            return [list(self._texts[i % len(self._texts)]) for i in range(n)]
        if self.args.prompt_tokens == 0:
            return [[] for _ in range(n)]
        from data_pipeline.loader import build_loader

        dcfg = dataclasses.replace(self.ckpt.cfg.data, num_workers=0)
        loader = build_loader(dcfg, split="val", tokenizer=tok, micro_batch=1, seed=self.ckpt.cfg.run.seed)
        out = []
        for b in loader:
            out.append(b["input_ids"][0, : self.args.prompt_tokens].tolist())
            if len(out) == n:
                break
        return [out[i % len(out)] for i in range(n)]

    def spec(self) -> dict:
        s = super().spec()
        s.update(prompts=self.args.prompts, prompt_tokens=self.args.prompt_tokens, num_examples=self.args.num_examples,
                 warmup=self.args.warmup, batch_sizes=self.batch_sizes, settings=[[l, o] for l, o in self.settings],
                 base_values=self.base_values,
                 scorer=self.scorer.describe() if self.scorer else None)
        return s

    def units(self) -> list[Unit]:
        prompts = self.prompts()
        units = []
        for label, _ in self.settings:
            for bs in self.batch_sizes:
                for i in range(0, len(prompts), bs):
                    idx = list(range(i, min(len(prompts), i + bs)))
                    units.append(Unit(len(units), [f"{label}|b{bs}|{j}" for j in idx],
                                      (label, bs, [(j, prompts[j]) for j in idx])))
        return units

    def run_unit(self, unit: Unit) -> list[dict]:
        label, bs, items = unit.payload
        pred = self._predictors[label]
        ps = [p for _, p in items]
        if (label, bs) not in self._warm:
            for w in range(self.args.warmup):
                pred.complete(ps, seed=w, max_batch=bs)
            self._warm.add((label, bs))
        outs = pred.complete(ps, self.unit_seed(unit), max_batch=bs)
        recs = []
        for key, (j, p), o in zip(unit.keys, items, outs):
            r = {"key": key, "setting": label, "batch_size": bs, "prompt_index": j,
                 "entropy": unigram_entropy(o["tokens"]), **{k: v for k, v in o.items() if k not in ("text", "tokens")},
                 "text": o["text"]}
            if self.scorer is not None:
                r["gen_nll"], r["gen_scored_tokens"] = self.scorer.nll(o["text"] or "", seed=j)
            recs.append(r)
        return recs

    @staticmethod
    def aggregate(records, spec, out=None) -> dict:
        import math

        rows = []
        labels = [l for l, _ in spec.get("settings", [["base", {}]])]
        for label in labels:
            for bs in spec.get("batch_sizes", [1]):
                rs = [r for r in records if r["setting"] == label and r["batch_size"] == bs]
                if not rs:
                    continue
                batches, seen = [], set()
                for r in rs:
                    if r["unit"] not in seen:
                        seen.add(r["unit"])
                        batches.append(r["batch_seconds"])
                toks = sum(r["n_tokens"] for r in rs)
                steps = sum(r["steps"] for r in rs)
                row = {"setting": label, "batch_size": bs, "n": len(rs),
                       "tokens_per_s": mean([r["n_tokens"] / r["seconds"] for r in rs if r["seconds"] > 0]),
                       "batch_tokens_per_s": toks / sum(batches) if sum(batches) > 0 else None,
                       "latency_s": mean([r["seconds"] for r in rs]), "latency_p50_s": percentile([r["seconds"] for r in rs], 0.5),
                       "latency_p90_s": percentile([r["seconds"] for r in rs], 0.9),
                       "tokens_per_step": toks / steps if steps else None, "new_tokens": mean([r["n_tokens"] for r in rs]),
                       "entropy": mean([r["entropy"] for r in rs])}
                if "gen_nll" in rs[0]:
                    n = sum(r["gen_scored_tokens"] for r in rs)
                    row["gen_ppl"] = math.exp(min(sum(r["gen_nll"] for r in rs) / n, 50.0)) if n else None
                rows.append(row)
        m = {"rows": rows, **overlong_metrics(records, spec)}
        base = next((r for r in rows if r["setting"] == "base" and r["batch_size"] == min(spec.get("batch_sizes", [1]))), None)
        if base:
            m.update({k: base[k] for k in ("tokens_per_s", "latency_s", "tokens_per_step", "batch_size")})
        if out is not None and len(labels) > 1:
            from ..report import frontier_plot

            bmin = min(spec.get("batch_sizes", [1]))
            pts = [r for r in rows if r["batch_size"] == bmin]
            ykey = "gen_ppl" if pts and pts[0].get("gen_ppl") is not None else "entropy"
            labelled = []
            for r in pts:  # the base point joins every swept option's curve, labelled with its value there
                if r["setting"] == "base" and spec.get("base_values"):
                    labelled += [(r["tokens_per_s"], r[ykey], f"{k}={v} (base)") for k, v in spec["base_values"].items()]
                else:
                    labelled.append((r["tokens_per_s"], r[ykey], r["setting"]))
            m["frontier"] = {"x": "tokens_per_s", "y": ykey, "batch_size": bmin,
                             "png": frontier_plot(labelled,
                                                  out / "frontier.png", xlabel=f"tokens/s per example (batch {bmin})",
                                                  ylabel={"gen_ppl": "generative perplexity (lower is better)",
                                                          "entropy": "unigram entropy (nats)"}[ykey],
                                                  title="speed-quality frontier")}
        return m
