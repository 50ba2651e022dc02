"""Chat-formatted prompts for the decoding tasks (`setdlm eval gsm8k --prompt-format chatml|tokenizer`).

- ``chatml``: the built-in ChatML of `setdlm data prepare --template chatml` (special tokens inserted
  as ids, exactly the context of a chatml training row);
- ``tokenizer``: the checkpoint tokenizer's own chat template (``chat_template`` of its
  tokenizer_config.json, which exports carry), else the built-in ChatML where the tokenizer has the
  ChatML tokens (`data_pipeline.chat_template.default_chat_template`): what lm-eval's
  ``apply_chat_template`` renders for a Hugging Face model, tokenized as it tokenizes (special tokens
  parsed).

`ChatPrompts.fit` cuts an over-long prompt inside the content of its last user turn (its start: the
question at the end is kept), never inside a turn's header: ``<|im_start|>user\\n`` ...
``<|im_end|>\\n<|im_start|>assistant\\n`` stay whole. `render_text` renders a template from its text
alone (the merge replays the harness's prompts without the tokenizer).
"""

from __future__ import annotations

from .errors import EvalError

FORMATS = ("chatml", "tokenizer")


def render_text(template: str, variables: dict, messages: list[dict], add_generation_prompt: bool = True,
                name: str = "--prompt-format: the chat template") -> str:
    """`messages` rendered with the Jinja `template` as `apply_chat_template(..., tokenize=False)` does
    (transformers' sandboxed renderer, under `render_chat_template`'s time, memory and output limits;
    `variables`: the special tokens, eos_token, ...)."""
    from data_pipeline.chat_template import ChatTemplateError, render_chat_template

    try:
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    variables=variables, name=name)[0]
    except ChatTemplateError as e:
        raise EvalError(str(e)) from None


def read_template(path: str) -> str:
    """The text of a --chat-template file (EvalError naming it)."""
    from pathlib import Path

    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EvalError(f"--chat-template: {path} cannot be read ({type(e).__name__}: {e.strerror or e})") from None
    if not text.strip():
        raise EvalError(f"--chat-template: {path} is empty (a Jinja chat template)")
    return text


class ChatPrompts:
    """Prompts of `fmt` ("chatml" or "tokenizer") for the stack's tokenizer `tok`; `template` (the text
    of --chat-template `template_name`) replaces the tokenizer's own; `paper`: under --protocol paper."""

    def __init__(self, tok, fmt: str, *, template: str | None = None, template_name: str | None = None,
                 paper: bool = False):
        from data_pipeline.chat_template import CHATML_JINJA, ChatTemplate, default_chat_template

        if fmt not in FORMATS:
            raise EvalError(f"--prompt-format: {fmt!r} is not a chat format; valid: {', '.join(FORMATS)}")
        has_chatml = tok.token_to_id("<|im_start|>") is not None and tok.token_to_id("<|im_end|>") is not None
        if fmt == "chatml" and not has_chatml:
            raise EvalError(f"--prompt-format chatml: tokenizer {tok.name!r} has no <|im_start|>/<|im_end|> tokens; "
                            f"use --prompt-format plain")
        own = template is None
        template = CHATML_JINJA if fmt == "chatml" else template or default_chat_template(tok)
        if template is None:
            what = "--protocol paper" if paper else "--prompt-format tokenizer"
            instead = ("or drop --protocol paper and evaluate with plain prompts (--prompt-format plain)" if paper
                       else "or use --prompt-format plain")
            raise EvalError(f"{what}: tokenizer {tok.name!r} has no chat template (tokenizer_config.json chat_template) "
                            f"and no ChatML tokens to render the prompts with; give the template the model was "
                            f"fine-tuned with as --chat-template FILE, {instead}")
        self.tok, self.fmt, self.template = tok, fmt, template
        self.source = ("built-in ChatML" if template == CHATML_JINJA and (fmt == "chatml" or not tok.chat_template)
                       else "the tokenizer's chat_template" if own else f"--chat-template {template_name}")
        self.where = f"--prompt-format {fmt}: the chat template" + (
            f" of tokenizer {tok.name!r}" if self.source == "the tokenizer's chat_template" else
            " (built-in ChatML)" if self.source == "built-in ChatML" else f" {template_name}")
        self._chat = ChatTemplate(tok, template, where=self.where)
        names = {"eos_token": tok.eos_id, "bos_token": tok.bos_id, "pad_token": tok.pad_id, "mask_token": tok.mask_id}
        self.variables = {k: tok.id_to_token(v) for k, v in names.items() if v is not None}

    def describe(self) -> dict:
        """What the merge needs to render the same prompts (and what the spec records)."""
        return {"format": self.fmt, "source": self.source, "template": self.template, "variables": self.variables}

    def text(self, messages: list[dict]) -> str:
        return render_text(self.template, self.variables, messages, name=self.where)

    def ids(self, prompt) -> list[int]:
        """Token ids of a prompt: messages, or a rendered text (special tokens parsed, as transformers)."""
        if isinstance(prompt, str):
            return self._chat.tokens(prompt)
        if self.fmt == "chatml":
            from data_pipeline.prompt_answer import chatml_prompt

            return chatml_prompt(self.tok, prompt)
        return self._chat.tokens(self.text(prompt))

    def floor(self, messages: list[dict]) -> int:
        """Tokens of the prompt with its last user turn's content emptied (the most a cut can reach)."""
        return len(self.ids(_with_content(messages, "")))

    def fit(self, messages: list[dict], limit: int) -> tuple[list[int], int] | None:
        """(ids, tokens cut) of the prompt of `messages` in at most `limit` tokens: the start of the last
        user turn's content is cut as far as needed; None when even an empty content does not fit."""
        ids = self.ids(messages)
        if len(ids) <= limit:
            return ids, 0
        content = self.tok.encode(messages[-1]["content"])
        k = len(ids) - limit
        while k <= len(content):
            cut = self.ids(_with_content(messages, self.tok.decode(content[k:]) if k < len(content) else ""))
            if len(cut) <= limit:
                return cut, len(ids) - len(cut)
            k += len(cut) - limit  # a re-tokenized boundary can cost a token more than counted
        return None


def _with_content(messages: list[dict], content: str) -> list[dict]:
    return [*messages[:-1], {**messages[-1], "content": content}]
