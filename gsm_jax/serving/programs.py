"""The serving engine's compiled programs: a fixed, small set, compiled before the server
says ready, none after.

- `decode`, one per row bound r (1, 2, 4, ... max_batch): one token for each of the first
  r slots: the token feed, the model's step, penalties, the pick, log-probabilities;
- `extend`, one per chunk width W (16, 32, ... prefill_chunk): W prompt tokens into one
  slot of the running cache, in place, and the pick after them (a request's first token);
- `penalty_row`, one: a penalized request's prompt tokens and logit bias into its slot's
  counters;
- `snapshot` / `restore`, one each with prefix caching: a prefill chunk's KV block (and
  the GSM rings after it) out of / into a slot.

Nothing here depends on the context length: attention loops over cache blocks up to
the rows' lengths (`models.common.cache_attention`), so `--max-len` only sizes the
cache. The sampling mode (greedy / sampled / top-k-top-p), penalties and
log-probabilities are run-time flags (`lax.cond`: a greedy batch runs no sampler, a batch
without penalties no penalty), not program variants. The token feed of async scheduling
is inside `decode`: it takes the previous step's picks as a [max_batch] device array.

`ProgramSet` lowers each program for its shapes and compiles them (in threads: XLA
compiles outside the GIL), and calls the compiled executables: a call whose arguments do
not match raises instead of compiling (`ProgramMissing`), so "no compilation after
ready" is a property of the code, checked by the server test that counts JAX's own
compilation events.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.families import family_module
from gsm_jax.generation import sample_tokens
from gsm_jax.models import common
from gsm_jax.serving.requests import MAX_LOGPROBS

__all__ = ["ProgramMissing", "ProgramSet", "decode", "extend", "penalize", "pick"]


class ProgramMissing(RuntimeError):
    """A call for shapes no compiled program has (a bug: the plan missed a bucket)."""


# ----------------------------------------------------------------------------- pieces


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


def _no_logprobs(r: int):
    return (jnp.zeros((r,), jnp.float32), jnp.zeros((r, MAX_LOGPROBS), jnp.float32),
            jnp.zeros((r, MAX_LOGPROBS), jnp.int32))


def logprobs_of(logits, targets):
    """(log-probability of `targets` [r], top-`MAX_LOGPROBS` log-probabilities [r, K] and
    their ids) of logits [r, V]: the model's own (raw) distribution."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    k = min(MAX_LOGPROBS, logp.shape[-1])
    vals, ids = jax.lax.top_k(logp, k)
    if k < MAX_LOGPROBS:
        vals = jnp.pad(vals, ((0, 0), (0, MAX_LOGPROBS - k)), constant_values=-jnp.inf)
        ids = jnp.pad(ids, ((0, 0), (0, MAX_LOGPROBS - k)))
    return chosen, vals, ids.astype(jnp.int32)


def pick(logits, sampling, penalties, flags):
    """Next token per row of logits [r, V] (f32), and its log-probabilities.

    sampling = (temperature, top_k, top_p, seed, count) [r] each: a row's k-th token draws
    from key fold_in(key(seed), k); greedy where temperature == 0 (the same argmax
    `generate_tokens` takes). penalties: `penalize`'s. flags = (any row sampled, any row
    filtered by top-k / top-p, any row penalized, any row wants log-probabilities), run-time
    booleans: each part runs only when some row needs it."""
    any_sample, any_filtered, any_penalty, any_logprobs = flags
    temperature, top_k, top_p, seeds, counts = sampling
    raw = logits.astype(jnp.float32)
    adj = jax.lax.cond(any_penalty, lambda: penalize(raw, penalties), lambda: raw)

    def sampled(filtered: bool):
        def one(row, seed, count, t, k, p):
            key = jax.random.fold_in(jax.random.key(seed), count)
            return sample_tokens(row[None], key, t[None], k[None], p[None],
                                 filtered=filtered)[0]

        return lambda: jax.vmap(one)(adj, seeds, counts, temperature, top_k, top_p)

    def sample():
        return jax.lax.cond(any_filtered, sampled(True), sampled(False))

    tok = jax.lax.cond(any_sample, sample,
                       lambda: jnp.argmax(adj, axis=-1).astype(jnp.int32))
    lp = jax.lax.cond(any_logprobs, lambda: logprobs_of(raw, tok),
                      lambda: _no_logprobs(raw.shape[0]))
    return tok, lp


