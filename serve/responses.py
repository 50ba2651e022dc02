"""OpenAI-shaped JSON bodies: completions, chat completions, their stream chunks, `usage` and `logprobs`."""

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


def _keyed(pairs: list[tuple[str, float]]) -> dict:
    """Completions' top_logprobs {token text: logprob}; two tokens with the same text (e.g. two halves
    of characters, both shown as U+FFFD) stay apart as 'token_id:ID' (vLLM's spelling)."""
    out = {}
    for (tid, piece), lp in pairs:
        out[piece if piece not in out else f"token_id:{tid}"] = lp
    return out


def logprobs(tokenizer, out, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's `logprobs` of one choice: per output token its log-probability under the decoding step
    that committed it, and that step's most likely tokens at its position (model/sampling, docs/serve.md);
    completions' `top_logprobs` also hold the chosen token (so `logprobs: 0` gives it alone), chat's only
    the `top_logprobs` most likely, as OpenAI's two APIs do."""
    if out.logprobs is None:
        return None
    piece = {}

    def text(t: int) -> str:
        if t not in piece:
            piece[t] = tokenizer.decode([t])
        return piece[t]

    tops = out.top_logprobs or [[] for _ in out.tokens]
    if chat:
        def entry(t, lp):
            s = text(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in top]}
                            for t, lp, top in zip(out.tokens, out.logprobs, tops)], "refusal": None}
    offsets, at = [], offset
    for t in out.tokens:
        offsets.append(at)
        at += len(text(t))

    def top_of(t, lp, top):  # the k most likely, and the chosen token where it is not among them (OpenAI's rule)
        pairs = [((a, text(a)), alp) for a, alp in top]
        return _keyed(pairs if any(a == t for a, _ in top) else pairs + [((t, text(t)), lp)])

    return {"tokens": [text(t) for t in out.tokens], "token_logprobs": list(out.logprobs),
            "top_logprobs": [top_of(t, lp, top) for t, lp, top in zip(out.tokens, out.logprobs, tops)],
            "text_offset": offsets}


def full(ids: Ids, plan, outputs, tokenizer) -> dict:
    choices = []
    for i, o in enumerate(outputs):
        echo = plan.choices[i].prompt_text if plan.echo else ""
        text = echo + (o.text or "")
        c = {"index": i, "logprobs": logprobs(tokenizer, o, ids.chat, len(echo)), "finish_reason": finish_reason(o),
             "setdlm": final_payload(o)}
        c.update({"message": {"role": "assistant", "content": text}} if ids.chat else {"text": text})
        choices.append(c)
    return {**ids.head(False), "choices": choices, "usage": usage(plan, outputs)}


def chunk(ids: Ids, index: int, text: str, payload: dict | None, finish: str | None = None,
          first: bool = False, lp: dict | None = None) -> dict:
    c = {"index": index, "logprobs": lp, "finish_reason": finish}
    if ids.chat:
        c["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or not first else {})
    else:
        c["text"] = text
    if payload is not None:
        c["setdlm"] = payload
    return {**ids.head(True), "choices": [c]}


def usage_chunk(ids: Ids, plan, outputs) -> dict:
    return {**ids.head(True), "choices": [], "usage": usage(plan, outputs)}
