"""A validated request -> what the decode loop runs: a SamplingConfig and one Choice per output.

`sampling_config` is the one place request fields become a SamplingConfig; it starts from the
checkpoint's recipe exactly as `setdlm sample` does (family, window w = D, block size; w = S_max for
infilling), so the same fields decode the same tokens. The budget checks name the field at fault
(`total_budget`): a prompt (with an infill's suffix) must fit in the model's positions, as it is
prefilled in one forward (`prompt` / `messages`); prompt + new tokens must fit in the output budget,
which for SW-SetDLM, BD3-LM and AR is the server's `--max-total-tokens` (they decode past the model's
positions by dropping the oldest cached tokens, model/sampling) and for MDLM the model's positions
(it re-reads the whole sequence every step) (`max_tokens`, `setdlm.infill.length`); a window above the
model's S_max (`setdlm.window`). Every other number a request holds is bounded by the model before
anything is allocated (`check_numbers`): token ids (in prompts and `logit_bias`) inside the vocabulary,
widths (`setdlm.window`, `block_size`, ...) within the model's positions, step counts within the
output budget. A prompt is tokenised only as far as the model's positions reach (`encode`), in a way
that lets the event loop's thread run meanwhile; a chat is rendered by `render_chat` with the
tokenizer's template, checked once (`chat_template`: a failing one is remembered and refused).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass

from data_pipeline.long_text import encode_prefix
from model.sampling import Infill, SamplingConfig
from model.sampling.stop_regex import StopRegexError, compile_stop_regex

from .schema import MAX_CHOICES, ChatRequest, CompletionRequest, RequestError

log = logging.getLogger("setdlm.serve")

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions; chat defaults to the room left
PLAIN_CHAT = ("User", "Assistant")  # the chat template of a tokenizer without chat tokens
CHAT_RENDER_SECONDS = 5.0  # the most one request's chat rendering may take (a slower one is a 400 naming messages)
_CHAT_LOCK = threading.Lock()


@dataclass
class Choice:
    index: int
    prompt: list[int] | Infill
    prompt_tokens: int
    max_new_tokens: int
    stop: list[str]
    stop_regex: str | None
    prompt_text: str = ""  # echoed before the completion with `echo`


@dataclass
class Plan:
    chat: bool
    cfg: SamplingConfig  # shared by every choice (per-choice fields are in Choice)
    choices: list[Choice]
    stream: bool
    include_usage: bool
    n: int  # choices per prompt
    texts: list[tuple[str, str]]  # per choice: the prompt text and the infill suffix (for traces)
    logprobs: int | None = None  # alternatives per token in `logprobs` (None: no logprobs)
    echo: bool = False  # completions: the prompt's text before each completion


def sampling_config(req, recipe, *, infill: bool, stop_token_ids=()) -> SamplingConfig:
    """Request fields over the recipe's defaults (those of `setdlm sample`); stop strings are per choice."""
    ext, obj = req.setdlm, recipe.objective
    cfg = SamplingConfig.from_objective(obj)
    window = cfg.spec.infill_window(obj) if infill and ext.window is None else None
    if window:  # SW-SetDLM: the paper infills with w = S_max
        cfg = dataclasses.replace(cfg, window=window)
    fields = {k: getattr(ext, k) for k in ("family", "window", "threshold", "adaptive_window", "window_min",
                                           "window_max", "block_size", "steps_per_block", "steps", "remasking",
                                           "top_k", "repetition_penalty")}
    fields.update(temperature=req.temperature, top_p=req.top_p, seed=req.seed, stop_on_eos=not ext.ignore_eos,
                  stop_token_ids=sorted(set(stop_token_ids)), presence_penalty=req.presence_penalty,
                  frequency_penalty=req.frequency_penalty, logit_bias=dict(req.logit_bias or {}),
                  logprobs=logprobs_wanted(req))
    try:  # the section checks every value, S_max (SamplingConfig.s_max, from the objective) included
        cfg = dataclasses.replace(cfg, **{k: v for k, v in fields.items() if v is not None})
        if cfg.greedy:  # greedy ignores these: requests differing only there share a batch
            cfg = dataclasses.replace(cfg, top_p=1.0, top_k=0, seed=None)
        cfg.validate()
    except ValueError as e:  # "sampling.window: ..." -> the request's name of that field
        name, _, msg = str(e).partition(": ")
        field = name.removeprefix("sampling.")
        top = ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs")
        raise RequestError(field if field in top else f"setdlm.{field}", msg) from None
    return cfg