def _count(pen, tok, active):
    """The output-token counters after this step's picks (every active row counts; a
    penalized request's row is reset when it is admitted: `penalty_row`)."""
    counts, seen, bias = pen
    r = tok.shape[0]
    counts = counts.at[jnp.arange(r), tok].add(active.astype(jnp.int32), mode="drop")
    return counts, seen, bias


def _rows_of(pen, r: int):
    return tuple(a[:r] for a in pen)


# ----------------------------------------------------------------------------- programs


@functools.partial(jax.jit, static_argnames=("config", "row_bound"),
                   donate_argnames=("cache", "pen"))
def decode(weights, cache, pen, prev, host, use_prev, active, gsm, sampling, fpr, flags, *,
           config, row_bound: int | None):
    """One decode step over the first `row_bound` slots (None: all; the engine's static
    bound of the running slots, `Engine.rows_bound`).

    prev [max_batch]: the step before's picks (on device: async scheduling feeds them
    without a round trip); host [r]: the host's tokens (a just-admitted row's first);
    use_prev [r]: which to feed. active [r]; gsm: `GSMInputs` of the r rows or None;
    sampling, flags: `pick`'s; fpr = (frequency, presence, repetition) [r].
    pen = (counts, seen, bias) [max_batch, V]: the penalty counters (donated; this step's
    picks are counted). Returns (picks padded to [max_batch], log-probabilities, cache,
    pen)."""
    family = family_module(config.family)
    b = prev.shape[0]
    r = b if row_bound is None else row_bound
    tokens = jnp.where(use_prev, prev[:r], host)
    with jax.named_scope("model"):
        if row_bound is None:
            logits, cache = family.decode_step(weights, config, tokens, cache, gsm, active)
        else:
            logits, part = family.decode_step(weights, config, tokens,
                                              common.first_rows(cache, row_bound), gsm,
                                              active)
            cache = common.put_first_rows(cache, part)
    with jax.named_scope("pick"):
        tok, lp = pick(logits, sampling, (*fpr, *_rows_of(pen, r)), flags)
    pen = _count(pen, tok, active)
    out = tok if r == b else jnp.zeros((b,), jnp.int32).at[:r].set(tok)
    return out, lp, cache, pen


def _fresh(row, start, config, gsm, dtype):
    """A row about to be prefilled from slot 0 (start == 0) starts from an empty cache:
    a dense KV cache needs only its GSM rings cleared (slots past the length are never
    read); other caches (DeepSeek's window, compressed entries, compressor state) are
    reset whole."""
    fresh = start == 0
    if isinstance(row, common.KVCache):
        if row.rings is None:
            return row
        return row.replace(rings=tuple(jnp.where(fresh, jnp.zeros_like(a), a)
                                       for a in row.rings))
    family = family_module(config.family)
    empty = family.init_cache(config, 1, int(row.max_len), dtype=dtype,
                              gsm_max_window=None if gsm is None else gsm.max_window)
    return jax.tree.map(lambda a, z: jnp.where(fresh, z.astype(a.dtype), a), row, empty)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnames=("cache", "pen"))
