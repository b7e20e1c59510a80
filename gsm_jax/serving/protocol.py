"""The OpenAI request bodies the server accepts, and its error shape.

Types are strict (a string where a number belongs is a 400, not coerced). Fields of
the OpenAI / vLLM APIs that this server does not implement (`tools`,
`response_format`, `min_p`, guided decoding, image content parts, ...) are refused
with a 400 that names the field (`unsupported`), unless they carry their neutral
value (`tools: []`, `min_p: 0`, ...), which changes nothing. Penalties
(`frequency_penalty`, `presence_penalty`, vLLM's `repetition_penalty`) and `logit_bias`
are implemented (the engine's `penalize`). Names
neither API knows are accepted, like vLLM, and named back to the client in the
`x-ignored-fields` response header. Errors use the nested OpenAI body
`{"error": {"message", "type", "param", "code"}}` with string codes.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = ["MAX_LOGPROBS", "ChatRequest", "CompletionRequest", "DetokenizeRequest",
           "TokenizeRequest", "ValidationError", "error_body", "first_error",
           "unsupported_field"]

MAX_LOGPROBS = 20  # the most top log-probabilities per token (OpenAI's and vLLM's limit)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    def ignored_fields(self) -> list[str]:
        """Names neither API knows (fields it knows but the server does not implement
        were refused unless neutral: `unsupported_field`)."""
        return sorted(k for k in (self.model_extra or {}) if k not in _NOT_IMPLEMENTED)


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
    user: str | None = None
    ignore_eos: bool = False  # vLLM's extra: generate exactly max_tokens (load tests)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)  # vLLM's extra
    # token id (as a JSON string key, OpenAI's form) -> bias added to its logit
    logit_bias: dict[str, float] | None = None

    def logit_bias_ids(self) -> dict[int, float] | None:
        """`logit_bias` with integer token ids; a key that is not one is a ValueError."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            try:
                out[int(key)] = value
            except ValueError:
                raise ValueError(f"logit_bias: key {key!r} is not a token id") from None
        return out

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False  # the prompt before the completion (with its log-probabilities)
    # the top-`logprobs` alternatives per token (0: the chosen token's only); None: off
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def top_logprobs_k(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict[str, Any]:
        """The message for the chat template: text parts joined by newlines (vLLM's)."""
        out = self.model_dump()
        if not isinstance(self.content, str):
            out["content"] = "\n".join(p.text for p in self.content)
        return out


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False  # each generated token's log-probability
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # models with a reasoning chat format (DeepSeek-V4: low/high/xhigh/max, V4.1: also 1-100;
    # "none" turns thinking off); a 400 for other models
    reasoning_effort: str | int | None = None
    # vLLM's: options of the chat template (DeepSeek-V4/V4.1: `thinking` / `enable_thinking`)
    chat_template_kwargs: dict[str, Any] | None = None

    def top_logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's `POST /tokenize`: a `prompt`, or chat `messages` rendered as the chat endpoint
    renders them (generation header included)."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # the model's BOS (prompts only, as vLLM)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    """vLLM's `POST /detokenize`."""
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------- refused fields

_ANY = object()  # refused whatever its value

# field -> the neutral values accepted (they change nothing); any other value is a 400
_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "parallel_tool_calls": (None, False, True),
    "response_format": (None, {"type": "text"}),
    "suffix": (None, ""), "best_of": (None, 1),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "web_search_options": (None,),
    # vLLM's sampling and decoding extras
    "min_p": (None, 0, 0.0), "min_tokens": (None, 0),
    "stop_token_ids": (None, []), "bad_words": (None, []), "allowed_token_ids": (None,),
    "use_beam_search": (None, False), "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False), "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True), "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,), "structured_outputs": (None,),
    "logits_processors": (None,), "return_tokens_as_token_ids": (None, False),
    "add_generation_prompt": (None, True), "continue_final_message": (None, False),
    "chat_template": (None,), "documents": (None,), "mm_processor_kwargs": (None,),
}
_MESSAGE_NOT_IMPLEMENTED = ("tool_calls", "function_call", "audio", "refusal")


def _neutral(value: Any, accepted: tuple[Any, ...]) -> bool:
    for a in accepted:
        if isinstance(a, bool) or isinstance(value, bool):  # True is not 1 here
            if value is a:
                return True
        elif value == a:
            return True
    return False


def unsupported_field(raw: dict[str, Any], kind: str) -> tuple[str, str] | None:
    """(param, message) of the first field of the body `raw` (of a "chat" or "completion"
    request) that this server does not implement with a value that would change the
    output; None if there is none."""
    for key, value in raw.items():
        accepted = _NOT_IMPLEMENTED.get(key)
        if accepted is None:
            if key == "echo" and kind == "chat" and value not in (None, False):
                return key, ("echo is not supported on /v1/chat/completions (it is a field of "
                             "/v1/completions)")
            continue
        if key == "best_of" and value == raw.get("n", 1) and not isinstance(value, bool):
            continue  # the best n of n: plain sampling
        if not _neutral(value, accepted):
            return key, (f"{key} is not supported by this server (got {value!r:.80}); "
                         "remove it or send its neutral value")
    if kind == "chat":
        for i, m in enumerate(raw.get("messages") or []):
            if not isinstance(m, dict):
                continue
            for key in _MESSAGE_NOT_IMPLEMENTED:
                if m.get(key) not in (None, []):
                    return (f"messages[{i}].{key}",
                            f"messages[{i}].{key} is not supported by this server")
            content = m.get("content")
            if isinstance(content, list):
                for j, part in enumerate(content):
                    kind_j = part.get("type") if isinstance(part, dict) else None
                    if kind_j != "text":
                        return (f"messages[{i}].content[{j}].type",
                                f"messages[{i}].content[{j}] is of type {kind_j!r}: this server "
                                "takes text content parts only (no images, audio or files)")
    return None


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
