"""Chat formats built in code, for models whose release ships no Jinja chat template.

DeepSeek-V4 (`model_type` "deepseek_v4") and DeepSeek-V4.1 ("deepseek_v41") build their
prompts in Python (the release's `encoding/` folder). This module renders the same prompts,
written from the format's rules (research note `deepseek_v4_chat.md`), and checked token for
token against DeepSeek's own `deepseek-recipe` package in tests/test_chat_deepseek.py.

A rendering is a list of pieces, each either a special token the format inserts or plain text
(message content, the effort text). The prompt string is their concatenation; the prompt's
token ids are the special tokens' ids with each run of plain text encoded *without* the added
vocabulary, so a special-token spelling typed by a user stays plain text.

The rules, both versions:

* BOS once at the start. Every assistant turn is
  `<｜Assistant｜></think>content<｜end▁of▁sentence｜>`: reasoning of earlier turns is never
  rendered (no tool calls here, so none is kept).
* Consecutive user messages merge into one `<｜User｜>` turn, joined by a blank line.
* The prompt ends with the generation header `<｜Assistant｜>` then `<think>` (thinking on)
  or `</think>` (thinking off), whatever the last message is.
* Thinking is on unless `thinking=False` or `reasoning_effort="none"` (the DeepSeek API's and
  the recipe's default); the effort only matters with thinking on.

V4: system messages (and `developer` ones, OpenAI's newer name for them) carry no role token.
The non-empty ones, wherever they are, are joined by a blank line right after BOS; a user
turn drops empty parts when merging. Thinking mode puts an effort paragraph between BOS and
the system text: none for `low`, "Absolute maximum..." for `high` (the default) and `xhigh`,
"Beyond maximum..." for `max`.

V4.1: each system message is `<｜System｜>text` where it stands (a later one splits user turns).
Thinking mode opens with `<｜System｜>Reasoning Effort: N (range 1-100, ...)` and a blank line,
in front of the first message's text when that message is a system message; N is 50, 75
(default), 75, 100 for low / high / xhigh / max, or an integer 1-100.

Names the DeepSeek API accepts are mapped as it does: minimal -> low, medium -> high,
ultra -> max. `tool` messages (and tool calls) are not supported yet.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gsm_jax.errors import InvalidInputError

__all__ = [
    "BOS", "EOS", "SYSTEM", "USER", "ASSISTANT", "THINK", "THINK_END", "FORMATS",
    "ChatFormatError", "Piece", "ReasoningSplitter", "chat_format_for", "prompt_text", "render",
    "resolve_options", "special_tokens",
]

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM = "<｜System｜>"  # V4.1 only
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
THINK_END = "</think>"

FORMATS = ("deepseek_v4", "deepseek_v41")

# V4's effort paragraphs (the release's "reasoning effort" prompts; sha256 f7a24f3b...350f7
# and 53fb31b8...55d2c, checked in the tests)
_V4_HIGH = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)
_V4_MAX = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: "
    "exhaustively decompose the problem into its most fundamental components, trace every "
    "causal chain to its root, and resolve the underlying cause rather than any surface "
    "symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple "
    "angles and are certain that no assumption remains unchecked and no error remains "
    "undiscovered.\n\n"
)
_V4_EFFORT = {"low": "", "high": _V4_HIGH, "xhigh": _V4_HIGH, "max": _V4_MAX}
_V41_EFFORT = {"low": 50, "high": 75, "xhigh": 75, "max": 100}
_ALIASES = {"minimal": "low", "medium": "high", "ultra": "max"}
_DEFAULT_EFFORT = "high"


class ChatFormatError(InvalidInputError):
    """A conversation or option the format cannot render; `param` names the request field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Piece:
    text: str
    special: bool = False


def chat_format_for(model_type: Any) -> str | None:
    """The built-in chat format of a config's `model_type`, or None (use a Jinja template)."""
    return model_type if model_type in FORMATS else None


def special_tokens(fmt: str) -> tuple[str, ...]:
    """The special tokens the format inserts (all must be in the tokenizer's vocabulary)."""
    base = (BOS, EOS, USER, ASSISTANT, THINK, THINK_END)
    return base + (SYSTEM,) if fmt == "deepseek_v41" else base