def extend(weights, cache, pen, tokens, n_new, start, slot, targets, gsm, sampling, fpr, flags,
           prompt_lp, last, page_row, *, config):
    """W prompt tokens `tokens` [1, W] (the first `n_new` [1] real) into slot `slot` of the
    running cache, whose row holds `start` tokens already (0: a fresh prefill), in place.
    `page_row`: a paged cache's table row for the slot (the pages the engine gave the
    request; written before the chunk), None for a cache of rows.

    Returns (the pick after the chunk's last real token [1] and its log-probabilities,
    the prompt log-probabilities of `targets` [1, W] (each position's next prompt token;
    computed only when `prompt_lp`), cache, pen). The pick is the request's first token
    when this is its last chunk (`last`; ignored otherwise), and is then counted for the
    penalties."""
    family = family_module(config.family)
    cache = _with_page_row(cache, slot, page_row)
    row = common.take_row(cache, slot)
    row = _fresh(row, start, config, gsm, jax.tree.leaves(weights)[0].dtype)
    row = row.replace(lengths=jnp.reshape(start, (1,)).astype(row.lengths.dtype))
    with jax.named_scope("model"):
        x, row = family.extend(weights, config, tokens, n_new, row, gsm, hidden=True)
        final = family.logits(weights, config, common.last_token(x, n_new))
    cache = common.put_row(cache, row, slot)
    with jax.named_scope("pick"):
        tok, lp = pick(final, sampling, (*fpr, *(jax.lax.dynamic_slice_in_dim(a, slot, 1)
                                                 for a in pen)), flags)
    counts, seen, bias = pen  # the first output token counts (`last`: the prompt's end)
    pen = (counts.at[slot, tok[0]].add(last.astype(counts.dtype)), seen, bias)
    w = tokens.shape[1]
    plp = jax.lax.cond(prompt_lp,
                       lambda: logprobs_of(family.logits(weights, config, x)[0], targets[0]),
                       lambda: _no_logprobs(w))
    return tok, lp, plp, cache, pen


def _with_page_row(cache, slot, page_row):
    """A paged cache with row `slot` of its page table set to `page_row`."""
    if page_row is None:
        return cache
    return cache.replace(pages=jax.lax.dynamic_update_slice_in_dim(
        cache.pages, page_row[None].astype(cache.pages.dtype), slot, axis=0))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def fresh_state(config, max_batch: int, max_len: int, dtype, gsm_window: int | None,
                paged: tuple[int, int] | None = None):
    """An engine's empty state: the running cache (`family.init_cache`; `paged` = (pages,
    page size): a pool of pages, max_len a multiple of the page), the penalty counters
    (counts, seen, bias) [max_batch, V], and the token feed [max_batch]."""
    extra = {} if paged is None else {"paged": paged}  # families without pages lack the arg
    cache = family_module(config.family).init_cache(config, max_batch, max_len, dtype=dtype,
                                                    gsm_max_window=gsm_window, **extra)
    v = config.vocab_size
    pen = (jnp.zeros((max_batch, v), jnp.int32), jnp.zeros((max_batch, v), bool),
           jnp.zeros((max_batch, v), jnp.float32))
    return cache, pen, jnp.zeros((max_batch,), jnp.int32)


@functools.partial(jax.jit, donate_argnames=("pen",))
def penalty_row(pen, slot, seen_row, bias_row):
    """A penalized request's slot: its counters zeroed, its prompt tokens seen [V] and its
    logit bias [V] set."""
    counts, seen, bias = pen
    return (counts.at[slot].set(0), seen.at[slot].set(seen_row), bias.at[slot].set(bias_row))


@functools.partial(jax.jit, static_argnames=("block",))
def snapshot(cache, slot, start, *, block: int):
    """Prefix caching: a copy of slot `slot`'s state after a prefill chunk that ended at
    `start + block`: a dense KV cache's slots [start, start + block) and its GSM rings;
    any other cache's whole row."""
    row = common.take_row(cache, slot)
    if not isinstance(row, common.KVCache):
        return jax.tree.map(lambda a: a + jnp.zeros_like(a), row)  # its own buffers

    def cut(a):
        if row.pages is not None:  # the block's tokens, gathered through the row's table
            page, off = _token_pages(row, start, block)
            return jnp.swapaxes(a[page, :, off], 0, 1)[None]
        return jax.lax.dynamic_slice_in_dim(a, start, block, axis=2)

    return row.replace(k=tuple(map(cut, row.k)), v=tuple(map(cut, row.v)),
                       k_scale=None if row.k_scale is None else tuple(map(cut, row.k_scale)),
                       v_scale=None if row.v_scale is None else tuple(map(cut, row.v_scale)),
                       rings=None if row.rings is None else
                       tuple(a + jnp.zeros_like(a) for a in row.rings), pages=None)


