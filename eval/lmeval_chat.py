"""lm-eval-harness's LM base class (imported lazily), its chat API for our LM classes, and the
likelihood requests they do not serve."""

from __future__ import annotations

from .errors import EvalError


def _base():
    try:
        from lm_eval.api.model import LM
    except ImportError:
        raise EvalError("lm-evaluation-harness is not installed: pip install 'setdlm[lm-eval]'") from None
    return LM


class ChatAPI:
    """lm-eval's chat API for an LM class (mixed in before `LM`): `apply_chat_template` renders the
    history with the template of `chat_spec` (eval/chat_prompt.py `describe()`) and remembers it, so
    a prompt that must be cut is cut inside its last user turn's content, not its header."""

    chat_spec: dict | None = None

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        from .chat_prompt import render_text

        if not self.chat_spec:
            raise EvalError("apply_chat_template: this run has no chat template (--prompt-format chatml or tokenizer)")
        text = render_text(self.chat_spec["template"], self.chat_spec["variables"], list(chat_history),
                           add_generation_prompt)
        self.histories = getattr(self, "histories", None) or {}
        self.histories[text] = list(chat_history)
        return text

    @property
    def tokenizer_name(self) -> str:
        spec = self.chat_spec or {}
        return f"setdlm-{spec.get('format', 'plain')}"

    def chat_template(self, chat_template=False) -> str:
        return (self.chat_spec or {}).get("template", "")


class GenerationOnly:
    """Our LM classes serve `generate_until` only (mixed in before `LM`): a likelihood request names the
    command that computes the bound instead."""

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("setdlm: loglikelihood requests are not supported (use setdlm eval likelihood)")

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("setdlm: loglikelihood requests are not supported (use setdlm eval likelihood)")
