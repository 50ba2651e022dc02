"""`setdlm` as an lm-eval-harness model: after ``import eval.lmeval`` (or this module),
``lm_eval.simple_evaluate(model="setdlm", model_args="checkpoint=RUN_DIR,threshold=0.9", ...,
apply_chat_template=True)`` decodes any generation task with our samplers, rendering chat prompts
with the checkpoint tokenizer's template (eval/lmeval_chat.py)."""

from __future__ import annotations

from .errors import EvalError
from .lmeval_chat import ChatAPI, GenerationOnly, _base


def _register():
    try:
        from lm_eval.api.registry import register_model
    except ImportError:
        return None
    LM = _base()

    @register_model("setdlm")
    class SetDLMLM(ChatAPI, GenerationOnly, LM):
        """lm-eval LM for setdlm checkpoints (generate_until only).

        model_args: checkpoint=RUN_DIR, and optionally family, window, threshold, block_size,
        max_new_tokens, temperature, batch_size, device, ema, chat (tokenizer: the tokenizer's
        template, else ChatML, for --apply_chat_template; chatml; none). Decoding continues past
        max_seq_len as the reference's (the prompt must fit)."""

        def __init__(self, checkpoint: str, family=None, window=None, threshold=0.9, block_size=None,
                     max_new_tokens=256, temperature=0.0, batch_size=1, device=None, ema=True, chat="tokenizer", **_):
            super().__init__()
            from .models import Checkpoint, ModelPredictor, pick_device
            from .options import DecodingOptions, sampling_config

            self.ckpt = Checkpoint(checkpoint, ema=str(ema).lower() not in ("0", "false"), device=pick_device(0, device))
            opts = DecodingOptions(family=family, window=int(window) if window else None,
                                   threshold=None if threshold in (None, "none") else float(threshold),
                                   block_size=int(block_size) if block_size else None, temperature=float(temperature),
                                   max_new_tokens=int(max_new_tokens))
            self.predictor = ModelPredictor(self.ckpt, sampling_config(self.ckpt.cfg.objective, opts), overflow=True)
            self.bs = int(batch_size)
            self.chat = None
            if chat not in (None, "none", False):
                from .chat_prompt import ChatPrompts

                try:
                    self.chat = ChatPrompts(self.ckpt.tokenizer, str(chat))
                except EvalError:
                    if chat != "tokenizer":
                        raise
                self.chat_spec = self.chat.describe() if self.chat else None

        def generate_until(self, requests, disable_tqdm: bool = False):
            outs = []
            for i in range(0, len(requests), self.bs):
                group = requests[i:i + self.bs]
                until = list(group[0].arguments[1].get("until") or [])
                prompts = [r.arguments[0] for r in group]
                if self.chat is not None:  # rendered chat text: its special tokens are tokens
                    prompts = [self.chat.ids(p) for p in prompts]
                res = self.predictor.complete(prompts, seed=i, stop=until)
                outs += [o["text"] for o in res]
            return outs

    return SetDLMLM


try:
    SetDLMLM = _register()
except Exception:  # noqa: BLE001 - registering twice (re-import) or an incompatible harness
    SetDLMLM = None