def _token_pages(row, start, n: int):
    """(physical page, slot in it) [n] of tokens [start, start + n) of a one-row paged
    cache."""
    pos = start + jnp.arange(n)
    return row.pages[0, pos // row.page_size], pos % row.page_size


@functools.partial(jax.jit, donate_argnames=("cache",))
def restore(cache, saved, slot, start, page_row=None):
    """`snapshot`'s inverse: its block back at slots [start, start + block) of slot `slot`
    (GSM rings and length included: restoring the blocks in order leaves the last one's),
    or its whole row. `page_row`: as `extend`'s (a paged cache's table row, set first)."""
    if not isinstance(saved, common.KVCache):
        return common.put_row(cache, saved, slot)
    cache = _with_page_row(cache, slot, page_row)
    row = common.take_row(cache, slot)
    block = saved.k[0].shape[2]

    def put(big, small):
        if row.pages is not None:
            page, off = _token_pages(row, start, block)
            return big.at[page, :, off].set(jnp.swapaxes(small[0], 0, 1),
                                            mode="promise_in_bounds")
        return jax.lax.dynamic_update_slice_in_dim(big, small, start, axis=2)

    row = row.replace(
        k=tuple(map(put, row.k, saved.k)), v=tuple(map(put, row.v, saved.v)),
        k_scale=None if row.k_scale is None else tuple(map(put, row.k_scale, saved.k_scale)),
        v_scale=None if row.v_scale is None else tuple(map(put, row.v_scale, saved.v_scale)),
        rings=saved.rings, lengths=jnp.reshape(start + block, (1,)).astype(row.lengths.dtype))
    return common.put_row(cache, row, slot)


# ----------------------------------------------------------------------------- the set


class ProgramSet:
    """The compiled executables of one engine, by (program, bucket).

    `add(name, bucket, fn, args, static)` records a program to build from example
    arguments (arrays or ShapeDtypeStructs: only their shapes, dtypes and shardings
    matter); `compile(progress, threads)` lowers each (tracing: one at a time) and
    compiles them (`threads` at a time); `call(name, bucket, *args)` runs one. A call
    for a (name, bucket) not compiled raises `ProgramMissing`."""

    def __init__(self, save: bool = True, aot: bool = True) -> None:
        self._plan: dict[tuple[str, Any], tuple[Callable, tuple, dict, tuple]] = {}
        self._compiled: dict[tuple[str, Any], tuple[Any, bool]] = {}  # (executable, flat)
        self._out: dict[tuple[str, Any], Any] = {}
        # with the compilation cache on, save what is built whole
        # (`compile_cache.save_executable`): a warm start loads the executables, neither
        # tracing, lowering nor compiling
        self.save = bool(save)
        # aot: calls run the executables built here. Off (an engine on a mesh, whose caches
        # are placed by the partitioner at the first call): calls go through the jitted
        # functions, which find what `compile` built in the persistent compilation cache
        self.aot = bool(aot)
        self.seconds: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._plan)

    def keys(self) -> list[tuple[str, Any]]:
        return list(self._plan)

    @property
    def compiled(self) -> int:
        """How many of the planned programs are built."""
        return len(self._compiled)

    def add(self, name: str, bucket: Any, fn: Callable, args: Sequence[Any],
            static: dict[str, Any] | None = None, donate: Sequence[int] = (),
            out: Any = None) -> None:
        """Plan `fn(*args, **static)` as program (name, bucket); `donate`: the positions
        of the arguments it donates (as `fn`'s own jit says: kept when built from a
        saved program); `out`: anything with the tree structure of its outputs (None:
        found by tracing it), so that a program built from its saved form is not traced."""
        self._plan[(name, bucket)] = (fn, tuple(args), dict(static or {}), tuple(donate))
        self._out[(name, bucket)] = out

    def has(self, name: str, bucket: Any) -> bool:
        return (name, bucket) in self._plan

    def compile(self, progress: Callable[[int, int, str], None] | None = None,
                threads: int = 2, mesh: Any = None,
                keys: Sequence[tuple[str, Any]] | None = None) -> dict[str, float]:
        """Lower every planned program not built yet (tracing: one at a time, on this
        thread) and compile them, `threads` at a time (XLA compiles outside the GIL);
        `progress(done, total, label)` is called on this thread after each. An exception
        from `progress` (a cancelled warm-up) stops the work: programs not started are
        dropped. `keys`: only those programs (default: every planned one). Returns seconds
        per program label (from its lowering to its build)."""
        from gsm_jax.compile_cache import executable_path
        from gsm_jax.generation import on_mesh
        from gsm_jax.serving.requests import clock

        todo = [k for k in (self._plan if keys is None else keys) if k not in self._compiled]
        total, done = len(todo), 0
        pending: dict[Future, tuple[Any, float, Any]] = {}

        def finished(key, compiled, t0, sig) -> None:
            nonlocal done
            self._compiled[key] = compiled
            if sig is not None:
                if len(_EXECUTABLES) >= _KEEP:
                    _EXECUTABLES.pop(next(iter(_EXECUTABLES)))
                _EXECUTABLES[sig] = compiled
            label = f"{key[0]} {key[1]}"
            self.seconds[label] = clock() - t0
            done += 1
            if progress is not None:
                progress(done, total, label)

        def build(key, t0, sig, path) -> None:  # lower here (tracing holds the GIL), compile
            fn, args, static, donate = self._plan[key]
            with on_mesh(mesh):
                lowered, flat = self._lower(key, fn, args, static, donate,
                                            saved=path is not None)
            pending[pool.submit(_build, lowered, flat, path if flat else None)] = (
                key, t0, sig, None)

        def collect(block: bool) -> None:
            ready = [f for f in pending if f.done()]
            if block and not ready:
                ready = [next(as_completed(pending))]
            for f in ready:
                key, t0, sig, loaded_from = pending.pop(f)
                got = f.result()
                if got is None:  # a saved executable that did not load: built again
                    build(key, t0, sig, loaded_from)
                else:
                    finished(key, got, t0, sig)

        pool = ThreadPoolExecutor(max_workers=max(1, int(threads)),
                                  thread_name_prefix="gsm-jax-compile")
        try:
            for key in todo:
                fn, args, static, donate = self._plan[key]
                t0 = clock()
                sig = _signature(fn, args, static)
                known = _EXECUTABLES.get(sig)
                if known is not None:  # another engine of this process built it
                    finished(key, known, t0, None)
                    continue
                path = (executable_path(f"serve_{key[0]}", args, static)
                        if self.save and self.aot else None)
                if path is not None and path.is_file():  # saved: no tracing, no compiling
                    n = len(jax.tree.leaves(args))
                    pending[pool.submit(_load, path, n, self._out_tree(key))] = (
                        key, t0, sig, path)
                else:
                    build(key, t0, sig, path)
                collect(block=False)
            while pending:
                collect(block=True)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return dict(self.seconds)

    def _out_tree(self, key: tuple[str, Any]) -> Any:
        """The tree structure of program `key`'s outputs: as `add` was told, else traced."""
        fn, args, static, _ = self._plan[key]
        out = self._out.get(key)
        return jax.tree.structure(
            jax.eval_shape(functools.partial(fn, **static), *args) if out is None else out)

    def _lower(self, key, fn, args, static, donate, saved: bool = False) -> tuple[Any, bool]:
        """(the program lowered, whether it takes the flat leaves of its arguments).

        `saved` (its executable will be saved whole, `compile_cache.save_executable`, which
        takes a function of flat arguments): traced from `fn` as a function of the flat
        leaves, and nothing else is written (a warm start loads the executable). Otherwise
        `fn` lowered as it is (the compilation cache off, or an engine on a mesh)."""
        if not saved:
            return fn.lower(*args, **static), False
        leaves, first = [], []
        for a in args:
            first.append(len(leaves))
            leaves += jax.tree.leaves(a)
        bounds = first + [len(leaves)]
        donated = tuple(i for p in donate for i in range(bounds[p], bounds[p + 1]))
        in_tree = jax.tree.structure(tuple(args))

        def direct(*flat):
            return fn(*jax.tree.unflatten(in_tree, flat), **static)

        direct.__name__ = direct.__qualname__ = f"serve_{key[0]}"
        return jax.jit(direct, donate_argnums=donated).lower(*leaves), True

    def call(self, name: str, bucket: Any, *args: Any) -> Any:
        if not self.aot:
            fn, _, static, _ = self._plan[(name, bucket)]
            return fn(*args, **static)
        built = self._compiled.get((name, bucket))
        if built is None:
            raise ProgramMissing(f"no compiled {name!r} program for {bucket!r} (compiled: "
                                 f"{sorted(map(str, self._compiled))})")
        compiled, flat = built
        return compiled(*jax.tree.leaves(args)) if flat else compiled(*args)


