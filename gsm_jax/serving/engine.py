"""Continuous batching over fixed slots: requests join and leave between decode steps.

The engine owns `max_batch` slots and one running KV cache
(`family.init_cache(cfg, max_batch, max_len)`; for the dense families a pool of pages
sized by memory, `kv_cache_tokens`: see `Engine`), and runs a fixed, small set of compiled
programs (`serving/programs.py`), JetStream's split, built by `warmup` before a server
says ready, none after (tested by counting JAX's compilation events):

- **extend** (one program per chunk width 32, 64, ... `prefill_chunk`): a prompt's
  tokens into its slot of the running cache, in place (no one-row cache, no insert),
  `prefill_chunk` tokens per engine step, so a long prompt delays the running decodes
  by one chunk at a time (the last chunk is padded to its own width). The last chunk's
  pick is the request's first token (its time to first token). With prefix caching
  (`prefix_cache_bytes`, `serving/prefix_cache.py`) each chunk's KV block is kept, and
  a prompt starting with the same chunks restores them and prefills only the rest, bit
  for bit as if it had prefilled them;
- **decode** (one program per row bound): one `decode_step` over the first r slots
  (cache donated; free slots among them are inactive rows), with the token feed, the
  penalties, the pick and the log-probabilities inside, one token per active slot.

**The context length is run-time data.** Attention loops over 128-slot cache blocks up
to the longest row's length (`models.common.cache_attention`): a step costs what the
rows hold (the same at max_len 256 or 8192 while they hold 64 tokens), and `--max-len`
adds no program. Families whose caches have their own sizes (DeepSeek's window and
compressed entries) read those.

**Rows bounded by what is running** (`bound_rows`, on by default). A decode step runs
the first r slots only, r = the power of 2 >= the highest running slot + 1
(`ROW_BOUND_FACTOR`; new requests take the lowest free slot, so the running ones stay
low): one stream costs a one-row step, not a `max_batch` one (vLLM pads its batches to a
few captured sizes the same way): log2(max_batch) + 1 decode programs. The slots past r
are left as they are (`models.common.first_rows`). The dense families' caches on one
device; DeepSeek caches and a mesh (its data axis splits the slots) step every slot.

A request finishes at EOS (kept in its output, like `generate_tokens`), at its
`max_new_tokens`, or when the caller aborts it (`abort`: a client that went away,
a stop string matched); its slot is free for the next step's admissions.
Scheduling: first come first served; each step admits what fits (or advances one
chunk of a long prompt), then decodes.

GSM per request. With GSM compiled in (`gsm=` given, or `compile_gsm=True`), every
slot carries its own strengths [layers, sites] and window (runtime arrays), so
requests smoothed by different config versions share a batch, and a request keeps
the config it was admitted with until it finishes. A request's `gsm` is `DEFAULT`
(the engine's config, with its `short_request_tokens` bypass and `rollout_fraction`
by request id), `None` (not smoothed) or a `GSMConfig` (smoothed by it). Nothing
numeric is compiled in: changing configs never recompiles. Static are
`max_window`, `precision` and the kernel choice (a config that differs there is
refused), and `protect_first` is one value for the whole batch: a request whose
config changes it waits until the smoothed rows of the previous value finish.
`set_gsm(None)` runs the same compiled code with zero strength ("GSM zero"). An
engine built without GSM has no GSM code and no ring buffers at all: the honest
"GSM off" baseline the benchmarks use.

Sampling per request: temperature, top-k, top-p and a seed; a request's k-th
token draws from key `fold_in(key(seed), k)`, so a seeded sampled output does not
depend on the schedule. Greedy outputs equal `gsm_jax.generate_tokens` run on each
request alone (tested). Penalties (OpenAI's frequency / presence, vLLM's repetition,
`logit_bias`) adjust a row's logits before it picks (`programs.penalize`); their counters
live on the device ([max_batch, vocab], counted inside the steps), so a penalized batch
needs no round trip. Sampling, filtering, penalties and log-probabilities are run-time
flags of the same programs: a greedy batch runs no sampler. Log-probabilities
(`Request.logprobs`, `prompt_logprobs`) are the model's raw ones, log-softmax and the
top 20 computed on the device inside the step that produced the token.

Per request the engine records: arrival (given by the caller), admission (prefill
start), the time of every output token (right after it reached the host) and the
finish. `on_token(record, token)` and `on_finish(record)` callbacks (called from
the thread that steps the engine) let a server stream them.
"""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from gsm_jax.errors import GSMConfigError, InvalidInputError
from gsm_jax.families import family_module
from gsm_jax.generation import (
    MIN_PROMPT_BUCKET,
    check_refused_tokens,
    on_mesh,
    with_kv_cache_dtype,
)
from gsm_jax.models import common
from gsm_jax.models.gsm_sites import GSMInputs
from gsm_jax.params import ModelParams
from gsm_jax.serving import programs
from gsm_jax.serving.prefix_cache import PrefixCache, check_capacity
from gsm_jax.serving.programs import ProgramMissing, ProgramSet
from gsm_jax.serving.requests import (
    DEFAULT,
    MAX_LOGPROBS,
    Request,
    RequestRecord,
    Sampling,
    clock,
)
from gsm_jax.serving.slots import SlotState, pick_flags
from gsm_jax.sharding import mesh_of

__all__ = ["DEFAULT", "Engine", "Request", "RequestRecord", "clock"]

STEP_LOG = 65536  # engine calls kept in `Engine.step_times` outside `run`


# The serving default of `prefill_chunk` (the engine's, the server's `--prefill-chunk`): a
# 128-token chunk already runs at the per-token cost of a 512-token one (SmolLM2, AMD EPYC, 2
# threads: 2.02 against 2.00 ms per token; 16 tokens 5.5, 64 tokens 2.6), so wider chunks
# only add programs to build at start-up (each width is one `extend`) and lengthen the
# stall a prompt puts on the running decodes (docs/performance_notes.md, "Serving engine:
# prefill chunks of 128").
PREFILL_CHUNK = 128

# The narrowest chunk width (below it a chunk is padded to it): a 16-token chunk took 88 ms
# and a 32-token one 113 ms (same note), so a 16-wide `extend` program would save 25 ms on
# the shortest prompts at the price of one more program to build before ready.
MIN_CHUNK_WIDTH = 32

# Row bounds grow by this factor (1, 2, 4, ...). Measured (docs/performance_notes.md,
# "Serving engine: row bounds are powers of two"): a SmolLM2 step of 2 rows costs 1.52x
# one row, 4 rows 1.77x, 8 rows 2.14x, 16 rows 2.86x; each bound is one decode program.
ROW_BOUND_FACTOR = 2

# The KV cache's page (`models.common.KVCache.pages`): as many slots as one block of the
# attention loop reads (`common.ATTN_BLOCK`), so a paged step reads what a step over rows
# reads; a request holds ceil((prompt + max_new_tokens) / page) pages.
KV_PAGE = common.ATTN_BLOCK

