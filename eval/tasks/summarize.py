"""summarize: CNN/DailyMail-style summaries, ROUGE-1/2/L/Lsum against the highlights.

Prompt: ``--template`` (default ``{article}\\n\\nTL;DR:``). An article too long for prompt +
``--max-new-tokens`` to fit the model's context follows ``--overlong`` (eval/overlong.py): skipped
and counted by default; ``truncate`` cuts the article (its beginning kept, at a token boundary) and
counts the examples whose article was cut; ``error`` refuses the run. Decoding stops at EOS or a
blank line.
"""

from __future__ import annotations

from common.schema import Field, PathText, TextList

from ..data import load_cnndm
from ..errors import EvalError, OptionError
from ..metrics import ROUGE_TYPES, mean, rouge, require_extra
from ..options import GenerationOptions, eval_options
from ..overlong import overlong_metrics
from ..units import Unit
from .base import GenerationTask, chunk_units, speed_metrics

TEMPLATE = "{article}\n\nTL;DR:"


@eval_options("setdlm eval summarize")
class SummarizeOptions(GenerationOptions):
    option_group = "summarize"

    data: PathText = Field(description="CSV or JSONL with article, highlights, id")
    template: str = Field(TEMPLATE, description="prompt with {article}")
    stop: TextList | None = Field(None, description="stop string (repeatable; default: a blank line)")

    def __post_init__(self):
        if "{article}" not in self.template:
            raise OptionError(f"--template: must contain {{article}}, got {self.template!r}")


class SummarizeTask(GenerationTask):
    name = "summarize"
    help = "CNN/DailyMail-style summarisation, ROUGE-1/2/L"
    headline = ("rouge1", "rouge2", "rougeL", "rougeLsum", "n", "skipped_overlong")
    options = SummarizeOptions

    def __init__(self, args, shard, predictor=None):
        require_extra("rouge_score", "rouge-score", "summarize: ROUGE")  # before the checkpoint and the data are read
        super().__init__(args, shard, predictor)
        if self.tokenizer is not None and self.ckpt is not None:
            self.prompt("")  # a --max-new-tokens that leaves no room for an article fails before the model loads
        self.docs = load_cnndm(args.data)
        if args.limit:
            self.docs = self.docs[: args.limit]
        if self.tokenizer is not None and self.ckpt is not None:
            fixed = self.fixed_tokens() + self.args.max_new_tokens
            self.docs = self.fit(self.docs, [fixed + len(self.tokenizer.encode(d["article"])) for d in self.docs],
                                 what="articles (prompt + --max-new-tokens)")

    def sampling_extra(self) -> dict:
        return {"stop": list(self.args.stop) if self.args.stop else ["\n\n"]}

    def spec(self) -> dict:
        s = super().spec()
        s.update(data=self.args.data, template=self.args.template, n=len(self.docs))
        return s

    def units(self) -> list[Unit]:
        return chunk_units(self.docs, self.unit_size())

    def fixed_tokens(self) -> int:
        """Tokens of the template around the article."""
        head, tail = self.args.template.split("{article}", 1)
        return len(self.tokenizer.encode(head)) + len(self.tokenizer.encode(tail))

    def prompt(self, article: str) -> tuple[str, bool]:
        """(prompt, whether the article was cut to fit: only under --overlong truncate)."""
        tok = self.tokenizer
        if tok is None or self.ckpt is None:
            return self.args.template.format(article=article), False
        head, tail = self.args.template.split("{article}", 1)
        budget = int(self.ckpt.cfg.model.max_seq_len) - self.args.max_new_tokens - self.fixed_tokens()
        if budget < 1:
            raise EvalError(f"--max-new-tokens: {self.args.max_new_tokens} leaves no room for the article in the model's "
                            f"max_seq_len {self.ckpt.cfg.model.max_seq_len}")
        ids = tok.encode(article)
        if len(ids) <= budget:
            return head + article + tail, False
        return head + tok.decode(ids[:budget]) + tail, True

    def run_unit(self, unit: Unit) -> list[dict]:
        prompts, cut = zip(*(self.prompt(d["article"]) for d in unit.payload))
        outs = self.predictor.complete(list(prompts), self.unit_seed(unit), examples=unit.payload,
                                       max_batch=self.args.batch_size)
        recs = []
        for key, d, c, o in zip(unit.keys, unit.payload, cut, outs):
            gen = (o["text"] or "").strip()
            recs.append({"key": key, "id": d["id"], "reference": d["highlights"], "generation": gen, "article_cut": c,
                         **rouge(gen, d["highlights"], ROUGE_TYPES), **{k: v for k, v in o.items() if k != "text"}})
        return recs

    @staticmethod
    def aggregate(records, spec, out=None) -> dict:
        m = {t: mean([r[t] for r in records]) for t in ROUGE_TYPES}
        m.update(n=len(records), articles_cut=sum(1 for r in records if r.get("article_cut")),
                 summary_tokens=mean([r.get("n_tokens") for r in records]))
        m.update(overlong_metrics(records, spec))
        m.update(speed_metrics(records))
        return m
