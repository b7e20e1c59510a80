"""The OpenAI-compatible HTTP server (FastAPI + uvicorn, the stack of vLLM and SGLang).

    gsm-jax serve --model smollm2-135m --port 8000 --max-batch 16 --gsm cal/gsm.yaml

Endpoints: `/v1/completions`, `/v1/chat/completions` (the model's chat template; for
DeepSeek-V4/V4.1 their own format, `reasoning_effort`, thinking on by default and the
answer split at `</think>` into `reasoning_content` and `content`, as vLLM does),
`/v1/models`, `/v1/models/{id}`, `/health` (503 with `Retry-After` while loading or
warming, with "warming n/N" there; 503 while draining), `/ready`, `/metrics`
(Prometheus, `gsm_jax_compilations_total` among them), and, with `--admin-token`,
`GET/PUT /admin/gsm`, `POST /admin/gsm/rollout`, `POST /admin/gsm/rollback`, `GET /admin/stats`.

Each HTTP request gets one id (`x-request-id` if the client sent one, else a new
`cmpl-...` / `chatcmpl-...`; the body's `id` carries that prefix); it picks the GSM
version and arm (`gsm_state`), which every response names in `x-gsm-version` /
`x-gsm-arm` and in its `gsm` body field.

Log-probabilities (`logprobs` on completions, `logprobs` / `top_logprobs` on chat,
`echo` with the prompt's on completions; `max_tokens: 0` with `echo` scores the
prompt alone, what lm-evaluation-harness's `local-completions` sends) are the engine's
own: each output token's from the decode step that picked it, the prompt's from its
prefill (`Request.logprobs` / `prompt_logprobs`), log-softmax and top-k computed on the
device inside those steps, as vLLM does, under the request's GSM config (its arm). So
they score the tokens actually produced, greedy or sampled, equal
`jax.nn.log_softmax(gsm_jax.forward(...))` there to float rounding, and a stream's
chunks cost work linear in the tokens sent. `max_tokens: 0` runs a one-token request
whose token is not returned.

Start-up: status "loading" (the model), "warming" (`Engine.warmup`, each stage logged as
"warming n/N" and shown by /health), then "ready"; every API request before that gets
503 with `Retry-After`. SIGTERM while loading or warming stops the warm-up and the
process exits 0 at once (`serve`), without waiting for the program XLA is compiling.
Programs built after ready are logged as warnings and counted on /metrics
(`gsm_jax_compilations_after_ready_total`; issue 42 wants none).

Text is detokenized incrementally on the engine thread, where stop strings are matched:
a matched stop ends the request at once (`finish_reason: "stop"`, the stop cut).
A client that disconnects has its requests aborted at the next engine step.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gsm_jax.errors import GSMConfigError, GSMJaxError, InvalidInputError
from gsm_jax.serving import compile_events
from gsm_jax.serving.engine import PREFILL_CHUNK, Engine
from gsm_jax.serving.engine import Request as EngineRequest
from gsm_jax.serving.gsm_state import GSMVersion, LiveGSM
from gsm_jax.serving.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from gsm_jax.serving.protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    ValidationError,
    error_body,
    first_error,
    unsupported_field,
)
from gsm_jax.serving.scheduler import Draining, EngineLoop, QueueFull, Ticket

__all__ = ["GSMServer", "ServerOptions", "WarmupCancelled", "build_app"]

log = logging.getLogger("gsm_jax.serving")

STARTING = ("loading", "warming")  # statuses before ready: API requests get 503
STARTING_RETRY_AFTER_S = 5  # the Retry-After of a 503 while loading or warming


class WarmupCancelled(BaseException):
    """Raised in the loading thread (from the warm-up's progress callback) once
    `GSMServer.stop_loading` was called: the warm-up ends at its next stage. A
    BaseException, as asyncio's CancelledError, so no `except Exception` swallows it."""


@dataclass(frozen=True)
class ServerOptions:
    model: str = "smollm2-135m"
    dtype: str | None = None
    max_batch: int = 16
    max_len: int = 2048
    max_queue: int = 1024
    prefill_chunk: int | None = PREFILL_CHUNK
    gsm: str | None = None  # a GSM config file (watched) or None
    compile_gsm: bool = True  # False: no GSM code at all (PUT /admin/gsm is then refused)
    admin_token: str | None = None
    shutdown_timeout: float = 30.0
    retry_after_s: int = 1
    warmup_lengths: tuple[int, ...] = (16,)
    warmup_sampling: bool = True  # also compile the sampled (temperature > 0) programs
    served_model_name: str | None = None
    seed: int = 0
    mesh: tuple[int, int] | None = None  # (data, model): weights sharded, JAX SPMD
    gsm_ring: int | None = None  # GSM ring rows; default: what `gsm` needs, else 16
    kv_cache_dtype: str | None = None  # the KV cache's format (with_kv_cache_dtype); None: own
    # slots of the paged KV cache (Engine's kv_cache_tokens); None: every slot's max_len,
    # capped at engine.KV_POOL_BYTES
    kv_cache_tokens: int | None = None
    # automatic prefix caching (vLLM's --enable-prefix-caching, on by default as in vLLM
    # V1): the states at prefill-chunk boundaries within this many bytes; 0: off
    prefix_cache_bytes: int = 10**9
    # a decode step dispatched before the previous one is read back (vLLM's async
    # scheduling): the host's streaming overlaps the model; the same outputs
    async_scheduling: bool = True
    # int8 weights (gsm_jax.quant): "w8a16" (on CPU the int8 kernel at decode) or "w8a8";
    # quantize_head: the LM head int8 weight-only too; quantize_group_size: w8a16 with a
    # scale and offset per that many input channels (quantize(..., group_size=...))
    quantize: str | None = None
    quantize_head: bool = False
    quantize_group_size: int | None = None


class HTTPError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), type=self.type, param=self.param,
                                       code=self.code), status_code=self.status,
                            headers=self.headers)


# ----------------------------------------------------------------------------- text


