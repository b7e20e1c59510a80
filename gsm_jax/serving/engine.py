"""Continuous batching over fixed slots: requests join and leave between decode steps.

The engine owns `max_batch` slots and one running KV cache
(`family.init_cache(cfg, max_batch, max_len)`), and three compiled functions with
fixed shapes, JetStream's split:

- **prefill** a prompt into a fresh one-row cache (prompt padded to a power of two
  >= 16, the buckets of `gsm_jax.generate_tokens`, so compilations stay bounded).
  A prompt longer than `prefill_chunk` is prefilled in chunks: the first chunk by
  the prefill, each further chunk by the family's `extend` (attention over the
  row's cache so far, GSM continuing from the row's ring), one chunk per engine
  step, so a long prompt delays the running decodes by one chunk at a time,
  not by its whole prefill (the last chunk is padded to its own bucket). With
  prefix caching (`prefix_cache_bytes`, `serving/prefix_cache.py`) the state at
  each chunk boundary is kept, and a prompt starting with the same chunks resumes
  from the longest one kept, bit for bit as if it had prefilled them;
- **insert** the finished row into a free slot of the running cache
  (`family.cache_insert`, running cache donated); the prefill's logits give the
  request's first token (its time to first token);
- **generate**: one `decode_step` over the slots up to the row bound (below; cache
  donated; free slots among them are inactive rows), one token per active slot handed to
  the host.

Reads bounded by what rows hold. The running cache has `max_len` slots, but a decode
step attends over slots [0, n) only, n = the power of two >= the longest active row + 1
(at least `min_attend`, at most max_len; `models.common.bound_reads`): a step costs the
same whether max_len is 256 or 8192 while the rows hold 64 tokens. Each n is its own
compiled program (a handful: 128, 256, ... max_len; `warmup` compiles them up front,
else a row compiles one when it first reaches it); the donated cache stays
whole and the slots past n are masked out anyway, so the tokens are those of a read of
the whole cache. A chunked prefill's `extend` is bounded the same way. Families whose
caches have their own sizes (DeepSeek-V4's sliding window and compressed entries) are
not bounded (one program).

Rows bounded by what is running (`bound_rows`, on by default). A decode step runs the
first r slots only, r = the power of 2 >= the highest running slot + 1
(`ROW_BOUND_FACTOR`; new requests take the lowest free slot, so the running ones stay
low): one stream costs a one-row step, not a `max_batch` one (vLLM pads its batches to a
few captured sizes the same way). Each (n, r) pair is one compiled program, all compiled
by `warmup`; the slots past r are left as they are (`models.common.first_rows`). The
dense families' caches on one device; DeepSeek caches and a mesh (its data axis splits
the slots) step every slot.

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
`logit_bias`) adjust a row's logits before it picks (`penalize`); the engine counts each
penalized row's output tokens on the host, and a batch without penalties runs the same
programs as before (the penalized pick is its own small program).

Per request the engine records: arrival (given by the caller), admission (prefill
start), the time of every output token (right after it reached the host) and the
finish. `on_token(record, token)` and `on_finish(record)` callbacks (called from
the thread that steps the engine) let a server stream them.
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import GSMConfigError, InvalidInputError
from gsm_jax.families import family_module
from gsm_jax.generation import (
    MIN_PROMPT_BUCKET,
    bucket,
    check_refused_tokens,
    on_mesh,
    sample_tokens,
    with_kv_cache_dtype,
)
from gsm_jax.models import common
from gsm_jax.models.gsm_sites import GSMInputs
from gsm_jax.params import ModelParams
from gsm_jax.serving.prefix_cache import (
    PrefixCache,
    check_capacity,
    restore_rows,
    snapshot_rows,
)
from gsm_jax.sharding import mesh_of

__all__ = ["DEFAULT", "Engine", "Request", "RequestRecord"]

clock = time.perf_counter
STEP_LOG = 65536  # engine calls kept in `Engine.step_times` outside `run`


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


# ----------------------------------------------------------------------------- jitted steps


def penalize(logits, penalties):
    """`Request`'s penalties on logits [B, V]: penalties = (frequency [B], presence [B],
    repetition [B], output token counts [B, V], prompt tokens seen [B, V] bool,
    logit bias [B, V]); neutral rows (0, 0, 1, ..., 0) come out unchanged."""
    freq, pres, rep, counts, seen, bias = penalties
    logits = logits.astype(jnp.float32) + bias
    r = rep[:, None]
    logits = jnp.where(seen | (counts > 0), jnp.where(logits > 0, logits / r, logits * r),
                       logits)
    return logits - freq[:, None] * counts - pres[:, None] * (counts > 0)


@functools.partial(jax.jit, static_argnames=("sample", "filtered"))
def _pick(logits, sampling, penalties=None, *, sample: bool, filtered: bool):
    """Next token per row: greedy, or sampled from key fold_in(key(seed), count) per row,
    after `penalize` when some row has penalties (None: none has).

    Its own (small) program: the model's programs return logits, so each compiles once
    per shape, not once per sampling mode (greedy / sampled / top-k-top-p)."""
    temperature, top_k, top_p, seeds, counts = sampling
    if penalties is not None:
        logits = penalize(logits, penalties)
    if not sample:  # greedy: the same argmax generate_tokens takes at temperature 0
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def one(row_logits, seed, count, t, k, p):
        key = jax.random.fold_in(jax.random.key(seed), count)
        return sample_tokens(row_logits[None], key, t[None], k[None], p[None],
                             filtered=filtered)[0]

    return jax.vmap(one)(logits, seeds, counts, temperature, top_k, top_p)


@functools.partial(jax.jit, static_argnames=("config", "max_len"))
def _prefill(weights, tokens, lengths, gsm, *, config, max_len: int):
    """Prefill `tokens` [1, T] into a fresh one-row cache of `max_len` slots."""
    family = family_module(config.family)
    rows = family.init_cache(
        config, tokens.shape[0], max_len, dtype=jax.tree.leaves(weights)[0].dtype,
        gsm_max_window=None if gsm is None else gsm.max_window,
    )
    return family.prefill(weights, config, tokens, lengths, rows, gsm)


def _unbound(cache):
    """The cache with no read bound (what the engine keeps: one pytree structure)."""
    return cache.replace(attend=None) if common.can_bound_reads(cache) else cache


@functools.partial(jax.jit, static_argnames=("config", "attend"), donate_argnames=("rows",))
def _extend(weights, tokens, n_new, rows, gsm, *, config, attend: int | None = None):
    """Append the next chunk `tokens` [1, C] (n_new real) of a prompt to its one-row cache,
    attending over its first `attend` slots (None: all)."""
    logits, rows = family_module(config.family).extend(
        weights, config, tokens, n_new, common.bound_reads(rows, attend), gsm)
    return logits, _unbound(rows)


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("config",))
def _insert(cache, rows, slots, *, config):
    """Copy the one-row cache `rows` into the running cache at `slots`."""
    return family_module(config.family).cache_insert(cache, rows, slots)


@functools.partial(jax.jit, static_argnames=("config", "max_len"), donate_argnames=("cache",))
def _prefill_insert(weights, tokens, lengths, cache, slots, gsm, *, config, max_len: int):
    """Prefill and insert in one call: a prompt that fits one chunk."""
    family = family_module(config.family)
    rows = family.init_cache(
        config, tokens.shape[0], max_len, dtype=jax.tree.leaves(weights)[0].dtype,
        gsm_max_window=None if gsm is None else gsm.max_window,
    )
    logits, rows = family.prefill(weights, config, tokens, lengths, rows, gsm)
    return logits, family.cache_insert(cache, rows, slots)


@functools.partial(jax.jit, static_argnames=("config", "attend", "rows"),
                   donate_argnames=("cache",))
def _decode(weights, tokens, cache, gsm, active, *, config, attend: int | None = None,
            rows: int | None = None):
    """One decode step over every slot, attending over the first `attend` cache slots
    (None: all; every active row must hold fewer tokens); returns the logits per slot and
    the cache (whole: the writes go to all `max_len` slots).

    `rows` (the row bound, `Engine.rows_bound`): only the first `rows` slots step, so the
    step costs the rows in use, not `max_batch`; tokens, gsm and active are given for
    those rows and the logits come back for them; the other slots are left as they are
    (`common.first_rows`). None: every slot."""
    family = family_module(config.family)
    if rows is None:
        logits, cache = family.decode_step(
            weights, config, tokens, common.bound_reads(cache, attend), gsm, active)
        return logits, _unbound(cache)
    logits, part = family.decode_step(
        weights, config, tokens, common.bound_reads(common.first_rows(cache, rows), attend),
        gsm, active)
    return logits, common.put_first_rows(cache, _unbound(part))


@jax.jit
def _feed(prev, host, use_prev):
    """The tokens a decode step feeds its rows when the step before it is still running
    (async scheduling): `prev` [r'] (that step's picks, on device, r' its row bound),
    where `use_prev` [r]; the host's `host` [r] (a just-admitted row's first token)
    elsewhere. r' and r may differ: `prev` is cut or padded to r rows."""
    n, r = prev.shape[0], host.shape[0]
    prev = prev[:r] if n >= r else jnp.pad(prev, (0, r - n))
    return jnp.where(use_prev, prev, host)