# The KV pool's default size in bytes when `kv_cache_tokens` is not given: every slot's
# max_len, but no more than this (and never less than one max_len request). SmolLM2's
# float32 cache is 45 KiB a token: 16 slots x 2048 tokens (1.4 GiB) fit whole; at
# --max-len 8192 the pool holds 46k tokens (5.7 whole-context requests, or 16 of 2.9k)
# instead of 6 GiB of slots mostly never written (vLLM sizes its pool by memory too:
# `--gpu-memory-utilization`, on CPU `VLLM_CPU_KVCACHE_SPACE`).
KV_POOL_BYTES = 2 << 30


# ----------------------------------------------------------------------------- engine

# the engine's running state, as `programs.fresh_state` returns it: the attributes it lands in
_STATE_FIELDS = ("_cache_now", "_pen_now", "_prev_now")


def _in_background(fn: Callable[[], Any]) -> Future:
    """`fn()` on a daemon thread (a process stopping during the warm-up does not wait for
    it): its Future."""
    future: Future = Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - raised where the result is read
            future.set_exception(e)

    threading.Thread(target=run, name="gsm-jax-fresh-state", daemon=True).start()
    return future


@dataclass
class _Waiting:
    record: RequestRecord
    prompt: np.ndarray
    sampling: Sampling
    gsm: Any  # DEFAULT | None | GSMConfig
    logprobs: int | None = None  # Request.logprobs
    prompt_logprobs: int | None = None


@dataclass
class _Prefilling:
    """A prompt being prefilled, in place in its slot, one chunk per step."""

    item: _Waiting
    slot: int
    cfg: Any  # the GSMConfig smoothing it, or None
    done: int  # prompt tokens already in the slot's row
    keys: dict[int, bytes] = field(default_factory=dict)  # prefix-cache key per boundary


@dataclass
class _InFlight:
    """A decode step dispatched and not yet read back (async scheduling)."""

    tokens: Any  # its picks, a device array [max_batch]
    lp: Any  # its log-probabilities (device arrays [row bound, ...])
    active: np.ndarray  # [max_batch] bool: the slots it steps
    owners: list  # the record in each slot when it was dispatched
    start: float  # when it was dispatched