def _build(lowered, flat: bool, path: Any = None) -> tuple[Any, bool]:
    """Compile (in a worker thread); a program of flat arguments is saved at `path`
    (`compile_cache.save_executable`) for the next process."""
    from gsm_jax.compile_cache import save_executable

    if path is None:
        return lowered.compile(), flat
    with _no_persistent_cache_entry():  # saved whole below: a cache entry is never read
        compiled = lowered.compile()
    save_executable(path, compiled)
    return compiled, flat


def _no_persistent_cache_entry() -> Any:
    """A context (this thread only) in which JAX's persistent compilation cache writes no
    entry: its minimum compile time set out of reach. A no-op where JAX lacks the setting."""
    try:
        from jax._src import config as jax_config

        return jax_config.persistent_cache_min_compile_time_secs(float("inf"))
    except (ImportError, AttributeError, TypeError):
        import contextlib

        return contextlib.nullcontext()


def _load(path: Any, n_args: int, out_tree: Any) -> tuple[Any, bool] | None:
    """A saved executable (`compile_cache.load_executable`), loaded in a worker thread; None
    when it cannot be read."""
    from gsm_jax.compile_cache import load_executable

    compiled = load_executable(path, n_args, out_tree)
    return None if compiled is None else (compiled, True)


# Executables by signature, shared by the engines of a process (tests and benchmarks build
# many alike): the oldest go first past `_KEEP`.
_EXECUTABLES: dict[Any, Any] = {}
_KEEP = 256