class TextStream:
    """Incremental detokenization with stop strings (vLLM's prefix/read offsets): the
    text of new tokens is the decode of a short tail minus its already-read prefix;
    a tail ending in an incomplete UTF-8 sequence waits for the next token."""

    def __init__(self, tokenizer: Any, stops: list[str], eos_ids: frozenset[int],
                 literal: dict[int, str] | None = None) -> None:
        self.tok, self.stops, self.eos = tokenizer, stops, eos_ids
        self.literal = literal or {}  # ids written as their text even if special (</think>)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters handed to the client
        self.hold = max((len(s) for s in stops), default=1) - 1
        self._prefix = 0
        self._read = 0
        self.stopped = False

    def add(self, token: int) -> bool:
        """Take one token; True if a stop string matched (the text is cut before it)."""
        if token in self.eos or self.stopped:
            return False
        if token in self.literal:  # the bytes before it decode on their own, as one-shot
            before = self.tok.decode(self.ids[self._prefix:self._read])
            after = self.tok.decode(self.ids[self._prefix:])
            self.text += after[len(before):] + self.literal[token]
            self.ids.append(token)
            self._prefix = self._read = len(self.ids)
        else:
            self.ids.append(token)
            before = self.tok.decode(self.ids[self._prefix:self._read])
            after = self.tok.decode(self.ids[self._prefix:])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                self.text += after[len(before):]
                self._prefix, self._read = self._read, len(self.ids)
        if self.stops:
            start = max(0, len(self.text) - len(after) - self.hold - 1)
            cut = min((i for i in (self.text.find(s, start) for s in self.stops) if i >= 0),
                      default=-1)
            if cut >= 0:
                self.text, self.stopped = self.text[:cut], True
        return self.stopped

    def pending(self, final: bool) -> str:
        """Text not yet sent; while running, the last `hold` characters wait (they may be
        the start of a stop string)."""
        end = len(self.text) if final or self.stopped else max(self.sent,
                                                                len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out


FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


# ----------------------------------------------------------------------------- log-probabilities


def _finite(x: float) -> float:
    """A log-probability JSON can carry: -inf (and below) as vLLM's -9999."""
    x = float(x)
    return x if x > -9999.0 else -9999.0


# ----------------------------------------------------------------------------- server


async def read_json(http: Request) -> Any:
    """The request's body parsed as JSON, or a 400 saying why it is not."""
    try:
        return await http.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"the body is not valid JSON: {e}", code="invalid_json") from e


