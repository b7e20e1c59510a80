"""Batch generation: one jit-compiled prefill + `while_loop` decode, and teacher forcing.

Shapes are bucketed so the number of compilations stays bounded:

- batch size  -> next power of two (dummy rows are inactive from the start);
- prompt length -> next power of two, at least 16;
- new tokens  -> next power of two, at least 16 (the loop stops at each row's own
  `max_new_tokens`, EOS, or when every row is done);
- the KV cache holds prompt bucket + new-token bucket slots.

So one (model, dtype, sampling mode, GSM on/off) combination compiles at most
once per (batch bucket, prompt bucket, new-token bucket); GSM strengths,
windows, layer masks, temperatures, top-k/top-p values and seeds are runtime
arrays and never recompile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.compile_cache import cached_call
from gsm_jax.errors import InvalidInputError
from gsm_jax.families import family_module
from gsm_jax.models.gsm_sites import GSMInputs
from gsm_jax.params import ModelParams
from gsm_jax.sharding import mesh_of

MIN_PROMPT_BUCKET = 16
MIN_NEW_TOKEN_BUCKET = 16
# Prompts longer than this many tokens (after bucketing) are prefilled in chunks of it
# through the family's `extend` (as vLLM's and SGLang's chunked prefill): the attention
# scores of one call are [B, heads, chunk, context] instead of [B, heads, prompt, context],
# so prefill memory grows linearly in the prompt (benchmarks/bench_long_context.py
# measures it). Shorter prompts are one `prefill` call, as before.
PREFILL_CHUNK = 1024


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(n, minimum)
    return 1 << (n - 1).bit_length()


# ----------------------------------------------------------------------------- sampling


def sample_tokens(logits: jax.Array, key: jax.Array, temperature: jax.Array,
                  top_k: jax.Array, top_p: jax.Array, *, filtered: bool) -> jax.Array:
    """Greedy where temperature == 0, else sampling with optional top-k / top-p.

    logits [B, V] f32; temperature, top_k (0 = off), top_p (1 = off): [B].
    `filtered` is static: the full-vocabulary sort is only compiled in when asked for.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sample() -> jax.Array:
        scaled = logits / jnp.maximum(temperature, 1e-6)[:, None]
        if filtered:
            order = jnp.argsort(-scaled, axis=-1)
            sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
            ranks = jnp.arange(scaled.shape[-1])[None, :]
            keep = jnp.where(top_k[:, None] > 0, ranks < top_k[:, None], True)
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            keep &= mass_before < top_p[:, None]
            sorted_logits = jnp.where(keep, sorted_logits, -jnp.inf)
            choice = jax.random.categorical(key, sorted_logits, axis=-1)
            sampled = jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]
        else:
            sampled = jax.random.categorical(key, scaled, axis=-1)
        return jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)

    # An all-greedy batch skips the sampler: its Gumbel noise over the whole vocabulary is
    # not free (docs/performance_notes.md, "Greedy batches skip the sampler").
    # Under vmap the cond becomes a select and both run, as before.
    return jax.lax.cond(jnp.any(temperature > 0), sample, lambda: greedy)


