"""infill: ROCStories-style infilling, ROUGE-1/2/L of the filled span against the reference.

Each five-sentence story (Story Cloze CSV: the right ending is the fifth sentence) becomes
prefix + masked span + suffix: ``--span 3`` fills sentence 3 given 1-2 and 4-5, ``--span 2-4`` fills
sentences 2-4 given 1 and 5. The span length is given: the number of tokens of the reference span
(sentences joined by single spaces, tokenized in place with the checkpoint's tokenizer). SetDLM,
BD3-LM and MDLM see prefix and suffix; AR conditions on the prefix only. Default window
w = S_max (as the paper does for infilling), no threshold (one token per step).
"""

from __future__ import annotations

from ..data import load_rocstories
from ..metrics import mean, rouge
from ..runner import EvalError, Unit
from .base import GenerationTask, chunk_units, speed_metrics

SPANS = {"3": (2, 3), "2-4": (1, 4)}
TYPES = ("rouge1", "rouge2", "rougeL")


def split_story(sentences: list[str], span: str) -> tuple[str, str, str]:
    """(prefix text, span text with its leading space, suffix text with its leading space)."""
    a, b = SPANS[span]
    return " ".join(sentences[:a]), " " + " ".join(sentences[a:b]), " " + " ".join(sentences[b:])


class InfillTask(GenerationTask):
    name = "infill"
    help = "ROCStories infilling (sentence 3, or 2-4), ROUGE-1/2/L"
    window_default = "S_max (2D unless the objective sets s_max)"
    headline = ("rouge1", "rouge2", "rougeL", "n", "speed/tokens_per_s")

    @classmethod
    def add_args(cls, p):
        p.add_argument("--data", required=True, help="ROCStories CSV (Story Cloze columns, or storyid/sentence1..5)")
        p.add_argument("--span", choices=sorted(SPANS), default="3", help="sentences to fill (default 3)")
        super().add_args(p)

    def __init__(self, args, shard, predictor=None):
        super().__init__(args, shard, predictor)
        self.stories = load_rocstories(args.data)
        if args.limit:
            self.stories = self.stories[: args.limit]
        if self.tokenizer is None:
            raise EvalError("infill: needs a tokenizer (--checkpoint) to measure span lengths")

    def default_window(self):
        o = self.ckpt.cfg.objective
        return int(o.s_max if o.s_max is not None else 2 * o.set_size)

    def spec(self) -> dict:
        s = super().spec()
        s.update(data=self.args.data, span=self.args.span, n=len(self.stories))
        return s

    def units(self) -> list[Unit]:
        return chunk_units(self.stories, self.unit_size())

    def run_unit(self, unit: Unit) -> list[dict]:
        tok = self.tokenizer
        parts, texts = [], []
        for st in unit.payload:
            pre, mid, suf = split_story(st["sentences"], self.args.span)
            parts.append((tok.encode(pre), len(tok.encode(mid)), tok.encode(suf)))
            texts.append((pre, mid.strip(), suf.strip()))
        outs = self.predictor.infill(parts, self.unit_seed(unit), examples=unit.payload, max_batch=self.args.batch_size)
        recs = []
        for key, (pre, ref, suf), part, o in zip(unit.keys, texts, parts, outs):
            gen = (o["text"] or "").strip()
            recs.append({"key": key, "prefix": pre, "suffix": suf, "reference": ref, "generation": gen,
                         "span_tokens": part[1], **rouge(gen, ref, TYPES),
                         **{k: v for k, v in o.items() if k != "text"}})
        return recs

    @staticmethod
    def aggregate(records, spec, out=None) -> dict:
        m = {t: mean([r[t] for r in records]) for t in TYPES}
        m.update({f"{t}_{x}": mean([r[f"{t}_{x}"] for r in records]) for t in TYPES for x in ("p", "r")})
        m.update(n=len(records), span=spec.get("span"), span_tokens=mean([r["span_tokens"] for r in records]))
        m.update(speed_metrics(records))
        return m
