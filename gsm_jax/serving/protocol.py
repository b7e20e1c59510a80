"""The OpenAI request bodies the server accepts, and its error shape.

Types are strict (a string where a number belongs is a 400, not coerced); fields
the server does not know are accepted, like vLLM, and named back to the client in
the `x-ignored-fields` response header rather than dropped silently. Errors use
the nested OpenAI body `{"error": {"message", "type", "param", "code"}}` with
string codes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["ChatRequest", "CompletionRequest", "ValidationError", "error_body", "first_error"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = True


class _Sampling(_Body):
    model: str
    max_tokens: int | None = Field(default=None)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # vLLM's extra; -1 and 0 mean off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extra: generate exactly max_tokens (load tests)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # models with a reasoning chat format (DeepSeek-V4: low/high/xhigh/max, V4.1: also 1-100;
    # "none" turns thinking off); a 400 for other models
    reasoning_effort: str | int | None = None
    # vLLM's: options of the chat template (DeepSeek-V4/V4.1: `thinking` / `enable_thinking`)
    chat_template_kwargs: dict[str, Any] | None = None


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def first_error(e: ValidationError) -> tuple[str, str | None]:
    """(message, param) of a pydantic error, worded for a client."""
    errs = e.errors()
    if not errs:
        return str(e), None
    err = errs[0]
    loc = ".".join(str(p) for p in err.get("loc", ()))
    more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
    return f"{loc}: {err.get('msg', 'invalid')}{more}", loc or None