def resolve_options(fmt: str, thinking: bool | None = None,
                    reasoning_effort: str | int | None = None) -> tuple[bool, str | int | None]:
    """(thinking, effort) after defaults and the API's names; ChatFormatError if invalid."""
    if fmt not in FORMATS:
        raise ChatFormatError(f"unknown chat format {fmt!r}", param="model")
    if thinking is not None and not isinstance(thinking, bool):
        raise ChatFormatError(f"thinking must be true or false, got {thinking!r}",
                              param="thinking")
    effort = reasoning_effort
    if isinstance(effort, bool) or not isinstance(effort, str | int | None):
        raise ChatFormatError(f"reasoning_effort must be a string or an integer, got "
                              f"{effort!r}", param="reasoning_effort")
    if isinstance(effort, str):
        effort = _ALIASES.get(effort, effort)
        if effort == "none":
            if thinking:
                raise ChatFormatError("reasoning_effort 'none' turns thinking off, but thinking "
                                      "was asked for", param="reasoning_effort")
            return False, None
        if effort not in _V4_EFFORT:
            names = ["none", *_V4_EFFORT, *_ALIASES]
            extra = " or an integer 1-100" if fmt == "deepseek_v41" else ""
            raise ChatFormatError(f"reasoning_effort {reasoning_effort!r} is not one of "
                                  f"{names}{extra}", param="reasoning_effort")
    elif isinstance(effort, int):
        if fmt != "deepseek_v41":
            raise ChatFormatError(f"reasoning_effort: {fmt} takes named levels (low, high, "
                                  f"max), not a number ({effort})", param="reasoning_effort")
        if not 1 <= effort <= 100:
            raise ChatFormatError(f"reasoning_effort {effort} is outside 1-100",
                                  param="reasoning_effort")
    thinking = True if thinking is None else thinking
    return thinking, (effort if effort is not None else _DEFAULT_EFFORT) if thinking else None


def _effort_text(fmt: str, effort: str | int) -> str:
    if fmt == "deepseek_v4":
        return _V4_EFFORT[effort]
    n = effort if isinstance(effort, int) else _V41_EFFORT[effort]
    return (f"Reasoning Effort: {n} (range 1-100, the higher the value, the more thorough "
            "the reasoning)\n\n")


def render(fmt: str, messages: Sequence[Mapping[str, Any]], *, thinking: bool | None = None,
           reasoning_effort: str | int | None = None) -> list[Piece]:
    """The prompt of `messages` (dicts with `role` and string `content`) as pieces."""
    thinking, effort = resolve_options(fmt, thinking, reasoning_effort)
    msgs = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content")
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant"):
            raise ChatFormatError(f"message {i}: role {role!r} is not supported by the {fmt} "
                                  "chat format (system, developer, user, assistant)")
        if not isinstance(content, str):
            raise ChatFormatError(f"message {i}: content must be a string")
        if role == "assistant" and m.get("tool_calls"):
            raise ChatFormatError(f"message {i}: tool calls are not supported by the {fmt} "
                                  "chat format yet")
        msgs.append((role, content))
    v41 = fmt == "deepseek_v41"
    out = [Piece(BOS, True)]
    prefix = _effort_text(fmt, effort) if thinking else ""
    if v41:
        if thinking and not (msgs and msgs[0][0] == "system"):
            out += [Piece(SYSTEM, True), Piece(prefix)]
            prefix = ""
    else:
        system = "\n\n".join(c for r, c in msgs if r == "system" and c)
        if prefix or system:
            out.append(Piece(prefix + system))
        prefix = ""
        msgs = [(r, c) for r, c in msgs if r != "system"]
    users: list[str] = []

    def flush_users() -> None:
        if users:
            parts = users if v41 else [u for u in users if u]
            out.extend([Piece(USER, True), Piece("\n\n".join(parts))])
            users.clear()

    for role, content in msgs:
        if role == "user":
            users.append(content)
            continue
        flush_users()
        if role == "system":  # V4.1 only: V4's were taken out above
            out.extend([Piece(SYSTEM, True), Piece(prefix + content)])
            prefix = ""
        else:
            out.extend([Piece(ASSISTANT, True), Piece(THINK_END, True), Piece(content),
                        Piece(EOS, True)])
    flush_users()
    out.extend([Piece(ASSISTANT, True), Piece(THINK if thinking else THINK_END, True)])
    return [p for p in out if p.special or p.text]


def prompt_text(pieces: Sequence[Piece]) -> str:
    return "".join(p.text for p in pieces)


class ReasoningSplitter:
    """Splits generated text at the first `</think>` into (reasoning, content), incrementally.

    As vLLM's DeepSeek reasoning parser (R1 rules): with thinking on (the prompt ended in
    `<think>`), a leading `<think>` is dropped, text before the first `</think>` is reasoning
    and the rest is content; with no `</think>` all of it is reasoning. With thinking off all
    of it is content. Text that may be the start of `</think>` waits for the next delta.
    """

    def __init__(self, thinking: bool) -> None:
        self.in_reasoning = thinking
        self.at_start = thinking
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of the new text; `final` flushes what was held back."""
        if not self.in_reasoning:
            return "", text
        self.buf += text
        if self.at_start:
            if THINK.startswith(self.buf) and not final:
                return "", ""
            if self.buf.startswith(THINK):
                self.buf = self.buf[len(THINK):]
            self.at_start = False
        i = self.buf.find(THINK_END)
        if i >= 0:
            reasoning, content = self.buf[:i], self.buf[i + len(THINK_END):]
            self.buf, self.in_reasoning = "", False
            return reasoning, content
        keep = 0 if final else next((k for k in range(len(THINK_END) - 1, 0, -1)
                                     if self.buf.endswith(THINK_END[:k])), 0)
        reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return reasoning, ""
