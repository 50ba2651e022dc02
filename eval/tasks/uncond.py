"""uncond: unconditional samples -- MAUVE against held-out text, generative perplexity, unigram entropy.

Sample i (``--length`` tokens, default the checkpoint's sequence length, sampled at temperature 1
from an empty prompt, EOS does not stop it) is paired with held-out text i: the i-th sequence of the
checkpoint's validation split decoded, or the i-th document of ``--reference`` cut to the same
number of tokens. Each rank featurizes its samples and references (features go into the records, so
the merge needs no model) and scores both under ``--scorer`` when one is given. Metrics: MAUVE
(``mauve-text`` on those features; the featurizer is reported), generative perplexity
exp(sum NLL / sum tokens) of the samples and of the references under the scorer, mean unigram
entropy of the samples (nats) and of the references.
"""

from __future__ import annotations

from common.schema import Field, PathText, like

from ..errors import EvalError
from ..featurize import Featurizer, decode_features, encode_features
from ..metrics import mauve_report, mean, unigram_entropy, require_extra
from ..options import GenerationOptions, eval_options
from ..scoring import Scorer
from ..units import Unit
from .base import GenerationTask, chunk_units, speed_metrics


@eval_options("setdlm eval uncond")
class UncondOptions(GenerationOptions):
    option_group = "uncond"

    num_samples: int = Field(256, ge=2, description="samples (and reference texts); MAUVE is reported only from 100")
    length: int | None = Field(None, ge=1, description="tokens per sample (default: the checkpoint's data.seq_len)")
    reference: PathText | None = Field(None, description=(
        "held-out text (.txt / .jsonl 'text'); default: the checkpoint's val split"))
    featurizer: str = Field("minilm", description="MAUVE features: minilm, self, hf:NAME_OR_DIR[:mean]")
    scorer: str | None = Field(None, description=("generative perplexity model: a setdlm checkpoint (AR: exact) or "
                                                  "hf:NAME_OR_DIR (e.g. hf:gpt2-large); default: not computed"))
    mauve_buckets: str = Field("auto", pattern=r"^(auto|[1-9][0-9]*)$", description="k-means buckets (auto: n/10)")
    stop_on_eos: bool = Field(False, description="end a sample at EOS (default: full length)")
    temperature: float = like(GenerationOptions, "temperature", 1.0)  # samples of the model's distribution


