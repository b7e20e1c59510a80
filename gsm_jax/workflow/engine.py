"""A small continuous-batching engine: requests join and leave between decode steps.

The engine owns a fixed number of batch *slots* and one running KV cache
(`family.init_cache(cfg, max_batch, max_len)`). Each call of `Engine.step()`:

1. admits waiting requests into free slots: one jitted prefill per request into a
   fresh batch-1 cache of the same `max_len` (prompt padded to a power of two
   >= 16, the same buckets as `gsm_jax.generate_tokens`, so compilations stay
   bounded), whose row is then copied into the running cache with the family's
   `cache_insert` (same jitted call, running cache donated). The prefill's
   logits give the request's first token (its time to first token);
2. runs one jitted `decode_step` over all slots (cache donated; free slots are
   inactive rows), samples one token per active slot and hands it to the host;
3. finishes a request at EOS (kept in its output, like `generate_tokens`) or at
   its `max_new_tokens`, and frees its slot for the next step's admissions.

Scheduling is the simplest useful policy: first come first served, prefill
before decode, each prefill on its own (a long prompt stalls the running decodes
for its prefill time: that shows up in their time per output token).

GSM per slot. With GSM compiled in (`gsm=` given, or `compile_gsm=True`), the
decode step takes `GSMInputs` whose `row_enabled[slot]` is the request's own
decision (`short_request_tokens` bypass, `rollout_fraction` by request id),
set when the request joins; strengths and the layer mask are runtime arrays,
so `set_gsm(config)` takes effect without recompiling (unless `max_window`,
`precision` or the kernel choice change: those are static and rebuild the
cache). `set_gsm(None)` on such an engine runs the *same compiled code with
zero strength* ("GSM zero"). An engine built without GSM (`gsm=None`,
`compile_gsm=False`) has no GSM code and no ring buffers at all: that is the
honest "GSM off" baseline the benchmark uses.

Per request the engine records: arrival (given by the caller: a client's send
time or a scheduled Poisson arrival), admission (prefill start), the time of
every output token (taken right after the token reached the host) and finish.

Greedy outputs equal those of `gsm_jax.generate_tokens` run on each request
alone (tested). Sampled outputs (temperature > 0) use one key per engine step,
so they depend on the schedule.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import GSMConfigError, InvalidInputError
from gsm_jax.families import family_module
from gsm_jax.generation import MIN_PROMPT_BUCKET, _on_mesh, bucket, sample_tokens
from gsm_jax.models.gsm_sites import GSMInputs
from gsm_jax.params import ModelParams
from gsm_jax.sharding import mesh_of

__all__ = ["Engine", "Request", "RequestRecord"]

clock = time.perf_counter


# ----------------------------------------------------------------------------- requests


@dataclass
class Request:
    """One generation request: token ids in, up to `max_new_tokens` token ids out."""

    prompt: Sequence[int] | np.ndarray
    max_new_tokens: int
    request_id: Any = None  # used for GSM rollout; default: the engine's submission counter
    temperature: float = 0.0
    tag: str = ""  # free label carried into the record (the benchmark uses "short"/"long")


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
    finish_reason: str = ""  # "eos" | "length"
    tokens: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

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


# ----------------------------------------------------------------------------- jitted steps


def _pick(logits, step, temperature, *, seed_key, sample: bool):
    if not sample:  # greedy: the same argmax generate_tokens takes at temperature 0
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    b = logits.shape[0]
    return sample_tokens(logits, jax.random.fold_in(seed_key, step), temperature,
                         jnp.zeros((b,), jnp.int32), jnp.ones((b,), jnp.float32),
                         filtered=False)


@functools.partial(jax.jit, static_argnames=("config", "max_len", "sample"),
                   donate_argnames=("cache",))
def _prefill_insert(weights, tokens, lengths, cache, slots, gsm, seed_key, step, temperature, *,
                    config, max_len: int, sample: bool):
    """Prefill `tokens` [b, T] into a fresh b-row cache, copy it into `cache` at `slots`."""
    family = family_module(config.family)
    rows = family.init_cache(
        config, tokens.shape[0], max_len, dtype=jax.tree.leaves(weights)[0].dtype,
        gsm_max_window=None if gsm is None else gsm.max_window,
    )
    logits, rows = family.prefill(weights, config, tokens, lengths, rows, gsm)
    cache = family.cache_insert(cache, rows, slots)
    return _pick(logits, step, temperature, seed_key=seed_key, sample=sample), cache


@functools.partial(jax.jit, static_argnames=("config", "sample"), donate_argnames=("cache",))
def _decode(weights, tokens, cache, gsm, active, seed_key, step, temperature, *,
            config, sample: bool):
    """One decode step over every slot; returns the next token per slot and the cache."""
    logits, cache = family_module(config.family).decode_step(
        weights, config, tokens, cache, gsm, active
    )
    return _pick(logits, step, temperature, seed_key=seed_key, sample=sample), cache


# ----------------------------------------------------------------------------- engine


@dataclass
class _Slot:
    record: RequestRecord
    temperature: float


class Engine:
    """Continuous batching over `max_batch` slots of a `max_len`-token KV cache.

    `params`: a `ModelParams` (what `gsm_jax.load` returns). `gsm`: a GSMConfig,
    dict, config path or ConfigWatcher (its current config) to compile GSM in
    and use it; `compile_gsm=True` with `gsm=None` compiles GSM in at zero
    strength. `eos_ids`: default the tokenizer's (or the config's); pass `()`
    to ignore EOS. Use `submit` + `step` to drive it yourself, or `run`.
    """

    def __init__(self, params: ModelParams, *, max_batch: int = 8, max_len: int = 1024,
                 gsm: Any = None, compile_gsm: bool = False,
                 eos_ids: Sequence[int] | None = None, seed: int = 0) -> None:
        if not isinstance(params, ModelParams):
            raise InvalidInputError(
                f"params must be what gsm_jax.load returns (ModelParams), got "
                f"{type(params).__name__}"
            )
        if int(max_batch) < 1:
            raise InvalidInputError(f"max_batch must be >= 1, got {max_batch!r}")
        self.params = params
        self._mesh = mesh_of(params.weights)  # sharded params: the mesh, for expert parallelism
        self.config = params.config
        self.family = family_module(self.config.family)
        if not hasattr(self.family, "cache_insert"):
            raise InvalidInputError(
                f"model family {self.config.family!r} has no cache_insert: it cannot join a "
                "running batch"
            )
        context = self.config.max_position_embeddings
        if not 1 <= int(max_len) <= context:
            raise InvalidInputError(f"max_len must be in [1, {context}] (the model's context), "
                                    f"got {max_len!r}")
        self.max_batch = int(max_batch)
        self.max_len = int(max_len)
        if eos_ids is None:
            tok = params.tokenizer
            eos_ids = tok.eos_ids if tok is not None else self.config.eos_token_ids
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self._seed_key = jax.random.key(seed)
        self._step_counter = 0
        self._submitted = 0
        # (kind, size, seconds) of every jitted call, host sync included: ("prefill",
        # prompt bucket, s) and ("decode", active slots, s). `run` starts a fresh list.
        self.step_times: list[tuple[str, int, float]] = []
        self.gsm_compiled = gsm is not None or bool(compile_gsm)
        self._gsm_cfg = None
        self._gsm_static: tuple[int, str, str] | None = None
        self._gsm_strength: jax.Array | None = None
        self._gsm_window = jnp.asarray(0, jnp.int32)
        self._gsm_protect = jnp.asarray(0, jnp.int32)
        self._cache = None
        self.slots: list[_Slot | None] = [None] * self.max_batch
        self.waiting: deque[tuple[RequestRecord, np.ndarray, float]] = deque()
        self._last = np.zeros((self.max_batch,), np.int32)
        self._rows = np.zeros((self.max_batch,), np.float32)
        self._temps = np.zeros((self.max_batch,), np.float32)
        if self.gsm_compiled:
            self.set_gsm(gsm)
        else:
            self._new_cache()

    # ------------------------------------------------------------------ configuration

    @property
    def gsm(self) -> Any:
        """The GSMConfig in force (None: no GSM compiled in, or zero strength)."""
        return self._gsm_cfg

    @property
    def mode(self) -> str:
        """"off" (no GSM compiled in), "zero" (compiled in, zero strength) or "on"."""
        if not self.gsm_compiled:
            return "off"
        return "on" if self._gsm_cfg is not None else "zero"

    def set_gsm(self, gsm: Any) -> None:
        """Switch the GSM config between runs (the engine must be idle). No recompilation
        unless `max_window`, `precision` or the kernel implementation change."""
        from gsm_jax.gsm_runtime import as_gsm_config, gsm_inputs_for_batch

        if self.has_work:
            raise InvalidInputError("set_gsm needs an idle engine (requests are in flight)")
        if not self.gsm_compiled:
            if gsm is None:
                return
            raise GSMConfigError("this engine was built without GSM; build it with gsm=... or "
                                 "compile_gsm=True to switch GSM configs")
        if gsm is None:  # zero strength, same compiled code (keeps the current statics)
            base = self._gsm_static
            if base is None:
                from gsm_jax.config import GSMConfig

                ref = GSMConfig()
                base = (ref.max_window, ref.precision, None)
            inputs = gsm_inputs_for_batch({"enable": False, "max_window": base[0],
                                           "precision": base[1], "target_layers": "all"},
                                          self.config.num_layers, 1, [])
            cfg = None
        else:
            cfg = as_gsm_config(gsm)
            inputs = gsm_inputs_for_batch(cfg, self.config.num_layers, 1, [])
        static = (inputs.max_window, inputs.precision, inputs.impl)
        self._gsm_cfg = cfg
        self._gsm_strength = inputs.strength
        self._gsm_window = inputs.window
        self._gsm_protect = inputs.protect_first
        if static != self._gsm_static or self._cache is None:
            self._gsm_static = static
            self._new_cache()

    def _new_cache(self) -> None:
        window = self._gsm_static[0] if self.gsm_compiled else None
        self._cache = self.family.init_cache(
            self.config, self.max_batch, self.max_len, dtype=self.params.dtype,
            gsm_max_window=window,
        )

    def _gsm_inputs(self, rows: np.ndarray) -> GSMInputs | None:
        if not self.gsm_compiled:
            return None
        max_window, precision, impl = self._gsm_static
        return GSMInputs(strength=self._gsm_strength, row_enabled=jnp.asarray(rows, jnp.float32),
                         window=self._gsm_window, protect_first=self._gsm_protect,
                         max_window=max_window, precision=precision, impl=impl)

    def _row_enabled(self, request_id: Any, total_tokens: int) -> bool:
        if self._gsm_cfg is None:
            return False
        from gsm_jax.config import row_enabled

        return bool(row_enabled(self._gsm_cfg, [request_id], [total_tokens])[0])

    # ------------------------------------------------------------------ state

    @property
    def num_active(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_active > 0

    # ------------------------------------------------------------------ requests

    def _check(self, req: Request) -> np.ndarray:
        prompt = np.asarray(req.prompt)
        if prompt.ndim != 1 or prompt.size == 0:
            raise InvalidInputError("a request's prompt must be a non-empty flat list of ids")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise InvalidInputError(f"a request's prompt holds non-integer ids ({prompt.dtype})")
        if prompt.min() < 0 or prompt.max() >= self.config.vocab_size:
            raise InvalidInputError(
                f"a request's prompt has ids outside the vocabulary [0, {self.config.vocab_size})"
            )
        n_new = req.max_new_tokens
        if not isinstance(n_new, int | np.integer) or n_new < 1:
            raise InvalidInputError(f"max_new_tokens must be an integer >= 1, got {n_new!r}")
        if prompt.size + n_new > self.max_len:
            raise InvalidInputError(
                f"a request of {prompt.size} prompt + {n_new} new tokens does not fit the "
                f"engine's max_len={self.max_len}"
            )
        if req.temperature is None or req.temperature < 0:
            raise InvalidInputError(f"temperature must be >= 0, got {req.temperature!r}")
        return prompt.astype(np.int32)

    def submit(self, request: Request, arrival: float | None = None,
               index: int | None = None) -> RequestRecord:
        """Queue a request (arrived at `arrival`, default now); it joins at the next step."""
        prompt = self._check(request)
        rid = request.request_id if request.request_id is not None else self._submitted
        record = RequestRecord(
            index=self._submitted if index is None else index, request_id=rid, tag=request.tag,
            prompt_len=int(prompt.size), max_new_tokens=int(request.max_new_tokens),
            arrival=clock() if arrival is None else float(arrival),
        )
        self._submitted += 1
        self.waiting.append((record, prompt, float(request.temperature)))
        return record

    # ------------------------------------------------------------------ stepping

    def _emit(self, slot: int, rec: RequestRecord, token: int, t: float) -> bool:
        """Record one output token; True if the request is finished."""
        rec.tokens.append(token)
        rec.token_times.append(t)
        if len(rec.tokens) == 1:
            rec.first_token = t
        reason = ("eos" if token in self.eos_ids
                  else "length" if len(rec.tokens) >= rec.max_new_tokens else "")
        if not reason:
            self._last[slot] = token
            return False
        rec.finish, rec.finish_reason = t, reason
        self.slots[slot] = None
        self._rows[slot] = 0.0
        self._temps[slot] = 0.0
        self._last[slot] = 0
        return True

    def _admit(self, slot: int, rec: RequestRecord, prompt: np.ndarray,
               temperature: float) -> bool:
        rec.slot = slot
        rec.gsm = self._row_enabled(rec.request_id, rec.prompt_len + rec.max_new_tokens)
        rec.admitted = clock()
        padded = min(bucket(prompt.size, MIN_PROMPT_BUCKET), self.max_len)
        tokens = np.zeros((1, padded), np.int32)
        tokens[0, : prompt.size] = prompt
        gsm = self._gsm_inputs(np.asarray([rec.gsm], np.float32))
        with _on_mesh(self._mesh):
            tok, self._cache = _prefill_insert(
                self.params.weights, jnp.asarray(tokens), jnp.asarray([prompt.size], jnp.int32),
                self._cache, jnp.asarray([slot], jnp.int32), gsm, self._seed_key,
                jnp.asarray(self._step_counter, jnp.int32),
                jnp.asarray([temperature], jnp.float32),
                config=self.config, max_len=self.max_len, sample=temperature > 0,
            )
        self._step_counter += 1
        token = int(np.asarray(tok)[0])
        self.step_times.append(("prefill", padded, clock() - rec.admitted))
        self.slots[slot] = _Slot(rec, temperature)
        self._rows[slot] = float(rec.gsm)
        self._temps[slot] = temperature
        return self._emit(slot, rec, token, clock())

    def _decode_once(self) -> list[RequestRecord]:
        active = np.array([s is not None for s in self.slots])
        gsm = self._gsm_inputs(self._rows * active)
        t = clock()
        with _on_mesh(self._mesh):
            tok, self._cache = _decode(
                self.params.weights, jnp.asarray(self._last), self._cache, gsm,
                jnp.asarray(active), self._seed_key, jnp.asarray(self._step_counter, jnp.int32),
                jnp.asarray(self._temps),
                config=self.config, sample=bool((self._temps[active] > 0).any()),
            )
        self._step_counter += 1
        tokens = np.asarray(tok)
        self.step_times.append(("decode", int(active.sum()), clock() - t))
        t = clock()
        done = []
        for slot in np.flatnonzero(active):
            rec = self.slots[slot].record
            if self._emit(int(slot), rec, int(tokens[slot]), t):
                done.append(rec)
        return done

    def step(self) -> list[RequestRecord]:
        """Admit what fits (prefill each), then one decode step; returns finished requests."""
        done: list[RequestRecord] = []
        now = clock()
        while self.waiting and self.waiting[0][0].arrival <= now:
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not free:
                break
            rec, prompt, temperature = self.waiting.popleft()
            if self._admit(free[0], rec, prompt, temperature):
                done.append(rec)
        if self.num_active:
            done.extend(self._decode_once())
        return done

    # ------------------------------------------------------------------ warm-up

    def warmup(self, prompt_lengths: Sequence[int] = (16,), *,
               sample: bool = False) -> dict[str, Any]:
        """Compile and run, through the normal request path, the prefill of each prompt
        bucket the given lengths fall in, and the decode step (greedy; also sampled
        with `sample=True`).

        Returns seconds per prompt bucket (a dummy request's prefill + one decode
        step, compilation included) and in total. The engine is left idle; its
        cache holds junk rows, which the next admissions overwrite.
        """
        if self.has_work:
            raise InvalidInputError("warmup needs an idle engine")
        by_bucket: dict[int, int] = {}
        for n in sorted(int(n) for n in prompt_lengths):
            n = max(1, min(n, self.max_len - 1))
            by_bucket.setdefault(min(bucket(n, MIN_PROMPT_BUCKET), self.max_len), n)
        out: dict[str, Any] = {"prefill_s": {}}
        start = clock()
        for padded, n in by_bucket.items():
            t = clock()
            for temperature in ([0.0, 1.0] if sample else [0.0]):
                self.submit(Request([0] * n, min(2, self.max_len - n), request_id="warmup",
                                    temperature=temperature))
                while self.has_work:
                    self.step()
            out["prefill_s"][padded] = clock() - t
        if all(n >= self.max_len - 1 for n in by_bucket.values()):  # decode not reached yet
            self.submit(Request([0], 2, request_id="warmup"))
            while self.has_work:
                self.step()
        out["total_s"] = clock() - start
        return out

    # ------------------------------------------------------------------ driver

    def run(self, requests: Sequence[Request], *, arrival_times: Sequence[float] | None = None,
            clients: int | None = None,
            on_finish: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
        """Serve `requests` to completion; returns their records in request order.

        - `arrival_times` (seconds from the start, open loop): request i arrives then,
          whatever the engine is doing;
        - `clients=N` (closed loop): N clients each send their next request (the next
          one not yet sent, in order) the moment their previous one completes;
        - neither: everything arrives at once.

        Record times stay absolute (`time.perf_counter()`); the run started at the
        earliest arrival (closed loop / all at once) or at `min(arrival_times)` less
        its offset.
        """
        if self.has_work:
            raise InvalidInputError("run needs an idle engine")
        n = len(requests)
        for r in requests:
            self._check(r)
        if arrival_times is not None and clients is not None:
            raise InvalidInputError("give arrival_times (open loop) or clients (closed loop)")
        if arrival_times is not None:
            if len(arrival_times) != n:
                raise InvalidInputError(f"arrival_times has {len(arrival_times)} entries, "
                                        f"requests {n}")
            order = sorted(range(n), key=lambda i: float(arrival_times[i]))
        else:
            order = list(range(n))
        if clients is not None and int(clients) < 1:
            raise InvalidInputError(f"clients must be >= 1, got {clients!r}")
        records: list[RequestRecord | None] = [None] * n
        self.step_times = []
        pending = deque(order)
        t0 = clock()

        def send(i: int, at: float) -> None:
            self.submit(requests[i], arrival=at, index=i)

        if arrival_times is None:
            for _ in range(n if clients is None else min(int(clients), n)):
                send(pending.popleft(), t0)
        while True:
            if arrival_times is not None:
                now = clock()
                while pending and t0 + float(arrival_times[pending[0]]) <= now:
                    i = pending.popleft()
                    send(i, t0 + float(arrival_times[i]))
            if not self.has_work:
                if not pending:
                    break
                if arrival_times is None:  # cannot happen: closed loop refills on finish
                    send(pending.popleft(), clock())
                    continue
                time.sleep(max(0.0, t0 + float(arrival_times[pending[0]]) - clock()))
                continue
            for rec in self.step():
                records[rec.index] = rec
                if on_finish is not None:
                    on_finish(rec)
                if clients is not None and pending:
                    send(pending.popleft(), rec.finish)
        return records  # type: ignore[return-value]
