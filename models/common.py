"""What every model family shares: the step context, the loop over layers, the KV cache of
the dense families, attention, RoPE, norms and the weight layouts.

A family file (`llama.py`, `gemma3.py`, `deepseek_v4.py`) writes one function,

    layer(cfg, weights_of_layer, index, x, cache_of_layer, step) -> (x, cache_of_layer)

and its entry points are thin wrappers around `run_layers`:

| entry point | mode | what the layer sees |
|---|---|---|
| `hidden_states` / `forward` | "forward" | right-padded rows, no cache |
| `prefill` | "prefill" | a fresh cache: rows start at position 0 |
| `extend` | "extend" | a chunk continuing rows that hold `step.start` tokens |
| `decode_step` | "decode" | one token per row (the decode attention is picked here) |

Prefill and decode are the two special cases of `extend` (a prefill starts at slot 0, a
decode step has one query per row); all three read the cache through `cache_attention`,
whose loop over cache blocks runs as far as the rows' lengths (run-time data: one
program for every context length). The layer sees `step.mode`, which is static. `Step`
also carries the hooks (`models/sites.py`): every GSM site and every projection goes
through `step.site` and `step.linear`, and hooks hand values back with `step.sow`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gsm_jax.errors import InvalidInputError, UnsupportedModelError
from gsm_jax.in_place import scatter_set
from gsm_jax.models.linear import QuantizedWeight, linear
from gsm_jax.models.partitioning import constrain_rings
from gsm_jax.models.sites import Sites, as_sites

MASK_VALUE = -1e30  # finite, so a row with no valid key (a dummy batch row) gives no NaN
MODES = ("forward", "prefill", "extend", "decode")


# ----------------------------------------------------------------------------- the step


@dataclasses.dataclass
class Step:
    """What one call of the layer stack does; built by the entry points, lives in the trace.

    positions: [B, T] the position of each token (= its cache slot), -1 for padding.
    start:     [B] tokens each row held before this call (0 for forward / prefill).
    n_new:     [B] real tokens of each row in this call.
    active:    [B] rows that advance (decode: finished rows compute but stay put).
    max_len:   the cache's slots (None without a cache).
    pages:     a paged cache's page table (`KVCache.pages`), None otherwise.
    rings:     the GSM rings, one [layers, B, W, C] array per site (a list the site hook
               reads and replaces), or None when the hooks keep no state.
    """

    mode: str
    positions: jax.Array
    start: jax.Array
    n_new: jax.Array
    active: jax.Array
    sites: Sites
    max_len: int | None = None
    rings: list | None = None
    pages: jax.Array | None = None  # a paged cache's page table [B, S / page] (`KVCache`)
    _sown: dict | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown step mode {self.mode!r}; known: {MODES}")

    # -- hooks (models/sites.py)

    def site(self, layer: Any, index: int, x: Any, next_weight: Any = None) -> Any:
        """A GSM site: what the hooks make of x [B, T, C] (GSM: smoothed)."""
        return self.sites.site(self, layer, index, x, next_weight)

    def linear(self, layer: Any, name: str, x: Any, w: Any) -> jax.Array:
        """A projection `x @ w`, through the hooks (`name`: the weight's leaf name)."""
        return self.sites.linear(self, layer, name, x, w)

    def sow(self, name: str, value: Any) -> None:
        """Hand a value of the current layer back to the caller (stacked over layers)."""
        if self._sown is None:
            raise RuntimeError("sow() outside a layer of run_layers")
        self._sown[name] = value

    # -- what layers ask

    @property
    def valid(self) -> jax.Array:
        return self.positions >= 0

    @property
    def rope_positions(self) -> jax.Array:
        return jnp.maximum(self.positions, 0)

    def chunk_mask(self) -> jax.Array:
        """[B, T, T]: causal within the chunk, real keys of the same row (forward, prefill)."""
        t = self.positions.shape[1]
        steps = jnp.arange(t)
        return (steps[None, :, None] >= steps[None, None, :]) & self.valid[:, None, :]


def forward_step(lengths: jax.Array, t: int, sites: Any = None) -> Step:
    """Teacher forcing over right-padded rows of `lengths` tokens, no cache."""
    steps = jnp.arange(t)
    valid = steps[None, :] < lengths[:, None]
    b = lengths.shape[0]
    return Step("forward", jnp.where(valid, steps[None, :], -1), jnp.zeros((b,), jnp.int32),
                lengths.astype(jnp.int32), jnp.ones((b,), bool), as_sites(sites))


def prefill_step(lengths: jax.Array, t: int, cache: Any, sites: Any = None) -> Step:
    """Right-padded prompts into a fresh cache (rows start at position 0)."""
    step = forward_step(lengths, t, sites)
    return dataclasses.replace(step, mode="prefill", max_len=cache.max_len,
                               rings=_rings_in(cache, step.sites), pages=_pages_of(cache))


def extend_step(n_new: jax.Array, t: int, cache: Any, sites: Any = None) -> Step:
    """A chunk of [B, t] tokens (the first n_new real) after each row's cache.lengths."""
    steps = jnp.arange(t)
    valid = steps[None, :] < n_new[:, None]
    start = cache.lengths
    sites = as_sites(sites)
    return Step("extend", jnp.where(valid, start[:, None] + steps[None, :], -1), start,
                n_new.astype(jnp.int32), jnp.ones((n_new.shape[0],), bool), sites,
                max_len=cache.max_len, rings=_rings_in(cache, sites), pages=_pages_of(cache))


def decode_step_ctx(cache: Any, active: jax.Array | None, sites: Any = None) -> Step:
    """One token per row at position cache.lengths (clamped to the last slot)."""
    b = cache.lengths.shape[0]
    active = jnp.ones((b,), bool) if active is None else active
    slot = jnp.minimum(cache.lengths, cache.max_len - 1)
    sites = as_sites(sites)
    return Step("decode", slot[:, None], cache.lengths, active.astype(jnp.int32),
                active, sites, max_len=cache.max_len, rings=_rings_in(cache, sites),
                pages=_pages_of(cache))


def _pages_of(cache: Any) -> jax.Array | None:
    return getattr(cache, "pages", None)


def _rings_in(cache: Any, sites: Sites) -> list | None:
    rings = getattr(cache, "rings", None)
    if not sites.uses_rings:
        return None
    if rings is None:
        raise InvalidInputError("GSM is on but this cache holds no GSM rings: make it with "
                                "init_cache(..., gsm_max_window=...)")
    return list(rings)


def rings_out(step: Step, cache: Any) -> Any:
    """The cache's GSM rings after the step (unchanged when the hooks keep no state)."""
    if step.rings is None:
        return getattr(cache, "rings", None)
    return constrain_rings(tuple(step.rings))


def new_lengths(step: Step) -> jax.Array:
    if step.mode == "decode":
        return step.start + step.active.astype(jnp.int32)
    return step.start + step.n_new


def last_token(x: jax.Array, n: jax.Array) -> jax.Array:
    """x [B, T, ...] -> each row's token n - 1, [B, ...]."""
    idx = jnp.maximum(n - 1, 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.take_along_axis(x, idx, axis=1)[:, 0]


# ----------------------------------------------------------------------------- the loop


def run_layers(layer_fn: Callable, cfg: Any, layers: Any, x: jax.Array,
               caches: tuple | None, step: Step) -> tuple[jax.Array, tuple | None, dict]:
    """Apply `layer_fn(cfg, weights_of_layer, index, x, cache_of_layer, step)` to every layer.

    layers: a tuple of per-layer weight trees (an unrolled loop, the index a Python int), or
            one tree of stacked [L, ...] arrays (`lax.scan`, one compiled layer body; the
            index a traced int, so only for families whose layers are all alike).
    caches: per-layer cache pieces (a tuple), or None (forward).
    Returns x, the new per-layer cache pieces, and what the hooks sowed: {name: [L, ...]}.
    """
    if isinstance(layers, tuple | list):
        new_caches, sown = [], []
        for i, lw in enumerate(layers):
            step._sown = {}
            with jax.named_scope("layer"):
                x, c = layer_fn(cfg, lw, i, x, None if caches is None else caches[i], step)
            new_caches.append(c)
            sown.append(step._sown)
        step._sown = None
        stacked = {k: jax.tree.map(lambda *a: jnp.stack(a), *[s[k] for s in sown])
                   for k in (sown[0] if sown else {})}
        return x, None if caches is None else tuple(new_caches), stacked

    n = jax.tree.leaves(layers)[0].shape[0]
    stacked_cache = None if caches is None else jax.tree.map(lambda *a: jnp.stack(a), *caches)

    def body(carry, inputs):
        x, rings = carry
        lw, i, c = inputs
        step.rings, step._sown = None if rings is None else list(rings), {}
        with jax.named_scope("layer"):
            x, c = layer_fn(cfg, lw, i, x, c, step)
        rings = None if step.rings is None else tuple(step.rings)
        sown, step._sown = step._sown, None
        return (x, rings), (c, sown)

    rings0 = None if step.rings is None else tuple(step.rings)
    (x, rings), (c_all, sown) = jax.lax.scan(
        body, (x, rings0), (layers, jnp.arange(n), stacked_cache))
    step.rings = None if rings is None else list(rings)
    caches_out = None if caches is None else tuple(jax.tree.map(lambda a, i=i: a[i], c_all)
                                                   for i in range(n))
    return x, caches_out, sown


# ----------------------------------------------------------------------------- weight layouts


def is_per_layer(weights: dict) -> bool:
    """True when weights["layers"] is a tuple of per-layer trees (see `unstack_layers`)."""
    return isinstance(weights["layers"], tuple | list)


def unstack_layers(weights: dict) -> dict:
    """The same weights with "layers" as a tuple of per-layer trees: the layers then run as
    an unrolled loop over separate arrays instead of `lax.scan` over stacked [L, ...] arrays
    (on XLA:CPU a dot cannot read a layer's slice of a stacked weight in place, so under
    scan every layer's weights are copied out first; docs/performance_notes.md)."""
    if is_per_layer(weights):
        return weights
    stacked = weights["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n))
    return {**weights, "layers": layers}


def stack_layers(weights: dict) -> dict:
    """The inverse of `unstack_layers`: "layers" as one tree of stacked [L, ...] arrays."""
    if not is_per_layer(weights):
        return weights
    return {**weights, "layers": jax.tree.map(lambda *a: jnp.stack(a), *weights["layers"])}


def layer_weights(weights: dict, num_layers: int, *, scan_ok: bool) -> Any:
    """The "layers" tree as `run_layers` takes it: stacked weights stay stacked when the
    family allows a scan, else they are sliced per layer; the count is checked."""
    layers = weights["layers"]
    if not is_per_layer(weights):
        if scan_ok:
            n = jax.tree.leaves(layers)[0].shape[0]
            if n != num_layers:
                raise InvalidInputError(f"the weights hold {n} layers but the config says "
                                        f"num_layers={num_layers}")
            return layers
        layers = unstack_layers(weights)["layers"]
    if len(layers) != num_layers:  # lax.scan fails on this by itself; a loop would not
        raise InvalidInputError(f"the weights hold {len(layers)} layers but the config "
                                f"says num_layers={num_layers}")
    return tuple(layers)


# ----------------------------------------------------------------------------- KV cache


@struct.dataclass
class KVCache:
    """Per-row KV cache of the dense families, plus the GSM rings (when GSM is compiled in).

    k, v: one [B, kv_heads, S, head_dim] array per layer (a tuple); slot s holds the
          token at position s. Heads before slots: the decode step's attention products
          read the cache in place ([B, K] batch dims, contiguous [S, hd] per head), and a
          separate array per layer is updated and read in place (a layer's slice of one
          stacked [L, ...] array was copied out every step; docs/performance_notes.md).
    lengths: [B] tokens already in the cache (= the position of the next token).
    rings: per site [layers, B, max_window, C] of raw site inputs (see gsm_sites).
    k_scale, v_scale: with a low-precision cache (`kv_cache_dtype` "int8" / "fp8": k and v
          are int8 / float8_e4m3fn), one [B, kv_heads, S, head_dim // 32] float32 array of
          block scales per layer: slot s of head h holds k[.., h, s, 32 j: 32 (j + 1)] *
          k_scale[.., h, s, j] (`kv_quantize`); None when float.
    pages: None (the layout above), or **paged** (the serving engine's pool, vLLM's
          PagedAttention layout): the [B, S / page] int32 page table, row b's logical
          page j (positions [j page, (j + 1) page)) held in physical page pages[b, j] of
          each layer's pool; k, v (and their scales) are then [P, kv_heads, page, ...]
          pools of P pages shared by every row (`init_paged_kv_cache`). The cache's
          memory is then P pages, not B x max_len slots: which rows hold which pages is
          the engine's business (it writes a row's table before the row's first chunk).
          A decode row that is not active writes nothing, so a free row's stale table
          never touches a page another row now holds.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    rings: tuple[jax.Array, jax.Array] | None = None
    k_scale: tuple[jax.Array, ...] | None = None
    v_scale: tuple[jax.Array, ...] | None = None
    pages: jax.Array | None = None

    @property
    def max_len(self) -> int:
        if self.pages is not None:
            return self.pages.shape[1] * self.k[0].shape[2]
        return self.k[0].shape[2]

    @property
    def page_size(self) -> int | None:
        """Slots per page of a paged cache (None: not paged)."""
        return None if self.pages is None else self.k[0].shape[2]


def init_kv_cache(num_layers: int, num_kv_heads: int, head_dim: int,
                  site_sizes: tuple[int, ...], batch_size: int, max_len: int, *,
                  dtype: Any = jnp.float32, gsm_max_window: int | None = None,
                  kv_dtype: str | None = None) -> KVCache:
    """An empty cache; `kv_dtype` ("int8" / "fp8", see `kv_quantize`) stores keys and values
    in that format with their scales, None in `dtype` (the GSM rings always are)."""
    kv_dtype = check_kv_cache_dtype(kv_dtype)
    shape = (batch_size, num_kv_heads, max_len, head_dim)
    rings = _empty_rings(num_layers, batch_size, site_sizes, gsm_max_window, dtype)
    store = dtype if kv_dtype is None else KV_CACHE_DTYPES[kv_dtype][0]

    def layers(shape=shape, dt=store):
        return tuple(jnp.zeros(shape, dt) for _ in range(num_layers))

    scales = None if kv_dtype is None else shape[:3] + (head_dim // kv_block(head_dim),)
    return KVCache(k=layers(), v=layers(), lengths=jnp.zeros((batch_size,), jnp.int32),
                   rings=rings,
                   k_scale=None if scales is None else layers(scales, jnp.float32),
                   v_scale=None if scales is None else layers(scales, jnp.float32))


def init_paged_kv_cache(num_layers: int, num_kv_heads: int, head_dim: int,
                        site_sizes: tuple[int, ...], batch_size: int, max_len: int,
                        num_pages: int, page_size: int, *, dtype: Any = jnp.float32,
                        gsm_max_window: int | None = None,
                        kv_dtype: str | None = None) -> KVCache:
    """An empty paged cache (`KVCache.pages`): `num_pages` pages of `page_size` slots per
    layer, shared by `batch_size` rows of up to `max_len` tokens (a multiple of
    `page_size`); every row's table points at page 0 until the engine gives it pages."""
    if page_size < 1 or max_len % page_size or num_pages < 1:
        raise InvalidInputError(f"a paged KV cache needs max_len ({max_len}) a multiple of "
                                f"page_size ({page_size}) and num_pages >= 1 ({num_pages})")
    pool = init_kv_cache(num_layers, num_kv_heads, head_dim, site_sizes, num_pages,
                         page_size, dtype=dtype, kv_dtype=kv_dtype)
    return pool.replace(lengths=jnp.zeros((batch_size,), jnp.int32),
                        rings=_empty_rings(num_layers, batch_size, site_sizes,
                                           gsm_max_window, dtype),
                        pages=jnp.zeros((batch_size, max_len // page_size), jnp.int32))


def _empty_rings(num_layers: int, batch_size: int, site_sizes: tuple[int, ...],
                 gsm_max_window: int | None, dtype: Any) -> tuple | None:
    """The GSM rings of an empty cache, [layers, B, max_window, C] per site (None: no GSM)."""
    if gsm_max_window is None:
        return None
    return tuple(jnp.zeros((num_layers, batch_size, gsm_max_window, c), dtype)
                 for c in site_sizes)


# Low-precision KV cache: storage dtype and the largest magnitude it holds (int8 symmetric
# to +-127; e4m3fn's largest finite value is 448).
KV_CACHE_DTYPES = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}


def check_kv_cache_dtype(kind: Any) -> str | None:
    """None / "auto" / "float": keys and values in the activation dtype (None); "int8" or
    "fp8": that format. Anything else is refused by name."""
    if kind is None or kind in ("auto", "float"):
        return None
    if not isinstance(kind, str) or kind not in KV_CACHE_DTYPES:
        raise InvalidInputError(f"kv_cache_dtype must be one of 'auto', 'float', "
                                f"{', '.join(repr(k) for k in KV_CACHE_DTYPES)} ('released': "
                                f"DeepSeek-V4.1's own formats); got {kind!r}")
    return kind


def config_with_kv_cache_dtype(cfg: Any, kind: Any) -> Any:
    """`cfg` with its KV cache in format `kind` (checked). None / "auto": cfg unchanged.

    - Families whose config has `kv_cache_dtype` (the dense KV cache: Llama family,
      Gemma 3): "float", "int8", "fp8".
    - Families whose config has `cache_qdq` (DeepSeek-V4.1: its caches held packed in the
      released FP8 / FP4 formats, the default): "released" (those formats) or "float"
      (`cache_qdq=False`); "int8" / "fp8" are refused by name.
    - DeepSeek-V4 (float caches only): "float".
    Any other pairing is refused by name, before any work."""
    if kind is None or kind == "auto":
        return cfg
    if hasattr(cfg, "cache_qdq"):
        if kind not in RELEASED_KV_KINDS:
            raise UnsupportedModelError(
                f"kv_cache_dtype={kind!r}: the {cfg.family} family keeps its caches in its "
                "released formats (FP8 window KV, FP4 compressed KV and index keys): choose "
                f"{' or '.join(repr(k) for k in RELEASED_KV_KINDS)}")
        qdq = kind == "released"
        return cfg if cfg.cache_qdq == qdq else dataclasses.replace(cfg, cache_qdq=qdq)
    if kind == "released":
        raise UnsupportedModelError(
            f"kv_cache_dtype='released': the {cfg.family} family has no released cache "
            "format of its own (DeepSeek-V4.1 has); choose 'float', 'int8' or 'fp8'"
            if hasattr(cfg, "kv_cache_dtype") else
            f"kv_cache_dtype='released': the {cfg.family} family keeps float caches")
    kind = check_kv_cache_dtype(kind)
    if not hasattr(cfg, "kv_cache_dtype"):
        if kind is None:  # "float": what these families' caches hold anyway
            return cfg
        raise UnsupportedModelError(
            f"kv_cache_dtype={kind!r}: the {cfg.family} family keeps its KV cache in its own "
            "formats (DeepSeek-V4: float; DeepSeek-V4.1: 'released' or 'float'); "
            "Llama-family and Gemma 3 models take int8 / fp8")
    return cfg if cfg.kv_cache_dtype == kind else dataclasses.replace(cfg,
                                                                      kv_cache_dtype=kind)


# the kv_cache_dtype kinds of a family with its own released cache formats (`cache_qdq`);
# every kind a user may name is `gsm_jax.families.KV_CACHE_KINDS`
RELEASED_KV_KINDS = ("released", "float")


KV_BLOCK = 32  # values per scale along head_dim (as V4.1's own FP8 window cache, OCP MX)


def kv_block(head_dim: int) -> int:
    """Values per scale of a low-precision KV cache: `KV_BLOCK` consecutive head_dim values
    (gcd(head_dim, 32) when head_dim is not a multiple: a whole small head)."""
    return math.gcd(int(head_dim), KV_BLOCK)


def kv_quantize(x: jax.Array, kind: str) -> tuple[jax.Array, jax.Array]:
    """Round keys or values [..., head_dim] to the cache format, one scale per token, head
    and block of `kv_block(head_dim)` (32) consecutive values: s = max|x| * (1 / M) over the
    block (M = 127 for int8, 448 for fp8; the float32 reciprocal, as XLA computes a division
    by a constant; s = 1 for an all-zero block), stored = Q(x / s) with Q
    round-to-nearest-even onto int8 in [-127, 127], or the cast to e4m3fn (also
    round-to-nearest-even; |x / s| <= 448). Blocks rather than one scale per head vector:
    a few outlier channels (Gemma 3's keys) would otherwise set the step of every value
    in the head (measured: Gemma 3 270M's int8 KLD 2.1e-2 per head, 2.1e-3 per 32).
    Returns (stored [..., head_dim], s [..., head_dim // block] float32); `kv_dequantize`
    inverts it."""
    store, qmax = KV_CACHE_DTYPES[kind]
    hd = x.shape[-1]
    block = kv_block(hd)
    x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], hd // block, block)
    amax = jnp.max(jnp.abs(x32), axis=-1)
    scale = jnp.where(amax > 0, amax * np.float32(1.0 / qmax), 1.0)
    y = jnp.clip(x32 / scale[..., None], -qmax, qmax)
    if kind == "int8":
        y = jnp.round(y)
    return y.astype(store).reshape(x.shape), scale


def kv_dequantize(stored: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """stored [..., head_dim] * its block scales [..., head_dim // block] in `dtype`
    (float32 product, then cast)."""
    g = scale.shape[-1]
    blocks = stored.astype(jnp.float32).reshape(*stored.shape[:-1], g, stored.shape[-1] // g)
    return (blocks * scale[..., None]).reshape(stored.shape).astype(dtype)


def can_cut_rows(cache: Any) -> bool:
    """True when a decode step can run over the first rows of this cache only
    (`first_rows`): the dense families' KVCache; DeepSeek's caches step every row."""
    return isinstance(cache, KVCache)


def first_rows(cache: KVCache, rows: int) -> KVCache:
    """The cache as a decode step over its first `rows` rows sees it (the serving engine's
    row bound: a step costs the rows it runs, not `max_batch`): lengths and GSM rings cut
    to those rows; k and v (and their scales) stay whole, the step writes its rows' new
    slots in place and reads rows [0, rows) of them (`kv_attention`). `put_first_rows`
    puts the step's result back. For the dense families' KVCache (`can_cut_rows`)."""
    if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= len(
            cache.lengths):
        raise InvalidInputError(f"first_rows: rows must be in [1, {len(cache.lengths)}], "
                                f"got {rows!r}")
    rings = None if cache.rings is None else tuple(r[:, :rows] for r in cache.rings)
    pages = None if cache.pages is None else cache.pages[:rows]
    return cache.replace(lengths=cache.lengths[:rows], rings=rings, pages=pages)


def put_first_rows(cache: KVCache, part: KVCache) -> KVCache:
    """`cache` (the whole one `first_rows` cut) with the step's result `part` for its first
    rows: part's k, v (the whole arrays, written in place), its lengths and rings put into
    rows [0, rows) of cache's."""
    rings = cache.rings
    if rings is not None:
        rings = tuple(jax.lax.dynamic_update_slice(r, p.astype(r.dtype), (0,) * r.ndim)
                      for r, p in zip(rings, part.rings, strict=True))
    return part.replace(lengths=jax.lax.dynamic_update_slice(
        cache.lengths, part.lengths.astype(cache.lengths.dtype), (0,)), rings=rings,
        pages=cache.pages)


def insert_rows(cache: Any, rows: Any, slots: jax.Array) -> Any:
    """Copy the rows of `rows` (same max_len) into `cache` at batch indices `slots` [b]:
    continuous batching, a request prefilled on its own joins a running batch. Works for
    any cache whose leaves have the batch first, except GSM rings (batch second); not a
    paged one (its rows are page tables: the serving engine writes them)."""
    if getattr(cache, "pages", None) is not None or getattr(rows, "pages", None) is not None:
        raise InvalidInputError("insert_rows: a paged KV cache's rows are page tables "
                                "(serving engine); insert into a cache of rows")

    def put(big, small, axis=0):
        index = (slice(None),) * axis + (slots,)
        return big.at[index].set(small.astype(big.dtype))

    rings = cache.rings
    if cache.rings is not None and rows.rings is not None:
        rings = tuple(put(b, s, axis=1) for b, s in zip(cache.rings, rows.rings, strict=True))
    body = jax.tree.map(put, cache.replace(rings=None, lengths=cache.lengths),
                        rows.replace(rings=None, lengths=rows.lengths))
    return body.replace(lengths=cache.lengths.at[slots].set(rows.lengths), rings=rings)


def _batch_axis(path: tuple) -> int:
    """The batch axis of a cache leaf: 1 for the GSM rings ([layers, B, W, C]), else 0."""
    return 1 if any(getattr(k, "name", None) == "rings" for k in path) else 0


def take_row(cache: Any, slot: jax.Array) -> Any:
    """Row `slot` (a traced int) of a cache as a one-row cache of the same structure:
    the serving engine prefills a request in place, in its slot of the running cache.
    For any cache laid out as `insert_rows` wants (batch first, GSM rings second)."""
    def take(path, a):
        return jax.lax.dynamic_slice_in_dim(a, slot, 1, axis=_batch_axis(path))

    if getattr(cache, "pages", None) is not None:  # the pools stay whole: the row's table
        rows = cache.replace(k=(), v=(), k_scale=None, v_scale=None)
        row = jax.tree_util.tree_map_with_path(take, rows)
        return row.replace(k=cache.k, v=cache.v, k_scale=cache.k_scale, v_scale=cache.v_scale)
    return jax.tree_util.tree_map_with_path(take, cache)


def put_row(cache: Any, row: Any, slot: jax.Array) -> Any:
    """`cache` with its row `slot` replaced by the one-row cache `row` (`take_row`'s
    inverse; in place when `cache` is donated)."""
    def put(path, big, small):
        return jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot,
                                                   axis=_batch_axis(path))

    if getattr(cache, "pages", None) is not None:  # the row's pools are the whole pools
        pools = dict(k=row.k, v=row.v, k_scale=row.k_scale, v_scale=row.v_scale)
        none = dict(k=(), v=(), k_scale=None, v_scale=None)
        out = jax.tree_util.tree_map_with_path(put, cache.replace(**none), row.replace(**none))
        return out.replace(**pools)
    return jax.tree_util.tree_map_with_path(put, cache, row)


def kv_pieces(cache: KVCache) -> tuple:
    """Per layer (k, v), or (k, v, k_scale, v_scale) for a low-precision cache."""
    if cache.k_scale is None:
        return tuple(zip(cache.k, cache.v, strict=True))
    return tuple(zip(cache.k, cache.v, cache.k_scale, cache.v_scale, strict=True))


def kv_from_pieces(pieces: tuple, step: Step, cache: KVCache) -> KVCache:
    scaled = len(pieces[0]) == 4
    return KVCache(k=tuple(p[0] for p in pieces), v=tuple(p[1] for p in pieces),
                   lengths=new_lengths(step).astype(jnp.int32), rings=rings_out(step, cache),
                   k_scale=tuple(p[2] for p in pieces) if scaled else None,
                   v_scale=tuple(p[3] for p in pieces) if scaled else None,
                   pages=_pages_of(cache))


def write_kv(layer_cache: jax.Array, new: jax.Array, step: Step) -> jax.Array:
    """Put a call's keys or values [B, T, K, hd] into one layer's cache [B, K, S, hd] (or
    their block scales [B, T, K, G] into [B, K, S, G]); into a paged pool
    [P, K, page, hd] through the step's page table (`KVCache.pages`)."""
    if step.pages is not None:
        return _write_paged(layer_cache, new, step)
    if step.mode == "prefill":  # the chunk from slot 0 (padding lands in unread slots)
        return jax.lax.dynamic_update_slice(
            layer_cache, jnp.swapaxes(new, 1, 2).astype(layer_cache.dtype),
            (0,) * layer_cache.ndim)
    b = new.shape[0]
    # scatters kept in place at batch 1 too (`in_place.scatter_set`)
    if step.mode == "decode":
        # In range by construction (the slot is clamped): no bounds-guarding select.
        return scatter_set(layer_cache, (jnp.arange(b), slice(None), step.positions[:, 0]),
                           new[:, 0].astype(layer_cache.dtype), mode="promise_in_bounds")
    write = jnp.where(step.valid, step.positions, step.max_len)  # padding: dropped
    return scatter_set(layer_cache, (jnp.arange(b)[:, None], slice(None), write),
                       new.astype(layer_cache.dtype), mode="drop")


def _write_paged(pool: jax.Array, new: jax.Array, step: Step) -> jax.Array:
    """`write_kv` into a paged pool: position p of row b goes to slot p % page of page
    pages[b, p // page]. Padding, and every row of a decode step that is not active,
    write nothing (index P: dropped)."""
    n_pool, page = pool.shape[0], pool.shape[2]
    b = new.shape[0]
    table = step.pages
    if step.mode == "decode":
        pos = step.positions[:, 0]
        phys = jnp.where(step.active, table[jnp.arange(b), pos // page], n_pool)
        return scatter_set(pool, (phys, slice(None), pos % page),
                           new[:, 0].astype(pool.dtype), mode="drop")
    pos = jnp.maximum(step.positions, 0)
    logical = jnp.minimum(pos // page, table.shape[1] - 1)
    phys = jnp.where(step.valid, jnp.take_along_axis(table[:b], logical, axis=1), n_pool)
    return scatter_set(pool, (phys, slice(None), pos % page), new.astype(pool.dtype),
                       mode="drop")


def kv_attention(q: jax.Array, k: jax.Array, v: jax.Array, kv_cache: tuple | None,
                 step: Step, mask_fn: Callable[[jax.Array], jax.Array] | None = None,
                 scale: float | None = None,
                 kv_dtype: str | None = None) -> tuple[jax.Array, tuple | None]:
    """Write this call's k, v [B, T, K, hd] into the layer's cache and attend, the way the
    mode wants: over the chunk itself (forward, no cache), or over the cache in blocks up
    to each row's position (prefill, extend, decode: `cache_attention`). `mask_fn(mask)`
    narrows the causal mask (Gemma's sliding window). Returns the attention output [B, T, H * hd]
    and the new cache piece.

    `kv_dtype` ("int8" / "fp8": the model config's `kv_cache_dtype`): the cache stores k
    and v rounded by `kv_quantize`, and every key and value any query sees, in every mode
    (the teacher-forced forward too), is that rounding dequantized: so prefill, chunked
    extend and decode equal the forward with the same rounding applied."""
    if kv_dtype is None:
        stored = (k, v)
    else:  # what the cache holds; every query sees its dequantized values
        (kq, ks), (vq, vs) = kv_quantize(k, kv_dtype), kv_quantize(v, kv_dtype)
        stored = (kq, vq, ks, vs)
    if step.mode == "forward":
        if kv_dtype is not None:  # attending over the chunk itself: its rounded values
            k, v = kv_dequantize(kq, ks, k.dtype), kv_dequantize(vq, vs, v.dtype)
        mask = step.chunk_mask()
        if mask_fn is not None:
            t = q.shape[1]
            mask = mask_fn(mask, jnp.broadcast_to(jnp.arange(t), step.positions.shape))
        with jax.named_scope("attention"):
            return attention(q, k, v, mask, scale), None
    # Prefill, extend, decode: write this call's k, v first, then read the cache
    # (`cache_attention`, whose trip count follows the rows' lengths); reading before the
    # scatter makes XLA keep (copy) the old cache alive. A prefill reads its own chunk
    # back from the cache: the same blocks, in the same order, as an extend from slot 0,
    # so the serving engine's prefill (an extend into a slot) equals `generate`'s.
    piece = tuple(write_kv(c, n, step) for c, n in zip(kv_cache, stored, strict=True))
    with jax.named_scope("attention"):
        out = cache_attention(q, piece, step.positions, mask_fn, scale, pages=step.pages)
    return out, piece


# Cache slots per block of `cache_attention` (a multiple of nothing in particular: the
# loop clamps its last block into the cache and masks what an earlier block covered).
ATTN_BLOCK = 128


def cache_attention(q: jax.Array, piece: tuple, positions: jax.Array,
                    mask_fn: Callable | None = None, scale: float | None = None,
                    block: int = ATTN_BLOCK, pages: jax.Array | None = None) -> jax.Array:
    """Attention of the queries q [B, T, H, hd] at `positions` [B, T] (-1: padding) over a
    layer's cache `piece` (k, v [B', K, S, hd], B' >= B: rows [0, B) are read; or with
    their block scales, `kv_quantize`), each query seeing the slots <= its position.

    **The context length is run-time data.** The loop runs over blocks of `block` slots,
    as many as the longest row needs (ceil((max position + 1) / block), a traced trip
    count): a step reading a row of 64 tokens costs one block whatever the cache's size,
    so one compiled program serves every length (vLLM's paged attention reads block
    tables the same way). Online softmax (flash-decoding): per block the running max m,
    denominator l and output are rescaled, in float32. A block past a row's length is
    fully masked and leaves that row's numbers bit for bit unchanged (its weights are
    exp(-1e30 - m) = 0 and the rescale exp(0) = 1), so a row's result does not depend on
    the other rows, the trip count or the cache's size. `mask_fn(mask [B, T, blk],
    slots [blk])` narrows the mask (Gemma's sliding window). Returns [B, T, H * hd].

    `pages` [B', S / page] (a paged cache, `KVCache.pages`; piece is then the layer's
    pools [P, K, page, hd]): a block is a page, block i of row b is read from page
    pages[b, i] (a gather of one page per row), and the numbers are those of the same
    tokens in a cache of rows with `block` = page."""
    b, t, h, hd = q.shape
    k_all, v_all = piece[0], piece[1]
    kh = k_all.shape[1]
    if pages is not None:
        blk = k_all.shape[2]
        s = pages.shape[1] * blk
        table = pages[:b]
    else:
        s = k_all.shape[2]
        blk = min(int(block), s)
    g = h // kh
    scale = hd**-0.5 if scale is None else scale
    # [B, K, G * T, hd]: per (row, kv head) the block's products are plain matrix products
    # [G T, hd] x [hd, blk] and [G T, blk] x [blk, hd] reading the cache in place
    qg = q.reshape(b, t, kh, g, hd).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, hd)
    valid = positions >= 0
    n_blocks = (jnp.max(jnp.where(valid, positions, 0)) + blk) // blk
    n_blocks = jnp.minimum(n_blocks, -(-s // blk)).astype(jnp.int32)

    def read(a: jax.Array, start: jax.Array) -> jax.Array:
        if pages is not None:  # start = i * page: each row's page i
            if b == 1:  # one row: a slice at its page (as the rows' cache's read)
                return jax.lax.dynamic_slice_in_dim(a, table[0, start // blk], 1, axis=0)
            return a.at[table[:, start // blk]].get(mode="promise_in_bounds")
        return jax.lax.dynamic_slice(a, (0, 0, start, 0), (b,) + a.shape[1:2] + (blk,)
                                     + a.shape[3:])

    def body(i, carry):
        m, denom, acc = carry
        first = i * blk
        start = jnp.minimum(first, s - blk)  # the last block may overlap the one before
        kb, vb = read(k_all, start), read(v_all, start)
        if len(piece) == 4:
            kb = kv_dequantize(kb, read(piece[2], start), q.dtype)
            vb = kv_dequantize(vb, read(piece[3], start), q.dtype)
        kb, vb = kb.astype(q.dtype), vb.astype(q.dtype)
        slots = start + jnp.arange(blk)
        mask = ((slots[None, None, :] <= positions[:, :, None]) & valid[..., None]
                & (slots >= first)[None, None, :])
        if mask_fn is not None:
            mask = mask_fn(mask, slots)
        mask = jnp.broadcast_to(mask[:, None, None], (b, kh, g, t, blk)).reshape(
            b, kh, g * t, blk)
        sc = jnp.einsum("bkqd,bksd->bkqs", qg, kb, preferred_element_type=jnp.float32)
        sc = jnp.where(mask, sc * scale, MASK_VALUE)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        p = jnp.exp(sc - m_new[..., None])
        alpha = jnp.exp(m - m_new)
        denom = denom * alpha + jnp.sum(p, axis=-1)
        pv = jnp.einsum("bkqs,bksd->bkqd", p.astype(vb.dtype), vb,
                        preferred_element_type=jnp.float32)
        return m_new, denom, acc * alpha[..., None] + pv

    init = (jnp.full((b, kh, g * t), MASK_VALUE, jnp.float32),
            jnp.zeros((b, kh, g * t), jnp.float32),
            jnp.zeros((b, kh, g * t, hd), jnp.float32))
    _, denom, acc = jax.lax.fori_loop(0, n_blocks, body, init)
    out = (acc / denom[..., None]).astype(q.dtype)
    return out.reshape(b, kh, g, t, hd).transpose(0, 3, 1, 2, 4).reshape(b, t, h * hd)


# ----------------------------------------------------------------------------- numerics


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float | None = None, *,
               inv_freq: Any = None, attention_factor: float = 1.0) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face convention). x [B, T, N, hd], positions [B, T].

    Plain RoPE of base `theta` over the whole head, or, given `inv_freq` ([hd // 2], e.g. a
    scaled `RopeSpec.inv_freq()`: linear, llama3, YaRN), those frequencies, with cos and sin
    multiplied by `attention_factor` (YaRN's; 1 for the others) as transformers does."""
    half = x.shape[-1] // 2
    if inv_freq is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    elif tuple(inv_freq.shape) != (half,):
        raise ValueError(f"apply_rope: inv_freq has shape {tuple(inv_freq.shape)}, the head "
                         f"rotates {half} channel pairs")
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              scale: float | None = None) -> jax.Array:
    """Grouped-query attention. q [B,T,H,hd]; k, v [B,S,K,hd]; mask [B,T,S] -> [B,T,H*hd].
    scale: of the scores, head_dim**-0.5 unless given (Gemma's query_pre_attn_scalar)."""
    b, t, h, hd = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (hd**-0.5 if scale is None else scale)
    scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h * hd)


def embed(weights: dict, tokens: jax.Array) -> jax.Array:
    return jnp.take(weights["embed"], tokens, axis=0)


def lm_head(weights: dict, x: jax.Array, tied: bool) -> jax.Array:
    """Logits (f32) of hidden states x [..., D] that are already final-normed.

    An int8 head (`gsm_jax.quant.quantize(..., head=True)`: a weight-only
    `QuantizedWeight` [D, V] under "lm_head", tied models included) goes through
    `linear` on float32 activations."""
    with jax.named_scope("lm_head"):
        head = weights.get("lm_head")
        if isinstance(head, QuantizedWeight):
            return linear(x.astype(jnp.float32), head)
        if tied:
            table = weights["embed"].astype(x.dtype)
            return jnp.einsum("...d,vd->...v", x, table, preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", x, weights["lm_head"].astype(x.dtype),
                          preferred_element_type=jnp.float32)