class UncondTask(GenerationTask):
    name = "uncond"
    help = "unconditional samples: MAUVE, generative perplexity, unigram entropy"
    headline = ("mauve", "gen_ppl", "ref_gen_ppl", "entropy", "ref_entropy", "n")
    options = UncondOptions

    def __init__(self, args, shard, predictor=None):
        require_extra("mauve", "mauve-text", "uncond: MAUVE")  # before the checkpoint and the data are read
        super().__init__(args, shard, predictor)
        self.length = args.length or (self.ckpt.cfg.data.seq_len if self.ckpt else args.max_new_tokens)
        if self.sampling is not None:
            self.sampling.max_new_tokens = self.length
        self.featurizer = Featurizer(args.featurizer, self.device, self.ckpt)
        self.scorer = Scorer(args.scorer, self.device) if args.scorer else None
        self._refs = None
        if self.tokenizer is not None or args.reference:
            self.references()  # more samples than references fails here, before the model loads

    def prompt_room(self) -> int:
        return 0  # unconditional: an empty prompt

    def check_fits(self) -> None:
        try:
            super().check_fits()
        except EvalError as e:
            raise EvalError(str(e).replace("--max-new-tokens:", "--length:", 1)) from None

    @property
    def device(self):
        return self.ckpt.device if self.ckpt else __import__("torch").device("cpu")

    def sampling_extra(self) -> dict:
        return {"stop_on_eos": bool(self.args.stop_on_eos), "max_new_tokens": self.args.length or self.ckpt.cfg.data.seq_len}

    def spec(self) -> dict:
        s = super().spec()
        s.update(num_samples=self.args.num_samples, length=self.length, reference=self.args.reference or "val split",
                 featurizer=self.args.featurizer, featurizer_description=self.featurizer.describe(),
                 scorer=self.scorer.describe() if self.scorer else None, mauve_buckets=self.args.mauve_buckets)
        return s

    def references(self) -> list[str]:
        if self._refs is not None:
            return self._refs
        n, tok = self.args.num_samples, self.tokenizer
        if self.args.reference:
            from ..data import load_texts

            docs = load_texts(self.args.reference, "--reference")
            refs = [tok.decode(tok.encode(d)[: self.length]) for d in docs[:n]] if tok else docs[:n]
        else:
            import dataclasses

            from data_pipeline.loader import build_loader

            dcfg = dataclasses.replace(self.ckpt.cfg.data, num_workers=0)
            try:
                loader = build_loader(dcfg, split="val", tokenizer=tok, micro_batch=1, seed=self.ckpt.cfg.run.seed)
            except ValueError as e:
                raise EvalError(f"--reference: the checkpoint's val split cannot be read ({e}); give --reference") from None
            refs = []
            for b in loader:
                refs.append(tok.decode(b["input_ids"][0, : self.length].tolist(), skip_special=True))
                if len(refs) == n:
                    break
        if len(refs) < n:
            raise EvalError(f"--num-samples: {n} samples but only {len(refs)} reference texts "
                            f"({self.args.reference or 'val split'}); lower --num-samples or give more text")
        self._refs = refs
        return refs

    def units(self) -> list[Unit]:
        exs = [{"id": str(i), "index": i} for i in range(self.args.num_samples)]
        return chunk_units(exs, self.unit_size())

    def run_unit(self, unit: Unit) -> list[dict]:
        refs = self.references()
        outs = self.predictor.complete([[] for _ in unit.payload], self.unit_seed(unit), examples=unit.payload,
                                       max_batch=self.args.batch_size)
        gens = [o["text"] or "" for o in outs]
        my_refs = [refs[e["index"]] for e in unit.payload]
        feats = self.featurizer(gens)
        ref_feats = self.featurizer(my_refs)
        recs = []
        for i, (key, e, o) in enumerate(zip(unit.keys, unit.payload, outs)):
            r = {"key": key, "generation": gens[i], "reference": my_refs[i], "entropy": unigram_entropy(o["tokens"]),
                 "ref_entropy": unigram_entropy(self.tokenizer.encode(my_refs[i])) if self.tokenizer else None,
                 "features": encode_features(feats[i]), "ref_features": encode_features(ref_feats[i]),
                 **{k: v for k, v in o.items() if k != "text"}}
            if self.scorer is not None:
                r["gen_nll"], r["gen_scored_tokens"] = self.scorer.nll(gens[i], seed=e["index"])
                r["ref_nll"], r["ref_scored_tokens"] = self.scorer.nll(my_refs[i], seed=e["index"])
            recs.append(r)
        return recs

    @staticmethod
    def aggregate(records, spec, out=None) -> dict:
        import math

        import numpy as np

        p = np.stack([decode_features(r["features"]) for r in records])
        q = np.stack([decode_features(r["ref_features"]) for r in records])
        buckets = spec.get("mauve_buckets", "auto")
        mv = mauve_report(p, q, num_buckets=buckets if buckets == "auto" else int(buckets), seed=int(spec.get("seed") or 0) + 25)
        m = {**mv, "featurizer": spec.get("featurizer_description"),
             "entropy": mean([r["entropy"] for r in records]), "ref_entropy": mean([r.get("ref_entropy") for r in records]),
             "n": len(records), "sample_tokens": mean([r["n_tokens"] for r in records])}
        if records and "gen_nll" in records[0]:
            for pre, nll, cnt in (("gen", "gen_nll", "gen_scored_tokens"), ("ref_gen", "ref_nll", "ref_scored_tokens")):
                tot, n = sum(r[nll] for r in records), sum(r[cnt] for r in records)
                m[f"{pre}_ppl"] = math.exp(min(tot / n, 50.0)) if n else None
            m["scorer"] = (spec.get("scorer") or {}).get("scorer")
        else:
            m["gen_ppl"] = None
            m["note"] = "generative perplexity not computed (no --scorer)"
        m.update(speed_metrics(records))
        return m