def _batch_bucket(n: int, mesh: Any) -> int:
    """The batch bucket, a multiple of the mesh's data axis (padding rows are dummies)."""
    b = bucket(n)
    if mesh is None:
        return b
    data = mesh.shape["data"]
    return -(-b // data) * data


def _batch_inputs(mesh: Any, *arrays: np.ndarray) -> list[jax.Array]:
    """Per-row inputs on the device(s): split over the mesh's data axis when there is one
    (every process passes the same rows; each places its own devices' slices)."""
    if mesh is None:
        return [jnp.asarray(a) for a in arrays]
    from gsm_jax.sharding import batch_sharding, place

    return [place(a, batch_sharding(mesh, np.ndim(a))) for a in arrays]


def on_mesh(mesh: Any) -> Any:
    """The params' mesh as the context mesh while tracing (`jax.set_mesh`): model code
    that partitions by hand (DeepSeek-V4's expert-parallel dispatch) reads it."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _to_host(x: jax.Array) -> np.ndarray:
    """A result as numpy; gathered from every process when the mesh spans several."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ----------------------------------------------------------------------------- jitted core


def chunked_prefill(family: Any, weights, config, tokens, lengths, cache, gsm, chunk: int | None):
    """The family's `prefill` of right-padded prompts [B, T], or, when T > chunk, the same
    prefill as a `lax.scan` of `extend` over chunks of
    `chunk` tokens (one compiled chunk body; a row whose prompt ended gets n_new = 0 and
    keeps the logits of its last token). Returns (last-token logits [B, V], cache)."""
    t = tokens.shape[1]
    extend = family.extend
    if chunk is None or t <= chunk:
        return family.prefill(weights, config, tokens, lengths, cache, gsm)
    n = -(-t // chunk)
    chunks = jnp.pad(tokens, ((0, 0), (0, n * chunk - t)))
    chunks = jnp.swapaxes(chunks.reshape(tokens.shape[0], n, chunk), 0, 1)  # [n, B, C]

    def one(i, toks, cache):
        return extend(weights, config, toks, jnp.clip(lengths - i * chunk, 0, chunk), cache, gsm)

    shape = jax.eval_shape(one, 0, chunks[0], cache)[0]

    def body(carry, xs):
        logits, cache = carry
        i, toks = xs
        new, cache = one(i, toks, cache)
        return (jnp.where((lengths > i * chunk)[:, None], new, logits), cache), None

    (logits, cache), _ = jax.lax.scan(
        body, (jnp.zeros(shape.shape, shape.dtype), cache), (jnp.arange(n), chunks))
    return logits, cache


@functools.partial(
    jax.jit,
    static_argnames=("config", "max_steps", "cache_len", "filtered", "return_logits",
                     "prefill_chunk"),
)
def _generate_loop(weights, tokens, lengths, max_new, key, temperature, top_k, top_p, eos_ids,
                   gsm: GSMInputs | None, *, config, max_steps: int, cache_len: int,
                   filtered: bool, return_logits: bool, prefill_chunk: int | None = None):
    """Prefill (`chunked_prefill`), then decode until every row hit EOS or its own max_new
    (<= max_steps)."""
    family = family_module(config.family)
    batch = tokens.shape[0]
    cache = family.init_cache(
        config, batch, cache_len, dtype=jax.tree.leaves(weights)[0].dtype,
        gsm_max_window=None if gsm is None else gsm.max_window,
    )
    logits, cache = chunked_prefill(family, weights, config, tokens, lengths, cache, gsm,
                                    prefill_chunk)

    def pick(logits, step):
        return sample_tokens(logits, jax.random.fold_in(key, step), temperature, top_k, top_p,
                             filtered=filtered)

    def finished(tok, step, done):
        return done | jnp.isin(tok, eos_ids) | (step + 1 >= max_new)

    out = jnp.zeros((batch, max_steps), jnp.int32)
    logits_out = jnp.zeros((batch, max_steps, logits.shape[-1]) if return_logits else (0,),
                           jnp.float32)
    done = max_new <= 0
    tok = pick(logits, 0)
    out = out.at[:, 0].set(tok)
    if return_logits:
        logits_out = logits_out.at[:, 0].set(logits)
    n_out = jnp.where(done, 0, 1)
    done = finished(tok, 0, done)

    def cond(state):
        step, _, _, done, *_ = state
        return (step < max_steps) & ~jnp.all(done)

    def body(state):
        step, out, n_out, done, cache, logits_out = state
        prev = out[:, step - 1]
        logits, cache = family.decode_step(weights, config, prev, cache, gsm, ~done)
        tok = pick(logits, step)
        out = out.at[:, step].set(jnp.where(done, 0, tok))
        if return_logits:
            logits_out = logits_out.at[:, step].set(jnp.where(done[:, None], 0.0, logits))
        n_out = n_out + (~done).astype(jnp.int32)
        return step + 1, out, n_out, finished(tok, step, done), cache, logits_out

    state = (jnp.int32(1), out, n_out, done, cache, logits_out)
    _, out, n_out, _, _, logits_out = jax.lax.while_loop(cond, body, state)
    return out, n_out, logits_out


@functools.partial(jax.jit, static_argnames=("config",))
def _forward_jit(weights, tokens, lengths, gsm, *, config):
    return family_module(config.family).forward(weights, config, tokens, lengths, gsm)


# ----------------------------------------------------------------------------- validation


def check_params(params: Any) -> ModelParams:
    if not isinstance(params, ModelParams):
        raise InvalidInputError(
            f"params must be what gsm_jax.load returns (ModelParams), got {type(params).__name__}"
        )
    return params


# Config fields naming token ids a prompt may not hold: every family here runs text only,
# so a config's image placeholder is refused in a prompt (a field the config lacks, or set
# below 0, refuses nothing).
REFUSED_PROMPT_TOKEN_FIELDS = ("image_token_id",)


def refused_token_ids(config: Any) -> dict[int, str]:
    """{token id: the config field naming it} of the ids a prompt may not contain.

    The fields are `REFUSED_PROMPT_TOKEN_FIELDS`; a field the config lacks, or set below 0,
    refuses nothing. DeepSeek-V4.1 runs text only: its `image_token_id` (129264 in the
    release) would be routed with the text router bias and never see an image."""
    out = {}
    for field in REFUSED_PROMPT_TOKEN_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= 0:
            out[int(value)] = field
    return out


def check_refused_tokens(rows: Sequence[np.ndarray], config: Any) -> None:
    """InvalidInputError naming the prompt, position, id and config field when a prompt
    holds a token id the model refuses (`refused_token_ids`)."""
    refused = refused_token_ids(config)
    if not refused:
        return
    ids = np.fromiter(refused, np.int64)
    for i, r in enumerate(rows):
        hit = np.flatnonzero(np.isin(r, ids))
        if hit.size:
            tok = int(r[hit[0]])
            raise InvalidInputError(
                f"prompt {i} holds token id {tok} at position {int(hit[0])}: the config's "
                f"{refused[tok]}; this {config.family} model runs text only (image inputs "
                "are not supported)")


def as_token_rows(token_ids: Any, vocab_size: int) -> list[np.ndarray]:
    if isinstance(token_ids, np.ndarray | jax.Array):
        arr = np.asarray(token_ids)
        if arr.ndim == 1:
            arr = arr[None]
        if arr.ndim != 2:
            raise InvalidInputError(f"token_ids must be [batch, length], got shape {arr.shape}")
        rows = list(arr)
    else:
        if isinstance(token_ids, str) or not isinstance(token_ids, Sequence):
            raise InvalidInputError("token_ids must be a list of token-id lists or a 2-D array")
        rows = [np.asarray(r) for r in token_ids]
    if not rows:
        raise InvalidInputError("no prompts given: the batch is empty")
    for i, r in enumerate(rows):
        if r.ndim != 1:
            raise InvalidInputError(f"prompt {i} must be a flat list of token ids")
        if r.size == 0:
            raise InvalidInputError(f"prompt {i} is empty (0 tokens)")
        if not np.issubdtype(r.dtype, np.integer):
            raise InvalidInputError(f"prompt {i} holds non-integer token ids ({r.dtype})")
        if r.min() < 0 or r.max() >= vocab_size:
            raise InvalidInputError(
                f"prompt {i} has token ids outside the vocabulary [0, {vocab_size})"
            )
    return [r.astype(np.int32) for r in rows]


def _pad_rows(rows: list[np.ndarray], batch: int, length: int, pad_id: int = 0):
    tokens = np.full((batch, length), pad_id, np.int32)
    lengths = np.zeros((batch,), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : r.size] = r
        lengths[i] = r.size
    return tokens, lengths


def _per_row(value: Any, n: int, name: str, dtype) -> np.ndarray:
    arr = np.asarray(value, dtype=dtype)
    if arr.ndim == 0:
        arr = np.full((n,), arr, dtype)
    if arr.shape != (n,):
        raise InvalidInputError(f"{name} must be a scalar or one value per prompt ({n})")
    return arr


# ----------------------------------------------------------------------------- public API


def with_kv_cache_dtype(params: ModelParams, kind: str | None) -> ModelParams:
    """The same model with its KV cache in format `kind`.

    - "int8" or "fp8" (e4m3): each token's head vector with one float32 scale per 32
      values (`models.common.kv_quantize`: the rounding rule); Llama-family and Gemma 3
      models. Every attention then reads keys and values so rounded, the teacher-forced
      `forward` too, so its logits are what the cached paths compute.
    - "released": DeepSeek-V4.1's caches held packed as released (FP8 window KV, FP4
      compressed KV and index keys: 890 B per cached token; its default, `cache_qdq`).
    - "float": the activation dtype (V4.1: no rounding).
    - None or "auto": the params unchanged.
    A pairing a family does not take is refused by name
    (`common.config_with_kv_cache_dtype`)."""
    from gsm_jax.models.common import config_with_kv_cache_dtype

    cfg = config_with_kv_cache_dtype(params.config, kind)
    return params if cfg is params.config else dataclasses.replace(params, config=cfg)


def generate_tokens(
    params: ModelParams,
    token_ids: Any,
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_ids: Sequence[int] | None = None,
    gsm: Any = None,
    request_ids: Sequence[Any] | None = None,
    return_logits: bool = False,
    kv_cache_dtype: str | None = None,
    prefill_chunk: int | None = PREFILL_CHUNK,
) -> list[np.ndarray] | tuple[list[np.ndarray], list[np.ndarray]]:
    """Generate continuations of token-id prompts; returns one int32 array per prompt.

    Each row stops at its first EOS (included in the output), or after
    `max_new_tokens`. With `return_logits=True` also returns, per row, the f32
    logits [n, V] each new token was chosen from. `kv_cache_dtype` ("int8" / "fp8";
    None or "auto": the model's own): the KV cache's format (`with_kv_cache_dtype`).
    `prefill_chunk`: prompts longer than this many tokens are prefilled in chunks of it
    (`PREFILL_CHUNK`; memory linear in the prompt); None: one prefill call whatever the
    length.
    """
    params = with_kv_cache_dtype(check_params(params), kv_cache_dtype)
    cfg = params.config
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int | np.integer)
                                      or prefill_chunk < MIN_PROMPT_BUCKET):
        raise InvalidInputError(f"prefill_chunk must be an integer >= {MIN_PROMPT_BUCKET} "
                                f"or None, got {prefill_chunk!r}")
    rows = as_token_rows(token_ids, cfg.vocab_size)
    check_refused_tokens(rows, cfg)
    if not isinstance(max_new_tokens, int | np.integer) or max_new_tokens < 1:
        raise InvalidInputError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if temperature is None or temperature < 0:
        raise InvalidInputError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (int(top_k) != top_k or top_k < 1):
        raise InvalidInputError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise InvalidInputError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    context = cfg.max_position_embeddings
    for i, r in enumerate(rows):
        if r.size + max_new_tokens > context:
            raise InvalidInputError(
                f"prompt {i} has {r.size} tokens; with max_new_tokens={max_new_tokens} it "
                f"exceeds the model's context of {context} tokens"
            )
    n = len(rows)
    mesh = mesh_of(params.weights)
    batch = _batch_bucket(n, mesh)
    prompt_len = bucket(max(r.size for r in rows), MIN_PROMPT_BUCKET)
    max_steps = bucket(max_new_tokens, MIN_NEW_TOKEN_BUCKET)
    tokens, lengths = _pad_rows(rows, batch, prompt_len)
    max_new = np.zeros((batch,), np.int32)
    max_new[:n] = max_new_tokens
    if eos_ids is None:
        eos_ids = params.tokenizer.eos_ids if params.tokenizer is not None else cfg.eos_token_ids
    eos = np.asarray(list(eos_ids) or [-1], np.int32)
    gsm_inputs = None
    if gsm is not None:
        from gsm_jax.gsm_runtime import gsm_inputs_for_batch

        totals = [int(r.size) + max_new_tokens for r in rows]
        gsm_inputs = gsm_inputs_for_batch(gsm, cfg.num_layers, batch, totals, request_ids,
                                          fit_ring=True)
    rows_in = _batch_inputs(mesh, tokens, lengths, max_new,
                            np.full((batch,), temperature, np.float32),
                            np.full((batch,), top_k or 0, np.int32),
                            np.full((batch,), 1.0 if top_p is None else top_p, np.float32))
    with on_mesh(mesh):
        # a second process with these shapes loads the traced program (`cached_call`)
        out, n_out, logits = cached_call(
            "generate_loop", _generate_loop,
            (params.weights, *rows_in[:3], jax.random.key(seed), *rows_in[3:],
             jnp.asarray(eos), gsm_inputs),
            dict(config=cfg, max_steps=max_steps, cache_len=prompt_len + max_steps,
                 filtered=(top_k is not None or top_p is not None) and temperature > 0,
                 return_logits=return_logits,
                 prefill_chunk=None if prefill_chunk is None else int(prefill_chunk)))
    out, n_out = _to_host(out), _to_host(n_out)
    results = [out[i, : n_out[i]] for i in range(n)]
    if return_logits:
        logits = _to_host(logits)
        return results, [logits[i, : n_out[i]] for i in range(n)]
    return results


