"""One example -> (token ids, context) under one template: the formats and templates of
`setdlm data prepare --format ...` (described in prompt_answer.py, which drives them).

With `max_tokens` only the first `max_tokens` ids of an example are made (a long text is tokenized
only as far as that, data_pipeline/long_text.py): every decision about a row of ``max_tokens - 1``
tokens (cut, left out, no room) comes out as with all of them.
"""

from __future__ import annotations

import numpy as np

from .chat_template import ChatTemplate
from .example_sources import ExampleError
from .long_text import encode_prefix

__all__ = ["Encoder", "chatml_prompt", "FORMATS", "TEMPLATES", "SKIPS", "IM_START", "IM_END", "PLAIN_PROMPT"]

FORMATS = ("prompt_answer", "prompt_completion", "chat", "marker")
TEMPLATES = ("auto", "chatml", "plain", "tokenizer")
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
PLAIN_PROMPT = "Question: {prompt}\nAnswer:"
SKIPS = ("no_marker", "empty_answer", "no_room", "special_text", "template_prefix")


def _messages_problem(msgs) -> bool:
    return not isinstance(msgs, list) or not msgs or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs)


class Encoder:
    """Turns examples into (token ids, context) under one template; `choice` says which and why."""

    def __init__(self, tok, fmt: str, template: str = "auto", *, prompt_field: str = "prompt",
                 answer_field: str = "answer", messages_field: str = "messages", prompt_template: str = PLAIN_PROMPT,
                 marker: str = IM_START, marker_offset: int = 2, chat_template: str | None = None,
                 chat_template_name: str | None = None, max_tokens: int | None = None):
        if fmt not in FORMATS:
            raise ExampleError(f"--format: {fmt!r}; valid: text, {', '.join(FORMATS)}")
        if template not in TEMPLATES:
            raise ExampleError(f"--template: {template!r}; valid: {', '.join(TEMPLATES)}")
        self.tok, self.fmt, self.max_tokens = tok, fmt, max_tokens
        self.im_start, self.im_end = tok.token_to_id(IM_START), tok.token_to_id(IM_END)
        has_chat = self.im_start is not None and self.im_end is not None
        jinja = chat_template or tok.chat_template
        asked = template
        if template == "auto":
            template, why = self._auto(has_chat, jinja)
        else:
            why = "as asked"
        if template != "tokenizer" and jinja:
            why += "; the tokenizer has a chat template of its own: --template tokenizer renders with it"
        self.choice = f"--template {asked}: {template} ({why})"
        if template == "chatml" and not has_chat:
            raise ExampleError(f"--template chatml: tokenizer {tok.name!r} has no {IM_START} / {IM_END} tokens; use "
                               "--template plain or a tokenizer with chat tokens (e.g. Qwen's)")
        if fmt == "chat" and template not in ("chatml", "tokenizer"):
            raise ExampleError("--format chat: needs the chatml template (a tokenizer with <|im_start|>/<|im_end|>) "
                               "or --template tokenizer (a tokenizer with a chat template)")
        if template == "plain" and tok.eos_id is None and fmt != "prompt_completion":
            raise ExampleError(f"--template plain: tokenizer {tok.name!r} has no EOS token to end the answer with")
        if "{prompt}" not in prompt_template:
            raise ExampleError(f"--prompt-template: {prompt_template!r} has no {{prompt}} placeholder")
        self.chat = None
        if template == "tokenizer":
            if not jinja:
                raise ExampleError(f"--template tokenizer: tokenizer {tok.name!r} has no chat template (tokenizer_config"
                                   ".json's chat_template or chat_template.jinja); give one with --chat-template FILE "
                                   "or use --template chatml|plain")
            where = (chat_template_name or "--chat-template") if chat_template else \
                f"the chat template of tokenizer {tok.name!r}"
            self.chat = ChatTemplate(tok, jinja, where)
        self.template, self.prompt_template = template, prompt_template
        self.fields = (prompt_field, answer_field, messages_field)
        if fmt == "marker":
            self.marker = tok.token_to_id(marker)
            if self.marker is None:
                raise ExampleError(f"--marker: {marker!r} is not a token of tokenizer {tok.name!r}")
            if marker_offset < 0:
                raise ExampleError(f"--marker-offset: must be >= 0, got {marker_offset}")
            self.marker_offset = marker_offset

    def _auto(self, has_chat: bool, jinja) -> tuple[str, str]:
        name = self.tok.name
        if has_chat:
            return "chatml", f"tokenizer {name!r} has the {IM_START}/{IM_END} tokens"
        if jinja and self.fmt in ("chat", "prompt_completion"):
            return "tokenizer", f"tokenizer {name!r} has no {IM_START}/{IM_END} tokens but a chat template"
        return "plain", f"tokenizer {name!r} has no {IM_START}/{IM_END} tokens"

    # -- checks (open_examples runs them on every example before any work) -------------------------
    def check(self, ex) -> str | None:
        """What is wrong with example `ex` (a user's mistake), or None."""
        pf, af, mf = self.fields
        if self.fmt == "marker":
            if isinstance(ex, dict) and not (isinstance(ex.get("input_ids"), list)
                                             and all(isinstance(t, int) for t in ex["input_ids"])):
                return "--format marker: field 'input_ids' missing or not a list of token ids"
            return None
        if self.fmt == "chat":
            if _messages_problem(ex.get(mf)):
                return f"--format chat: field {mf!r} must be a list of {{role, content}} strings"
            return None
        if self.fmt == "prompt_completion":
            p, c = ex.get("prompt"), ex.get("completion")
            if isinstance(p, str) and isinstance(c, str):
                return None
            if isinstance(p, list) and isinstance(c, list) and not _messages_problem(p) and not _messages_problem(c):
                if self.template not in ("chatml", "tokenizer"):
                    return ("--format prompt_completion: conversational rows (message lists) need a chat template: "
                            "--template chatml or tokenizer")
                return None
            return ("--format prompt_completion: fields 'prompt' and 'completion' must both be strings, or both lists "
                    f"of {{role, content}} strings (TRL's conversational form); fields: {sorted(ex)}")
        for f in (pf, af):
            if not isinstance(ex.get(f), str):
                return (f"--format prompt_answer: field {f!r} missing or not a string (fields: {sorted(ex)}); set "
                        "--prompt-field / --answer-field")
        return None

    # -- encoding ------------------------------------------------------------------------------
    def _enc(self, text: str, room: int | None) -> list[int]:
        if room is None:
            return self.tok.encode(text)
        return encode_prefix(self.tok.backend, text, room) if room > 0 else []

    def _room(self, used: int, least: int = 0) -> int | None:
        return None if self.max_tokens is None else max(self.max_tokens - used, least)

    def _chatml(self, messages: list[dict]) -> tuple[list[int], int, int]:
        ids = chatml_prompt(self.tok, messages[:-1], messages[-1]["role"], limit=self.max_tokens)
        answer = self._enc(messages[-1]["content"], self._room(len(ids), 1))
        return ids + answer + [self.im_end], len(ids), len(answer)

    def encode(self, ex):
        """(ids, context length), or the name of the reason it is skipped (see SKIPS). A multi-turn
        chat under --template tokenizer may give a 0/1 context list per token instead of a length."""
        problem = self.check(ex)
        if problem:
            raise ExampleError(problem)
        out = self._encode(ex)
        if isinstance(out, str) or self.max_tokens is None:
            return out
        ids, ctx = out
        return ids[: self.max_tokens], ctx

    def _encode(self, ex):
        if self.fmt == "marker":
            ids = np.asarray(ex["input_ids"] if isinstance(ex, dict) else ex)
            where = np.flatnonzero(ids == self.marker)
            if not len(where):
                return "no_marker"
            n_ctx = min(int(where[-1]) + self.marker_offset + 1, len(ids))
            return (ids[: self.max_tokens].tolist(), n_ctx) if n_ctx < len(ids) else "empty_answer"
        pf, af, mf = self.fields
        if self.fmt == "chat":
            msgs = ex[mf]
            if msgs[-1]["role"] != "assistant":
                return "empty_answer"
            if self.chat is not None:
                return self.chat.encode(msgs, self.max_tokens) if msgs[-1]["content"].strip() else "empty_answer"
        elif self.fmt == "prompt_completion":
            if isinstance(ex["prompt"], str):  # TRL's standard form: prompt + completion + EOS, no template
                return self._concatenated(ex["prompt"], ex["completion"])
            prompt, completion = ex["prompt"], ex["completion"]
            if not completion or not completion[-1]["content"].strip():
                return "empty_answer"
            if self.chat is not None:
                return self.chat.encode(prompt + completion, self.max_tokens, context=prompt)
            ctx = chatml_prompt(self.tok, prompt, completion[0]["role"], limit=self.max_tokens)
            ids, _, n_answer = self._chatml(prompt + completion)
            return (ids, len(ctx)) if n_answer else "empty_answer"
        else:
            if self.template == "plain":
                ctx = self._enc(self.prompt_template.format(prompt=ex[pf]), self._room(0))
                answer = self._enc(" " + ex[af], self._room(len(ctx), 1)) if ex[af].strip() else []
                return (ctx + answer + [self.tok.eos_id], len(ctx)) if answer else "empty_answer"
            msgs = [{"role": "user", "content": ex[pf]}, {"role": "assistant", "content": ex[af]}]
            if self.chat is not None:
                return self.chat.encode(msgs, self.max_tokens) if ex[af].strip() else "empty_answer"
        ids, n_ctx, n_answer = self._chatml(msgs)
        return (ids, n_ctx) if n_answer and msgs[-1]["content"].strip() else "empty_answer"

    def _concatenated(self, prompt: str, completion: str):
        if self.tok.eos_id is None:
            raise ExampleError(f"--format prompt_completion: tokenizer {self.tok.name!r} has no EOS token to end the "
                               "completion with")
        ctx = self._enc(prompt, self._room(0))
        answer = self._enc(completion, self._room(len(ctx), 1)) if completion.strip() else []
        return (ctx + answer + [self.tok.eos_id], len(ctx)) if answer else "empty_answer"


def chatml_prompt(tok, messages: list[dict], next_role: str = "assistant", limit: int | None = None) -> list[int]:
    """Ids of `messages` in the built-in ChatML template followed by the header of the next turn
    (``<|im_start|>assistant\n``): the context of training rows, and the prompt to decode from.
    With `limit`, only the first `limit` ids are right (texts are tokenized no further)."""
    im_start, im_end = tok.token_to_id(IM_START), tok.token_to_id(IM_END)
    if im_start is None or im_end is None:
        raise ExampleError(f"the chatml template needs {IM_START} / {IM_END}, which tokenizer {tok.name!r} lacks")
    ids = []

    def enc(text):
        if limit is None:
            return tok.encode(text)
        return encode_prefix(tok.backend, text, limit - len(ids)) if len(ids) < limit else []

    for m in messages:
        ids += [im_start, *enc(f"{m['role']}\n")]
        ids += [*enc(m["content"]), im_end]
        ids += enc("\n")
    ids += [im_start]
    return ids + enc(f"{next_role}\n")