class GSMServer:
    """Model, engine thread, live GSM config and metrics behind one FastAPI app."""

    def __init__(self, options: ServerOptions, params: Any = None) -> None:
        self.options = options
        # "loading" (the model) -> "warming" (compiling) -> "ready" -> "draining";
        # "failed" (the load or warm-up raised), "stopped" (stopped while starting)
        self.status = "loading"
        self.warm_progress: tuple[int, int | None, str] = (0, None, "")  # done, total, what
        self._stopping = threading.Event()  # stop_loading() was called
        # the loop starts, or close() / stop_loading() ran: not both (reentrant: a signal
        # handler may run on the main thread while it is inside close())
        self._lifecycle = threading.RLock()
        self._unsubscribe: Any = None  # the after-ready compilation warning
        self.load_thread: threading.Thread | None = None  # build_app's loading thread
        self.error: str | None = None
        self.exception: BaseException | None = None
        self.params = params
        self.engine: Engine | None = None
        self.loop: EngineLoop | None = None
        self.live: LiveGSM | None = None
        self.watcher: Any = None
        self.name = options.served_model_name or options.model
        self.metrics = ServerMetrics(self.name)
        self.started = int(time.time())
        self._token_text: Any = None

    # ---------------------------------------------------------------- lifecycle

    def load(self) -> None:
        """Load the model, build and warm the engine, start its thread (blocking)."""
        try:
            from gsm_jax.config import ConfigWatcher
            from gsm_jax.loading import load

            o = self.options
            if self.params is None:
                mesh = None
                if o.mesh is not None:
                    from gsm_jax.sharding import mesh_from_shape

                    mesh = mesh_from_shape(tuple(o.mesh))
                self.params = load(o.model, dtype=o.dtype, mesh=mesh)
            if o.quantize not in (None, "none"):
                from gsm_jax.quant import apply_quantize_option

                kwargs = {**({"head": True} if o.quantize_head else {}),
                          **({"group_size": o.quantize_group_size}
                             if o.quantize_group_size else {})}
                self.params = apply_quantize_option(self.params, o.quantize, **kwargs)
                log.info("gsm-jax serve: weights quantized: %s%s%s", o.quantize,
                         f", groups of {o.quantize_group_size}" if o.quantize_group_size
                         else "", " (LM head too)" if o.quantize_head else "")
            if self.params.tokenizer is None:
                raise InvalidInputError(f"{o.model}: no tokenizer; the server takes text")
            initial = None
            if o.gsm is not None:
                self.watcher = ConfigWatcher(o.gsm, num_layers=self.params.config.num_layers,
                                             on_change=lambda new, old: self._file_changed(new))
                initial = self.watcher.config
            compile_gsm = o.compile_gsm or initial is not None
            # requests carry their own config (the arm's), so the engine's default is unused
            self.engine = engine = Engine(
                self.params, max_batch=o.max_batch, max_len=o.max_len, compile_gsm=compile_gsm,
                gsm=initial, seed=o.seed, prefill_chunk=o.prefill_chunk,
                gsm_ring=o.gsm_ring or (None if initial is not None else 16),
                kv_cache_dtype=o.kv_cache_dtype,
                prefix_cache_bytes=o.prefix_cache_bytes if o.prefill_chunk else 0,
                async_scheduling=o.async_scheduling, kv_cache_tokens=o.kv_cache_tokens)
            self.params = engine.params  # the KV-cache format is part of the model config
            self.live = LiveGSM(initial, check=self._check_gsm, on_change=self._gsm_changed)
            self._gsm_changed(self.live.current)
            self._check_stopping()
            self.status = "warming"
            t0, c0 = time.perf_counter(), compile_events.count()
            log.info("gsm-jax serve: %s loaded; warming up (compiling the engine's programs)",
                     self.name)
            if engine.paged is not None:
                log.info("gsm-jax serve: KV cache: %d pages of %d tokens (%d tokens, %.2f GiB; "
                         "--kv-cache-tokens)", engine.paged[0], engine.paged[1],
                         engine.kv_cache_tokens,
                         engine.paged[0] * engine.kv_page_bytes / 2**30)

            def progress(done: int, total: int, what: str) -> None:
                self.warm_progress = (int(done), int(total), str(what))
                log.info("gsm-jax serve: warming %d/%d: %s (%d programs, %.1f s)", done, total,
                         what, compile_events.count() - c0, time.perf_counter() - t0)
                self._check_stopping()

            engine.warmup(o.warmup_lengths, sample=o.warmup_sampling, progress=progress)
            with self._lifecycle:
                self._check_stopping()
                self.loop = EngineLoop(engine, max_queue=o.max_queue,
                                       on_step=self._engine_stepped).start()
                if self.watcher is not None:
                    self.watcher.start()
                self.metrics.mark_ready()
                self._unsubscribe = compile_events.subscribe(self._compiled_after_ready)
                self.status = "ready"
            log.info("gsm-jax serve: %s ready (max_batch %d, max_len %d; warm-up %.1f s, "
                     "%d programs compiled or loaded from the cache)", self.name, o.max_batch,
                     o.max_len, time.perf_counter() - t0, compile_events.count() - c0)
        except WarmupCancelled:
            self.status = "stopped"
            log.info("gsm-jax serve: stopped while %s", "warming up" if self.engine else
                     "loading")
        except Exception as e:
            self.status, self.error, self.exception = "failed", f"{type(e).__name__}: {e}", e
            log.error("loading failed: %s", self.error)

    def _check_stopping(self) -> None:
        if self._stopping.is_set():
            raise WarmupCancelled("stopped while starting")

    def stop_loading(self) -> bool:
        """Stop a load or warm-up in progress: the loading thread ends at the warm-up's next
        stage (the program XLA is compiling then is not interrupted). True if the server was
        still starting (False: it is ready, or failed, and nothing was changed)."""
        with self._lifecycle:
            if self.status not in STARTING:
                return False
            self._stopping.set()
            return True

    def progress_message(self) -> str:
        """What the server is doing while it starts: "loading the model", "warming n/N"."""
        if self.status == "loading":
            return "the model is still loading"
        done, total, what = self.warm_progress
        if total is None:
            return "warming 0/?: compiling the first stage"
        return f"warming {done}/{total}" + (f" ({what} done)" if what else "")

    def _compiled_after_ready(self, name: str, seconds: float) -> None:
        log.warning("gsm-jax serve: compiled %s after ready (%.2f s; %d so far)", name,
                    seconds, self.metrics.compilations_after_ready)

    def drain(self, timeout: float | None = None) -> bool:
        """Stop taking requests (503), finish the running ones within `timeout` s."""
        if self.status == "ready":
            self.status = "draining"
        if self.loop is None:
            return True
        clean = self.loop.drain(self.options.shutdown_timeout if timeout is None else timeout)
        log.info("gsm-jax serve: drained (%s)", "clean" if clean else "timed out; aborted")
        return clean

    def close(self) -> None:
        with self._lifecycle:  # a warm-up that ends now starts no engine thread
            self._stopping.set()
            if self._unsubscribe is not None:
                self._unsubscribe()
                self._unsubscribe = None
        if self.watcher is not None:
            self.watcher.stop()
        if self.loop is not None:
            self.loop.stop()

    # ---------------------------------------------------------------- log-probabilities

    def token_text(self, token: int) -> str:
        """One token as text (special tokens spelled out), cached."""
        if self._token_text is None:
            tok = self.params.tokenizer
            self._token_text = functools.lru_cache(maxsize=1 << 16)(
                lambda i: tok.decode([i], skip_special_tokens=False))
        return self._token_text(int(token))

    # ---------------------------------------------------------------- GSM

    def _check_gsm(self, cfg: Any) -> Any:
        if not self.engine.gsm_compiled:
            raise GSMConfigError("this server was started with --no-gsm: GSM is compiled out")
        return self.engine.check_gsm(cfg)

    def _gsm_changed(self, v: GSMVersion) -> None:
        self.metrics.observe_gsm(v.number, v.rollout_fraction)
        log.info("GSM version %d (%s): %s", v.number, v.source,
                 None if v.config is None else v.config.to_dict())

    def _file_changed(self, cfg: Any) -> None:
        if self.live is None:
            return
        try:
            self.live.put(cfg, source="file")
        except GSMJaxError as e:
            log.error("GSM file %s refused: %s", self.options.gsm, e)

    def _engine_stepped(self, engine: Engine) -> None:
        self.metrics.observe_engine(self.loop.num_running, self.loop.num_waiting,
                                    engine.kv_usage, engine.prefix_cache_stats())

    # ---------------------------------------------------------------- requests

    def _ready(self) -> None:
        if self.status in STARTING:
            raise HTTPError(503, f"the server is starting: {self.progress_message()}",
                            type="unavailable_error", code=self.status,
                            headers={"Retry-After": str(STARTING_RETRY_AFTER_S)})
        if self.status == "draining":
            raise HTTPError(503, "the server is shutting down", type="unavailable_error",
                            code="draining")
        if self.status != "ready" or self.loop is None or not self.loop.alive:
            why = self.error or (self.loop.error if self.loop is not None else self.status)
            raise HTTPError(503, f"the engine is not running: {why}", type="server_error",
                            code="engine_dead")

    def _chat_options(self, body: ChatRequest) -> tuple[dict[str, Any], bool | None]:
        """The chat template's options of `body`, and whether the prompt opens thinking
        (None: the model has no reasoning chat format, its output is not split)."""
        tok = self.params.tokenizer
        kwargs = dict(body.chat_template_kwargs or {})
        for key in ("messages", "add_generation_prompt"):
            if key in kwargs:
                raise HTTPError(400, f"chat_template_kwargs may not set {key!r}",
                                param="chat_template_kwargs")
        fmt = getattr(tok, "chat_format", None)
        if fmt is None:
            if body.reasoning_effort is not None:
                raise HTTPError(400, f"reasoning_effort is not supported by {self.name!r}: "
                                "only models with a reasoning chat format (DeepSeek-V4, V4.1) "
                                "take it", param="reasoning_effort", code="unsupported")
            return kwargs, None
        from gsm_jax.chat_formats import resolve_options

        if body.reasoning_effort is not None:
            kwargs["reasoning_effort"] = body.reasoning_effort
        thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
        try:
            thinking, _ = resolve_options(fmt, thinking, kwargs.get("reasoning_effort"))
        except InvalidInputError as e:
            raise HTTPError(400, str(e), param=getattr(e, "param", None),
                            code="invalid_value") from e
        return kwargs, thinking

    def _prompt_ids(self, body: CompletionRequest | ChatRequest) -> list[list[int]]:
        tok = self.params.tokenizer
        if isinstance(body, ChatRequest):
            kwargs, _ = self._chat_options(body)
            try:
                return [tok.encode_chat([m.as_template_message() for m in body.messages],
                                         **kwargs)]
            except GSMJaxError as e:
                raise HTTPError(400, str(e), param=getattr(e, "param", "messages")) from e
        p = body.prompt
        if isinstance(p, str):
            prompts: list[Any] = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [list(p)]
        else:
            prompts = list(p)
        if not prompts:
            raise HTTPError(400, "prompt is empty", param="prompt")
        out = []
        for i, one in enumerate(prompts):
            if isinstance(one, str):
                if not one:
                    raise HTTPError(400, f"prompt {i} is empty", param="prompt")
                out.append(tok.encode(one))
            else:
                if not one:
                    raise HTTPError(400, f"prompt {i} has no tokens", param="prompt")
                vocab = self.params.config.vocab_size
                if any(t < 0 or t >= vocab for t in one):
                    raise HTTPError(400, f"prompt {i} has token ids outside [0, {vocab})",
                                    param="prompt")
                out.append(list(one))
        return out

    def _max_tokens(self, body: Any, n_prompt: int) -> int:
        """The tokens to generate for a prompt of `n_prompt` tokens, or a 400: a prompt
        longer than --max-len (or, to generate, as long) is refused before max_tokens is
        looked at, with both lengths named."""
        max_len = self.options.max_len
        limit = body.max_tokens
        if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
            limit = body.max_completion_tokens
        echo = isinstance(body, CompletionRequest) and body.echo
        if limit == 0 and echo:  # scoring the prompt alone (lm-evaluation-harness)
            if n_prompt > max_len:
                raise HTTPError(400, f"this model's context is {max_len} tokens (--max-len); "
                                f"the prompt has {n_prompt}", param="prompt",
                                code="context_length_exceeded")
            return 0
        room = max_len - n_prompt
        if room < 1:
            raise HTTPError(400, f"this model's context is {max_len} tokens (--max-len); the "
                            f"prompt has {n_prompt}, which leaves no room for a new token: "
                            "shorten the prompt", param="prompt",
                            code="context_length_exceeded")
        if limit is None:
            limit = 16 if isinstance(body, CompletionRequest) else room
        if limit < 1:
            raise HTTPError(400, f"max_tokens must be >= 1 (0 only with echo), got {limit}",
                            param="max_tokens")
        if limit > room:
            raise HTTPError(
                400, f"this model's context is {max_len} tokens (--max-len); the prompt has "
                f"{n_prompt} and max_tokens asks for {limit}: shorten the prompt or lower "
                "max_tokens", param="max_tokens", code="context_length_exceeded")
        return limit

    def check_model(self, name: str | None) -> None:
        """404 naming `name` unless it is this server's model (None: not given, fine)."""
        if name is not None and name != self.name:
            raise HTTPError(404, f"the model {name!r} does not exist; this server serves "
                            f"{self.name!r}", type="not_found_error", param="model",
                            code="model_not_found")

    @staticmethod
    async def json_object(http: Request) -> dict[str, Any]:
        """The request's body as a JSON object, or a 400 saying what it is not."""
        raw = await read_json(http)
        if not isinstance(raw, dict):
            raise HTTPError(400, "the body must be a JSON object", code="invalid_json")
        return raw

    @staticmethod
    def validate(model_cls: Any, raw: dict[str, Any]) -> Any:
        """`model_cls.model_validate(raw)`, or a 400 naming the first bad field."""
        try:
            return model_cls.model_validate(raw)
        except ValidationError as e:
            msg, param = first_error(e)
            raise HTTPError(400, msg, param=param, code="invalid_value") from e

    async def handle(self, http: Request, kind: str) -> Response:
        self._ready()
        raw = await self.json_object(http)
        refused = unsupported_field(raw, kind)
        if refused is not None:
            self.metrics.refuse(refused[0].split("[")[0])
            raise HTTPError(400, refused[1], param=refused[0], code="unsupported")
        body = self.validate(ChatRequest if kind == "chat" else CompletionRequest, raw)
        self.check_model(body.model)
        if isinstance(body, ChatRequest) and body.top_logprobs is not None \
                and not body.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        stops = body.stops()
        if any(not s for s in stops):
            raise HTTPError(400, "stop strings must be non-empty", param="stop")
        prompts = self._prompt_ids(body)
        limits = [self._max_tokens(body, len(p)) for p in prompts]
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        rid = http.headers.get("x-request-id") or f"{prefix}{uuid.uuid4().hex}"
        version, arm = self.live.assign(rid, len(prompts[0]) + limits[0])
        cfg = version.config if arm == "gsm" else None
        top_k = max(0, body.top_k)
        base_seed = body.seed
        try:
            bias = body.logit_bias_ids()
        except ValueError as e:
            raise HTTPError(400, str(e), param="logit_bias") from e
        # log-probabilities come from the engine's own steps, on device (`Request.logprobs`,
        # `prompt_logprobs` for echo): the decode step's logits, the prefill's for the prompt
        k = body.top_logprobs_k()
        echo = kind == "completion" and body.echo
        specs = []
        for pi, (ids, limit) in enumerate(zip(prompts, limits, strict=True)):
            for j in range(body.n):
                if limit == 0 and k is None:  # echo alone, no scores: nothing to run
                    specs.append((pi * body.n + j, None))
                    continue
                if limit == 0 and len(ids) >= self.engine.max_len:
                    raise HTTPError(400, f"scoring a prompt of {len(ids)} tokens needs "
                                    f"--max-len > {len(ids)} (the server's is "
                                    f"{self.engine.max_len})", param="prompt",
                                    code="context_length_exceeded")
                seed = None if base_seed is None else base_seed + j
                # echo alone with scores: a one-token run whose prefill scores the prompt
                # (its token is not returned)
                req = EngineRequest(ids, max(limit, 1), request_id=rid,
                                    temperature=body.temperature,
                                    top_k=top_k, top_p=body.top_p, seed=seed, gsm=cfg,
                                    ignore_eos=body.ignore_eos,
                                    frequency_penalty=body.frequency_penalty,
                                    presence_penalty=body.presence_penalty,
                                    repetition_penalty=body.repetition_penalty,
                                    logit_bias=bias, logprobs=None if limit == 0 else k,
                                    prompt_logprobs=k if echo else None,
                                    tag="score" if limit == 0 else "")
                try:
                    self.engine.check_request(req)
                except GSMJaxError as e:
                    field = str(e).split(" ")[0].split("[")[0].rstrip(":")
                    raise HTTPError(400, str(e), param=field if field in (
                        "logit_bias", "frequency_penalty", "presence_penalty",
                        "repetition_penalty") else None) from e
                specs.append((pi * body.n + j, req))
        call = _Call(self, kind, body, rid, version, arm, stops, specs,
                     asyncio.get_running_loop(), prompts=prompts, prefix=prefix)
        call.submit()
        headers = {"x-request-id": rid, "x-gsm-version": str(version.number), "x-gsm-arm": arm}
        ignored = body.ignored_fields()
        if ignored:
            headers["x-ignored-fields"] = ",".join(ignored)
            log.warning("request %s: ignored fields %s", rid, ignored)
        if body.stream:
            return StreamingResponse(call.stream(http), media_type="text/event-stream",
                                     headers=headers)
        return JSONResponse(await call.result(http), headers=headers)