def _signature(fn: Callable, args: Sequence[Any], static: dict[str, Any]) -> Any:
    """What a compiled program depends on: the function, its static arguments, and each
    argument's tree structure, shape, dtype, sharding and weak type."""
    leaves, tree = jax.tree.flatten(args)

    def one(a):
        sharding = getattr(a, "sharding", None)
        return (tuple(np.shape(a)), str(np.asarray(a).dtype) if np.isscalar(a)
                else str(a.dtype), sharding, bool(getattr(a, "weak_type", False)))

    return (fn, tuple(sorted(static.items(), key=lambda kv: kv[0])), tree,
            tuple(map(one, leaves)))


def abstract(tree: Any) -> Any:
    """ShapeDtypeStructs of a tree's arrays, with the shardings of arrays committed to
    theirs (an uncommitted array, e.g. a fresh cache, goes where the program puts it);
    numpy arrays stay numpy (their shapes and dtypes are what a call passes)."""
    def one(a):
        if isinstance(a, jax.Array):
            committed = getattr(a, "_committed", True)
            return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                        sharding=a.sharding if committed else None)
        return a

    return jax.tree.map(one, tree)


def row_buckets(max_batch: int, factor: int = 2) -> list[int | None]:
    """The row bounds of the decode program: 1, factor, factor^2, ... below max_batch,
    then None (every slot)."""
    out, n = [], 1
    while n < max_batch:
        out.append(n)
        n *= factor
    return out + [None]


def width_buckets(smallest: int, largest: int) -> list[int]:
    """The chunk widths of the extend program: powers of two from `smallest` to `largest`
    (itself included when it is not one)."""
    out, n = [], int(smallest)
    while n < largest:
        out.append(n)
        n *= 2
    return out + [int(largest)]
