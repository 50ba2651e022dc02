"""A tokenizer's chat template (Jinja, as in Hugging Face's tokenizer_config.json): conversations ->
token ids with a context mask (`data prepare --template tokenizer`), and prompts to decode from.

The template is rendered by transformers (`render_jinja_template`, what `apply_chat_template` runs:
its sandboxed Jinja environment, so a template cannot execute code), in a separate process with a
time, memory and output-size limit (`render_chat_template`, data_pipeline/template_worker.py), so a
template cannot hang or exhaust the process either, and the text is tokenized with
the template's special tokens parsed, as `apply_chat_template` tokenizes it. Which tokens the loss
sees:

* a template that marks the assistant's text with ``{% generation %}`` tags: every token inside
  them (every assistant turn of a multi-turn chat; `apply_chat_template`'s
  `return_assistant_tokens_mask` rule: a token that overlaps a marked span); the tokens after the
  last marked span (the template's trailing newline) are left out;
* any other template: the context is the rendering of the conversation before the last assistant
  turn with the generation prompt, the answer is the rest of the whole conversation's rendering (as
  TRL splits prompt and completion); a conversation whose context rendering is not a prefix of the
  whole one is skipped (``template_prefix``).

A prompt/completion pair (`encode(..., context=prompt)`) takes its context from the prompt's
rendering with the generation prompt in both cases (TRL's completion-only loss); the tags, where
present, still end the answer.

Because the rendered text is tokenized with special tokens parsed, a message holding the text of a
special token (``<|im_end|>``) would forge one: such a conversation is skipped (``special_text``).
`CHATML_JINJA` is the built-in ChatML template (prompt_answer.py's ``chatml``) written in Jinja with
generation tags: the template of the built-in ``qwen3`` tokenizer, and of exports whose tokenizer has
the ChatML tokens but no template of its own.
"""

from __future__ import annotations

import importlib.util
import re

from tokenizers import Tokenizer as _HFTokenizer

from .long_text import encode_prefix, encode_prefix_offsets
from .template_worker import RenderFailure, RenderLimit, TemplateWorker, default_worker
from .tokenizer import TokenizerError

__all__ = ["CHATML_JINJA", "ChatTemplate", "ChatTemplateError", "default_chat_template", "has_generation_tags",
           "hf_tokenizer", "render_chat_template", "check_chat_template", "RENDER_TIME_LIMIT_S", "RENDER_MAX_CHARS"]

RENDER_TIME_LIMIT_S = 10.0  # the most one rendering may take
RENDER_MAX_CHARS = 16_000_000  # the longest rendering (characters) that is kept

CHATML_JINJA = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}"
    "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def has_generation_tags(template: str) -> bool:
    return bool(_GENERATION.search(template))


def default_chat_template(tok) -> str | None:
    """The tokenizer's own template, else the built-in ChatML when it has the ChatML tokens."""
    if tok.chat_template:
        return tok.chat_template
    if tok.token_to_id("<|im_start|>") is not None and tok.token_to_id("<|im_end|>") is not None:
        return CHATML_JINJA
    return None


class ChatTemplateError(TokenizerError):
    """A chat template that fails or passes a limit when rendered (the message names the template)."""


def render_chat_template(template: str, messages: list[dict], *, add_generation_prompt: bool = False,
                         generation_spans: bool = False, variables: dict | None = None,
                         name: str = "the chat template", time_limit_s: float | None = None,
                         max_chars: int | None = None, worker: TemplateWorker | None = None) -> tuple[str, list]:
    """(text, generation spans) of `messages` rendered with the Jinja chat `template`, exactly as
    transformers' `apply_chat_template(..., tokenize=False)` renders it (`variables`: eos_token,
    bos_token, ...; `generation_spans`: the (start, end) characters of each ``{% generation %}`` block,
    [] otherwise). The render runs in a separate process (`worker`, default: this process's shared
    one) and is stopped past `time_limit_s` seconds (default RENDER_TIME_LIMIT_S, 10), past the
    worker's memory allowance (1 GiB), or when its text is longer than `max_chars` characters (default
    RENDER_MAX_CHARS, 16 million). Any failure is a one-line ChatTemplateError starting with
    `name` (what the user knows the template as: ``--chat-template FILE``, ``the chat template of
    tokenizer X``) that never holds the rendered text. Thread-safe: a worker renders one at a time."""
    if importlib.util.find_spec("transformers") is None:
        raise ChatTemplateError(f"{name}: rendering a chat template needs transformers (pip install transformers)")
    if not isinstance(template, str) or not template.strip():
        raise ChatTemplateError(f"{name}: empty or not a string")
    worker = worker or default_worker()
    time_limit_s = RENDER_TIME_LIMIT_S if time_limit_s is None else time_limit_s
    max_chars = RENDER_MAX_CHARS if max_chars is None else max_chars
    try:
        return worker.render(template, messages, {"add_generation_prompt": bool(add_generation_prompt),
                                                  **(variables or {})},
                             bool(generation_spans), time_limit_s=time_limit_s, max_chars=max_chars)
    except RenderLimit as e:
        raise ChatTemplateError(f"{name}: {e}; a template that loops or builds a huge text is refused (chat "
                                f"templates render under a time, memory and output limit)") from None
    except RenderFailure as e:
        raise ChatTemplateError(f"{name}: {e}") from None


def check_chat_template(template: str, variables: dict | None = None, name: str = "the chat template",
                        worker: TemplateWorker | None = None) -> None:
    """Renders a short chat (a user and an assistant turn) and a prompt (a user turn with the generation
    prompt) under the limits: a template that loops or fails whatever it is given is refused before
    any work (`worker`: the TemplateWorker to render in, default the process's own)."""
    user, assistant = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}
    for messages, prompt in (([user, assistant], False), ([user], True)):
        render_chat_template(template, messages, add_generation_prompt=prompt, variables=variables, name=name,
                             generation_spans=has_generation_tags(template), worker=worker)