class _Call:
    """One HTTP request's engine requests (prompts x n), their text, their events, and
    the log-probabilities of their tokens when asked."""

    def __init__(self, server: GSMServer, kind: str, body: Any, rid: str, version: GSMVersion,
                 arm: str, stops: list[str], specs: list[tuple[int, EngineRequest | None]],
                 aloop: asyncio.AbstractEventLoop, *, prompts: list[list[int]],
                 prefix: str) -> None:
        self.server, self.kind, self.body, self.rid = server, kind, body, rid
        self.id = rid if rid.startswith(prefix) else prefix + rid
        self.version, self.arm, self.aloop = version, arm, aloop
        self.created = int(time.time())
        self.events: asyncio.Queue = asyncio.Queue()
        eos = server.engine.eos_ids
        tok = server.params.tokenizer
        # reasoning split (DeepSeek-V4/V4.1 chat): None, or whether the prompt opened thinking
        self.thinking = server._chat_options(body)[1] if kind == "chat" else None
        literal = {}
        if self.thinking is not None:
            from gsm_jax.chat_formats import THINK, THINK_END

            literal = {tok.backend.token_to_id(t): t for t in (THINK, THINK_END)}
        self.texts = {i: TextStream(tok, stops, eos, literal) for i, _ in specs}
        self.splits = {}
        if self.thinking is not None:
            from gsm_jax.chat_formats import ReasoningSplitter

            self.splits = {i: ReasoningSplitter(self.thinking) for i, _ in specs}
        self.choice_ids = [i for i, _ in specs]
        self.tickets: list[Ticket] = []
        self.ticket_of: dict[int, Ticket] = {}
        self.score_only: set[int] = set()  # echo with max_tokens 0: the prompt's scores only
        for i, req in specs:
            if req is None:  # echo with max_tokens 0 and no scores: nothing to run
                continue
            t = Ticket(req, on_token=self._token, on_finish=self._finish, meta={"choice": i})
            self.tickets.append(t)
            self.ticket_of[i] = t
            if req.tag == "score":
                self.score_only.add(i)
        self.open = len(self.tickets)
        self.lock = threading.Lock()
        self.n = body.n
        self.prompts = prompts
        self.prompt_tokens = sum(len(p) for p in prompts)
        # log-probabilities: the top-k asked (None: off), echo
        self.k = body.top_logprobs_k()
        self.echo = kind == "completion" and body.echo
        self.lp_sent = {i: 0 for i in self.choice_ids}  # output tokens whose scores went out
        self.lp_offset = {i: 0 for i in self.choice_ids}  # next `text_offset`

    def submit(self) -> None:
        loop = self.server.loop
        try:
            for t in self.tickets:
                loop.submit(t)
        except (QueueFull, Draining) as e:
            for t in self.tickets:
                loop.abort(t, "rejected")
            reason = "queue_full" if isinstance(e, QueueFull) else "draining"
            self.server.metrics.reject(reason)
            raise HTTPError(503, str(e), type="unavailable_error", code=reason,
                            headers={"Retry-After": str(self.server.options.retry_after_s)}
                            ) from e

    # engine thread
    def _token(self, ticket: Ticket, token: int) -> str | None:
        if ticket.meta["choice"] in self.score_only:  # its one token is not an output
            return None
        stream = self.texts[ticket.meta["choice"]]
        stopped = stream.add(token)
        self.server.metrics.observe_token(ticket.record, self.arm)
        self.aloop.call_soon_threadsafe(self.events.put_nowait, ("token", ticket))
        return "stop" if stopped else None

    def _finish(self, ticket: Ticket) -> None:
        rec = ticket.record
        if rec is not None:
            self.server.metrics.observe_finish(rec, self.version.number, self.arm)
        self.aloop.call_soon_threadsafe(self.events.put_nowait, ("finish", ticket))

    # event loop
    def abort(self) -> None:
        for t in self.tickets:
            if not t.done:
                self.server.loop.abort(t, "abort")

    def _finish_reason(self, ticket: Ticket | None) -> str:
        if ticket is None or ticket.meta["choice"] in self.score_only:
            return "length"  # echo alone: the prompt is the whole (max_tokens 0) answer
        rec = ticket.record
        if rec is None:
            return "abort"
        return FINISH_REASONS.get(rec.finish_reason, "abort")

    def _usage(self) -> dict[str, int]:
        done = sum(t.record.n_tokens for i, t in self.ticket_of.items()
                   if t.record is not None and i not in self.score_only)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def _gsm(self) -> dict[str, Any]:
        return {"version": self.version.number, "arm": self.arm}

    def _object(self, chunk: bool) -> str:
        if self.kind == "chat":
            return "chat.completion.chunk" if chunk else "chat.completion"
        return "text_completion"

    def _split(self, i: int, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning, content) of new text; reasoning None where the output is not split."""
        split = self.splits.get(i)
        if split is None:
            return None, text
        return split.feed(text, final)

    def _tokens(self, i: int) -> list[int]:
        """The output tokens of choice `i` so far (EOS included), a snapshot."""
        t = self.ticket_of.get(i)
        if t is None or t.record is None or i in self.score_only:
            return []
        return [int(x) for x in list(t.record.tokens)]

    def _prompt_text(self, i: int) -> str:
        """The prompt of choice `i` as the client sent it (token ids: decoded)."""
        p, pi = self.body.prompt, i // self.n
        if isinstance(p, str):
            return p
        if p and isinstance(p[pi], str):
            return p[pi]
        return self.server.params.tokenizer.decode(self.prompts[pi])

    async def _logprobs(self, i: int, tokens: list[int], start: int, end: int, *,
                        with_prompt: bool) -> dict[str, Any]:
        """The log-probabilities of output tokens [start, end) of choice `i` (and first of
        its prompt's tokens if `with_prompt`), in the endpoint's OpenAI format: what the
        engine's steps recorded (`RequestRecord.logprobs`, `.prompt_logprobs`), each
        token's once, so a stream costs work linear in the tokens it sends."""
        prompt = self.prompts[i // self.n]
        t = self.ticket_of.get(i)
        rec = None if t is None else t.record
        rows: list[tuple[int, tuple | None]] = []  # (token, (log p, top values, top ids))
        if with_prompt:
            scored = [] if rec is None else rec.prompt_logprobs
            rows.append((prompt[0], None))
            rows += [(prompt[j], scored[j - 1]) for j in range(1, len(prompt))]
        rows += [(tokens[g], rec.logprobs[g]) for g in range(start, end)]
        text = self.server.token_text
        k = self.k
        if self.kind == "chat":
            content = []
            for token, r in rows:
                s = text(token)
                content.append({
                    "token": s, "logprob": _finite(r[0]), "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": text(t), "logprob": _finite(v), "bytes": list(text(t).encode())}
                        for v, t in zip(r[1][:k], r[2][:k], strict=True)],
                })
            return {"content": content, "refusal": None}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                "text_offset": []}
        offset = self.lp_offset[i]
        for token, r in rows:
            s = text(token)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            if r is None:  # the first prompt token: nothing before it to condition on
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            lp = _finite(r[0])
            out["token_logprobs"].append(lp)
            top = {s: lp}  # the chosen token, then the k most likely (vLLM's)
            for v, t in zip(r[1][:k], r[2][:k], strict=True):
                top.setdefault(text(t), _finite(v))
            out["top_logprobs"].append(top)
        self.lp_offset[i] = offset
        return out

    def _choice(self, i: int, text: str, finish: str | None, *, chunk: bool,
                first: bool = False, reasoning: str | None = None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            if chunk:
                delta: dict[str, Any] = {"role": "assistant"} if first else {}
                if reasoning:
                    delta["reasoning_content"] = reasoning
                if text:
                    delta["content"] = text
                return {"index": i, "delta": delta, "finish_reason": finish,
                        "logprobs": logprobs}
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.thinking is not None:
                message["reasoning_content"] = reasoning if self.thinking else None
            return {"index": i, "message": message, "finish_reason": finish,
                    "logprobs": logprobs}
        return {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs}

    def _envelope(self, choices: list[dict], *, chunk: bool) -> dict[str, Any]:
        return {"id": self.id, "object": self._object(chunk), "created": self.created,
                "model": self.server.name, "choices": choices, "gsm": self._gsm()}

    async def _next(self, http: Request) -> tuple[str, Ticket] | None:
        """The next engine event; None once the client is gone (its requests aborted)."""
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), timeout=0.25)
            except TimeoutError:
                if await http.is_disconnected():
                    self.abort()
                    return None

    async def result(self, http: Request) -> dict[str, Any]:
        while self.open:
            ev = await self._next(http)
            if ev is None:
                return {}
            if ev[0] == "finish":
                self.open -= 1
        choices = []
        for i in self.choice_ids:
            t = self.ticket_of.get(i)
            if t is not None and "error" in t.meta:
                raise HTTPError(500, f"request {self.rid} failed: {t.meta['error']}",
                                type="server_error")
            reasoning, text = self._split(i, self.texts[i].pending(final=True), True)
            if self.echo:
                text = self._prompt_text(i) + text
            logprobs = None
            if self.k is not None:
                tokens = self._tokens(i)
                logprobs = await self._logprobs(i, tokens, 0, len(tokens),
                                                with_prompt=self.echo)
            choices.append(self._choice(i, text, self._finish_reason(t), chunk=False,
                                        reasoning=reasoning, logprobs=logprobs))
        out = self._envelope(choices, chunk=False)
        out["usage"] = self._usage()
        return out

    async def _drain_events(self, http: Request) -> list[tuple[int, bool]] | None:
        """The choices with news, in order, and whether each finished: the next event and
        every one queued behind it (a stream scoring log-probabilities falls behind the
        engine; it then catches up in one chunk per choice). None: the client left."""
        ev = await self._next(http)
        if ev is None:
            return None
        events = [ev]
        while True:
            try:
                events.append(self.events.get_nowait())
            except asyncio.QueueEmpty:
                break
        final: dict[int, bool] = {}
        for kind, ticket in events:
            i = ticket.meta["choice"]
            final[i] = final.get(i, False) or kind == "finish"
            if kind == "finish":
                self.open -= 1
        return list(final.items())

    async def stream(self, http: Request) -> AsyncIterator[bytes]:
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        started: set[int] = set()

        def chunk_of(choice: dict[str, Any]) -> bytes:
            chunk = self._envelope([choice], chunk=True)
            if include_usage:
                chunk["usage"] = None
            return _sse(chunk)

        try:
            for i in self.choice_ids:  # echo alone: the prompt (and its scores) in one chunk
                if i in self.ticket_of:
                    continue
                logprobs = None
                if self.k is not None:
                    logprobs = await self._logprobs(i, [], 0, 0, with_prompt=True)
                yield chunk_of(self._choice(i, self._prompt_text(i), "length", chunk=True,
                                            first=True, logprobs=logprobs))
            while self.open:
                news = await self._drain_events(http)
                if news is None:
                    return
                for i, final in news:
                    ticket = self.ticket_of[i]
                    reasoning, text = self._split(i, self.texts[i].pending(final=final), final)
                    first = i not in started
                    logprobs = None
                    if self.k is not None:
                        tokens = self._tokens(i)
                        if len(tokens) > self.lp_sent[i] or (first and self.echo):
                            logprobs = await self._logprobs(i, tokens, self.lp_sent[i],
                                                            len(tokens),
                                                            with_prompt=first and self.echo)
                            self.lp_sent[i] = len(tokens)
                    if first and self.echo:
                        text = self._prompt_text(i) + text
                    if not (text or reasoning or logprobs) and not final \
                            and not (first and self.kind == "chat"):
                        continue
                    started.add(i)
                    finish = self._finish_reason(ticket) if final else None
                    yield chunk_of(self._choice(i, text, finish, chunk=True, first=first,
                                                reasoning=reasoning, logprobs=logprobs))
            if include_usage:
                last = self._envelope([], chunk=True)
                last["usage"] = self._usage()
                yield _sse(last)
            yield b"data: [DONE]\n\n"
        finally:  # the client went away mid-stream (the task is cancelled): free the slots
            self.abort()


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ----------------------------------------------------------------------------- app


