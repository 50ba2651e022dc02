"""gsm8k: zero- or few-shot accuracy of the final answer.

Prompt: ``Question: {question}\\nAnswer:`` (few-shot: N solved examples ``Question: ..\\nAnswer: ..``
joined by blank lines before it). Decoding per the paper: greedy, w = D, confidence threshold 0.9,
stop at ``Question:`` or EOS. The final answer is extracted with `eval.metrics.extract_answer`
(``#### n``, then ``\\boxed{n}``, then the last number) and compared numerically with the gold
``#### n``.

Two backends give the same prompts and scoring for zero-shot:
- ``lm-eval`` (default when lm-evaluation-harness is installed): a task YAML written into the output
  directory (local JSONL, or the hub dataset with ``--data hub``) builds the requests; our registered
  LM class generates them through the sharded, resumable runner; the merge replays the records
  through the harness, which reports its own metric next to ours;
- ``direct``: our own prompt builder (few-shot examples drawn per example with a seed that depends on
  the example only).
"""

from __future__ import annotations

import random
from typing import Literal

from common.schema import Field, PathText, like

from ..data import load_gsm8k
from ..errors import EvalError
from ..metrics import extract_answer, gold_answer, mean
from ..options import GenerationOptions, eval_options
from ..overlong import overlong_metrics, scored, skip_record
from ..units import Unit
from .base import GenerationTask, chunk_units, speed_metrics

TEMPLATE = "Question: {question}\nAnswer:"
STOP = ["Question:"]


def lmeval_available() -> bool:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


@eval_options("setdlm eval gsm8k")
class GSM8KOptions(GenerationOptions):
    option_group = "gsm8k"

    data: PathText = Field(description="GSM8K JSONL (question, answer) or 'hub' (openai/gsm8k main, online)")
    fewshot: int = Field(0, ge=0, description="solved examples in the prompt")
    fewshot_data: PathText | None = Field(None, description=(
        "JSONL to draw few-shot examples from (with --data hub: its train split)"))
    backend: Literal["auto", "lm-eval", "direct"] = Field("auto", description="auto: lm-eval when installed, else direct")
    prompt_format: Literal["plain", "chatml"] = Field("plain", description=(
        "plain: the Question/Answer template; chatml: the question as a user turn in the ChatML template of "
        "`setdlm data prepare --template chatml` (direct backend; docs/finetune.md)"))
    threshold: float | None = like(GenerationOptions, "threshold", 0.9)  # the paper's decoding
    max_new_tokens: int = like(GenerationOptions, "max_new_tokens", 256)


