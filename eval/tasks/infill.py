"""infill: ROCStories-style infilling, ROUGE-1/2/L of the filled span against the reference.

Each five-sentence story (Story Cloze CSV: the right ending is the fifth sentence) becomes
prefix + masked span + suffix: ``--span 3`` fills sentence 3 given 1-2 and 4-5, ``--span 2-4`` fills
sentences 2-4 given 1 and 5. The span length is given: the number of tokens of the reference span
(sentences joined by single spaces, tokenized in place with the checkpoint's tokenizer). SetDLM,
BD3-LM and MDLM see prefix and suffix; AR conditions on the prefix only. Default window
w = S_max (as the paper does for infilling), no threshold (one token per step).

``--preset paper`` adds the paper's remaining settings, so ROUGE is comparable with its Table 2: the
story framed as one document (BOS before the prefix, EOS after the suffix) and a repetition penalty
of 1.2 over the tokens present (prefix, suffix and what is filled so far) unless
``--repetition-penalty`` gives another value. A story whose prefix + span + suffix does not fit the
model's max_seq_len is refused before the model loads (decoding past it would use positions the
model never saw).
"""

from __future__ import annotations

from typing import Literal

from common.schema import Field, PathText, like

from ..data import load_rocstories
from ..errors import EvalError
from ..metrics import mean, rouge
from ..options import GenerationOptions, eval_options, infill_window
from ..units import Unit
from .base import GenerationTask, chunk_units, speed_metrics

SPANS = {"3": (2, 3), "2-4": (1, 4)}
PRESETS = {"default": {"framing": False, "repetition_penalty": 1.0}, "paper": {"framing": True, "repetition_penalty": 1.2}}
TYPES = ("rouge1", "rouge2", "rougeL")


def split_story(sentences: list[str], span: str) -> tuple[str, str, str]:
    """(prefix text, span text with its leading space, suffix text with its leading space)."""
    a, b = SPANS[span]
    return " ".join(sentences[:a]), " " + " ".join(sentences[a:b]), " " + " ".join(sentences[b:])


@eval_options("setdlm eval infill")
class InfillOptions(GenerationOptions):
    option_group = "infill"

    data: PathText = Field(description="ROCStories CSV (Story Cloze columns, or storyid/sentence1..5)")
    span: Literal[tuple(sorted(SPANS))] = Field("3", description="sentences to fill")
    preset: Literal[tuple(sorted(PRESETS))] = Field("default", description=(
        "paper: BOS/EOS framing and repetition penalty 1.2, as in the paper's Table 2 (default: neither)"))
    window: int | None = like(GenerationOptions, "window", description=(
        "SW-SetDLM window w (default: S_max, 2D unless the objective sets s_max)"))


class InfillTask(GenerationTask):
    name = "infill"
    help = "ROCStories infilling (sentence 3, or 2-4), ROUGE-1/2/L"
    headline = ("rouge1", "rouge2", "rougeL", "n", "speed/tokens_per_s")
    options = InfillOptions

    def __init__(self, args, shard, predictor=None):
        self.preset = PRESETS[args.preset]
        super().__init__(args, shard, predictor)
        self.stories = load_rocstories(args.data)
        if args.limit:
            self.stories = self.stories[: args.limit]
        if self.tokenizer is None:
            raise EvalError("infill: needs a tokenizer (--checkpoint) to measure span lengths")
        if self.ckpt is not None:
            limit = int(self.ckpt.cfg.model.max_seq_len)
            sizes = [len(a) + n + len(b) for a, n, b in (self.part(st)[0] for st in self.stories)]
            over = [i for i, n in enumerate(sizes) if n > limit]
            if over:
                raise EvalError(f"--data: {len(over)} stories (the first: #{over[0]}, {sizes[over[0]]} tokens) do not fit the "
                                f"model's max_seq_len {limit} as prefix + span + suffix; use a model with a longer "
                                f"context or --limit")

    def check_fits(self) -> None:
        pass  # per story, in __init__

    def sampling_extra(self) -> dict:
        if self.preset["repetition_penalty"] != 1.0 and self.args.repetition_penalty == 1.0:
            return {"repetition_penalty": self.preset["repetition_penalty"]}
        return {}

    def part(self, story: dict):
        """((prefix ids, span length, suffix ids), (prefix, reference span, suffix) texts)."""
        tok = self.tokenizer
        pre, mid, suf = split_story(story["sentences"], self.args.span)
        a, b = tok.encode(pre), tok.encode(suf)
        if self.preset["framing"]:
            bos = tok.bos_id if tok.bos_id is not None else tok.eos_id
            a, b = ([bos] if bos is not None else []) + a, b + ([tok.eos_id] if tok.eos_id is not None else [])
        return (a, len(tok.encode(mid)), b), (pre, mid.strip(), suf.strip())

    def default_window(self):
        return infill_window(self.ckpt.cfg.objective)

    def spec(self) -> dict:
        s = super().spec()
        s.update(data=self.args.data, span=self.args.span, n=len(self.stories), preset=self.args.preset,
                 framing=self.preset["framing"])
        return s

    def units(self) -> list[Unit]:
        return chunk_units(self.stories, self.unit_size())

    def run_unit(self, unit: Unit) -> list[dict]:
        parts, texts = zip(*(self.part(st) for st in unit.payload))
        outs = self.predictor.infill(list(parts), self.unit_seed(unit), examples=unit.payload, max_batch=self.args.batch_size)
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
        m.update(n=len(records), span=spec.get("span"), span_tokens=mean([r["span_tokens"] for r in records]),
                 preset=spec.get("preset", "default"))
        m.update(speed_metrics(records))
        return m