def generate(
    params: ModelParams,
    prompts: str | Sequence[str],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop: str | Sequence[str] | None = None,
    chat: bool | Mapping[str, Any] = False,
    gsm: Any = None,
    request_ids: Sequence[Any] | None = None,
    return_token_counts: bool = False,
    kv_cache_dtype: str | None = None,
    prefill_chunk: int | None = PREFILL_CHUNK,
) -> list[str] | tuple[list[str], list[int]]:
    """Generate text continuations (the continuation only, without the prompt).

    A row ends at EOS, at `max_new_tokens`, or at the first `stop` string, which
    is cut from the returned text. `chat=True` wraps each prompt as one user
    message through the model's chat template; a dict instead of True holds the
    template's options (DeepSeek-V4/V4.1: `thinking`, `reasoning_effort`).
    `return_token_counts=True` also
    returns how many tokens each row generated (EOS included). `kv_cache_dtype`: "int8" /
    "fp8" store the KV cache in that format (`with_kv_cache_dtype`). `prefill_chunk`:
    as `generate_tokens`.
    """
    params = with_kv_cache_dtype(check_params(params), kv_cache_dtype)
    tok = params.tokenizer
    if tok is None:
        raise InvalidInputError(
            "this model was loaded without a tokenizer; use generate_tokens with token ids"
        )
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise InvalidInputError("no prompts given: the prompt list is empty")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise InvalidInputError("stop strings must be non-empty")
    rows = []
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise InvalidInputError(f"prompt {i} is not a string ({type(p).__name__})")
        if not p:
            raise InvalidInputError(f"prompt {i} is empty")
        if chat is not False:
            rows.append(tok.encode_chat(p, **(dict(chat) if isinstance(chat, Mapping) else {})))
        else:
            rows.append(tok.encode(p))
    outs = generate_tokens(
        params, rows, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
        top_p=top_p, seed=seed, gsm=gsm, request_ids=request_ids, prefill_chunk=prefill_chunk,
    )
    if return_token_counts:
        return _decode_outputs(tok, outs, stops), [len(o) for o in outs]
    return _decode_outputs(tok, outs, stops)