class GSM8KTask(GenerationTask):
    name = "gsm8k"
    help = "GSM8K final-answer accuracy (zero/few-shot; lm-evaluation-harness or direct)"
    headline = ("accuracy", "n", "skipped_overlong", "speed/tokens_per_s", "speed/tokens_per_step")
    options = GSM8KOptions

    def __init__(self, args, shard, predictor=None):
        super().__init__(args, shard, predictor)
        self.backend = args.backend
        if self.backend == "auto":
            self.backend = "lm-eval" if lmeval_available() and not self.chat else "direct"
        if self.chat and (self.backend != "direct" or args.fewshot):
            raise EvalError("--prompt-format chatml: zero-shot with --backend direct only")
        if self.backend == "lm-eval" and not lmeval_available():
            raise EvalError("--backend lm-eval: lm-evaluation-harness is not installed (pip install 'setdlm[lm-eval]'), "
                            "or use --backend direct")
        self.examples = load_gsm8k(args.data)
        if args.limit:
            self.examples = self.examples[: args.limit]
        self.pool = []
        if args.fewshot:
            if args.fewshot_data:
                self.pool = load_gsm8k(args.fewshot_data, "--fewshot-data")
            elif args.data == "hub":
                self.pool = load_gsm8k("hub", "--data", split="train")
            else:
                raise EvalError("--fewshot-data: required with --fewshot > 0 (a JSONL of solved problems, e.g. the train split)")
            if len(self.pool) < args.fewshot + 1:
                raise EvalError(f"--fewshot-data: {len(self.pool)} examples, fewer than --fewshot {args.fewshot} + 1")
        if self.backend == "direct" and self.tokenizer is not None:  # --overlong (lm-eval: on its prompts, later)
            self.examples = self.fit(self.examples, [self.needs(self.prompt(e)) for e in self.examples],
                                     what="problems (prompt, few-shot examples included, + --max-new-tokens)")

    def needs(self, prompt) -> int:
        """Tokens a prompt (text or ids) needs with the decoded ones."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        return len(ids) + self.args.max_new_tokens

    @property
    def chat(self) -> bool:
        return getattr(self.args, "prompt_format", "plain") == "chatml"

    def sampling_extra(self) -> dict:
        return {"stop": list(STOP) + (["<|im_end|>"] if self.chat else [])}

    def spec(self) -> dict:
        s = super().spec()
        s.update(data=self.args.data, fewshot=self.args.fewshot, fewshot_data=self.args.fewshot_data,
                 backend=self.backend, template="chatml" if self.chat else TEMPLATE,
                 n=len(self.examples))
        return s

    # -- direct --------------------------------------------------------------------------------
    def prompt(self, ex: dict):
        if self.chat:  # token ids: the special tokens are never parsed out of text
            from data_pipeline.prompt_answer import chatml_prompt

            return chatml_prompt(self.tokenizer, [{"role": "user", "content": ex["question"]}])
        shots = ""
        if self.args.fewshot:
            rng = random.Random(f"{self.args.seed}/fewshot/{ex['id']}")
            cands = [e for e in self.pool if e["question"] != ex["question"]]
            picks = rng.sample(cands, self.args.fewshot)
            shots = "\n\n".join(TEMPLATE.format(question=e["question"]) + " " + e["answer"] for e in picks) + "\n\n"
        return shots + TEMPLATE.format(question=ex["question"])

    def units(self) -> list[Unit]:
        return chunk_units(self.examples, self.unit_size())

    def _records(self, unit: Unit, docs: list[dict], prompts: list[str], stop: list[str],
                 skip: dict | None = None) -> list[dict]:
        """Records of a unit's problems; `skip`: {index in the unit: tokens needed} of prompts the
        --overlong policy leaves out at run time (lm-eval)."""
        skip = skip or {}
        run = [i for i in range(len(docs)) if i not in skip]
        outs = iter(self.predictor.complete([prompts[i] for i in run], self.unit_seed(unit), examples=[docs[i] for i in run],
                                            stop=list(stop), max_batch=self.args.batch_size) if run else [])
        recs = []
        for i, (key, doc, prompt) in enumerate(zip(unit.keys, docs, prompts)):
            if i in skip:
                recs.append(skip_record(key, skip[i], question=doc["question"], prompt=prompt, generation=""))
                continue
            o = next(outs)
            gold = gold_answer(doc["answer"])
            pred, rule = extract_answer(o["text"])
            recs.append({"key": key, "question": doc["question"], "gold": gold, "prediction": pred, "rule": rule,
                         "correct": pred is not None and pred == gold, "generation": o["text"], "prompt": prompt,
                         **{k: v for k, v in o.items() if k != "text"}})
        return recs

    def run_unit(self, unit: Unit) -> list[dict]:
        return self._records(unit, unit.payload, [self.prompt(e) for e in unit.payload], self.sampling_extra()["stop"])

    # -- lm-eval -------------------------------------------------------------------------------
    def execute(self, run, after_unit=None) -> dict:
        if self.backend == "direct":
            return super().execute(run, after_unit)
        from ..lmeval import run_generation

        return run_generation(self, run, after_unit)

    # -- metrics -------------------------------------------------------------------------------
    @staticmethod
    def aggregate(records, spec, out=None) -> dict:
        ran = scored(records)
        rules: dict = {}
        for r in ran:
            rules[r["rule"]] = rules.get(r["rule"], 0) + 1
        m = {"accuracy": mean([float(r["correct"]) for r in ran]), "n": len(ran),
             "extraction": rules, "backend": spec.get("backend"), "fewshot": spec.get("fewshot")}
        m.update(overlong_metrics(records, spec))  # problems skipped, or prompts (few-shot included) cut, to fit
        m.update(speed_metrics(ran))
        if spec.get("backend") == "lm-eval" and out is not None:
            from ..lmeval import replay_metrics

            m.update(replay_metrics(out, records, spec))
            if len(ran) < len(records):
                m["lm_eval/note"] = (f"the harness's exact_match counts the {len(records) - len(ran)} skipped problems "
                                     "as wrong; accuracy is over the problems that ran")
        return m
