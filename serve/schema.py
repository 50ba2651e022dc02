"""Request bodies of /v1/completions, /v1/chat/completions, /tokenize and /detokenize: typed, strict,
one error naming the field.

Every field of OpenAI's two APIs is accepted. The ones the server honours are typed (`max_tokens`,
`temperature`, `top_p`, `stop`, `seed`, `n`, `stream`, `stream_options`, `presence_penalty`,
`frequency_penalty`, `logit_bias`, `logprobs`, `top_logprobs`, `echo`; chat content parts, `name`, the
`developer` role), a number with the range of the SamplingConfig field it becomes (`sampler`: one
source for the sampler's bounds) within OpenAI's own (`temperature` at most 2, `n` at most 16); the
ones it has no use for (`user`, `metadata`, `prompt_cache_key`, ...) are accepted and ignored; the
rest are accepted at their default or neutral value (`best_of` = n, `suffix` empty, `tools` empty, `response_format` text, `store` false, ...) and any
other value is refused naming the field (`NEUTRAL`). Our extensions sit under one key, `setdlm`
(docs/serve.md). Every model forbids unknown fields and coerces nothing (`"8"` is not an integer), so
a typo or a wrong type is an HTTP 400 naming the field (`setdlm.window: Input should be a valid
integer`) rather than a silently ignored option.

`read_body` turns the raw bytes into a request with the limits a hostile body needs, the cheap checks
first (`precheck`: the number of outputs and the length of token prompts, before anything walks the
whole body): NaN and infinities, nesting deeper than `MAX_DEPTH` and invalid Unicode (a lone
surrogate such as "\\ud800" is valid JSON but no text) are a 400 naming where they are.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common.errors import Error
from common.schema import like
from model import families
from model.sampling import SamplingConfig
from model.sampling.config import REMASKING

FAMILY_NAMES = families.names()

MAX_DEPTH = 32  # nesting of a request body (a chat message with content parts is 5 deep)
MAX_STOP = 32  # stop strings (lm-eval sends a task's `until` list and the EOS text)
MAX_STOP_CHARS = 256
MAX_BIAS = 1024  # logit_bias entries
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts
MAX_CHOICES = 64  # prompts x n in one request
MODEL_CHECKS = ("best_of", "top_logprobs", "content", "prompt", "messages", "stream_options")  # named by cross-field checks


def sampler(key: str, default=None):
    """A request field with the range of SamplingConfig's `key` (model/sampling/config.py: one source
    for the bounds the sampler enforces) and its own default (None: the checkpoint recipe's)."""
    return like(SamplingConfig, key, default)


class RequestError(Error):
    """A request the server refuses: HTTP `status`, the field it names (`param`) and why."""

    def __init__(self, param: str | None, message: str, status: int = 400, kind: str = "invalid_request_error",
                 headers: dict | None = None):
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.status, self.kind, self.headers = param, status, kind, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def decode_json(raw: bytes):
    """The decoded JSON body (not yet checked by `check_text`), or a RequestError naming what is wrong (400)."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise RequestError("body", "not UTF-8 text") from None
    except RecursionError:
        raise RequestError("body", f"nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:
        raise RequestError("body", f"not valid JSON ({e})") from None


def load_body(raw: bytes):
    """The decoded JSON body, or a RequestError naming what is wrong with it (400)."""
    body = decode_json(raw)
    check_text(body)
    return body


def read_body(model: type[_Strict], raw: bytes, max_len: int) -> _Strict:
    """A raw body -> the validated request, the cheap checks first: JSON, `precheck` (outputs, token
    prompt lengths against the model's `max_len` positions), then `check_text` and the model."""
    body = decode_json(raw)
    precheck(model, body, max_len)
    check_text(body)
    return parse(model, body)


def check_text(body) -> None:
    """Refuse nesting deeper than MAX_DEPTH and strings that are not valid Unicode, naming where."""
    todo = [((), body)]
    while todo:
        path, v = todo.pop()
        if len(path) > MAX_DEPTH:
            raise RequestError("body", f"nested deeper than {MAX_DEPTH} levels")
        if isinstance(v, dict):
            for k, x in v.items():
                _unicode(k, path + (k,))
                todo.append((path + (k,), x))
        elif isinstance(v, list):
            todo.extend((path + (i,), x) for i, x in enumerate(v))
        elif isinstance(v, str):
            _unicode(v, path)


def _unicode(s: str, path) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(_dotted(path) or "body", f"not valid Unicode text (a lone surrogate "
                                                    f"{s[e.start]!r} at character {e.start})") from None


def _dotted(path) -> str:
    return ".".join(str(x) for x in path)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def neutral(*allowed, why: str = "not supported by this server"):
    """A field accepted only at OpenAI's default or a value that changes nothing here."""
    shown = " or ".join(json.dumps(a) for a in allowed)

    def check(v):
        if v not in allowed:
            raise ValueError(f"{why}; leave it out or send {shown}")
        return v

    return Annotated[Any, AfterValidator(check)]


class Infill(_Strict):
    suffix: str = Field("", description="text after the span (the prompt is the text before it)")
    length: int = Field(ge=1, description="tokens to fill between prompt and suffix (exactly)")


class Extension(_Strict):
    """The `setdlm` key: the decoder's own options (defaults: the checkpoint's recipe). Widths and step
    counts are bounded by the served model in params.py."""

    family: Literal[FAMILY_NAMES] | None = None
    window: int | None = sampler("window")
    threshold: float | None = sampler("threshold")
    adaptive_window: bool | None = None
    window_min: int | None = sampler("window_min")
    window_max: int | None = sampler("window_max")
    block_size: int | None = sampler("block_size")
    steps_per_block: int | None = sampler("steps_per_block")
    steps: int | None = sampler("steps")
    remasking: Literal[REMASKING] | None = None
    top_k: int | None = sampler("top_k")
    repetition_penalty: float | None = sampler("repetition_penalty")
    ignore_eos: bool = False
    stop_regex: str | None = Field(None, min_length=1)
    infill: Infill | None = None


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = True  # OpenAI's padding of stream events: none is added here


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    # OpenAI's range (0-2) within the sampler's (>= 0; below its floor, 1e-5, greedy: model/sampling/config.py)
    temperature: Annotated[float, Field(le=2)] = sampler("temperature", 1.0)
    top_p: float = sampler("top_p", 1.0)
    stop: Any = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = sampler("presence_penalty", 0.0)
    frequency_penalty: float = sampler("frequency_penalty", 0.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # accepted, not used
    setdlm: Extension = Field(default_factory=Extension)

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream: true (leave it out of a request that is not streamed)")
        return self

    @field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if not all(v):
            raise ValueError("stop strings must be non-empty")
        if len(v) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(v)}")
        if max(map(len, v), default=0) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        """{"token id": bias in [-100, 100]} -> {id: bias} (the ids are checked against the model later)."""
        if not v:
            return {}
        if len(v) > MAX_BIAS:
            raise ValueError(f"at most {MAX_BIAS} entries, got {len(v)}")
        out = {}
        for k, b in v.items():  # the values' range is SamplingConfig's (checked in params.sampling_config)
            if not (k.isascii() and k.isdigit()) or len(k) > 12:
                raise ValueError(f"keys are token ids (decimal integers), got {k!r}")
            out[int(k)] = float(b)
        return out


class CompletionRequest(_Common):
    prompt: Any
    echo: bool = False
    logprobs: int | None = sampler("logprobs")
    best_of: int | None = Field(None, ge=1)
    suffix: neutral(None, "") = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, v):
        """A string, a list of strings, a list of token ids or a list of such lists -> a list of prompts."""
        ints = lambda x: isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)  # noqa: E731
        if isinstance(v, str):
            return [v]
        if isinstance(v, list) and v and all(isinstance(s, str) for s in v):
            return list(v)
        if isinstance(v, list) and v and ints(v):
            return [list(v)]
        if isinstance(v, list) and v and all(ints(x) for x in v):
            return [list(x) for x in v]
        if isinstance(v, list) and not v:
            raise ValueError("empty list; give at least one prompt")
        raise ValueError("must be a string, a list of strings, a list of token ids or a list of lists of token ids")

    @model_validator(mode="after")
    def _best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: only best_of = n (here {self.n}): the server does not rank extra samples")
        return self


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any = Field(None, validate_default=True)
    name: str | None = Field(None, max_length=256)
    tool_calls: neutral(None, [], why="tool calls are not supported (no tools)") = None
    function_call: neutral(None, why="function calls are not supported (no tools)") = None
    refusal: neutral(None) = None
    audio: neutral(None) = None

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, v):
        """A string, a list of text parts ({"type": "text", "text": ...}, joined), or null (assistant)."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) for p in v):
            texts = []
            for i, p in enumerate(v):
                if p.get("type") != "text":
                    raise ValueError(f"part {i}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported, "
                                     f"got type {p.get('type')!r}")
                try:
                    texts.append(TextPart.model_validate(p).text)
                except ValidationError as e:
                    err = e.errors(include_url=False)[0]
                    raise ValueError(f"part {i}: {_dotted(err['loc'])}: {err['msg']}") from None
            return "\n".join(texts)  # as vLLM joins text parts
        raise ValueError("must be a string, a list of text parts or null")

    @model_validator(mode="after")
    def _null_content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: required for the {self.role} role (only an assistant turn may have null)")
        return self


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = sampler("logprobs")
    # accepted and ignored: hints and identifiers with no effect on a completion here
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None
    parallel_tool_calls: bool | None = None
    # accepted at their default or neutral value only
    tools: neutral(None, [], why="tool calling is not supported") = None
    tool_choice: neutral(None, "none", "auto", why="tool calling is not supported") = None
    functions: neutral(None, [], why="function calling is not supported") = None
    function_call: neutral(None, "none", "auto", why="function calling is not supported") = None
    response_format: neutral(None, {"type": "text"}, why="only text output (no JSON mode)") = None
    modalities: neutral(None, ["text"]) = None
    audio: neutral(None) = None
    prediction: neutral(None) = None
    moderation: neutral(None) = None
    web_search_options: neutral(None) = None
    reasoning_effort: neutral(None, "none") = None
    verbosity: neutral(None, "medium") = None
    service_tier: neutral(None, "auto", "default") = None
    store: neutral(None, False) = None

    @model_validator(mode="after")
    def _top_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt, or chat messages rendered as /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # the server adds none either way (it decodes what /tokenize gives)
    add_generation_prompt: bool = True
    continue_final_message: neutral(False) = False
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt (text) or messages (chat)")
        if self.messages is not None and not self.messages:
            raise ValueError("messages: empty list; give at least one message")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def precheck(model: type[_Strict], body, max_len: int) -> None:
    """The checks of a decoded body that cost nothing, before anything walks or validates all of it
    (`check_text`, the model): the number of outputs (prompts x `n`) and the length of token-id
    prompts, so a body of 700,000 tiny prompts or of 2 million ids is refused at once. Values of the
    wrong type are left to the model's validation (which names them)."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    if model is not CompletionRequest:
        return
    n, prompt = body.get("n", 1), body.get("prompt")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
    if not isinstance(prompt, list) or not prompt:
        return
    many = isinstance(prompt[0], (str, list))
    if many and len(prompt) * n > MAX_CHOICES:
        raise RequestError("n", f"{len(prompt)} prompts x n={n} is more than {MAX_CHOICES} outputs in one request")
    for i, ids in enumerate(prompt if many else [prompt]):
        if isinstance(ids, list) and len(ids) > max_len:
            raise RequestError("prompt", f"{len(ids)} prompt tokens exceed the model's {max_len} positions (a prompt "
                                         f"is read in one forward)" + (f" (prompt {i})" if many else ""))


def parse(model: type[_Strict], body) -> _Strict:
    """Validate a decoded JSON body; the first problem as a RequestError naming its field."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = err["loc"]
        param = _dotted(loc) or "body"
        if err["type"] == "extra_forbidden":
            parent = model
            for name in loc[:-1]:  # the nested model the unknown field sits in
                ann = parent.model_fields.get(str(name))
                inner = getattr(ann, "annotation", None)
                args = getattr(inner, "__args__", (inner,))
                args = [x for a in args for x in getattr(a, "__args__", (a,))]  # list[Message] -> Message
                parent = next((a for a in args if isinstance(a, type) and issubclass(a, _Strict)), None) or parent
            raise RequestError(param, f"unknown field; valid: {', '.join(parent.model_fields)}") from None
        msg = err["msg"].removeprefix("Value error, ")
        field, sep, rest = msg.partition(": ")
        if sep and field in MODEL_CHECKS and err["type"] == "value_error":  # a model's check across its fields
            param, msg = _dotted(loc + (field,)), rest
        raise RequestError(param, msg) from None
