"""gsm8k: zero- or few-shot accuracy of the final answer.

Prompt: ``Question: {question}\\nAnswer:`` (few-shot: N solved examples ``Question: ..\\nAnswer: ..``
joined by blank lines before it), or a chat prompt (``--prompt-format chatml|tokenizer``,
eval/chat_prompt.py). Decoding per the paper: greedy, w = D, confidence threshold 0.9, stop at
``Question:`` or EOS (and ``<|im_end|>`` for chat prompts). The final answer is extracted with
`eval.metrics.extract_answer` (``#### n``, then ``\\boxed{n}``, then the last number) and compared
numerically with the gold ``#### n``; ``format_rate`` is the fraction of generations with a
``#### n`` line.

Backends:
- ``lm-eval`` (default when lm-evaluation-harness is installed): the harness builds the requests
  (eval/lmeval.py); plain prompts come from a task YAML of ours with the prompt above, chat prompts
  from **lm-eval's own `gsm8k` task** with ``apply_chat_template`` (our LM renders the tokenizer's
  template), as the paper evaluates (``--protocol paper``: that, 0-shot, greedy, 1024 new tokens);
- ``direct``: our own prompt builder (few-shot examples drawn per example with a seed that depends on
  the example only).

What must fit the model's ``max_seq_len``: SW-SetDLM, BD3-LM and AR decode past it as the reference
does (the oldest cache entries are dropped by position), so only the prompt must fit (its prefill);
MDLM re-reads the whole sequence, so prompt + new tokens must. Unset, ``--max-new-tokens`` is
min(256, max_seq_len - the longest prompt that fits), so by default nothing decodes past the context.
A prompt cut to fit (``--overlong truncate``) loses the start of its last user turn's content, never a
chat header.
"""

from __future__ import annotations

import dataclasses
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
DEFAULT_NEW_TOKENS = 256  # the most --max-new-tokens takes when unset
PAPER = {"backend": "lm-eval", "prompt_format": "tokenizer", "fewshot": 0, "temperature": 0.0, "max_new_tokens": 1024}


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
    prompt_format: Literal["plain", "chatml", "tokenizer"] | None = Field(None, description=(
        "plain: the Question/Answer template; chatml: the question as a user turn in the ChatML template of "
        "`setdlm data prepare --template chatml`; tokenizer: the tokenizer's chat template (else ChatML, or "
        "--chat-template); with --backend lm-eval the chat formats run lm-eval's own gsm8k task with "
        "apply_chat_template (docs/finetune.md). Unset: plain (tokenizer with --protocol paper or --chat-template)"))
    chat_template: PathText | None = Field(None, description=(
        "a Jinja chat template file for --prompt-format tokenizer instead of the tokenizer's own (e.g. the one "
        "`setdlm data prepare --chat-template` fine-tuned with; a model without a template of its own needs it)"))
    protocol: Literal["paper"] | None = Field(None, description=(
        "paper: the paper's GSM8K protocol: lm-eval's gsm8k task, apply_chat_template with the tokenizer's template, "
        "0-shot, greedy, --max-new-tokens 1024"))
    threshold: float | None = like(GenerationOptions, "threshold", 0.9)  # the paper's decoding
    max_new_tokens: int | None = like(GenerationOptions, "max_new_tokens", None, (
        "new tokens per problem (unset: min(256, max_seq_len - the longest prompt))"))


def paper_protocol(args):
    """`args` with --protocol paper's settings (PAPER) and the prompt format resolved (unset: plain,
    or tokenizer with --protocol paper or --chat-template); an option that contradicts either is refused."""
    fmt = args.prompt_format
    if args.chat_template is not None and fmt not in (None, "tokenizer"):
        raise EvalError(f"--chat-template: renders --prompt-format tokenizer, not --prompt-format {fmt}; drop one")
    if args.protocol != "paper":
        fmt = fmt or ("tokenizer" if args.chat_template is not None else "plain")
        return dataclasses.replace(args, prompt_format=fmt)
    clash = [f"--{k.replace('_', '-')} {getattr(args, k)}" for k, v in PAPER.items()
             if k not in ("prompt_format", "backend") and getattr(args, k) not in (None, v)]
    if args.backend == "direct":
        clash.append("--backend direct")
    if fmt == "plain":
        clash.append("--prompt-format plain")
    if clash:
        raise EvalError(f"--protocol paper: {', '.join(clash)} contradicts it (lm-eval's gsm8k rendered with the "
                        f"tokenizer's chat template, 0-shot, greedy, 1024 new tokens); drop "
                        f"{'them' if len(clash) > 1 else 'it'}, or drop --protocol paper to evaluate otherwise")
    return dataclasses.replace(args, **{**PAPER, "prompt_format": fmt or PAPER["prompt_format"]})


