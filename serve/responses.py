"""OpenAI-shaped JSON bodies: completions, chat completions, their stream chunks and `usage`."""

from __future__ import annotations

import time
import uuid

from .streaming import final_payload, finish_reason


class Ids:
    """The id, creation time and object names of one response (shared by all its chunks)."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def head(self, stream: bool) -> dict:
        obj = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def usage(plan, outputs) -> dict:
    """Prompt tokens once per prompt (not per `n`), generated tokens of every choice, decoding steps."""
    prompt = sum(c.prompt_tokens for c in plan.choices[:: plan.n])
    completion = sum(len(o.tokens) for o in outputs)
    steps = sum(o.steps for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "setdlm": {"steps": steps, "tokens_per_step": round(completion / steps, 4) if steps else 0.0}}


def full(ids: Ids, plan, outputs) -> dict:
    choices = []
    for i, o in enumerate(outputs):
        text = o.text or ""
        c = {"index": i, "logprobs": None, "finish_reason": finish_reason(o), "setdlm": final_payload(o)}
        c.update({"message": {"role": "assistant", "content": text}} if ids.chat else {"text": text})
        choices.append(c)
    return {**ids.head(False), "choices": choices, "usage": usage(plan, outputs)}


def chunk(ids: Ids, index: int, text: str, payload: dict | None, finish: str | None = None,
          first: bool = False) -> dict:
    c = {"index": index, "logprobs": None, "finish_reason": finish}
    if ids.chat:
        c["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or not first else {})
    else:
        c["text"] = text
    if payload is not None:
        c["setdlm"] = payload
    return {**ids.head(True), "choices": [c]}


def usage_chunk(ids: Ids, plan, outputs) -> dict:
    return {**ids.head(True), "choices": [], "usage": usage(plan, outputs)}