class Engine:
    """Continuous batching over `max_batch` slots of a `max_len`-token KV cache.

    `params`: a `ModelParams` (what `gsm_jax.load` returns). `gsm`: a GSMConfig,
    dict, config path or ConfigWatcher (its current config) to compile GSM in
    and use it by default; `compile_gsm=True` with `gsm=None` compiles GSM in at
    zero strength. `eos_ids`: default the tokenizer's (or the config's); pass `()`
    to ignore EOS. `prefill_chunk`: longest prompt prefilled in one step (a power
    of two >= 16; longer prompts go in chunks of it; None: never chunk). `gsm_ring`:
    rows of the GSM ring buffers (default: what the config's windows need up to
    max_len, e.g. 8 for window 8; a live config needing more is refused).
    `kv_cache_dtype`: the KV cache's format (`gsm_jax.with_kv_cache_dtype`: "float",
    "int8" / "fp8", V4.1's "released"; None / "auto": the model's own). `prefix_cache_bytes` > 0:
    automatic prefix caching
    within that many bytes (`serving/prefix_cache.py`: the states at prefill-chunk
    boundaries, GSM rings included, reused by later prompts that start with the same
    chunks; outputs are bit for bit those with caching off; needs `prefill_chunk`).
    `bound_rows` (default on): a decode step runs the first 1, 2, 4, ... slots, the
    fewest that hold every running row (new requests take the lowest free slot), so
    one stream costs a one-row step, not a
    `max_batch` one, as vLLM's batch-size buckets do (the dense families' caches on one
    device; DeepSeek caches and a mesh step every slot). `async_scheduling` (default on):
    a decode step is dispatched before the previous one's tokens are read back, so the
    host's bookkeeping (emitting tokens, stop checks, the server's streaming) overlaps
    the device's work, as vLLM's async scheduling; outputs are the same as with it off
    (tested). Use `submit` + `step` to drive it yourself, or `run`.

    **The KV cache is a pool of pages** (vLLM's PagedAttention layout,
    `models.common.KVCache.pages`) for the dense families on one device: `kv_cache_tokens`
    slots in pages of `KV_PAGE` (128), shared by the `max_batch` rows; a request holds
    ceil((prompt + max_new_tokens) / 128) pages from its admission to its end, and waits
    in the queue while they are not free. Default: every row's max_len, capped at
    `KV_POOL_BYTES` (2 GiB; never below one max_len request), so `max_len` no longer
    sizes the memory (nor the start-up: 16 x 8192 slots of SmolLM2 were 6 GB to fill).
    DeepSeek caches and a mesh keep rows of max_len.
    """

    def __init__(self, params: ModelParams, *, max_batch: int = 8, max_len: int = 1024,
                 gsm: Any = None, compile_gsm: bool = False,
                 eos_ids: Sequence[int] | None = None, seed: int = 0,
                 prefill_chunk: int | None = PREFILL_CHUNK, gsm_ring: int | None = None,
                 kv_cache_dtype: str | None = None,
                 prefix_cache_bytes: int = 0, bound_rows: bool = True,
                 async_scheduling: bool = True, kv_cache_tokens: int | None = None) -> None:
        if not isinstance(params, ModelParams):
            raise InvalidInputError(
                f"params must be what gsm_jax.load returns (ModelParams), got "
                f"{type(params).__name__}"
            )
        params = with_kv_cache_dtype(params, kv_cache_dtype)
        if int(max_batch) < 1:
            raise InvalidInputError(f"max_batch must be >= 1, got {max_batch!r}")
        self.params = params
        self._mesh = mesh_of(params.weights)  # sharded params: the mesh, for expert parallelism
        self.config = params.config
        self.family = family_module(self.config.family)
        context = self.config.max_position_embeddings
        if not 1 <= int(max_len) <= context:
            raise InvalidInputError(f"max_len must be in [1, {context}] (the model's context), "
                                    f"got {max_len!r}")
        self.max_batch = int(max_batch)
        self.max_len = int(max_len)
        if prefill_chunk is not None:
            chunk = int(prefill_chunk)
            if chunk < MIN_PROMPT_BUCKET or chunk & (chunk - 1):
                raise InvalidInputError(f"prefill_chunk must be a power of two >= "
                                        f"{MIN_PROMPT_BUCKET}, got {prefill_chunk!r}")
            prefill_chunk = chunk
        self.prefill_chunk = prefill_chunk
        capacity = check_capacity(prefix_cache_bytes)
        if capacity and prefill_chunk is None:
            raise InvalidInputError(
                "prefix caching needs chunked prefill (its blocks are the prefill chunks): "
                "give prefill_chunk, or prefix_cache_bytes=0")
        self.prefix_cache = PrefixCache(capacity, prefill_chunk) if capacity else None
        if gsm_ring is not None and (isinstance(gsm_ring, bool) or int(gsm_ring) < 1):
            raise InvalidInputError(f"gsm_ring must be an integer >= 1, got {gsm_ring!r}")
        self._ring_request = None if gsm_ring is None else int(gsm_ring)
        self.bound_rows = bool(bound_rows)
        self.async_scheduling = bool(async_scheduling)
        self._ahead: _InFlight | None = None  # the decode step in flight (async scheduling)
        self._read_at = 0.0  # when the last decode step's tokens reached the host
        # the last decode step's picks [max_batch], on device: the next step's token feed
        # (made with the cache: `_new_cache`)
        if eos_ids is None:
            tok = params.tokenizer
            eos_ids = tok.eos_ids if tok is not None else self.config.eos_token_ids
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self._seed = int(seed)
        self._submitted = 0
        # (kind, size, seconds) of every compiled call, host sync included: ("extend",
        # chunk width, s), ("restore", tokens, s) and ("decode", active slots, s). A
        # server steps the engine for days: the last `STEP_LOG` calls are kept (the
        # server's `/admin/steps`); `run` starts a fresh list of its own calls.
        self.step_times: deque[tuple[str, int, float]] | list[tuple[str, int, float]] = (
            deque(maxlen=STEP_LOG))
        self.on_token: Callable[[RequestRecord, int], None] | None = None
        self.on_finish: Callable[[RequestRecord], None] | None = None
        self.gsm_compiled = gsm is not None or bool(compile_gsm)
        self._gsm_cfg = None
        self._gsm_static: tuple[int, str, str] | None = None
        self._row_params_cache: dict[Any, tuple[np.ndarray, int]] = {}
        self._protect = 0  # the batch's protect_first
        self._fresh = None  # the running state being made (`_new_cache`)
        self._state_like = None  # its shapes (ShapeDtypeStructs): what programs are planned from
        self.waiting: deque[_Waiting] = deque()
        self._prefilling: _Prefilling | None = None
        b, n_layers = self.max_batch, self.config.num_layers
        # who holds each slot and what its next decode step needs (`serving/slots.py`)
        self._state = SlotState(b, n_layers)
        self.slots: list[RequestRecord | None] = self._state.records
        # the penalty counters [max_batch, V] (`_pen`) are made with the cache
        self._pen_dirty = np.zeros((b,), bool)  # a penalized request's values still there
        self._setup_pages(kv_cache_tokens)
        if self.gsm_compiled:
            self.set_gsm(gsm)
        else:
            self._new_cache()

    # ------------------------------------------------------------------ configuration

    @property
    def gsm(self) -> Any:
        """The default GSMConfig (None: no GSM compiled in, or zero strength)."""
        return self._gsm_cfg

    @property
    def mode(self) -> str:
        """"off" (no GSM compiled in), "zero" (compiled in, zero strength) or "on"."""
        if not self.gsm_compiled:
            return "off"
        return "on" if self._gsm_cfg is not None else "zero"

    @property
    def gsm_static(self) -> tuple[int, str, str] | None:
        """(ring rows, precision, kernel impl) compiled in, or None without GSM."""
        return self._gsm_static

    def _static_of(self, cfg: Any) -> tuple[int, str, str]:
        """The statics a config needs: a ring of `ring_rows(cfg, [max_len])` rows (every
        window a request up to max_len can use: 8 rows for window 8, not max_window's
        64), or the `gsm_ring` the engine was given."""
        from gsm_jax.gsm_runtime import resolved_kernel_impl, resolved_precision, ring_rows

        ring = self._ring_request or ring_rows(cfg, [self.max_len])
        return (ring, resolved_precision(cfg.precision), resolved_kernel_impl())

    def _ring_misfit(self, cfg: Any, ring: int) -> str | None:
        """Why a ring of `ring` rows cannot run `cfg` exactly (None if it can). The ring
        size is also the adaptive window's upper clamp, so where `max_window` clamps the
        adaptive window below max_len's, the ring must be exactly `max_window`."""
        from gsm_jax.config import ADAPTIVE_MIN_WINDOW

        if cfg.window_size != "adaptive":
            if int(cfg.window_size) <= ring:
                return None
            return f"window_size={cfg.window_size} needs a ring of >= {cfg.window_size} rows"
        reach = max(self.max_len // 16, ADAPTIVE_MIN_WINDOW)  # largest adaptive window used
        if cfg.max_window < reach:
            if cfg.max_window == ring:
                return None
            return (f"adaptive windows clamped at max_window={cfg.max_window} need a ring of "
                    f"exactly {cfg.max_window} rows")
        if reach <= ring:
            return None
        return f"adaptive windows up to {reach} (max_len {self.max_len}) need a ring of {reach}"

    def check_gsm(self, gsm: Any) -> Any:
        """The GSMConfig `gsm` names, if this engine can run it without recompiling;
        otherwise a GSMConfigError that says which compiled value it changes."""
        from gsm_jax.config import resolve_mask
        from gsm_jax.gsm_runtime import as_gsm_config, resolved_precision

        if not self.gsm_compiled:
            raise GSMConfigError("this engine was built without GSM; build it with gsm=... or "
                                 "compile_gsm=True to run GSM configs")
        cfg = as_gsm_config(gsm)
        resolve_mask(cfg, self.config.num_layers)  # layers / profile must fit this model
        if self._gsm_static is None:
            return cfg
        ring, precision, _ = self._gsm_static
        if resolved_precision(cfg.precision) != precision:
            raise GSMConfigError(
                f"precision={resolved_precision(cfg.precision)!r} differs from the compiled "
                f"precision={precision!r}: the filter's arithmetic is static; restart with it")
        why = self._ring_misfit(cfg, ring)
        if why is not None:
            raise GSMConfigError(
                f"{why}, but the ring buffers were compiled with {ring} rows (static: their "
                "size); restart with a larger ring (gsm_ring= / --gsm-ring)")
        return cfg

    def set_gsm(self, gsm: Any) -> None:
        """Set the default config of requests submitted with `gsm=DEFAULT` (requests
        already admitted keep theirs). `None` = zero strength, same compiled code. An idle
        engine sizes its ring for the new config (a new size compiles once); a running
        one keeps its ring and precision, and refuses a config that does not fit them."""
        if not self.gsm_compiled:
            if gsm is None:
                return
            raise GSMConfigError("this engine was built without GSM; build it with gsm=... or "
                                 "compile_gsm=True to switch GSM configs")
        if gsm is None:
            cfg = None
            if self._gsm_static is None:
                from gsm_jax.config import GSMConfig

                static = self._static_of(GSMConfig())
            else:
                static = self._gsm_static
        elif self.has_work:
            cfg, static = self.check_gsm(gsm), self._gsm_static
        else:
            from gsm_jax.config import resolve_mask
            from gsm_jax.gsm_runtime import as_gsm_config

            cfg = as_gsm_config(gsm)
            resolve_mask(cfg, self.config.num_layers)
            static = self._static_of(cfg)
        self._gsm_cfg = cfg
        if static != self._gsm_static or self._state_like is None:
            self._gsm_static = static
            self._new_cache()

    def _new_cache(self) -> None:
        self._ahead = None  # an idle engine's step in flight has no running row to feed
        window = self._gsm_static[0] if self.gsm_compiled else None
        if self.prefix_cache is not None:  # its states have the old cache's structure
            self.prefix_cache.clear()
        # one program makes the running cache, the penalty counters and the token feed
        # (eager zeros would be a little program per shape: ten more at start-up). It runs
        # on a worker thread: filling a large cache takes seconds (16 slots x 8192 tokens
        # of SmolLM2 are 6 GB, first-touched memory), which `warmup`'s compiling or loading
        # of the programs overlaps; the first read of the state waits for it. The programs
        # are planned from its shapes meanwhile (see docs/performance_notes.md, "Serving
        # start-up: the running state made on a worker thread; where a cold compile goes").
        self._reset_pages()
        # a paged cache's rows are whole pages: max_len rounded up to the page
        cache_len = self.max_len if self.paged is None else self._table_len * self.paged[1]
        make = functools.partial(programs.fresh_state, self.config, self.max_batch,
                                 cache_len, np.dtype(self.params.dtype), window, self.paged)
        self._fresh = None
        self._state_like = jax.eval_shape(make)
        if self._mesh is None:
            self._fresh = _in_background(make)
        else:
            self._cache, self._pen, self._prev = make()
        self._pen_dirty[:] = False
        self._plan()  # the programs for this cache's structure

    def _take_fresh(self) -> None:
        """The running state `_new_cache` had made on its worker thread, now in place."""
        fresh, self._fresh = self._fresh, None
        state = fresh.result()
        for name, value in zip(_STATE_FIELDS, state, strict=True):
            self.__dict__[name] = value

    def _state_field(name: str) -> property:  # noqa: N805 - a property factory
        def get(self: Engine) -> Any:
            if self.__dict__.get("_fresh") is not None:
                self._take_fresh()
            return self.__dict__.get(name)

        def put(self: Engine, value: Any) -> None:
            if self.__dict__.get("_fresh") is not None:  # never overwritten by it later
                self._take_fresh()
            self.__dict__[name] = value

        return property(get, put, doc=f"the running {name[1:]} (waits for `_new_cache`)")

    _cache = _state_field("_cache_now")
    _pen = _state_field("_pen_now")
    _prev = _state_field("_prev_now")
    del _state_field

    def _row_params(self, cfg: Any) -> tuple[np.ndarray, int]:
        """(strength [layers, 2], window) of one smoothed row under `cfg`."""
        hit = self._row_params_cache.get(cfg)
        if hit is None:
            from gsm_jax.config import resolve_mask

            mask = resolve_mask(cfg, self.config.num_layers)
            strength = np.where(mask & cfg.enable, cfg.smooth_strength, 0.0).astype(np.float32)
            window = 0 if cfg.window_size == "adaptive" else int(cfg.window_size)
            if len(self._row_params_cache) > 64:
                self._row_params_cache.clear()
            hit = self._row_params_cache[cfg] = (strength, window)
        return hit

    def _gsm_inputs(self, smoothed: np.ndarray, strength: np.ndarray,
                    window: np.ndarray) -> GSMInputs | None:
        """The GSM arrays of a step: `smoothed` [r] 1 for each row whose request is smoothed
        (0: bypassed or rolled out), strength and window per row."""
        if not self.gsm_compiled:
            return None
        max_window, precision, impl = self._gsm_static
        # numpy leaves: the jitted step takes them as they are (a jnp.asarray per array
        # was an eager op each, ~0.1 ms apiece per decode step)
        return GSMInputs(strength=np.asarray(strength, np.float32),
                         row_enabled=np.asarray(smoothed, np.float32),
                         window=np.asarray(window, np.int32),
                         protect_first=np.asarray(self._protect, np.int32),
                         max_window=max_window, precision=precision, impl=impl)

    def _resolve_gsm(self, item: _Waiting) -> Any:
        """The GSMConfig smoothing this request (None: not smoothed)."""
        if not self.gsm_compiled:
            return None
        if item.gsm is DEFAULT:
            cfg = self._gsm_cfg
            if cfg is None:
                return None
            from gsm_jax.config import row_enabled

            rec = item.record
            ok = row_enabled(cfg, [rec.request_id], [rec.prompt_len + rec.max_new_tokens])[0]
            return cfg if ok else None
        if item.gsm is None or not item.gsm.enable:
            return None
        return item.gsm

    # ------------------------------------------------------------------ state

    @property
    def num_active(self) -> int:
        return sum(s is not None for s in self.slots)

    @property
    def num_waiting(self) -> int:
        """Requests not yet decoding: queued, or between the chunks of their prefill."""
        return len(self.waiting) + (self._prefilling is not None)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_active > 0 or self._prefilling is not None

    # ------------------------------------------------------------------ the KV pool

    def _setup_pages(self, tokens: int | None) -> None:
        """The page pool's size (`kv_cache_tokens`), or rows of max_len where the cache
        cannot be paged (DeepSeek caches, a mesh): `self.paged` = (pages, page) or None."""
        import inspect

        pageable = (self._mesh is None and "paged" in inspect.signature(
            self.family.init_cache).parameters)
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(
                tokens, int | np.integer) or tokens < 1):
            raise InvalidInputError(f"kv_cache_tokens must be an integer >= 1, got {tokens!r}")
        if not pageable:
            if tokens is not None:
                raise InvalidInputError(
                    f"kv_cache_tokens: the {self.config.family} family's cache "
                    + ("on a mesh " if self._mesh is not None else "")
                    + "is not paged (rows of max_len each); leave it unset")
            self.paged, self._table_len = None, 0
            return
        page = min(KV_PAGE, self.max_len)
        self._table_len = per_row = -(-self.max_len // page)  # pages of one max_len row
        one = jax.eval_shape(lambda: self.family.init_cache(
            self.config, 1, page, dtype=np.dtype(self.params.dtype), paged=(1, page)))
        page_bytes = sum(int(a.size) * a.dtype.itemsize for name in ("k", "v", "k_scale",
                                                                      "v_scale")
                         for a in jax.tree.leaves(getattr(one, name)))
        if tokens is None:
            fit = max(per_row, KV_POOL_BYTES // max(page_bytes, 1))
            n_pages = min(self.max_batch * per_row, fit)
        else:
            n_pages = -(-int(tokens) // page)
            if n_pages < per_row:
                raise InvalidInputError(
                    f"kv_cache_tokens={tokens} holds less than one request of max_len="
                    f"{self.max_len} ({per_row} pages of {page}); give at least "
                    f"{per_row * page}, or a smaller max_len")
        self.paged = (int(n_pages), int(page))
        self.kv_page_bytes = page_bytes
        self._reset_pages()

    def _reset_pages(self) -> None:
        """Every page free (a new running cache: `_new_cache`)."""
        if self.paged is not None:
            self._free_pages = list(range(self.paged[0] - 1, -1, -1))  # pop() takes page 0
            self._slot_pages = [[] for _ in range(self.max_batch)]

    @property
    def kv_cache_tokens(self) -> int:
        """Slots of the KV cache: the page pool's, or max_batch x max_len (rows)."""
        if self.paged is None:
            return self.max_batch * self.max_len
        return self.paged[0] * self.paged[1]

    def _pages_needed(self, item: _Waiting) -> int:
        page = self.paged[1]
        return -(-min(item.prompt.size + item.record.max_new_tokens, self.max_len) // page)

    def _take_pages(self, slot: int, n: int) -> None:
        assert not self._slot_pages[slot], f"slot {slot} still holds pages"
        self._slot_pages[slot] = [self._free_pages.pop() for _ in range(n)]

    def _release_pages(self, slot: int) -> None:
        if self.paged is not None and 0 <= slot < self.max_batch:
            self._free_pages.extend(reversed(self._slot_pages[slot]))
            self._slot_pages[slot] = []

    def _page_row(self, slot: int) -> np.ndarray | None:
        """The slot's page table row [max_len / page] (its pages, then page 0 where it
        holds none: never written, never read past its length); None when not paged."""
        if self.paged is None:
            return None
        row = np.zeros((self._table_len,), np.int32)
        held = self._slot_pages[slot]
        row[:len(held)] = held
        return row

    @property
    def kv_tokens(self) -> int:
        """Cache slots holding tokens of running requests (prompt + generated so far)."""
        used = sum(r.prompt_len + r.n_tokens for r in self.slots if r is not None)
        if self._prefilling is not None:
            used += self._prefilling.done
        return used

    @property
    def kv_usage(self) -> float:
        """The share of the KV cache held: pages reserved by running requests / pages
        (paged), else kv_tokens / (max_batch * max_len)."""
        if self.paged is None:
            return self.kv_tokens / float(self.max_batch * self.max_len)
        return 1.0 - len(self._free_pages) / float(self.paged[0])

    # ------------------------------------------------------------------ requests

    def check_request(self, req: Request) -> np.ndarray:
        prompt = np.asarray(req.prompt)
        if prompt.ndim != 1 or prompt.size == 0:
            raise InvalidInputError("a request's prompt must be a non-empty flat list of ids")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise InvalidInputError(f"a request's prompt holds non-integer ids ({prompt.dtype})")
        if prompt.min() < 0 or prompt.max() >= self.config.vocab_size:
            raise InvalidInputError(
                f"a request's prompt has ids outside the vocabulary [0, {self.config.vocab_size})"
            )
        check_refused_tokens([prompt], self.config)  # e.g. V4.1's image token: text only
        n_new = req.max_new_tokens
        if isinstance(n_new, bool) or not isinstance(n_new, int | np.integer) or n_new < 1:
            raise InvalidInputError(f"max_new_tokens must be an integer >= 1, got {n_new!r}")
        if prompt.size + n_new > self.max_len:
            raise InvalidInputError(
                f"a request of {prompt.size} prompt + {n_new} new tokens does not fit the "
                f"engine's max_len={self.max_len}"
            )
        if req.temperature is None or not req.temperature >= 0:
            raise InvalidInputError(f"temperature must be >= 0, got {req.temperature!r}")
        if isinstance(req.top_k, bool) or not isinstance(req.top_k, int | np.integer) \
                or req.top_k < 0:
            raise InvalidInputError(f"top_k must be an integer >= 0 (0 = off), got {req.top_k!r}")
        if req.top_p is None or not 0.0 < req.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {req.top_p!r}")
        if req.seed is not None and (isinstance(req.seed, bool)
                                     or not isinstance(req.seed, int | np.integer)):
            raise InvalidInputError(f"seed must be an integer or None, got {req.seed!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(req, name)
            if isinstance(value, bool) or not isinstance(value, int | float | np.number) \
                    or not -2.0 <= value <= 2.0:
                raise InvalidInputError(f"{name} must be a number in [-2, 2], got {value!r}")
        rep = req.repetition_penalty
        if isinstance(rep, bool) or not isinstance(rep, int | float | np.number) \
                or not (math.isfinite(rep) and rep > 0):
            raise InvalidInputError(f"repetition_penalty must be a number > 0, got {rep!r}")
        for token, value in (req.logit_bias or {}).items():
            if isinstance(token, bool) or not isinstance(token, int | np.integer) \
                    or not 0 <= token < self.config.vocab_size:
                raise InvalidInputError(f"logit_bias: token id {token!r} is not in the "
                                        f"vocabulary [0, {self.config.vocab_size})")
            if isinstance(value, bool) or not isinstance(value, int | float | np.number) \
                    or not -100.0 <= value <= 100.0:
                raise InvalidInputError(f"logit_bias[{token}] must be a number in "
                                        f"[-100, 100], got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(req, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int | np.integer)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidInputError(f"{name} must be None or an integer in "
                                        f"[0, {MAX_LOGPROBS}], got {k!r}")
        if req.gsm is not DEFAULT and req.gsm is not None:
            self.check_gsm(req.gsm)
        return prompt.astype(np.int32)

    def submit(self, request: Request, arrival: float | None = None,
               index: int | None = None) -> RequestRecord:
        """Queue a request (arrived at `arrival`, default now); it joins at the next step."""
        prompt = self.check_request(request)
        rid = request.request_id if request.request_id is not None else self._submitted
        record = RequestRecord(
            index=self._submitted if index is None else index, request_id=rid, tag=request.tag,
            prompt_len=int(prompt.size), max_new_tokens=int(request.max_new_tokens),
            arrival=clock() if arrival is None else float(arrival),
            ignore_eos=bool(request.ignore_eos),
        )
        seed = request.seed if request.seed is not None else self._seed * 1_000_003 + \
            self._submitted
        sampling = Sampling(float(request.temperature), int(request.top_k),
                             float(request.top_p), int(seed) & 0x7FFFFFFF,
                             float(request.frequency_penalty), float(request.presence_penalty),
                             float(request.repetition_penalty),
                             tuple((int(k), float(v)) for k, v in
                                   sorted((request.logit_bias or {}).items())))
        gsm = request.gsm
        if gsm is not DEFAULT and gsm is not None:
            gsm = self.check_gsm(gsm)
        self._submitted += 1
        self.waiting.append(_Waiting(record, prompt, sampling, gsm, request.logprobs,
                                     request.prompt_logprobs))
        return record

    def abort(self, record: RequestRecord, reason: str = "abort") -> bool:
        """End a request now (queued, prefilling or decoding) with `finish_reason=reason`;
        its slot is free for the next step. False if it had already finished."""
        if record.done:
            return False
        for item in self.waiting:
            if item.record is record:
                self.waiting.remove(item)
                break
        else:
            if self._prefilling is not None and self._prefilling.item.record is record:
                self._release_pages(self._prefilling.slot)
                self._prefilling = None
            elif 0 <= record.slot < self.max_batch and self.slots[record.slot] is record:
                self._free(record.slot)
        self._finish(record, reason, clock())
        return True

    # ------------------------------------------------------------------ stepping

    def _finish(self, rec: RequestRecord, reason: str, t: float) -> None:
        rec.finish, rec.finish_reason = t, reason
        if self.on_finish is not None:
            self.on_finish(rec)

    def _free(self, slot: int) -> None:
        self._state.free(slot)
        self._release_pages(slot)

    def _emit(self, slot: int, rec: RequestRecord, token: int, t: float,
              lp: tuple | None = None) -> bool:
        """Record one output token (and its log-probabilities `lp` = (chosen, top values,
        top ids), when the request asked); True if the request is finished. The scores
        go in first: a reader that sees the token (another thread) finds its scores."""
        k = self._state.logprobs[slot]
        if k is not None and lp is not None:
            rec.logprobs.append((float(lp[0]), np.array(lp[1][:k]), np.array(lp[2][:k])))
        rec.tokens.append(token)
        rec.token_times.append(t)
        if len(rec.tokens) == 1:
            rec.first_token = t
        if self.on_token is not None:
            self.on_token(rec, token)
        if rec.done:  # the callback aborted it (a stop string)
            return True
        reason = ("eos" if token in self.eos_ids and not rec.ignore_eos
                  else "length" if len(rec.tokens) >= rec.max_new_tokens else "")
        if not reason:
            self._state.last[slot] = token
            return False
        self._free(slot)
        self._finish(rec, reason, t)
        return True

    def _one_row_gsm(self, cfg: Any) -> GSMInputs | None:
        if not self.gsm_compiled:
            return None
        if cfg is None:
            strength, window = np.zeros((self.config.num_layers, 2), np.float32), 0
        else:
            strength, window = self._row_params(cfg)
        return self._gsm_inputs(np.ones((1,), np.float32), strength[None],
                                np.asarray([window], np.int32))

    def _can_admit(self, cfg: Any) -> bool:
        """protect_first is one value per batch: a smoothed request whose config changes it
        waits until no smoothed row of the previous value is running."""
        if cfg is None or cfg.protect_first == self._protect:
            return True
        smoothed = any(r is not None and self._state.smoothed[i] > 0
                       for i, r in enumerate(self.slots))
        if self._prefilling is not None and self._prefilling.cfg is not None:
            smoothed = True
        if smoothed:
            return False
        self._protect = cfg.protect_first
        return True

    # ------------------------------------------------------------------ prefix caching

    def _prefix_keys(self, item: _Waiting, cfg: Any) -> dict[int, bytes]:
        """{boundary: key} of a prompt's chunk boundaries (`PrefixCache.keys`), empty with
        caching off or a prompt of one chunk. Besides the tokens, the key holds what decides
        the row's state: its GSM strengths and window (or not smoothed), the batch's
        protect_first and the compiled ring / precision / kernel."""
        if self.prefix_cache is None or item.prompt.size <= self.prefill_chunk:
            return {}
        if cfg is None:
            gsm = b"not smoothed"
        else:
            strength, window = self._row_params(cfg)
            gsm = np.ascontiguousarray(strength, np.float32).tobytes() + b"|w%d" % window
        context = repr((self._gsm_static, self._protect, self.max_len)).encode() + b"|" + gsm
        return dict(self.prefix_cache.keys(item.prompt, context))

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix state (vLLM's `reset_prefix_cache`); running rows keep
        their own caches (a cached state is a copy), so this is safe between steps. False
        when caching is off."""
        if self.prefix_cache is None:
            return False
        self.prefix_cache.clear()
        return True

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        """The prefix cache's counters (`PrefixCache.stats`), None when caching is off."""
        return None if self.prefix_cache is None else self.prefix_cache.stats()

    def step(self) -> list[RequestRecord]:
        """Advance a chunked prefill by one chunk, or admit what fits (prefill each); then
        one decode step. Returns the requests that finished."""
        done: list[RequestRecord] = []
        if self._prefilling is not None:
            rec = self._prefilling.item.record
            if self._advance_prefill():
                done.append(rec)
        now = clock()
        while self._prefilling is None and self.waiting and self.waiting[0].record.arrival <= now:
            free = [i for i, s in enumerate(self.slots) if s is None]
            if not free:
                break
            item = self.waiting[0]
            need = 0 if self.paged is None else self._pages_needed(item)
            if self.paged is not None and need > len(self._free_pages):
                break  # first come first served: it waits for pages, as do those behind it
            cfg = self._resolve_gsm(item)
            if not self._can_admit(cfg):
                break
            self.waiting.popleft()
            if need:
                self._take_pages(free[0], need)
            if self._admit(free[0], item, cfg):
                done.append(item.record)
        if self.num_active or self._ahead is not None:
            done.extend(self._decode_once())
        if self._ahead is not None and not self._pending(self._ahead).any():
            # every row of the step in flight finished when its predecessor was read
            # (EOS, a stop string, an abort): read it now, so no step outlives its rows
            done.extend(self._read(self._ahead))
            self._ahead = None
        return done

    # ------------------------------------------------------------------ warm-up

    # ------------------------------------------------------------------ programs

    def _plan(self) -> None:
        """The programs this engine runs (`serving/programs.py`), for the cache it has:
        one decode per row bound, one extend per chunk width, the penalty row, and with
        prefix caching the snapshot / restore of a chunk. Compiled by `warmup`, else
        each the first time it is called."""
        ps = ProgramSet(save=self._mesh is None, aot=self._mesh is None)
        # the outputs' tree structures, known without tracing the model (a warm start
        # builds each program from its saved form and never traces it)
        lp, pen = (0, 0, 0), (0, 0, 0)
        cache, pens, _ = self._state_like
        for bound in self.rows_bounds():
            ps.add("decode", bound, programs.decode, self._decode_example(bound),
                   {"config": self.config, "row_bound": bound}, donate=(1, 2),
                   out=(0, lp, cache, pen))
        for w in self.widths():
            ps.add("extend", w, programs.extend, self._extend_example(w),
                   {"config": self.config}, donate=(1, 2), out=(0, lp, lp, cache, pen))
        v = self.config.vocab_size
        ps.add("penalty_row", None, programs.penalty_row,
               (pens, np.int32(0), np.zeros((v,), bool),
                np.zeros((v,), np.float32)), donate=(0,), out=pen)
        if self.prefix_cache is not None and self.prefill_chunk < self.max_len:
            block = self.prefill_chunk  # (a chunk >= max_len: no prompt has a boundary)
            ps.add("snapshot", block, programs.snapshot,
                   (cache, np.int32(0), np.int32(0)), {"block": block})
            saved = jax.eval_shape(functools.partial(programs.snapshot, block=block),
                                   cache, np.int32(0), np.int32(0))
            ps.add("restore", block, programs.restore,
                   (cache, saved, np.int32(0), np.int32(0), self._page_row(0)), donate=(0,),
                   out=cache)
        self.programs = ps

    def _call(self, name: str, bucket: Any, *args: Any) -> Any:
        """Run a compiled program (compiling it first if `warmup` did not)."""
        if not self.programs.has(name, bucket):
            raise ProgramMissing(f"no {name!r} program planned for {bucket!r}")
        if self.programs.aot and (name, bucket) not in self.programs._compiled:
            # not warmed up: this one only
            self.programs.compile(mesh=self._mesh, threads=1, keys=[(name, bucket)])
        with on_mesh(self._mesh):
            return self.programs.call(name, bucket, *args)

    def widths(self) -> list[int]:
        """The chunk widths a prompt is prefilled in: powers of two from `MIN_CHUNK_WIDTH`
        (32) to `prefill_chunk`, or to max_len when that is smaller or prompts are not
        chunked (a smaller top is the only width)."""
        top = min(self.prefill_chunk or self.max_len, self.max_len)
        return programs.width_buckets(min(MIN_CHUNK_WIDTH, top), top)

    def width_of(self, n: int) -> int:
        """The extend width of a chunk of n real tokens: the smallest bucket >= n."""
        return next(w for w in self.widths() if w >= n)

    def _decode_example(self, bound: int | None) -> tuple:
        """A decode call's arguments for row bound `bound` (the cache and counters as their
        shapes): what the program is planned from."""
        return self._decode_call_args(np.zeros((self.max_batch,), bool), bound,
                                      np.zeros((self.max_batch,), np.int32), False,
                                      state=self._state_like)

    def _extend_example(self, w: int) -> tuple:
        """An extend call's arguments for chunk width `w`."""
        return self._extend_call_args(np.zeros((1, w), np.int32), 1, 0, 0,
                                      np.zeros((1, w), np.int32), None, Sampling(0.0, 0, 1.0, 0),
                                      None, False, state=self._state_like)

    def _decode_call_args(self, active: np.ndarray, bound: int | None, counts: np.ndarray,
                          copy: bool, state: tuple | None = None) -> tuple:
        """A decode call's arguments; `state`: (cache, counters, feed) in place of the
        engine's own (their shapes, to plan the program from)."""
        d = self._state.decode_inputs(active, bound, counts, copy)
        gsm = self._gsm_inputs(d["smoothed"], d["strength"], d["window"])
        cache, pen, prev = state if state is not None else (self._cache, self._pen, self._prev)
        return (self.params.weights, cache, pen, prev, d["host"],
                d["use_prev"], d["active"], gsm, d["sampling"], d["fpr"], d["flags"])

    def _extend_call_args(self, tokens: np.ndarray, n: int, start: int, slot: int,
                          targets: np.ndarray, cfg: Any, s: Sampling, lp: int | None,
                          prompt_lp: bool, last: bool = True,
                          state: tuple | None = None) -> tuple:
        gsm = self._one_row_gsm(cfg)
        cache, pen = state[:2] if state is not None else (self._cache, self._pen)
        sampling = (np.asarray([s.temperature], np.float32), np.asarray([s.top_k], np.int32),
                    np.asarray([s.top_p], np.float32), np.asarray([s.seed], np.int32),
                    np.zeros((1,), np.int32))
        fpr = (np.asarray([s.frequency], np.float32), np.asarray([s.presence], np.float32),
               np.asarray([s.repetition], np.float32))
        return (self.params.weights, cache, pen, tokens,
                np.asarray([n], np.int32), np.int32(start), np.int32(slot), targets, gsm,
                sampling, fpr, pick_flags([(s, lp)]), np.bool_(prompt_lp), np.bool_(last),
                self._page_row(slot))

    # ------------------------------------------------------------------ admission

    def _occupy(self, slot: int, item: _Waiting, cfg: Any, token: int,
                lp: tuple | None) -> bool:
        """The request's row is in the running cache: it decodes from the next step on."""
        rec = item.record
        self._state.occupy(slot, rec, item.sampling, item.logprobs,
                           None if cfg is None else self._row_params(cfg))
        return self._emit(slot, rec, token, clock(), lp)

    def _admit(self, slot: int, item: _Waiting, cfg: Any) -> bool:
        """Start prefilling a request into `slot` (from the longest cached prefix, if
        any); its first chunk runs now. True if it finished."""
        rec, s = item.record, item.sampling
        rec.slot = slot
        rec.gsm = cfg is not None
        rec.admitted = clock()
        if s.penalized or self._pen_dirty[slot]:
            # its counters, prompt tokens and bias, before its first pick; a slot a penalized
            # request held is cleared for the next (its logit bias would apply again whenever
            # the batch has a penalized row)
            v = self.config.vocab_size
            seen = np.zeros((v,), bool)
            bias = np.zeros((v,), np.float32)
            if s.penalized:
                seen[item.prompt] = True
                for token, value in s.bias:
                    bias[token] = value
            self._pen = self._call("penalty_row", None, self._pen, np.int32(slot), seen, bias)
            self._pen_dirty[slot] = s.penalized
        keys = self._prefix_keys(item, cfg)
        done = 0
        # prompt log-probabilities need every chunk's logits: such a prompt is prefilled
        # whole (and still keeps its blocks for later prompts), as vLLM does
        if self.prefix_cache is not None and keys and item.prompt_logprobs is None:
            chain = self.prefix_cache.lookup_chain(list(keys.items()), item.prompt.size)
            for start, saved in chain:  # the blocks in order: the last one's rings stay
                self._cache = self._call("restore", self.prefill_chunk, self._cache, saved,
                                         np.int32(slot), np.int32(start),
                                         self._page_row(slot))
                done = start + self.prefill_chunk
            if chain:
                self.step_times.append(("restore", done, clock() - rec.admitted))
        self._prefilling = _Prefilling(item, slot, cfg, done, keys)
        return self._advance_prefill()

    def _advance_prefill(self) -> bool:
        """One more chunk of the prompt being prefilled; True if its request finished."""
        p = self._prefilling
        item, s = p.item, p.item.sampling
        prompt = item.prompt
        chunk = self.prefill_chunk or self.max_len
        n = min(chunk, prompt.size - p.done)
        # the last chunk is padded to its own width, not to a whole chunk (a 1030-token
        # prompt's last 6 tokens cost a 32-wide call, not a 128-wide one)
        width = self.width_of(n)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = prompt[p.done: p.done + n]
        want = item.prompt_logprobs is not None
        targets = np.zeros((1, width), np.int32)
        if want:  # each position's next prompt token (the last one's is the first output)
            nxt = prompt[p.done + 1: p.done + n + 1]
            targets[0, :nxt.size] = nxt
        t = clock()
        last = p.done + n >= prompt.size
        args = self._extend_call_args(tokens, n, p.done, p.slot, targets, p.cfg, s,
                                      item.logprobs if last else None, want, last)
        tok, lp, plp, self._cache, self._pen = self._call("extend", width, *args)
        if want:
            chosen, vals, ids = (np.asarray(a) for a in plp)
            k = item.prompt_logprobs
            rows = min(n, prompt.size - 1 - p.done)
            p.item.record.prompt_logprobs.extend(
                (float(chosen[i]), vals[i, :k], ids[i, :k]) for i in range(rows))
        start, p.done = p.done, p.done + n
        kind = "prefill" if start == 0 else "extend"  # a prompt's first chunk, or a later one
        if not last:
            self._keep(p, start)
            jax.block_until_ready(self._cache)
            self.step_times.append((kind, width, clock() - t))
            return False
        token = int(np.asarray(tok)[0])
        lp = None if item.logprobs is None else tuple(np.asarray(a)[0] for a in lp)
        self.step_times.append((kind, width, clock() - t))
        self._prefilling = None
        return self._occupy(p.slot, item, p.cfg, token, lp)

    def _keep(self, p: _Prefilling, start: int) -> None:
        """Keep the chunk a prefill just wrote (slots [start, start + chunk) and the GSM
        rings after it) under its boundary's key, unless it is cached already."""
        key = p.keys.get(start + self.prefill_chunk)
        if key is not None and self.prefix_cache.wants(key):
            saved = self._call("snapshot", self.prefill_chunk, self._cache,
                               np.int32(p.slot), np.int32(start))
            self.prefix_cache.store(key, start + self.prefill_chunk, saved, start=start)

    # ------------------------------------------------------------------ decoding

    def rows_bound(self, active: np.ndarray) -> int | None:
        """The row bound of a decode step whose running slots are `active` [max_batch]: the
        power of `ROW_BOUND_FACTOR` (2) >= the highest running slot + 1; None (every slot)
        when that reaches max_batch, when bounding is off, on a mesh (the data axis splits
        the slots), or for a cache whose rows cannot be cut (DeepSeek's)."""
        used = np.flatnonzero(active)
        top = int(used[-1]) + 1 if used.size else 1
        return next(b for b in self.rows_bounds() if b is None or b >= top)

    def rows_bounds(self) -> list[int | None]:
        """Every row bound a decode step can take (1, 2, 4, ... below max_batch, then None:
        all); one when bounding is off."""
        if (not self.bound_rows or self._mesh is not None
                or not common.can_cut_rows(self._state_like[0])):
            return [None]
        return programs.row_buckets(self.max_batch, ROW_BOUND_FACTOR)

    def lower_decode(self) -> Any:
        """The decode step the engine would run next, lowered but not run (a
        `jax.stages.Lowered`): for inspecting its program (`.compile().as_text()`)."""
        pending = self._pending(self._ahead)
        active = self._next_active(pending)
        bound = self.rows_bound(active)
        args = self._decode_call_args(active, bound, self._counts(pending), False)
        with on_mesh(self._mesh):
            return programs.decode.lower(*args, config=self.config, row_bound=bound)

    def _pending(self, step: _InFlight | None) -> np.ndarray:
        """[max_batch] int32: 1 where `step` (in flight) holds a token of the request
        still in that slot (not one that finished or was aborted since)."""
        out = np.zeros((self.max_batch,), np.int32)
        if step is not None:
            for slot in np.flatnonzero(step.active):
                rec = step.owners[slot]
                out[slot] = self.slots[slot] is rec and rec is not None and not rec.done
        return out

    def _next_active(self, pending: np.ndarray) -> np.ndarray:
        """[max_batch] bool: the rows the next decode step runs: running, and not finished
        by their token in flight (`pending`)."""
        return np.array([r is not None and r.n_tokens + int(pending[i]) < r.max_new_tokens
                         for i, r in enumerate(self.slots)])

    def _counts(self, pending: np.ndarray) -> np.ndarray:
        """[max_batch] the index of the token each row draws next."""
        counts = np.array([0 if r is None else r.n_tokens for r in self.slots], np.int32)
        return counts + pending

    def _decode_once(self) -> list[RequestRecord]:
        """Dispatch one decode step; read back the one before it (async scheduling: the
        new step was dispatched first, so the host's bookkeeping overlaps it) or this one
        (async scheduling off). Returns the requests that finished."""
        prev, self._ahead = self._ahead, None
        pending = self._pending(prev)
        # the rows of the new step: running, and not finished by their token in flight
        # (a row at its max_new_tokens is; one at EOS or a stop string is found out when
        # that token is read back, and its extra token is dropped)
        active = self._next_active(pending)
        done: list[RequestRecord] = []
        if prev is not None and (not self.async_scheduling or not active.any()):
            done = self._read(prev)
            prev, pending = None, self._pending(None)
            active = self._next_active(pending)
        if not active.any():
            return done
        sync = not self.async_scheduling
        # rows still running take their token from the step in flight, on device; the
        # others (just admitted) the host's
        self._state.use_prev[:] = (pending > 0) & active
        bound = self.rows_bound(active)
        t = clock()
        args = self._decode_call_args(active, bound, self._counts(pending), copy=not sync)
        self._prev, lp, self._cache, self._pen = self._call("decode", bound, *args)
        step = _InFlight(self._prev, lp, active, list(self.slots), t)
        if sync:
            return done + self._read(step)
        self._ahead = step
        return done + ([] if prev is None else self._read(prev))

    def _read(self, step: _InFlight) -> list[RequestRecord]:
        """Bring a decode step's tokens (and log-probabilities, when a row asked) to the
        host and emit them (a slot whose request finished or was aborted since the step
        was dispatched drops its token); logs the step's time from its dispatch, or from
        the previous read if later."""
        tokens = np.asarray(step.tokens)
        want = any(self._state.logprobs[i] is not None for i in np.flatnonzero(step.active)
                   if step.owners[i] is not None)
        lp = tuple(np.asarray(a) for a in step.lp) if want else None
        t = clock()
        self.step_times.append(("decode", int(step.active.sum()),
                                t - max(step.start, self._read_at)))
        self._read_at = t
        done = []
        for slot in np.flatnonzero(step.active):
            rec = step.owners[slot]
            if (rec is not None and self.slots[slot] is rec and not rec.done
                    and self._emit(int(slot), rec, int(tokens[slot]), t,
                                   None if lp is None else tuple(a[slot] for a in lp))):
                done.append(rec)
        return done

    # ------------------------------------------------------------------ warm-up

    def warmup(self, prompt_lengths: Sequence[int] = (16,), *, sample: bool = False,
               threads: int | None = None,
               progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
        """Compile every program the engine can run (`programs`: one decode per row bound,
        one extend per chunk width, ...: a number that does not depend on max_len), in
        `threads` compiler threads (default: the CPUs, at most 4), calling
        `progress(done, total, what)` after each; then serve one short request per
        given prompt length (greedy; also sampled with `sample=True`) through the normal
        path, which compiles nothing more. Returns {"programs": count, "compile_s":
        seconds per program, "requests_s": the requests' seconds, "total_s"}. The engine
        is left idle; its cache holds junk rows, which the next admissions overwrite."""
        if self.has_work:
            raise InvalidInputError("warmup needs an idle engine")
        start = clock()
        n_threads = threads if threads is not None else min(4, os.cpu_count() or 1)
        compile_s = self.programs.compile(progress, threads=n_threads, mesh=self._mesh)
        t = clock()
        for n in sorted({max(1, min(int(n), self.max_len - 1)) for n in prompt_lengths}):
            for temperature in ([0.0, 1.0] if sample else [0.0]):
                self.submit(Request([0] * n, min(2, self.max_len - n), request_id="warmup",
                                    temperature=temperature))
                while self.has_work:
                    self.step()
        return {"programs": len(self.programs), "compile_s": compile_s,
                "requests_s": clock() - t, "total_s": clock() - start}

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
            self.check_request(r)
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