class GSM8KTask(GenerationTask):
    name = "gsm8k"
    help = "GSM8K final-answer accuracy (zero/few-shot; lm-evaluation-harness or direct)"
    headline = ("accuracy", "format_rate", "n", "skipped_overlong", "max_new_tokens", "speed/tokens_per_s",
                "speed/tokens_per_step")
    options = GSM8KOptions
    overflow = True  # the cached families decode past max_seq_len: only the prompt must fit

    def __init__(self, args, shard, predictor=None):
        args = paper_protocol(args)
        super().__init__(args, shard, predictor)
        self.backend = args.backend
        if self.backend == "auto":
            self.backend = "lm-eval" if lmeval_available() and not self.chat else "direct"
        if self.chat and self.backend == "direct" and args.fewshot:
            raise EvalError(f"--prompt-format {args.prompt_format}: few-shot chat prompts need --backend lm-eval "
                            f"(its multi-turn few-shot); the direct backend is zero-shot")
        if self.backend == "lm-eval" and not lmeval_available():
            raise EvalError("--backend lm-eval: lm-evaluation-harness is not installed (pip install 'setdlm[lm-eval]'), "
                            "or use --backend direct")
        self.chat_prompts = None
        if self.chat:
            if self.tokenizer is None:
                raise EvalError(f"--prompt-format {args.prompt_format}: needs a tokenizer (--checkpoint)")
            from ..chat_prompt import ChatPrompts, read_template

            template = read_template(args.chat_template) if args.chat_template is not None else None
            self.chat_prompts = ChatPrompts(self.tokenizer, args.prompt_format, template=template,
                                            template_name=args.chat_template, paper=args.protocol == "paper")
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
        self.new_tokens, self.new_tokens_from = args.max_new_tokens, "--max-new-tokens"
        if self.ckpt is not None and self.tokenizer is not None:
            self._fit_to_model()
        elif self.new_tokens is None:
            self.new_tokens, self.new_tokens_from = DEFAULT_NEW_TOKENS, "default (no checkpoint)"

    # -- what fits ---------------------------------------------------------------------------------
    @property
    def holds_span(self) -> bool:
        """Whether the context must hold the new tokens too (MDLM re-reads the whole sequence)."""
        return self.sampling is not None and self.sampling.spec.rereads_sequence

    @property
    def limit(self) -> int:
        return int(self.ckpt.cfg.model.max_seq_len)

    def _fit_to_model(self) -> None:
        """--max-new-tokens when unset, then --overlong on the direct backend's prompts (lm-eval's are
        built later: the same rule runs on them then, eval/lmeval.py)."""
        L = self.limit
        prompts = [self.prompt(e, like_lmeval=self.backend == "lm-eval") for e in self.examples]
        sizes = [len(self.ids(p)) for p in prompts]
        if self.new_tokens is None:
            fitting = [s for s in sizes if s < L]
            longest = max(fitting, default=L - 1)
            self.new_tokens = min(DEFAULT_NEW_TOKENS, L - longest)
            self.new_tokens_from = (f"unset: min({DEFAULT_NEW_TOKENS}, max_seq_len {L} - the longest prompt "
                                    f"{longest}{' (zero-shot estimate)' if self.backend == 'lm-eval' and self.args.fewshot else ''})")
        if self.sampling is not None:
            self.sampling.max_new_tokens = int(self.new_tokens)
        self._check_budget()
        self.check_fits()  # MDLM: a budget that leaves no room is named before the prompts are
        if self.backend != "direct":  # the harness's prompts are fitted when it builds them (eval/lmeval.py)
            self.overlong = {"policy": self.args.overlong, "max_seq_len": L,
                             "applied": "at run time, to the harness's prompts (the counts are in the metrics)"}
            return
        floors = None
        if self.chat and self.args.overlong == "truncate":
            floors = [self.chat_prompts.floor(p) + self.span_room() for p in prompts]
        self.examples = self.fit(self.examples, [s + self.span_room() for s in sizes], floors=floors,
                                 what=f"problems (prompt, few-shot examples included{self._with_new()})")

    def _check_budget(self) -> None:
        """The decoded-token budget against what an answer takes: the median token count of the
        problems' reference solutions (their reasoning and the `#### n` line). A budget below it is a
        warning, printed at start, recorded in the spec and the metrics, and shown by summary.md."""
        lengths = sorted(len(self.tokenizer.encode(e["answer"])) for e in self.examples)
        self.answer_tokens = lengths[(len(lengths) - 1) // 2] if lengths else None
        self.budget_warning = None
        if self.answer_tokens and self.new_tokens < self.answer_tokens:
            fix = (f"the model's max_seq_len {self.limit} holds prompt and answer (MDLM); use a model with a longer "
                   f"context" if self.holds_span else
                   f"set --max-new-tokens (SW-SetDLM, BD3-LM and AR decode past max_seq_len {self.limit})")
            self.budget_warning = (f"{self.new_tokens} new tokens per problem ({self.new_tokens_from}) is below what an "
                                   f"answer needs: the reference solutions take {self.answer_tokens} tokens (median), so "
                                   f"most generations stop before their '#### n' line; {fix}")

    def notes(self) -> list[str]:
        """Lines printed when the run starts: the decoded-token budget, and its warning."""
        if self.ckpt is None:
            return []
        lines = [f"decoding budget: {self.new_tokens} new tokens per problem ({self.new_tokens_from}); the reference "
                 f"solutions take {self.answer_tokens} tokens (median)"]
        return lines + ([f"warning: {self.budget_warning}"] if self.budget_warning else [])

    def span_room(self) -> int:
        return int(self.new_tokens) if self.holds_span else 0

    def _with_new(self) -> str:
        return f", + --max-new-tokens {self.new_tokens} (MDLM)" if self.holds_span else ""

    def prompt_limit(self) -> int:
        """Prompt tokens a problem may have (prefill; MDLM: beside the new tokens)."""
        return self.limit - self.span_room()

    def needs(self, prompt) -> int:
        """Tokens of a prompt (text, ids or chat messages) that must fit max_seq_len."""
        return len(self.ids(prompt)) + self.span_room()

    def check_fits(self) -> None:
        if self.holds_span:  # the cached families decode past max_seq_len
            super().check_fits()

    def ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            return prompt
        if self.chat_prompts is not None:
            return self.chat_prompts.ids(prompt)
        return self.tokenizer.encode(prompt)

    @property
    def chat(self) -> bool:
        return getattr(self.args, "prompt_format", "plain") != "plain"

    def sampling_extra(self) -> dict:
        return {"stop": list(STOP) + (["<|im_end|>"] if self.chat else [])}

    def spec(self) -> dict:
        s = super().spec()
        s.update(data=self.args.data, fewshot=self.args.fewshot, fewshot_data=self.args.fewshot_data,
                 backend=self.backend, template=self.args.prompt_format if self.chat else TEMPLATE,
                 n=len(self.examples), protocol=self.args.protocol, max_new_tokens=self.new_tokens,
                 max_new_tokens_from=self.new_tokens_from, answer_tokens_median=getattr(self, "answer_tokens", None),
                 budget_warning=getattr(self, "budget_warning", None),
                 context=("prompt + new tokens fit max_seq_len (MDLM)" if self.holds_span else
                          "the prompt fits max_seq_len; decoding past it drops the oldest cache entries"))
        if self.chat_prompts is not None:
            s["chat"] = self.chat_prompts.describe()
        if self.backend == "lm-eval":
            s["lm_eval_task"] = "gsm8k" if self.chat else "setdlm_gsm8k"
        return s

    # -- direct --------------------------------------------------------------------------------
    def prompt(self, ex: dict, like_lmeval: bool = False):
        """The problem's prompt: chat messages, or text. `like_lmeval`: the harness's zero-shot one."""
        if self.chat:
            content = TEMPLATE.format(question=ex["question"]) if like_lmeval else ex["question"]
            return [{"role": "user", "content": content}]
        shots = ""
        if self.args.fewshot and not like_lmeval:
            rng = random.Random(f"{self.args.seed}/fewshot/{ex['id']}")
            cands = [e for e in self.pool if e["question"] != ex["question"]]
            picks = rng.sample(cands, self.args.fewshot)
            shots = "\n\n".join(TEMPLATE.format(question=e["question"]) + " " + e["answer"] for e in picks) + "\n\n"
        return shots + TEMPLATE.format(question=ex["question"])

    def fitted(self, prompt, messages=None) -> tuple[list[int] | str, int]:
        """(what to decode from, tokens cut): a chat prompt over the limit is cut inside its last user
        turn's content (--overlong truncate; skip and error left it out before); text is cut from the
        left by the predictor."""
        if messages is None or self.ckpt is None:
            return prompt, 0
        ids = self.ids(prompt)
        if len(ids) <= self.prompt_limit():
            return ids, 0
        got = self.chat_prompts.fit(messages, self.prompt_limit())
        if got is None:  # the floors left it out already; defensive
            raise EvalError(f"--overlong truncate: a chat prompt cannot be cut to {self.prompt_limit()} tokens")
        return got

    def units(self) -> list[Unit]:
        return chunk_units(self.examples, self.unit_size())

    def _records(self, unit: Unit, docs: list[dict], prompts: list, stop: list[str], skip: dict | None = None,
                 inputs: list | None = None, cuts: list[int] | None = None) -> list[dict]:
        """Records of a unit's problems; `skip`: {index in the unit: tokens needed} of prompts the
        --overlong policy leaves out at run time (lm-eval); `inputs`: what each decodes from when not
        the prompt it records (ids of a chat prompt), `cuts`: tokens cut from each to fit."""
        skip, inputs, cuts = skip or {}, inputs or prompts, cuts or [0] * len(prompts)
        run = [i for i in range(len(docs)) if i not in skip]
        outs = iter(self.predictor.complete([inputs[i] for i in run], self.unit_seed(unit), examples=[docs[i] for i in run],
                                            stop=list(stop), max_batch=self.args.batch_size) if run else [])
        recs = []
        for i, (key, doc, prompt) in enumerate(zip(unit.keys, docs, prompts)):
            if i in skip:
                recs.append(skip_record(key, skip[i], question=doc["question"], prompt=prompt, generation=""))
                continue
            o = next(outs)
            gold = gold_answer(doc["answer"])
            pred, rule = extract_answer(o["text"])
            rec = {"key": key, "question": doc["question"], "gold": gold, "prediction": pred, "rule": rule,
                   "correct": pred is not None and pred == gold, "generation": o["text"], "prompt": prompt,
                   **{k: v for k, v in o.items() if k != "text"}}
            if cuts[i]:
                rec["prompt_cut"] = int(rec.get("prompt_cut") or 0) + cuts[i]
            recs.append(rec)
        return recs

    def run_unit(self, unit: Unit) -> list[dict]:
        texts, inputs, cuts = [], [], []
        for e in unit.payload:
            p = self.prompt(e)
            ids, cut = self.fitted(self.ids(p) if self.chat else p, p if self.chat else None)
            texts.append(self.chat_prompts.text(p) if self.chat else p)  # the record's prompt is text in every format
            inputs.append(ids)
            cuts.append(cut)
        return self._records(unit, unit.payload, texts, self.sampling_extra()["stop"], inputs=inputs, cuts=cuts)

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
             "format_rate": mean([float(r["rule"] == "####") for r in ran]),  # a "#### n" final-answer line
             "extraction": rules, "backend": spec.get("backend"), "fewshot": spec.get("fewshot"),
             "max_new_tokens": spec.get("max_new_tokens"), "answer_tokens_median": spec.get("answer_tokens_median"),
             "stopped_at_budget": sum(r.get("stop_reason") == "length" for r in ran)}
        if spec.get("budget_warning"):
            m["max_new_tokens_warning"] = spec["budget_warning"]
        m.update(overlong_metrics(records, spec))  # problems skipped, or prompts (few-shot included) cut, to fit
        m.update(speed_metrics(ran))
        if spec.get("backend") == "lm-eval" and out is not None:
            from ..lmeval import replay_metrics

            m.update(replay_metrics(out, records, spec))
            if len(ran) < len(records):
                m["lm_eval/note"] = (f"the harness's exact_match counts the {len(records) - len(ran)} skipped problems "
                                     "as wrong; accuracy is over the problems that ran")
        return m
