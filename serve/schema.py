"""Request bodies of /v1/completions and /v1/chat/completions: typed, strict, one error naming the field.

The OpenAI fields the server honours (`max_tokens`, `temperature`, `top_p`, `stop`, `seed`, `n`,
`stream`, `stream_options.include_usage`; `model` and `user` are checked / accepted) and our
extensions under one key, `setdlm` (docs/serve.md). Every model forbids unknown fields and coerces
nothing (`"8"` is not an integer), so a typo or a wrong type is an HTTP 400 naming the field
(`setdlm.window: Input should be a valid integer`) rather than a silently ignored option.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from common.errors import Error
from model import families

FAMILY_NAMES = families.names()


class RequestError(Error):
    """A request the server refuses: HTTP `status`, the field it names (`param`) and why."""

    def __init__(self, param: str | None, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.status, self.kind = param, status, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": None}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Infill(_Strict):
    suffix: str = Field("", description="text after the span (the prompt is the text before it)")
    length: int = Field(ge=1, description="tokens to fill between prompt and suffix (exactly)")


class Extension(_Strict):
    """The `setdlm` key: the decoder's own options (defaults: the checkpoint's recipe)."""

    family: Literal[FAMILY_NAMES] | None = None
    window: int | None = Field(None, ge=1)
    threshold: float | None = Field(None, ge=0)
    adaptive_window: bool | None = None
    window_min: int | None = Field(None, ge=1)
    window_max: int | None = Field(None, ge=1)
    block_size: int | None = Field(None, ge=1)
    steps_per_block: int | None = Field(None, ge=1)
    steps: int | None = Field(None, ge=1)
    remasking: Literal["confidence", "random"] | None = None
    top_k: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    stop_regex: str | None = None
    infill: Infill | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: Any = Field(None, validate_default=True)
    seed: int | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    setdlm: Extension = Field(default_factory=Extension)

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
        if len(v) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(v)}")
        return v


class CompletionRequest(_Common):
    prompt: Any

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


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


def parse(model: type[_Strict], body) -> _Strict:
    """Validate a decoded JSON body; the first problem as a RequestError naming its field."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = ".".join(str(x) for x in err["loc"]) or "body"
        if err["type"] == "extra_forbidden":
            parent = model
            for name in err["loc"][:-1]:  # the nested model the unknown field sits in
                ann = parent.model_fields.get(str(name))
                inner = getattr(ann, "annotation", None)
                parent = next((a for a in getattr(inner, "__args__", (inner,)) if isinstance(a, type)
                               and issubclass(a, _Strict)), None) or parent
            raise RequestError(param, f"unknown field; valid: {', '.join(parent.model_fields)}") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise RequestError(param, msg) from None