def _decode_outputs(tok: Any, outs: list[np.ndarray], stops: list[str]) -> list[str]:
    eos = set(tok.eos_ids)
    texts = []
    for ids in outs:
        ids = [int(t) for t in ids if int(t) not in eos]
        text = tok.decode(ids)
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        texts.append(text[:cut] if cut >= 0 else text)
    return texts


def forward(params: ModelParams, token_ids: Any, *, lengths: Any = None,
            gsm: Any = None, request_ids: Sequence[Any] | None = None) -> jax.Array:
    """Teacher-forced logits [B, T, V] (f32) over right-padded rows.

    `token_ids`: a [B, T] array (with `lengths` [B] giving each row's real
    length; default all T) or a list of ragged token lists. Positions past a
    row's length hold padding logits and should be ignored.
    """
    params = check_params(params)
    cfg = params.config
    rows = as_token_rows(token_ids, cfg.vocab_size)
    check_refused_tokens(rows, cfg)
    t = max(r.size for r in rows)
    if lengths is not None:
        lens = _per_row(lengths, len(rows), "lengths", np.int32)
        if (lens < 1).any() or (lens > t).any():
            raise InvalidInputError(f"lengths must be in [1, {t}], got {lens.tolist()}")
        rows = [r[:n] for r, n in zip(rows, lens, strict=True)]
    if t > cfg.max_position_embeddings:
        raise InvalidInputError(
            f"sequence of {t} tokens exceeds the model's context of "
            f"{cfg.max_position_embeddings} tokens"
        )
    n = len(rows)
    mesh = mesh_of(params.weights)
    padded_t = min(bucket(t, MIN_PROMPT_BUCKET), max(t, cfg.max_position_embeddings))
    tokens, lens = _pad_rows(rows, _batch_bucket(n, mesh), padded_t)
    gsm_inputs = None
    if gsm is not None:
        from gsm_jax.gsm_runtime import gsm_inputs_for_batch

        gsm_inputs = gsm_inputs_for_batch(gsm, cfg.num_layers, tokens.shape[0],
                                          [int(r.size) for r in rows], request_ids,
                                          fit_ring=True)
    with on_mesh(mesh):
        logits = _forward_jit(params.weights, *_batch_inputs(mesh, tokens, lens), gsm_inputs,
                              config=cfg)
    if not logits.is_fully_addressable:  # several processes: every one gets the values
        return _to_host(logits)[:n, :t]
    return logits[:n, :t]