def logprobs_wanted(req) -> int | None:
    """Alternatives per token the response's `logprobs` lists (None: no logprobs): completions'
    `logprobs: k`, chat's `logprobs: true` with `top_logprobs: k`."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def check_numbers(req, served) -> None:
    """Bound what a request's numbers may allocate or loop over by the model and the server's limits."""
    L, ext = served.max_len, req.setdlm
    most = (L - 1) // 2  # a step forwards up to twice its width (committed tokens + queries) within L positions
    for name in ("window", "window_min", "window_max", "block_size"):
        v = getattr(ext, name)
        if v is not None and v > most:
            raise RequestError(f"setdlm.{name}", f"at most {most}: a decoding step forwards up to twice this many "
                                                 f"tokens within the model's {L} positions; got {v}")
    budget = served.max_total or L
    for name in ("steps", "steps_per_block"):
        v = getattr(ext, name)
        if v is not None and v > budget:
            raise RequestError(f"setdlm.{name}", f"at most {budget} (this server's tokens per output); got {v}")
    vocab = served.model.cfg.vocab_size
    if ext.top_k is not None and ext.top_k > vocab:
        raise RequestError("setdlm.top_k", f"at most the vocabulary size {vocab}; got {ext.top_k}")
    for t in req.logit_bias or {}:
        if not 0 <= t < vocab or t == served.mask_id:
            raise RequestError("logit_bias", f"token id {t} is not a visible token id (vocabulary {vocab}, "
                                             f"MASK {served.mask_id})")


def total_budget(served, spec) -> int:
    """Prompt + new tokens one output may have: the model's positions for MDLM (it re-reads the whole
    sequence every step); the server's `max_total` for the cached families, which decode past the
    positions by dropping the oldest cached tokens (the prompt alone must fit: it is prefilled)."""
    total = served.max_total or served.max_len
    return min(total, served.max_len) if spec.rereads_sequence else total


@dataclass
class ChatText:
    """A chat rendered for decoding: its text, the template that rendered it (None: the plain
    'User: ...' format), and the stop token ids and strings that end the answer."""

    text: str
    template: object | None
    stop_ids: list[int]
    stops: list[str]


def chat_template(served, worker=None):
    """The served tokenizer's chat template (a ChatTemplate; None: the plain format), built and checked
    once (data_pipeline/chat_template.py renders a short chat under its limits). A template that fails
    that check is remembered as failing: every chat request is then a 400 naming `messages`, and it is
    never rendered again. `worker`: the TemplateWorker of the check (default: the process's own)."""
    with _CHAT_LOCK:
        if not served.chat_checked:
            from data_pipeline.chat_template import ChatTemplate, default_chat_template
            from data_pipeline.tokenizer import TokenizerError

            template = default_chat_template(served.tokenizer)
            if template is not None:
                try:
                    served.chat = ChatTemplate(served.tokenizer, template, worker=worker)
                except TokenizerError as e:
                    served.chat_error = str(e)
                    log.warning("setdlm serve: chat requests will be refused: %s", e)
            served.chat_checked = True
    if served.chat_error is not None:
        raise RequestError("messages", f"this server cannot render chats ({served.chat_error}; checked once at "
                                       f"start); send a prompt to /v1/completions")
    return served.chat


def render_chat(served, messages, generation_prompt: bool = True, worker=None,
                time_limit_s: float | None = None) -> ChatText:
    """`messages` rendered with the tokenizer's chat template and the generation prompt
    (`default_chat_template`: its own Jinja template, else the built-in ChatML where it has the ChatML
    tokens), as transformers' `apply_chat_template` renders them, `<|im_end|>` stopping the answer
    where the tokenizer has it; else 'User: ...\nAssistant:'. The render runs in a TemplateWorker
    process (`worker`, under `time_limit_s`): the caller's thread only waits for it."""
    from data_pipeline.prompt_answer import IM_END
    from data_pipeline.tokenizer import TokenizerError

    msgs = [message_dict(m) for m in messages]
    chat = chat_template(served)
    tok = served.tokenizer
    if chat is None:
        user, bot = PLAIN_CHAT
        names = {"system": "System", "user": user, "assistant": bot}
        text = "".join(f"{names[m['role']]}: {m['content']}\n" for m in msgs) + (f"{bot}:" if generation_prompt else "")
        return ChatText(text, None, [], [f"\n{user}:"])
    names = [{"role": m["role"], "content": m.get("name", "")} for m in msgs]
    if chat.forges(msgs) or chat.forges(names):
        raise RequestError("messages", "a message holds the text of a special token of the chat template "
                                       "(e.g. <|im_end|>), which would forge one; leave it out")
    try:  # in the worker process, under its time, memory and output limits (a failure is a 400 naming `messages`)
        text, _ = chat.render(msgs, add_generation_prompt=generation_prompt, worker=worker, time_limit_s=time_limit_s)
    except TokenizerError as e:
        raise RequestError("messages", str(e)) from None
    end = tok.token_to_id(IM_END)
    return ChatText(text, chat, [end] if end is not None else [], [])


class Unlocked:
    """A `tokenizers.Tokenizer` whose `encode` lets other threads run: `tokenizers` holds Python's
    interpreter lock for the whole of `encode` (4 MB of text: seconds during which the event loop
    cannot answer /health), but releases it in `encode_batch`, whose Encoding of one text is the same."""

    def __init__(self, backend):
        self.backend = backend

    def encode(self, text: str, add_special_tokens: bool = False):
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def get_added_tokens_decoder(self):
        return self.backend.get_added_tokens_decoder()


def encode(served, text: str, limit: int | None = None, backend=None) -> list[int]:
    """The token ids of `text`; with `limit`, the first `limit` of them (all when fewer), reading a long
    text only as far as they reach (data_pipeline/long_text.py): a prompt of megabytes then costs what
    its first `limit` tokens cost. Safe to call from a thread beside the event loop (`Unlocked`).
    `backend`: a tokenizers.Tokenizer other than the served tokenizer's (a chat template's)."""
    unlocked = Unlocked(backend or served.tokenizer.backend)
    if limit is None:
        return unlocked.encode(text).ids
    return encode_prefix(unlocked, text, limit)


def chat_ids(chat: ChatText, served, limit: int | None = None) -> list[int]:
    """The ids of a rendered chat (the first `limit` when given), its template's special tokens parsed."""
    return encode(served, chat.text, limit, None if chat.template is None else chat.template.backend)


def message_dict(m) -> dict:
    """A chat message as the template sees it: `developer` is rendered as `system` (templates know
    the older name), null content (an assistant turn) as empty text, `name` kept where given."""
    d = {"role": "system" if m.role == "developer" else m.role, "content": m.content or ""}
    if m.name is not None:
        d["name"] = m.name
    return d


def _check_ids(ids: list[int], served, i: int) -> None:
    vocab = served.model.cfg.vocab_size
    for t in ids:
        if not 0 <= t < vocab or t == served.mask_id:
            raise RequestError("prompt", f"prompt {i}: token id {t} is not a visible token id (vocabulary {vocab}, "
                                         f"MASK {served.mask_id})")


def check_request(req: CompletionRequest | ChatRequest, served) -> None:
    """The checks that need neither tokens nor a rendered chat: the model's name, the numbers
    (`check_numbers`), prompts x `n`."""
    if req.model is not None and req.model != served.name:
        raise RequestError("model", f"unknown model {req.model!r}; this server serves {served.name!r}", 404,
                           "not_found_error")
    check_numbers(req, served)
    n_prompts = 1 if isinstance(req, ChatRequest) else len(req.prompt)
    if n_prompts * req.n > MAX_CHOICES:
        raise RequestError("n", f"{n_prompts} prompts x n={req.n} is more than {MAX_CHOICES} outputs in one request")


def plan(req: CompletionRequest | ChatRequest, served, chat: ChatText | None = None) -> Plan:
    """Tokenize and check a request against the served model (RequestError naming the field); `chat`:
    the request's messages already rendered (`render_chat`; rendered here otherwise). The cheap checks
    come first; a prompt is tokenized only as far as the model's positions reach, so one longer than
    them costs no more than one that fits."""
    tok, L = served.tokenizer, served.max_len
    check_request(req, served)
    chat_req = isinstance(req, ChatRequest)
    stop_ids, stops = [], list(req.stop)
    if chat_req:
        chat = chat or render_chat(served, req.messages)
        ids = chat_ids(chat, served, L + 1)
        prompts, texts, stop_ids, stops = [ids], [tok.decode(ids)], chat.stop_ids, stops + chat.stops
        max_tokens = req.max_completion_tokens or req.max_tokens
    else:
        prompts = [encode(served, p, L + 1) if isinstance(p, str) else p for p in req.prompt]
        for i, ids in enumerate(prompts):  # before anything decodes them
            _check_ids(ids, served, i)
        texts = [p if isinstance(p, str) else tok.decode(p) for p in req.prompt]
        max_tokens = req.max_tokens
    ext = req.setdlm
    echo = bool(getattr(req, "echo", False))
    if echo and logprobs_wanted(req) is not None:
        raise RequestError("echo", "with logprobs it asks for the prompt's log-probabilities, which this server does "
                                   "not compute (a set model scores a text with `setdlm eval likelihood`); "
                                   "leave one of them out")
    if echo and ext.infill is not None:
        raise RequestError("echo", "not with setdlm.infill (the output is the span between prompt and suffix)")
    if ext.stop_regex is not None:
        try:
            compile_stop_regex(ext.stop_regex)
        except StopRegexError as e:
            raise RequestError("setdlm.stop_regex", str(e)) from None
    infill = ext.infill if not chat_req else None
    if chat_req and ext.infill is not None:
        raise RequestError("setdlm.infill", "infilling is for /v1/completions (prompt + suffix)")
    suffix = encode(served, infill.suffix, L + 1) if infill is not None else []
    if infill is not None and max_tokens is not None and max_tokens != infill.length:
        raise RequestError("max_tokens", f"with setdlm.infill the span is setdlm.infill.length={infill.length}; "
                                         f"leave max_tokens out or set it equal")
    cfg = sampling_config(req, served.recipe, infill=infill is not None, stop_token_ids=stop_ids)
    budget = total_budget(served, cfg.spec)
    where = (f"the model's {L} positions ({cfg.spec.title} re-reads the whole sequence)" if budget == L and cfg.spec.rereads_sequence
             else f"this server's {budget} tokens per output")
    choices, per = [], []
    field = "messages" if chat_req else "prompt"
    for i, ids in enumerate(prompts):
        if not ids and not suffix:
            raise RequestError(field, "empty prompt; give at least one token of text")
        visible = len(ids) + len(suffix)
        room = budget - visible
        if visible > L or room < 1:
            count = f"more than {L}" if len(ids) > L or len(suffix) > L else str(visible)  # tokenized up to L + 1
            raise RequestError(field, f"{count} prompt tokens " + (
                f"exceed the model's {L} positions (a prompt is read in one forward)" if visible > L else
                f"leave no room for new tokens in {where}"))
        if infill is not None:
            if infill.length > room:
                raise RequestError("setdlm.infill.length", f"{infill.length} tokens between a {len(ids)}-token prompt "
                                                           f"and a {len(suffix)}-token suffix exceed {where}; "
                                                           f"at most {room}")
            prompt, n_new = Infill(ids, infill.length, suffix), infill.length
        else:
            n_new = max_tokens if max_tokens is not None else (room if chat_req else min(DEFAULT_MAX_TOKENS, room))
            if n_new > room:
                raise RequestError("max_tokens", f"{n_new} new tokens after a {len(ids)}-token prompt exceed {where}; "
                                                 f"at most {room}")
            prompt = ids
        for _ in range(req.n):
            choices.append(Choice(len(choices), prompt, len(ids) + len(suffix), n_new, stops, ext.stop_regex,
                                  texts[i] if echo else ""))
            per.append((texts[i], infill.suffix if infill is not None else ""))
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return Plan(chat_req, cfg, choices, req.stream, include_usage, req.n, per, cfg.logprobs, echo)
