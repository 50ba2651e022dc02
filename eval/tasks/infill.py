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
model's max_seq_len (decoding past it would use positions the model never saw) follows
``--overlong`` (eval/overlong.py): skipped and counted by default; ``truncate`` cuts the context
farthest from the span (the start of the prefix, then the end of the suffix; BOS/EOS framing kept,
one prefix token at least); ``error`` refuses the run before the model loads.
"""

from __future__ import annotations

from typing import Literal

from common.schema import Field, PathText, like

from ..data import load_rocstories
from ..errors import EvalError
from ..metrics import mean, rouge, require_extra
from ..options import GenerationOptions, eval_options, infill_window
from ..overlong import overlong_metrics
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
    headline = ("rouge1", "rouge2", "rougeL", "n", "skipped_overlong", "speed/tokens_per_s")
    options = InfillOptions

    def __init__(self, args, shard, predictor=None):
        require_extra("rouge_score", "rouge-score", "infill: ROUGE")  # before the checkpoint and the data are read
        self.preset = PRESETS[args.preset]
        super().__init__(args, shard, predictor)
        self.stories = load_rocstories(args.data)
        if args.limit:
            self.stories = self.stories[: args.limit]
        if self.tokenizer is None:
            raise EvalError("infill: needs a tokenizer (--checkpoint) to measure span lengths")
        parts = [self.full_part(st) for st in self.stories]
        self.stories = self.fit(self.stories, [len(a) + n + len(b) for a, n, b in parts],
                                floors=[n + self.framing_tokens() + 1 for _, n, _ in parts],
                                what="stories (prefix + span + suffix)")

    def check_fits(self) -> None:
        pass  # per story, in __init__

    def sampling_extra(self) -> dict:
        if self.preset["repetition_penalty"] != 1.0 and self.args.repetition_penalty == 1.0:
            return {"repetition_penalty": self.preset["repetition_penalty"]}
        return {}

    def framing(self) -> tuple[list[int], list[int]]:
        """The tokens before the prefix and after the suffix (`--preset paper`: BOS, EOS; else none)."""
        tok = self.tokenizer
        if not self.preset["framing"]:
            return [], []
        bos = tok.bos_id if tok.bos_id is not None else tok.eos_id
        return ([bos] if bos is not None else []), ([tok.eos_id] if tok.eos_id is not None else [])

    def framing_tokens(self) -> int:
        head, tail = self.framing()
        return len(head) + len(tail)

    def full_part(self, story: dict):
        """(prefix ids, span length, suffix ids) of a story, uncut."""
        tok = self.tokenizer
        pre, mid, suf = split_story(story["sentences"], self.args.span)
        head, tail = self.framing()
        return head + tok.encode(pre), len(tok.encode(mid)), tok.encode(suf) + tail

    def part(self, story: dict):
        """((prefix ids, span length, suffix ids), (prefix, reference span, suffix) texts); under
        --overlong truncate the context farthest from the span is cut to fit max_seq_len."""
        pre, mid, suf = split_story(story["sentences"], self.args.span)
        return self.cut_to_fit(*self.full_part(story)), (pre, mid.strip(), suf.strip())

    def cut_to_fit(self, a: list[int], n: int, b: list[int]) -> tuple[list[int], int, list[int]]:
        """Under --overlong truncate: the start of the prefix (after BOS, one token of it kept), then the
        end of the suffix (before EOS) cut until prefix + span + suffix fit max_seq_len."""
        if self.ckpt is None or self.args.overlong != "truncate":
            return a, n, b
        excess = len(a) + n + len(b) - int(self.ckpt.cfg.model.max_seq_len)
        head, tail = (len(x) for x in self.framing())
        if excess > 0:
            k = max(0, min(excess, len(a) - head - 1))
            a, excess = a[:head] + a[head + k:], excess - k
        if excess > 0:
            k = min(excess, len(b) - tail)
            b = b[:len(b) - tail - k] + b[len(b) - tail:]
        return a, n, b

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
        full = [self.full_part(st) for st in unit.payload]
        cuts = [len(f[0]) + len(f[2]) - len(p[0]) - len(p[2]) for f, p in zip(full, parts)]
        outs = self.predictor.infill(list(parts), self.unit_seed(unit), examples=unit.payload, max_batch=self.args.batch_size)
        recs = []
        for key, (pre, ref, suf), part, cut, o in zip(unit.keys, texts, parts, cuts, outs):
            gen = (o["text"] or "").strip()
            recs.append({"key": key, "prefix": pre, "suffix": suf, "reference": ref, "generation": gen,
                         "span_tokens": part[1], "prompt_cut": cut, **rouge(gen, ref, TYPES),
                         **{k: v for k, v in o.items() if k != "text"}})
        return recs

    @staticmethod
    def aggregate(records, spec, out=None) -> dict:
        m = {t: mean([r[t] for r in records]) for t in TYPES}
        m.update({f"{t}_{x}": mean([r[f"{t}_{x}"] for r in records]) for t in TYPES for x in ("p", "r")})
        m.update(n=len(records), span=spec.get("span"), span_tokens=mean([r["span_tokens"] for r in records]),
                 preset=spec.get("preset", "default"))
        m.update(overlong_metrics(records, spec))
        m.update(speed_metrics(records))
        return m