class ChatTemplate:
    """`template` (Jinja) over the stack's tokenizer `tok`."""

    def __init__(self, tok, template: str, where: str = "the tokenizer's chat template",
                 worker: TemplateWorker | None = None):
        if not isinstance(template, str) or not template.strip():
            raise TokenizerError(f"{where}: empty or not a string")
        self.tok, self.template, self.where = tok, template, where
        self.tags = has_generation_tags(template)
        backend = _HFTokenizer.from_str(tok.backend.to_str())
        backend.encode_special_tokens = False  # the template's own special tokens are tokens
        self._backend = backend
        self._specials = sorted({t.content for t in backend.get_added_tokens_decoder().values() if t.special},
                                key=len, reverse=True)
        ids = {"eos_token": tok.eos_id, "bos_token": tok.bos_id, "pad_token": tok.pad_id, "mask_token": tok.mask_id}
        self._vars = {k: tok.id_to_token(v) for k, v in ids.items() if v is not None}
        check_chat_template(template, self._vars, where, worker)  # before any work

    def render(self, messages: list[dict], add_generation_prompt: bool = False, *,
               worker: TemplateWorker | None = None, time_limit_s: float | None = None) -> tuple[str, list]:
        """(text, generation spans as (start, end) characters; [] without generation tags), under the
        limits of `render_chat_template` (in `worker`, within `time_limit_s` when given)."""
        return render_chat_template(self.template, messages, add_generation_prompt=add_generation_prompt,
                                    generation_spans=self.tags, variables=self._vars, name=self.where,
                                    worker=worker, time_limit_s=time_limit_s)

    @property
    def backend(self) -> _HFTokenizer:
        """The `tokenizers.Tokenizer` that tokenizes rendered text (the template's special tokens parsed)."""
        return self._backend

    def tokens(self, text: str, limit: int | None = None) -> list[int]:
        """Ids of rendered `text` (special tokens parsed), the first `limit` of them when given."""
        if limit is None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return encode_prefix(self._backend, text, limit)

    def prompt(self, messages: list[dict]) -> list[int]:
        """Ids to decode the next assistant turn from: `messages` with the generation prompt."""
        return self.tokens(self.render(messages, add_generation_prompt=True)[0])

    def forges(self, messages: list[dict]) -> bool:
        """Whether a message's role or content holds the text of a special token."""
        return any(s in m[k] for m in messages for k in ("role", "content") for s in self._specials)

    def encode(self, messages: list[dict], limit: int | None = None, context: list[dict] | None = None):
        """(ids, context) of a conversation ending with an assistant turn, `context` the number of
        leading context tokens, or a 0/1 list per token where context follows an answer (multi-turn);
        or a skip reason (``special_text``, ``template_prefix``, ``empty_answer``). Only the first
        `limit` ids are made when given (what a row of ``limit - 1`` tokens needs). `context`: the
        leading messages that are context whatever the tags mark (a prompt/completion pair)."""
        if self.forges(messages):
            return "special_text"
        ctx = None
        if context is not None or not self.tags:
            before = messages[:-1] if context is None else context
            ctx = self.tokens(self.render(before, add_generation_prompt=True)[0], limit)
        if not self.tags:
            ids = self.tokens(self.render(messages)[0], limit)
            if ids[:len(ctx)] != ctx:
                return "template_prefix"
            return (ids, len(ctx)) if len(ids) > len(ctx) or len(ctx) == limit else "empty_answer"
        text, spans = self.render(messages)
        spans = [(a, b) for a, b in spans if b > a]
        if not spans:
            return "empty_answer"
        ids, offsets = encode_prefix_offsets(self._backend, text, limit or len(text) + 1)
        if ctx is not None and ids[:len(ctx)] != ctx:
            return "template_prefix"
        keep = sum(1 for a, _ in offsets if a < spans[-1][1])  # leave out what follows the last answer
        mask, k = [], 0
        for i, (a, b) in enumerate(offsets[:keep]):  # apply_chat_template's rule: a token overlapping a span
            while k < len(spans) and a >= spans[k][1]:
                k += 1
            mask.append(int(k < len(spans) and b > spans[k][0] and (ctx is None or i >= len(ctx))))
        if not any(mask) and len(ids) != limit:
            return "empty_answer"
        n_ctx = mask.index(1) if 1 in mask else len(mask)
        if all(mask[n_ctx:]):
            return ids[:keep], n_ctx
        return ids[:keep], [1 - m for m in mask]


def hf_tokenizer(tok, chat_template: str | None = None):
    """A transformers `PreTrainedTokenizerFast` of `tok` (special tokens parsed, as transformers
    tokenizes) carrying `chat_template` (default: `default_chat_template(tok)`): for tools that take a
    transformers tokenizer (lm-eval's ``apply_chat_template``, TRL)."""
    from transformers import PreTrainedTokenizerFast

    backend = _HFTokenizer.from_str(tok.backend.to_str())
    backend.encode_special_tokens = False
    names = {"eos_token": tok.eos_id, "bos_token": tok.bos_id, "pad_token": tok.pad_id, "mask_token": tok.mask_id}
    hf = PreTrainedTokenizerFast(tokenizer_object=backend,
                                 **{k: tok.id_to_token(v) for k, v in names.items() if v is not None})
    hf.chat_template = chat_template or default_chat_template(tok)
    return hf