# Row bounds grow by this factor (1, 2, 4, ...). Measured (docs/performance_notes.md,
# "Serving engine: row bounds are powers of two"): a SmolLM2 step of 2 rows costs 1.52x
# one row, 4 rows 1.77x, 8 rows 2.14x, 16 rows 2.86x, so a coarser factor (4: 15 programs
# instead of 25 at the default --max-batch 16 --max-len 2048) would run 5-8 streams at 1.34x
# the cost; the extra programs cost start-up time once (the compilation cache keeps them).
ROW_BOUND_FACTOR = 2

COMPILED = {"pick": _pick, "prefill": _prefill, "extend": _extend, "insert": _insert,
            "prefill_insert": _prefill_insert, "decode": _decode, "feed": _feed}


def check_min_attend(value: Any, name: str = "min_attend") -> int | None:
    """`Engine(min_attend=)`: a power of two >= 1, or None (every step reads all slots).
    `name` is what the error calls it (the server's CLI: "--min-attend")."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | np.integer)
                              or value < 1 or value & (value - 1)):
        raise InvalidInputError(f"{name} must be a power of two >= 1 or None, got {value!r}")
    return None if value is None else int(value)


def compile_counts() -> dict[str, int]:
    """How many programs each compiled function holds (process-wide): a config change
    that recompiled would show up here."""
    return {name: fn._cache_size() for name, fn in COMPILED.items()}


# ----------------------------------------------------------------------------- engine


@dataclass
class _Sampling:
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


@dataclass
class _Waiting:
    record: RequestRecord
    prompt: np.ndarray
    sampling: _Sampling
    gsm: Any  # DEFAULT | None | GSMConfig


@dataclass
class _Prefilling:
    """A long prompt between its chunks: its one-row cache and how far it got."""

    item: _Waiting
    slot: int
    cfg: Any  # the GSMConfig smoothing it, or None
    rows: Any
    done: int  # prompt tokens already in `rows`
    keys: dict[int, bytes] = field(default_factory=dict)  # prefix-cache key per boundary


@dataclass
class _InFlight:
    """A decode step dispatched and not yet read back (async scheduling)."""

    tokens: Any  # its picks, a device array [its row bound]
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
    max_len, e.g. 8 for window 8; a live config needing more is refused). `min_attend`:
    the smallest read bound of a decode step (a power of two; each step attends over
    the power of two >= its longest row + 1, at least this, at most max_len; None: every
    step reads all max_len slots, one decode program). `kv_cache_dtype`: the KV cache's
    format (`gsm_jax.with_kv_cache_dtype`: "float", "int8" / "fp8", V4.1's "released";
    None / "auto": the model's own). `prefix_cache_bytes` > 0: automatic prefix caching
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
    """

    def __init__(self, params: ModelParams, *, max_batch: int = 8, max_len: int = 1024,
                 gsm: Any = None, compile_gsm: bool = False,
                 eos_ids: Sequence[int] | None = None, seed: int = 0,
                 prefill_chunk: int | None = 512, gsm_ring: int | None = None,
                 min_attend: int | None = 128, kv_cache_dtype: str | None = None,
                 prefix_cache_bytes: int = 0, bound_rows: bool = True,
                 async_scheduling: bool = True) -> None:
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
        if prefill_chunk is not None:
            chunk = int(prefill_chunk)
            if chunk < MIN_PROMPT_BUCKET or chunk & (chunk - 1):
                raise InvalidInputError(f"prefill_chunk must be a power of two >= "
                                        f"{MIN_PROMPT_BUCKET}, got {prefill_chunk!r}")
            if not hasattr(self.family, "extend"):
                chunk = None  # this family prefills whole prompts only
            prefill_chunk = chunk
        self.prefill_chunk = prefill_chunk
        capacity = check_capacity(prefix_cache_bytes)
        if capacity and prefill_chunk is None:
            raise InvalidInputError(
                "prefix caching needs chunked prefill (its blocks are the prefill chunks): "
                "give prefill_chunk, or prefix_cache_bytes=0"
                + ("" if hasattr(self.family, "extend") else
                   f"; the {self.config.family} family has no extend"))
        self.prefix_cache = PrefixCache(capacity, prefill_chunk) if capacity else None
        if gsm_ring is not None and (isinstance(gsm_ring, bool) or int(gsm_ring) < 1):
            raise InvalidInputError(f"gsm_ring must be an integer >= 1, got {gsm_ring!r}")
        self._ring_request = None if gsm_ring is None else int(gsm_ring)
        self.min_attend = check_min_attend(min_attend)
        self.bound_rows = bool(bound_rows)
        self.async_scheduling = bool(async_scheduling)
        self._ahead: _InFlight | None = None  # the decode step in flight (async scheduling)
        self._read_at = 0.0  # when the last decode step's tokens reached the host
        # the token feed's `prev` when no step is in flight (every row's token is the host's)
        self._no_prev = jnp.zeros((self.max_batch,), jnp.int32)
        if eos_ids is None:
            tok = params.tokenizer
            eos_ids = tok.eos_ids if tok is not None else self.config.eos_token_ids
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self._seed = int(seed)
        self._submitted = 0
        # (kind, size, seconds) of every jitted call, host sync included: ("prefill",
        # prompt bucket, s), ("extend", chunk, s) and ("decode", active slots, s). A
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
        self._cache = None
        self.slots: list[RequestRecord | None] = [None] * self.max_batch
        self.waiting: deque[_Waiting] = deque()
        self._prefilling: _Prefilling | None = None
        b, n_layers = self.max_batch, self.config.num_layers
        self._last = np.zeros((b,), np.int32)
        self._rows = np.zeros((b,), np.float32)
        self._strength = np.zeros((b, n_layers, 2), np.float32)
        self._window = np.zeros((b,), np.int32)
        self._temps = np.zeros((b,), np.float32)
        self._top_k = np.zeros((b,), np.int32)
        self._top_p = np.ones((b,), np.float32)
        self._seeds = np.zeros((b,), np.int32)
        self._filtered = np.zeros((b,), bool)
        # penalties (`Request`): per slot, and the tokens they count
        v = self.config.vocab_size
        self._penalized = np.zeros((b,), bool)
        self._freq = np.zeros((b,), np.float32)
        self._pres = np.zeros((b,), np.float32)
        self._rep = np.ones((b,), np.float32)
        self._out_counts = np.zeros((b, v), np.int32)
        self._seen = np.zeros((b, v), bool)
        self._bias = np.zeros((b, v), np.float32)
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
        if static != self._gsm_static or self._cache is None:
            self._gsm_static = static
            self._new_cache()

    def _new_cache(self) -> None:
        self._ahead = None  # an idle engine's step in flight has no running row to feed
        window = self._gsm_static[0] if self.gsm_compiled else None
        if self.prefix_cache is not None:  # its states have the old cache's structure
            self.prefix_cache.clear()
        self._cache = self.family.init_cache(
            self.config, self.max_batch, self.max_len, dtype=self.params.dtype,
            gsm_max_window=window,
        )

    def attend_bound(self, tokens: int) -> int | None:
        """The read bound of a step whose longest row holds `tokens` before it (its new
        token goes to slot `tokens`): the power of two >= tokens + 1, at least
        `min_attend`; None (read all) when that reaches max_len, when bounding is off, or
        for a family whose cache cannot be bounded."""
        if self.min_attend is None or not common.can_bound_reads(self._cache):
            return None
        n = bucket(int(tokens) + 1, self.min_attend)
        return None if n >= self.max_len else n

    def attend_bounds(self) -> list[int | None]:
        """Every read bound a decode step of this engine can use (`warmup(all_attend=True)`
        compiles one program each)."""
        out: list[int | None] = []
        if self.min_attend is not None and common.can_bound_reads(self._cache):
            n = self.min_attend
            while n < self.max_len:
                out.append(n)
                n *= 2
        return out + [None]

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

    def _gsm_inputs(self, rows: np.ndarray, strength: np.ndarray,
                    window: np.ndarray) -> GSMInputs | None:
        if not self.gsm_compiled:
            return None
        max_window, precision, impl = self._gsm_static
        # numpy leaves: the jitted step takes them as they are (a jnp.asarray per array
        # was an eager op each, ~0.1 ms apiece per decode step)
        return GSMInputs(strength=np.asarray(strength, np.float32),
                         row_enabled=np.asarray(rows, np.float32),
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

    @property
    def kv_tokens(self) -> int:
        """Cache slots holding tokens of running requests (prompt + generated so far)."""
        used = sum(r.prompt_len + r.n_tokens for r in self.slots if r is not None)
        if self._prefilling is not None:
            used += self._prefilling.done
        return used

    @property
    def kv_usage(self) -> float:
        """kv_tokens / (max_batch * max_len)."""
        return self.kv_tokens / float(self.max_batch * self.max_len)

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
        sampling = _Sampling(float(request.temperature), int(request.top_k),
                             float(request.top_p), int(seed) & 0x7FFFFFFF,
                             float(request.frequency_penalty), float(request.presence_penalty),
                             float(request.repetition_penalty),
                             tuple((int(k), float(v)) for k, v in
                                   sorted((request.logit_bias or {}).items())))
        gsm = request.gsm
        if gsm is not DEFAULT and gsm is not None:
            gsm = self.check_gsm(gsm)
        self._submitted += 1
        self.waiting.append(_Waiting(record, prompt, sampling, gsm))
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
        self.slots[slot] = None
        self._rows[slot] = 0.0
        self._strength[slot] = 0.0
        self._temps[slot] = 0.0
        self._filtered[slot] = False
        self._last[slot] = 0
        if self._penalized[slot]:
            self._penalized[slot] = False
            self._freq[slot], self._pres[slot], self._rep[slot] = 0.0, 0.0, 1.0
            self._out_counts[slot], self._seen[slot], self._bias[slot] = 0, False, 0.0

    def _emit(self, slot: int, rec: RequestRecord, token: int, t: float) -> bool:
        """Record one output token; True if the request is finished."""
        rec.tokens.append(token)
        if self._penalized[slot]:
            self._out_counts[slot, token] += 1
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
            self._last[slot] = token
            return False
        self._free(slot)
        self._finish(rec, reason, t)
        return True

    def _sampling_args(self, items: Sequence[_Sampling], counts: Sequence[int]):
        # numpy, as `_decode_once` passes them (one signature: no second program entry)
        return (np.asarray([s.temperature for s in items], np.float32),
                np.asarray([s.top_k for s in items], np.int32),
                np.asarray([s.top_p for s in items], np.float32),
                np.asarray([s.seed for s in items], np.int32),
                np.asarray(counts, np.int32))

    def _one_row_penalties(self, item: _Waiting) -> tuple | None:
        """`_pick`'s penalties for a request's first token (nothing generated yet)."""
        s = item.sampling
        if not s.penalized:
            return None
        v = self.config.vocab_size
        seen = np.zeros((1, v), bool)
        seen[0, item.prompt] = True
        bias = np.zeros((1, v), np.float32)
        for token, value in s.bias:
            bias[0, token] = value
        return (np.asarray([s.frequency], np.float32), np.asarray([s.presence], np.float32),
                np.asarray([s.repetition], np.float32), np.zeros((1, v), np.int32), seen, bias)

    def _one_row_gsm(self, cfg: Any) -> GSMInputs | None:
        if not self.gsm_compiled:
            return None
        if cfg is None:
            strength, window = np.zeros((self.config.num_layers, 2), np.float32), 0
        else:
            strength, window = self._row_params(cfg)
        return self._gsm_inputs(np.ones((1,), np.float32), strength[None],
                                np.asarray([window], np.int32))

    def _occupy(self, slot: int, item: _Waiting, cfg: Any, token: int) -> bool:
        """The request's row is in the running cache: it decodes from the next step on."""
        rec = item.record
        self.slots[slot] = rec
        self._rows[slot] = float(cfg is not None)
        if cfg is not None:
            self._strength[slot], self._window[slot] = self._row_params(cfg)
        s = item.sampling
        self._temps[slot], self._top_k[slot], self._top_p[slot] = s.temperature, s.top_k, s.top_p
        self._seeds[slot], self._filtered[slot] = s.seed, s.filtered
        if s.penalized:
            self._penalized[slot] = True
            self._freq[slot], self._pres[slot], self._rep[slot] = (s.frequency, s.presence,
                                                                   s.repetition)
            self._out_counts[slot] = 0
            self._seen[slot] = False
            self._seen[slot, item.prompt] = True
            self._bias[slot] = 0.0
            for t, value in s.bias:
                self._bias[slot, t] = value
        return self._emit(slot, rec, token, clock())

    def _can_admit(self, cfg: Any) -> bool:
        """protect_first is one value per batch: a smoothed request whose config changes it
        waits until no smoothed row of the previous value is running."""
        if cfg is None or cfg.protect_first == self._protect:
            return True
        smoothed = any(r is not None and self._rows[i] > 0 for i, r in enumerate(self.slots))
        if self._prefilling is not None and self._prefilling.cfg is not None:
            smoothed = True
        if smoothed:
            return False
        self._protect = cfg.protect_first
        return True

    def _admit(self, slot: int, item: _Waiting, cfg: Any) -> bool:
        """Prefill a request (its first chunk if long) for `slot`; True if it finished."""
        rec, prompt, s = item.record, item.prompt, item.sampling
        rec.slot = slot
        rec.gsm = cfg is not None
        rec.admitted = clock()
        first = prompt.size if self.prefill_chunk is None else min(prompt.size,
                                                                    self.prefill_chunk)
        padded = min(bucket(first, MIN_PROMPT_BUCKET), self.max_len)
        tokens = np.zeros((1, padded), np.int32)
        tokens[0, :first] = prompt[:first]
        keys = self._prefix_keys(item, cfg)
        if self.prefix_cache is not None:
            done, kept = self.prefix_cache.lookup(list(keys.items()), prompt.size)
            if kept is not None:  # resume at the longest cached boundary: its next chunk now
                with on_mesh(self._mesh):
                    rows = restore_rows(kept, self.max_len)
                self.step_times.append(("restore", done, clock() - rec.admitted))
                self._prefilling = _Prefilling(item, slot, cfg, rows, done, keys)
                return self._advance_prefill()
        gsm = self._one_row_gsm(cfg)
        sampling = self._sampling_args([s], [0])
        kw = dict(config=self.config, max_len=self.max_len)
        with on_mesh(self._mesh):
            if first == prompt.size:
                logits, self._cache = _prefill_insert(
                    self.params.weights, jnp.asarray(tokens), jnp.asarray([first], jnp.int32),
                    self._cache, jnp.asarray([slot], jnp.int32), gsm, **kw)
                tok = _pick(logits, sampling, self._one_row_penalties(item),
                            sample=s.sample, filtered=s.filtered)
            else:
                _, rows = _prefill(self.params.weights, jnp.asarray(tokens),
                                   jnp.asarray([first], jnp.int32), gsm, **kw)
                self._keep(keys, first, rows)
                jax.block_until_ready(rows)
        self.step_times.append(("prefill", padded, clock() - rec.admitted))
        if first < prompt.size:
            self._prefilling = _Prefilling(item, slot, cfg, rows, first, keys)
            return False
        return self._occupy(slot, item, cfg, int(np.asarray(tok)[0]))

    def _advance_prefill(self) -> bool:
        """One more chunk of the prompt being prefilled; True if its request finished."""
        p = self._prefilling
        item, s = p.item, p.item.sampling
        prompt, chunk = item.prompt, self.prefill_chunk
        n = min(chunk, prompt.size - p.done)
        # the last chunk is padded to its own prompt bucket, not to a whole chunk (a
        # 1030-token prompt's last 6 tokens cost a 16-wide call, not a 512-wide one)
        width = chunk if n == chunk else min(bucket(n, MIN_PROMPT_BUCKET), chunk)
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :n] = prompt[p.done: p.done + n]
        t = clock()
        with on_mesh(self._mesh):
            # the chunk's slots are [done, done + width): bound the reads there
            logits, rows = _extend(self.params.weights, jnp.asarray(tokens),
                                   jnp.asarray([n], jnp.int32), p.rows,
                                   self._one_row_gsm(p.cfg), config=self.config,
                                   attend=self.attend_bound(p.done + width - 1))
            p.rows, p.done = rows, p.done + n
            if p.done < prompt.size:
                self._keep(p.keys, p.done, rows)
                jax.block_until_ready(rows)
                self.step_times.append(("extend", width, clock() - t))
                return False
            self._cache = _insert(self._cache, rows, jnp.asarray([p.slot], jnp.int32),
                                  config=self.config)
            tok = _pick(logits, self._sampling_args([s], [0]), self._one_row_penalties(item),
                        sample=s.sample, filtered=s.filtered)
        token = int(np.asarray(tok)[0])
        self.step_times.append(("extend", width, clock() - t))
        self._prefilling = None
        return self._occupy(p.slot, item, p.cfg, token)

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

    def _keep(self, keys: dict[int, bytes], tokens: int, rows: Any) -> None:
        """Keep the state a prefill reached at chunk boundary `tokens` (a copy: the next
        `extend` donates `rows`), unless it is cached already."""
        key = keys.get(tokens)
        if key is not None and self.prefix_cache.wants(key):
            self.prefix_cache.store(key, tokens, snapshot_rows(rows, tokens))

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

    def rows_bound(self, active: np.ndarray) -> int | None:
        """The row bound of a decode step whose running slots are `active` [max_batch]: the
        power of `ROW_BOUND_FACTOR` (2) >= the highest running slot + 1; None (every slot)
        when that reaches max_batch, when bounding is off, on a mesh (the data axis splits
        the slots), or for a cache `common.first_rows` cannot cut (DeepSeek's)."""
        used = np.flatnonzero(active)
        top = int(used[-1]) + 1 if used.size else 1
        return next(b for b in self.rows_bounds() if b is None or b >= top)

    def rows_bounds(self) -> list[int | None]:
        """Every row bound a decode step can take (1, 2, 4, ... below max_batch, then None:
        all); one each when bounding is off."""
        if (not self.bound_rows or self._mesh is not None
                or not common.can_bound_reads(self._cache)):
            return [None]
        out, n = [], 1
        while n < self.max_batch:
            out.append(n)
            n *= ROW_BOUND_FACTOR
        return out + [None]

    def _decode_args(self, active: np.ndarray | None = None, attend: Any = "held",
                     rows: Any = "active", pending: np.ndarray | None = None,
                     copy: bool = False) -> tuple[np.ndarray, tuple, dict[str, Any]]:
        """(active slots, arguments, static keywords) of the next decode step's `_decode`;
        the per-slot arguments are cut to its row bound. `active` / `attend` / `rows`
        override what the slots say (the warm-up compiles every bound on idle slots).
        `pending` [max_batch]: 1 where a step in flight (async scheduling) holds one more
        token of the slot's request. `copy`: the arguments are copies of the host arrays
        (a step that runs while the host changes them), not views."""
        if active is None:
            active = np.array([s is not None for s in self.slots])
        if attend == "held":
            # an active row holds its prompt and every output token but the last (this
            # step writes that one at slot `held`)
            held = max((r.prompt_len + r.n_tokens - 1 + (0 if pending is None else
                                                          int(pending[i]))
                        for i, r in enumerate(self.slots) if r is not None and active[i]),
                       default=0)
            attend = self.attend_bound(held)
        if rows == "active":
            rows = self.rows_bound(active)
        cut = slice(rows)  # rows None: every slot
        own = functools.partial(np.array, copy=copy)  # copy=False: the view itself
        gsm = self._gsm_inputs((self._rows * active)[cut], own(self._strength[cut]),
                               own(self._window[cut]))
        # without `copy`, numpy views: the step's tokens are read back before the host
        # arrays change
        args = (self.params.weights, own(self._last[cut]), self._cache, gsm,
                np.asarray(active[cut], bool))
        return active, args, {"config": self.config, "attend": attend, "rows": rows}

    def lower_decode(self) -> Any:
        """The decode step the engine would run next, lowered but not run (a
        `jax.stages.Lowered`): for inspecting its program, e.g.
        `.compile().as_text()` (the tests check what its attention reads); a step in
        flight (async scheduling) counts the token it holds."""
        pending = self._pending(self._ahead)
        _, args, kw = self._decode_args(self._next_active(pending), pending=pending)
        with on_mesh(self._mesh):
            return _decode.lower(*args, **kw)

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

    def _sync(self, active: np.ndarray) -> bool:
        """Whether a step over `active` is read back before the next one is dispatched:
        async scheduling off, or a penalized row (its penalties count the tokens read)."""
        return not self.async_scheduling or bool(self._penalized[active].any())

    def _decode_once(self) -> list[RequestRecord]:
        """Dispatch one decode step; read back the one before it (async scheduling: the
        new step was dispatched first, so the host's bookkeeping overlaps it) or this one
        (synchronous: async scheduling off, or a penalized row, whose penalties count
        the tokens read back). Returns the requests that finished."""
        prev, self._ahead = self._ahead, None
        pending = self._pending(prev)
        # the rows of the new step: running, and not finished by their token in flight
        # (a row at its max_new_tokens is; one at EOS or a stop string is found out when
        # that token is read back, and its extra token is dropped)
        active = self._next_active(pending)
        done: list[RequestRecord] = []
        if prev is not None and (self._sync(active) or not active.any()):
            done = self._read(prev)
            prev, pending = None, self._pending(None)
            active = self._next_active(pending)
        sync = self._sync(active)
        if not active.any():
            return done
        active, args, kw = self._decode_args(active, pending=pending, copy=not sync)
        cut = slice(kw["rows"])
        counts = np.array([0 if r is None else r.n_tokens for r in self.slots], np.int32)
        counts = counts + pending  # the index of the token each row draws
        sampling = (*(np.array(a[cut], copy=not sync) for a in (
            self._temps, self._top_k, self._top_p, self._seeds)), counts[cut])
        sample = bool((self._temps[active] > 0).any())
        penalties = None
        if self._penalized[active].any():
            penalties = tuple(a[cut] for a in (
                self._freq, self._pres, self._rep, self._out_counts, self._seen, self._bias))
        t = clock()
        with on_mesh(self._mesh):
            # rows still running take their token from the step in flight, on device;
            # the others (just admitted) the host's
            use = (pending[cut] > 0) & active[cut]
            args = (args[0], _feed(self._no_prev if prev is None else prev.tokens, args[1],
                                   use), *args[2:])
            logits, self._cache = _decode(*args, **kw)
            tok = _pick(logits, sampling, penalties, sample=sample,
                        filtered=sample and bool(self._filtered[active].any()))
        step = _InFlight(tok, active, list(self.slots), t)
        if sync:
            return done + self._read(step)
        self._ahead = step
        return done + ([] if prev is None else self._read(prev))

    def _read(self, step: _InFlight) -> list[RequestRecord]:
        """Bring a decode step's tokens to the host and emit them (a slot whose request
        finished or was aborted since the step was dispatched drops its token); logs the
        step's time from its dispatch, or from the previous read if later."""
        tokens = np.asarray(step.tokens)
        t = clock()
        self.step_times.append(("decode", int(step.active.sum()),
                                t - max(step.start, self._read_at)))
        self._read_at = t
        done = []
        for slot in np.flatnonzero(step.active):
            rec = step.owners[slot]
            if (rec is not None and self.slots[slot] is rec and not rec.done
                    and self._emit(int(slot), rec, int(tokens[slot]), t)):
                done.append(rec)
        return done

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
            cfg = self._resolve_gsm(item)
            if not self._can_admit(cfg):
                break
            self.waiting.popleft()
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

    def warmup(self, prompt_lengths: Sequence[int] = (16,), *,
               sample: bool = False, all_attend: bool = True) -> dict[str, Any]:
        """Compile and run, through the normal request path, the prefill of each prompt
        bucket the given lengths fall in, and the decode step (greedy; also sampled
        with `sample=True`), and (`all_attend`, default) the decode program of every
        read bound (`attend_bounds`: 128, 256, ... max_len), so no row compiles one
        mid-stream when it grows past a power of two.

        When no given length exceeds `prefill_chunk` but `max_len` does, a prompt of a
        chunk plus 16 tokens also runs (uncached), so the chunked-prefill programs (the
        whole-chunk prefill, an extend, the insert) are compiled too ("chunked_s").

        Returns seconds per prompt bucket (a dummy request's prefill + one decode
        step, compilation included), per read bound with `all_attend` ("attend_s"), for
        the token feed between row bounds ("feed_s", with `all_attend`) and in total. The
        engine is left idle; its cache holds junk rows, which the next admissions
        overwrite.
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
        chunk = self.prefill_chunk
        if (chunk is not None and self.max_len > chunk + MIN_PROMPT_BUCKET
                and all(n <= chunk for n in by_bucket.values())):
            # the chunked path (a whole-chunk prefill, an extend, the insert): without it
            # the first prompt longer than a chunk compiled those mid-serving (seconds)
            t, kept, self.prefix_cache = clock(), self.prefix_cache, None  # not cached
            try:
                self.submit(Request([0] * (chunk + MIN_PROMPT_BUCKET), 2,
                                    request_id="warmup"))
                while self.has_work:
                    self.step()
            finally:
                self.prefix_cache = kept
            out["chunked_s"] = clock() - t
        if all_attend:
            out["attend_s"] = self._warm_attend()
            out["feed_s"] = self._warm_feed()
        out["total_s"] = clock() - start
        return out

    def _warm_attend(self) -> dict[str, float]:
        """Compile and run the decode program of every read bound and row bound (and the
        greedy pick of each row bound) on the idle cache, every row inactive (no row
        advances; the junk rows' slots it writes are overwritten by the next admissions)."""
        inactive = np.zeros((self.max_batch,), bool)
        out: dict[str, float] = {}
        for n in self.attend_bounds():
            t = clock()
            for rows in self.rows_bounds():
                _, args, kw = self._decode_args(inactive, attend=n, rows=rows)
                with on_mesh(self._mesh):
                    use = np.zeros(args[1].shape, bool)  # tokens as `_decode_once` feeds them
                    args = (args[0], _feed(self._no_prev, args[1], use), *args[2:])
                    logits, self._cache = _decode(*args, **kw)
                    jax.block_until_ready(_pick(logits, tuple(
                        np.zeros(logits.shape[:1], d) for d in (
                            np.float32, np.int32, np.float32, np.int32, np.int32)),
                        None, sample=False, filtered=False))  # as `_decode_once` calls it
            out[str(n or self.max_len)] = clock() - t
        return out

    def _warm_feed(self) -> float:
        """Compile the token feed (`_feed`) from every row bound's picks (a step in
        flight, async scheduling) to every row bound; returns the seconds it took."""
        t = clock()
        for before in self.rows_bounds():
            prev = jnp.zeros((before or self.max_batch,), jnp.int32)
            for rows in self.rows_bounds():
                r = rows or self.max_batch
                with on_mesh(self._mesh):
                    jax.block_until_ready(_feed(prev, np.zeros((r,), np.int32),
                                                np.zeros((r,), bool)))
        return clock() - t

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