def build_app(server: GSMServer, *, load_in_background: bool = True) -> FastAPI:
    """The FastAPI app of `server`; its lifespan loads the model and warms the engine (in
    a thread, `server.load_thread`, so /health answers 503 "loading" / "warming n/N"
    meanwhile) and stops the engine at exit (a warm-up still running stops at its next
    stage)."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if server.status == "loading" and server.load_thread is None:
            if load_in_background:
                server.load_thread = threading.Thread(target=server.load, name="gsm-jax-load",
                                                      daemon=True)
                server.load_thread.start()
            else:
                server.load()
        yield
        server.close()

    app = FastAPI(title="gsm-jax", lifespan=lifespan)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _route_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}",
                                       type=kind), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(f"{type(e).__name__}: {e}", type="server_error"),
                            status_code=500)

    def admin(http: Request) -> None:
        token = server.options.admin_token
        if token is None:
            raise HTTPError(404, "the admin endpoints are off: start the server with "
                            "--admin-token", type="not_found_error", code="admin_disabled")
        got = http.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
            raise HTTPError(401, "admin endpoints need 'Authorization: Bearer <admin token>'",
                            type="authentication_error", code="invalid_admin_token")
        server._ready()

    def gsm_state() -> JSONResponse:
        state = server.live.state()
        return JSONResponse(state, headers={"x-gsm-version": str(state["version"])})

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        return await server.handle(http, "completion")

    @app.post("/v1/chat/completions")
    async def chat(http: Request) -> Response:
        return await server.handle(http, "chat")

    def model_card() -> dict[str, Any]:
        return {"id": server.name, "object": "model", "created": server.started,
                "owned_by": "gsm-jax", "max_model_len": server.options.max_len}

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        server.check_model(model_id)
        return JSONResponse(model_card())

    # vLLM's tokenizer endpoints (lm-evaluation-harness's `local-completions` finds them and
    # tokenizes through the server: no tokenizer files on the client's side)
    def tokenizer() -> Any:
        server._ready()
        if server.params.tokenizer is None:
            raise HTTPError(400, f"{server.name}: no tokenizer", code="no_tokenizer")
        return server.params.tokenizer

    async def tool_body(http: Request, model_cls: Any) -> Any:
        tokenizer()
        body = server.validate(model_cls, await server.json_object(http))
        server.check_model(body.model)
        return body

    @app.post("/tokenize")
    async def tokenize(http: Request) -> JSONResponse:
        body = await tool_body(http, TokenizeRequest)
        tok = server.params.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            kwargs = dict(body.chat_template_kwargs or {})
            kwargs["add_generation_prompt"] = body.add_generation_prompt
            try:
                ids = tok.encode_chat([m.as_template_message() for m in body.messages],
                                      **kwargs)
            except GSMJaxError as e:
                raise HTTPError(400, str(e), param="messages") from e
        else:
            ids = tok.encode(body.prompt, add_bos=None if body.add_special_tokens else False)
        return JSONResponse({"count": len(ids), "max_model_len": server.options.max_len,
                             "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(http: Request) -> JSONResponse:
        body = await tool_body(http, DetokenizeRequest)
        vocab = server.params.config.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise HTTPError(400, f"token id {bad} is outside the vocabulary [0, {vocab})",
                            param="tokens")
        text = server.params.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> JSONResponse:
        tok = tokenizer()
        return JSONResponse({"tokenizer_class": "gsm_jax.Tokenizer",
                             "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                             "pad_token": tok.pad_token, "add_bos_token": tok.add_bos,
                             "chat_template": tok.chat_template,
                             "model_max_length": server.options.max_len,
                             "vocab_size": server.params.config.vocab_size})

    def starting(body: dict[str, Any]) -> dict[str, str]:
        """While loading or warming: the progress in `body`, and the Retry-After header."""
        if server.status not in STARTING:
            return {}
        body["message"] = server.progress_message()
        if server.status == "warming":
            done, total, what = server.warm_progress
            body["warmup"] = {"done": done, "total": total, "stage": what}
        return {"Retry-After": str(STARTING_RETRY_AFTER_S)}

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = server.status == "ready" and server.loop is not None and server.loop.alive
        body: dict[str, Any] = {
            "status": server.status if alive or server.status != "ready" else "failed"}
        headers = starting(body)
        if server.error:
            body["error"] = server.error
        return JSONResponse(body, status_code=200 if alive else 503, headers=headers)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok = server.status == "ready" and server.loop is not None and server.loop.alive
        full = ok and server.loop.num_waiting >= server.loop.max_queue
        body: dict[str, Any] = {"status": "queue_full" if full else server.status}
        headers = starting(body)
        return JSONResponse(body, status_code=200 if ok and not full else 503, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/gsm")
    async def get_gsm(http: Request) -> JSONResponse:
        admin(http)
        return gsm_state()

    @app.put("/admin/gsm")
    async def put_gsm(http: Request) -> JSONResponse:
        admin(http)
        data = await read_json(http)
        try:
            server.live.put(data)
        except GSMJaxError as e:
            raise HTTPError(400, f"GSM config refused: {e}", param="config",
                            code="invalid_gsm_config") from e
        return gsm_state()

    @app.post("/admin/gsm/rollout")
    async def rollout(http: Request) -> JSONResponse:
        admin(http)
        data = await read_json(http)
        if not isinstance(data, dict) or set(data) != {"fraction"}:
            raise HTTPError(400, 'the body must be {"fraction": f} with f in [0, 1]',
                            param="fraction")
        try:
            server.live.rollout(data["fraction"])
        except GSMJaxError as e:
            raise HTTPError(400, str(e), param="fraction") from e
        return gsm_state()

    @app.post("/admin/gsm/rollback")
    async def rollback(http: Request) -> JSONResponse:
        admin(http)
        try:
            server.live.rollback()
        except GSMJaxError as e:
            raise HTTPError(409, str(e), code="no_previous_version") from e
        return gsm_state()

    @app.get("/admin/steps")
    async def steps(http: Request) -> JSONResponse:
        """The engine's last calls (at most `engine.STEP_LOG`), oldest first: [kind, size,
        seconds], kind "prefill" (size: prompt bucket), "extend" (chunk) or "decode" (active
        slots); a load test reads the step-time spread from it (evidence claim 14)."""
        admin(http)
        log = list(server.engine.step_times)  # one C-level copy: atomic under the GIL
        return JSONResponse({"steps": [[k, int(n), float(t)] for k, n, t in log]})

    @app.delete("/admin/steps")
    async def clear_steps(http: Request) -> JSONResponse:
        admin(http)
        server.engine.step_times.clear()
        return JSONResponse({"cleared": True})

    @app.post("/admin/reset_prefix_cache")
    async def reset_prefix_cache(http: Request) -> JSONResponse:
        """vLLM's `POST /reset_prefix_cache` (dev mode there; the admin token here): drops
        every cached prefix state on the engine thread, between steps. 409 when the server
        runs without prefix caching."""
        admin(http)
        done = await asyncio.to_thread(server.loop.call, lambda eng: eng.reset_prefix_cache())
        if not done:
            raise HTTPError(409, "prefix caching is off (--no-enable-prefix-caching or "
                            "--prefix-cache-gb 0)", code="prefix_caching_disabled")
        return JSONResponse({"reset": True})

    @app.get("/admin/stats")
    async def stats(http: Request) -> JSONResponse:
        admin(http)
        eng = server.engine
        return JSONResponse({
            # the engine's programs (`serving/programs.py`): how many it plans and has built
            "programs": {"planned": len(eng.programs), "compiled": eng.programs.compiled},
            # XLA programs this process built (JAX's events), and those since ready
            "compilations": {"total": compile_events.count(),
                             "after_ready": server.metrics.compilations_after_ready},
            "running": server.loop.num_running,
            "waiting": server.loop.num_waiting, "kv_usage": eng.kv_usage,
            "max_batch": eng.max_batch, "max_len": eng.max_len,
            "kv_cache_tokens": eng.kv_cache_tokens,
            "prefill_chunk": eng.prefill_chunk, "gsm_compiled": eng.gsm_compiled,
            "async_scheduling": eng.async_scheduling,
            "prefix_cache": eng.prefix_cache_stats(),
        })

    return app


# ----------------------------------------------------------------------------- launch


def serve(options: ServerOptions, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Run the server until SIGTERM / SIGINT. The first signal drains: /health turns 503,
    new requests get 503, running ones finish within `options.shutdown_timeout` s (then
    are aborted), and the process exits; a second signal exits at once. A signal while
    the model loads or the engine warms up stops at once: the HTTP side shuts down and,
    if the loading thread is still inside a compilation (which cannot be interrupted),
    the process exits 0 without waiting for it (`os._exit`, after flushing the logs)."""
    import uvicorn

    server = GSMServer(options)
    app = build_app(server)

    class DrainingServer(uvicorn.Server):
        draining = False

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.draining:  # second signal: uvicorn's own (forced) exit
                self.force_exit = True
                return super().handle_exit(sig, frame)
            self.draining = True
            if server.stop_loading():  # loading or warming: nothing to drain
                log.info("gsm-jax serve: signal %s while %s: stopping", sig, server.status)
                self.should_exit = True
                return
            log.info("gsm-jax serve: signal %s: draining (up to %.0f s)", sig,
                     options.shutdown_timeout)

            def drain_then_exit() -> None:
                server.drain()
                self.should_exit = True

            threading.Thread(target=drain_then_exit, name="gsm-jax-drain", daemon=True).start()

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=5)
    uv = DrainingServer(config)

    def exit_if_loading_fails() -> None:  # an unknown model or a corrupt file ends the process
        while server.status in STARTING:
            time.sleep(0.1)
        if server.status == "failed":
            uv.should_exit = True

    threading.Thread(target=exit_if_loading_fails, name="gsm-jax-load-watch",
                     daemon=True).start()
    uv.run()
    loading = server.load_thread
    if loading is not None and loading.is_alive():  # stopped while loading or warming
        loading.join(timeout=1.0)  # a warm-up between two stages ends now
        if loading.is_alive():  # inside a compilation: do not wait for it, nor let the
            # interpreter tear JAX down under it (its thread would run on during exit)
            log.info("gsm-jax serve: exiting during %s", server.status)
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(0)
    if server.status == "failed":
        if isinstance(server.exception, GSMJaxError):
            raise server.exception
        raise InvalidInputError(f"the server could not start: {server.error}")
