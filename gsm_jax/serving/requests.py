"""What the serving engine takes and gives: a `Request` (token ids in, sampling and
penalty settings, GSM choice, log-probabilities wanted) and its `RequestRecord` (tokens
out, their times and log-probabilities, why it finished)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["DEFAULT", "MAX_LOGPROBS", "Request", "RequestRecord", "Sampling", "clock"]

clock = time.perf_counter

# The most alternatives a token's log-probabilities list (OpenAI's `top_logprobs` <= 20,
# vLLM's default `max_logprobs`): the compiled steps always compute this many, on device,
# when some row asks.
MAX_LOGPROBS = 20


class _EngineDefault:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _EngineDefault()  # a request's gsm: the engine's config and rules


# ----------------------------------------------------------------------------- requests


@dataclass
class Request:
    """One generation request: token ids in, up to `max_new_tokens` token ids out."""

    prompt: Sequence[int] | np.ndarray
    max_new_tokens: int
    request_id: Any = None  # used for GSM rollout; default: the engine's submission counter
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None  # None: derived from the engine's seed and submission counter
    tag: str = ""  # free label carried into the record (the benchmark uses "short"/"long")
    gsm: Any = DEFAULT  # DEFAULT | None (not smoothed) | a GSMConfig smoothing this request
    ignore_eos: bool = False  # run to max_new_tokens (load tests: equal work per request)
    # OpenAI's penalties on the tokens generated so far: logit - frequency x count
    # - presence x (count > 0); vLLM's repetition penalty on the tokens of the prompt and
    # the output (logit / p where positive, logit x p where not); logit_bias: token id ->
    # added to its logit. Applied in that order (bias, repetition, frequency / presence)
    # before temperature / top-k / top-p, as vLLM; log-probabilities stay the model's.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    # log-probabilities (the model's, before penalties and temperature, as vLLM's default
    # "raw" mode): None: none; k in [0, MAX_LOGPROBS]: each output token's, with the k
    # most likely alternatives (`RequestRecord.logprobs`), taken from the decode step's
    # own logits on device. `prompt_logprobs` the same for each prompt token after the
    # first (`RequestRecord.prompt_logprobs`), from the prefill's logits.
    logprobs: int | None = None
    prompt_logprobs: int | None = None


@dataclass
class RequestRecord:
    """What happened to one request; times are `time.perf_counter()` seconds."""

    index: int
    request_id: Any
    tag: str
    prompt_len: int
    max_new_tokens: int
    arrival: float
    gsm: bool = False  # was this request's row smoothed
    slot: int = -1
    admitted: float = math.nan
    first_token: float = math.nan
    finish: float = math.nan
    finish_reason: str = ""  # "eos" | "length" | what `abort` was given ("abort", "stop")
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # the caller's (a server's) fields
    ignore_eos: bool = False
    # per output token (Request.logprobs): (its log-probability, the top-k log-probabilities
    # [k] float32, their token ids [k] int32); per prompt token after the first
    # (Request.prompt_logprobs): the same
    logprobs: list[tuple[float, np.ndarray, np.ndarray]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, np.ndarray, np.ndarray]] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def e2e(self) -> float:
        """End-to-end latency: arrival to last token."""
        return self.finish - self.arrival

    @property
    def ttft(self) -> float:
        """Time to first token, from arrival (so it includes queueing and prefill)."""
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        """Time per output token after the first: (finish - first token) / (n - 1)."""
        if self.n_tokens < 2:
            return math.nan
        return (self.finish - self.first_token) / (self.n_tokens - 1)

    @property
    def queue(self) -> float:
        """Waiting time before the prefill started."""
        return self.admitted - self.arrival

    def to_dict(self, t0: float = 0.0, *, with_tokens: bool = True) -> dict[str, Any]:
        """JSON-ready; absolute times become seconds since `t0`."""

        def rel(t: float) -> float | None:
            return None if math.isnan(t) else round(t - t0, 6)

        def num(v: float) -> float | None:
            return None if math.isnan(v) else round(v, 6)

        out = {
            "index": self.index, "request_id": self.request_id, "tag": self.tag,
            "prompt_len": self.prompt_len, "max_new_tokens": self.max_new_tokens,
            "n_tokens": self.n_tokens, "gsm": self.gsm, "slot": self.slot,
            "finish_reason": self.finish_reason,
            "arrival": rel(self.arrival), "admitted": rel(self.admitted),
            "first_token": rel(self.first_token), "finish": rel(self.finish),
            "e2e_s": num(self.e2e), "ttft_s": num(self.ttft), "tpot_s": num(self.tpot),
            "queue_s": num(self.queue),
            "token_times": [rel(t) for t in self.token_times],
        }
        if with_tokens:
            out["tokens"] = [int(t) for t in self.tokens]
        return out



@dataclass
class Sampling:
    """A request's sampling and penalty settings, as the engine keeps them."""

    temperature: float
    top_k: int
    top_p: float
    seed: int
    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    bias: tuple[tuple[int, float], ...] = ()

    @property
    def penalized(self) -> bool:
        return bool(self.frequency or self.presence or self.repetition != 1.0 or self.bias)

    @property
    def sample(self) -> bool:
        return self.temperature > 0

    @property
    def filtered(self) -> bool:
        return self.sample and (self.top_k > 0 or self.top_p < 1.0)
