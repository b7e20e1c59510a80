"""Exact greedy speculative decoding with a self-draft (early exit).

The draft is the model's own first `draft_layers` layers followed by its final norm
and LM head; the verifier is the full model. Each round the draft proposes
`draft_len` tokens one by one, the verifier scores the current token and the
proposals in one call, and the longest prefix on which both argmaxes agree is kept,
plus the verifier's own next token. The result is token for token plain greedy
decoding of the verifier (`gsm_jax.generate_tokens(params, ...)` with the same
`gsm`), whatever the draft proposes: the draft only decides how many tokens a round
yields. It exists to test the source document's claim that GSM interferes with
speculative decoding (`gsm_jax/workflow/evidence/speculative_claim.py`).

    res = speculative_generate(params, ids, max_new_tokens=48, draft_layers=10,
                               gsm_verifier=GSMConfig(target_layers="all"))
    res.tokens, res.acceptance_rate

Cache invariant between rounds, for both models: the cache holds every token of
the sequence except the last one (`cur`), with exactly the state plain decoding
would leave (KV entries and GSM rings).

Batch 1: one prompt per call (a batch of rows would accept different counts and
fall out of step).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import InvalidInputError
from gsm_jax.families import family_module, hook
from gsm_jax.generation import (
    MIN_PROMPT_BUCKET,
    as_token_rows,
    bucket,
    check_params,
    check_refused_tokens,
    on_mesh,
)
from gsm_jax.models.common import KVCache
from gsm_jax.models.gsm_sites import GSMInputs
from gsm_jax.params import ModelParams

# In the dense families' cache (`models.common.KVCache`) KV slot s holds position s and
# nothing else: there a rejected suffix is forgotten by moving `lengths` back (stale slots
# are masked out and later overwritten). Other caches (DeepSeek-V4's compressed KV and
# indexer entries fold blocks of tokens into state) are rolled back by re-running from
# the saved cache.


@dataclasses.dataclass(frozen=True)
class SpecResult:
    """One prompt's speculative generation."""

    tokens: np.ndarray  # int32 [n]: the new tokens (EOS included), = plain greedy decoding
    rounds: int  # verifier calls
    drafted: int  # draft tokens proposed (draft_len per round)
    accepted: int  # of those, how many the verifier agreed with
    wall_s: float  # the whole call, compilation included on a first call
    accepted_per_round: tuple[int, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return len(self.tokens) / self.rounds if self.rounds else 0.0


# ----------------------------------------------------------------------------- the draft model


def draft_config(cfg: Any, k: int) -> Any:
    """The model config cut to its first k layers: the family's `first_layers_config`
    hook where it has one (DeepSeek-V4.1: layer-id lists, not per-layer tuples), else
    per-layer tuple fields (DeepSeek-V4's `layer_types`, `mlp_layer_types`) cut with it."""
    own = hook(cfg.family, "first_layers_config")
    if own is not None:
        return own(cfg, k)
    cut = {
        f.name: getattr(cfg, f.name)[:k]
        for f in dataclasses.fields(cfg)
        if "layer" in f.name and isinstance(getattr(cfg, f.name), tuple)
        and len(getattr(cfg, f.name)) == cfg.num_layers
    }
    return dataclasses.replace(cfg, num_layers=k, **cut)


def draft_weights(weights: dict, k: int) -> dict:
    """The weights of the first k layers; embeddings, final norm and LM head shared."""
    layers = weights["layers"]
    if isinstance(layers, tuple | list):  # per-layer layout
        return {**weights, "layers": tuple(layers[:k])}
    return {**weights, "layers": jax.tree.map(lambda a: a[:k], layers)}  # stacked [L, ...]


def _gsm_inputs(gsm: Any, num_layers: int, k: int, total: int) -> GSMInputs | None:
    """GSMInputs as generate_tokens builds them, for a model of the first k layers.

    The layer mask is resolved for the full model and then cut: the draft's layer i is
    the verifier's layer i, so a list of layers or a kurtosis profile means the same
    layers in both (resolving for k layers would refuse indices >= k).
    """
    if gsm is None:
        return None
    from gsm_jax.gsm_runtime import gsm_inputs_for_batch

    inputs = gsm_inputs_for_batch(gsm, num_layers, 1, [total], None, fit_ring=True)
    return inputs.replace(strength=inputs.strength[:k])


# ----------------------------------------------------------------------------- appending tokens


def verify_mode(family: str) -> str:
    """How the verifier scores a round: "chunked", one `extend(..., all_logits=True)` call
    (the family contract's `extend`, models/contract.py: every family has it)."""
    family_module(family)  # an unknown family is refused by name
    return "chunked"


def _append(fam: Any, weights: dict, config: Any, tokens: jax.Array, n_new: jax.Array,
            cache: Any, gsm: GSMInputs | None, *, want_logits: bool):
    """Append tokens [1, C] (the first n_new [1] real) to the cache: one chunked forward,
    the family's `extend(..., all_logits=True)`. Returns (logits [1, C, V] of every
    position, or None; the cache)."""
    logits, cache = fam.extend(weights, config, tokens, n_new, cache, gsm,
                               all_logits=want_logits)
    return (logits if want_logits else None), cache


def _can_rewind(cache: Any) -> bool:
    """Whether moving `lengths` back forgets a rejected suffix (see `_rollback`)."""
    return isinstance(cache, KVCache) and cache.rings is None


def _rollback(fam: Any, weights: dict, config: Any, saved: Any, grown: Any,
              tokens: jax.Array, keep: jax.Array, gsm: GSMInputs | None) -> Any:
    """The cache holding `saved`'s tokens plus the first `keep` [1] of tokens [1, C],
    given `grown`, which holds `saved` plus at least those `keep` tokens.

    Moving `grown.lengths` back is enough for the KV entries (slot s = position s,
    masked past the length, rewritten later) but not for the GSM rings: a ring keeps
    the input of position q in slot q % W, so a rejected position q overwrote the
    input of position q - W. The ring is sized to the window (`ring_rows`: W is the
    window rounded up to a power of two), so q - W is still inside the window of the
    positions decoded next whenever the rejected suffix is longer than W - window + 1
    (with window 8, W = 8: two rejected draft tokens already corrupt it). That input
    is gone from `grown`, so with rings (or a family with other state) the kept tokens
    are re-run from `saved`: JAX arrays are immutable, `saved` is exactly the state
    before the round, and the re-run leaves the state of plain decoding.
    """
    if _can_rewind(grown):
        return dataclasses.replace(grown, lengths=saved.lengths + keep.astype(jnp.int32))

    def one():  # only the current token kept: one decode step, not a chunk of C positions
        return fam.decode_step(weights, config, tokens[:, 0], saved, gsm)[1]

    def chunk():
        return _append(fam, weights, config, tokens, keep, saved, gsm, want_logits=False)[1]

    return jax.lax.cond(keep[0] == 1, one, chunk)


# ----------------------------------------------------------------------------- jitted steps


@functools.partial(jax.jit, static_argnames=("config", "cache_len"))
def _prefill(weights, tokens, lengths, gsm, *, config, cache_len: int):
    """A fresh cache holding the prompt; the greedy first token [1]."""
    fam = family_module(config.family)
    cache = fam.init_cache(config, tokens.shape[0], cache_len,
                           dtype=jax.tree.leaves(weights)[0].dtype,
                           gsm_max_window=None if gsm is None else gsm.max_window)
    logits, cache = fam.prefill(weights, config, tokens, lengths, cache, gsm)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("config", "draft_len"))
def _draft(weights, cur, cache, gsm, *, config, draft_len: int):
    """The draft's greedy proposals [1, K] after `cur` [1]; the cache grown by cur and
    the first K-1 proposals."""
    fam = family_module(config.family)

    def body(carry, _):
        tok, cache = carry
        logits, cache = fam.decode_step(weights, config, tok, cache, gsm)
        nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return (nxt, cache), nxt

    (_, cache), drafts = jax.lax.scan(body, (cur, cache), None, length=draft_len)
    return drafts.T, cache


def _agreement(logits: jax.Array, drafts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The verifier's greedy tokens v [1, K+1] from its logits [1, K+1, V] over [cur,
    proposals], and the number m [1] of leading proposals [1, K] equal to them."""
    v = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    agree = jnp.cumprod((drafts == v[:, :-1]).astype(jnp.int32), axis=1)
    return v, agree.sum(axis=1)


@functools.partial(jax.jit, static_argnames=("config",))
def _verify(weights, cur, drafts, cache, gsm, *, config):
    """The verifier's greedy token after cur and after each proposal, v [1, K+1]; the
    number m [1] of leading proposals it agrees with; the cache grown by all K+1."""
    fam = family_module(config.family)
    tokens = jnp.concatenate([cur[:, None], drafts], axis=1)
    n = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    logits, cache = _append(fam, weights, config, tokens, n, cache, gsm, want_logits=True)
    v, m = _agreement(logits, drafts)
    return v, m, cache


@functools.partial(jax.jit, static_argnames=("config",))
def _commit_verifier(weights, saved, grown, cur, drafts, m, gsm, *, config):
    """The verifier's cache after accepting m proposals: saved + cur + the m accepted
    (the correction token v[m] becomes the next `cur`)."""
    fam = family_module(config.family)
    tokens = jnp.concatenate([cur[:, None], drafts], axis=1)
    return jax.lax.cond(
        m[0] == drafts.shape[1],
        lambda: grown,  # everything accepted: the grown cache is the plain-decoding state
        lambda: _rollback(fam, weights, config, saved, grown, tokens, m + 1, gsm))


@functools.partial(jax.jit, static_argnames=("config",))
def _commit_draft(weights, saved, grown, cur, drafts, m, gsm, *, config):
    """The draft's cache after accepting m proposals: saved + cur + the m accepted."""
    fam = family_module(config.family)
    tokens = jnp.concatenate([cur[:, None], drafts], axis=1)

    def all_accepted():  # grown lacks only the last proposal, and everything before is kept
        _, cache = fam.decode_step(weights, config, drafts[:, -1], grown, gsm)
        return cache

    return jax.lax.cond(
        m[0] == drafts.shape[1], all_accepted,
        lambda: _rollback(fam, weights, config, saved, grown, tokens, m + 1, gsm))


# ----------------------------------------------------------------------------- public API


def _check_int(name: str, value: Any, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise InvalidInputError(f"{name} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        where = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InvalidInputError(f"{name} must be {where}, got {value}")
    return int(value)


def _prompt_rows(prompt_ids: Any, vocab_size: int) -> list[np.ndarray]:
    """A flat prompt -> [it]; a 2-D array or list of lists is taken as rows."""
    if isinstance(prompt_ids, np.ndarray | jax.Array):
        return as_token_rows(prompt_ids, vocab_size)  # 1-D: one row
    if isinstance(prompt_ids, str) or not isinstance(prompt_ids, Sequence):
        raise InvalidInputError("prompt_ids must be a list or 1-D array of token ids")
    if len(prompt_ids) == 0:
        raise InvalidInputError("the prompt is empty (0 tokens)")
    if isinstance(prompt_ids[0], Sequence | np.ndarray):
        return as_token_rows(prompt_ids, vocab_size)
    return as_token_rows([prompt_ids], vocab_size)


def _one_prompt(params: ModelParams, prompt_ids: Any, max_new: int, n_draft: int,
                eos_ids: Sequence[int] | None, who: str):
    """The one prompt of a speculative call, checked, and what both loops derive from it:
    (prompt, EOS ids, total tokens, cache slots, the padded prompt [1, P], lengths [1])."""
    cfg = params.config
    rows = _prompt_rows(prompt_ids, cfg.vocab_size)
    check_refused_tokens(rows, cfg)  # e.g. V4.1's image token: text only
    if len(rows) != 1:
        raise InvalidInputError(
            f"{who} takes one prompt at a time, got {len(rows)}; loop over them")
    prompt = rows[0]
    if prompt.size + max_new > cfg.max_position_embeddings:
        raise InvalidInputError(
            f"the prompt has {prompt.size} tokens; with max_new_tokens={max_new} it exceeds "
            f"the model's context of {cfg.max_position_embeddings} tokens")
    if eos_ids is None:
        eos_ids = params.tokenizer.eos_ids if params.tokenizer is not None else cfg.eos_token_ids
    eos = {int(e) for e in eos_ids}
    total = int(prompt.size) + max_new  # as generate_tokens sizes rings and short-request bypass
    # A round scores positions up to n_draft past the cache length, which stays below
    # total - 1: the cache needs total + n_draft slots (what lies past total is discarded).
    cache_len = bucket(total + n_draft + 1, MIN_PROMPT_BUCKET)
    tokens = np.zeros((1, bucket(int(prompt.size), MIN_PROMPT_BUCKET)), np.int32)
    tokens[0, : prompt.size] = prompt  # generate_tokens' padding
    return prompt, eos, total, cache_len, tokens, np.asarray([prompt.size], np.int32)


def _take(out: list[int], new: list[int], eos: set[int], max_new: int) -> bool:
    """Append a round's tokens to `out` up to EOS (included) or max_new; True when done."""
    for t in new:
        out.append(t)
        if t in eos or len(out) == max_new:
            break
    return len(out) >= max_new or out[-1] in eos


def speculative_generate(
    params: ModelParams,
    prompt_ids: Any,
    *,
    max_new_tokens: int,
    draft_layers: int,
    draft_len: int = 4,
    gsm_verifier: Any = None,
    gsm_draft: Any = None,
    eos_ids: Sequence[int] | None = None,
) -> SpecResult:
    """Greedy-decode one prompt (a flat list or 1-D array of token ids) with the
    model's first `draft_layers` layers drafting `draft_len` tokens per round.

    `gsm_verifier` / `gsm_draft`: a GSMConfig (or anything `generate` accepts as
    `gsm`) for the full model / the draft, None for no GSM. Stops at EOS (included)
    or after `max_new_tokens`, as `generate_tokens` does, and returns the same tokens
    as `generate_tokens(params, [prompt], gsm=gsm_verifier)`: with the "decode_steps"
    verifier (`verify_mode`) by the same arithmetic; with a chunked `extend` up to the
    float rounding of a chunked forward, which could only flip an exact argmax tie.
    """
    start = time.perf_counter()
    params = check_params(params)
    cfg = params.config
    max_new = _check_int("max_new_tokens", max_new_tokens, 1)
    k = _check_int("draft_layers", draft_layers, 1, cfg.num_layers)
    n_draft = _check_int("draft_len", draft_len, 1)
    prompt, eos, total, cache_len, tokens, lengths = _one_prompt(
        params, prompt_ids, max_new, n_draft, eos_ids, "speculative_generate")
    d_cfg, d_weights = draft_config(cfg, k), draft_weights(params.weights, k)
    g_v = _gsm_inputs(gsm_verifier, cfg.num_layers, cfg.num_layers, total)
    g_d = _gsm_inputs(gsm_draft, cfg.num_layers, k, total)

    cur, v_cache = _prefill(params.weights, tokens, lengths, g_v, config=cfg,
                            cache_len=cache_len)
    _, d_cache = _prefill(d_weights, tokens, lengths, g_d, config=d_cfg, cache_len=cache_len)
    out = [int(cur[0])]
    rounds = drafted = accepted = 0
    per_round: list[int] = []
    while len(out) < max_new and out[-1] not in eos:
        drafts, d_grown = _draft(d_weights, cur, d_cache, g_d, config=d_cfg, draft_len=n_draft)
        v, m_dev, v_grown = _verify(params.weights, cur, drafts, v_cache, g_v, config=cfg)
        m = int(m_dev[0])  # the one host sync per round
        v_host, d_host = np.asarray(v[0]), np.asarray(drafts[0])
        rounds, drafted, accepted = rounds + 1, drafted + n_draft, accepted + m
        per_round.append(m)
        if _take(out, [int(t) for t in d_host[:m]] + [int(v_host[m])], eos, max_new):
            break  # the caches are not needed any more
        v_cache = _commit_verifier(params.weights, v_cache, v_grown, cur, drafts, m_dev, g_v,
                                   config=cfg)
        d_cache = _commit_draft(d_weights, d_cache, d_grown, cur, drafts, m_dev, g_d,
                                config=d_cfg)
        cur = jnp.asarray(v_host[m : m + 1])
    return SpecResult(tokens=np.asarray(out, np.int32), rounds=rounds, drafted=drafted,
                      accepted=accepted, wall_s=time.perf_counter() - start,
                      accepted_per_round=tuple(per_round))


# ----------------------------------------------------------------------------- DSpark
# A family's own drafter, its module's `DRAFTER` (models/contract.py, `Drafter`; today
# DeepSeek-V4.1's DSpark, models/deepseek_v41_dspark.py): one parallel draft call per round
# proposes block_size tokens from the target's features of the last feature_window
# positions, the verifier scores [cur, proposals] in one chunked call that also returns
# those positions' features, and the features of the accepted positions enter a ring of
# feature_window rows (slot = position % window) that the next draft reads.


def _drafter(cfg: Any) -> Any:
    """The family's own drafter; refused by name for a family without one."""
    family = getattr(cfg, "family", None)
    drafter = None if family is None else family_module(family).DRAFTER
    if drafter is None:
        raise InvalidInputError(
            f"DSpark drafting needs a model whose family has its own drafter (DeepSeek-V4.1), "
            f"not {family or type(cfg).__name__!r}")
    return drafter


def _ring_write(ring: jax.Array, ring_pos: jax.Array, feats: jax.Array, pos: jax.Array,
                n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Write feats [1, C, F] of positions pos [1, C] into the ring [1, W, F] (positions
    ring_pos [1, W]); only the last min(n, W) of the first n [1] rows (no slot twice)."""
    w, c = ring.shape[1], feats.shape[1]
    j = jnp.arange(c)
    keep = (j < n[0]) & (j >= n[0] - w)
    slot = jnp.where(keep, pos[0] % w, w)  # w: out of range, dropped
    ring = ring.at[0, slot].set(feats[0].astype(ring.dtype), mode="drop")
    ring_pos = ring_pos.at[0, slot].set(pos[0].astype(ring_pos.dtype), mode="drop")
    return ring, ring_pos


@functools.partial(jax.jit, static_argnames=("config", "cache_len"))
def _dspark_prefill(weights, tokens, lengths, gsm, *, config, cache_len: int):
    """A fresh cache holding the prompt, the greedy first token [1], and the feature ring."""
    drafter = _drafter(config)
    cache = family_module(config.family).init_cache(
        config, tokens.shape[0], cache_len, dtype=jax.tree.leaves(weights)[0].dtype,
        gsm_max_window=None if gsm is None else gsm.max_window)
    logits, feats, cache = drafter.prefill_with_features(weights, config, tokens, lengths,
                                                         cache, gsm)
    w = drafter.feature_window(config)
    ring = jnp.zeros((1, w, feats.shape[-1]), feats.dtype)
    ring_pos = jnp.full((1, w), -1, jnp.int32)
    pos = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    ring, ring_pos = _ring_write(ring, ring_pos, feats, pos, lengths)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache, ring, ring_pos


@functools.partial(jax.jit, static_argnames=("config", "draft_len"))
def _dspark_draft(weights, dw, cur, anchor, ring, ring_pos, *, config, draft_len: int):
    """The draft's proposals [1, draft_len] after cur [1] at position anchor [1]."""
    picks, _ = _drafter(config).propose(weights, dw, config, cur, anchor, ring, ring_pos)
    return picks[:, :draft_len]


@functools.partial(jax.jit, static_argnames=("config",))
def _dspark_verify(weights, cur, drafts, cache, gsm, *, config):
    """The verifier's greedy token after cur and after each proposal, v [1, K+1]; the
    number m [1] of leading proposals it agrees with; the features [1, K+1, F] of those
    positions; the cache grown by all K+1."""
    tokens = jnp.concatenate([cur[:, None], drafts], axis=1)
    n = jnp.full((1,), tokens.shape[1], jnp.int32)
    logits, feats, cache = _drafter(config).extend_with_features(weights, config, tokens, n,
                                                                  cache, gsm)
    v, m = _agreement(logits, drafts)
    return v, m, feats, cache


@functools.partial(jax.jit, static_argnames=("config",))
def _dspark_commit(weights, saved, grown, cur, drafts, m, gsm, ring, ring_pos, feats, anchor,
                   *, config):
    """After accepting m proposals: the cache holding saved + cur + the m accepted, and the
    ring with the features of those m + 1 positions."""
    fam = family_module(config.family)
    tokens = jnp.concatenate([cur[:, None], drafts], axis=1)

    cache = jax.lax.cond(
        m[0] == drafts.shape[1], lambda: grown,
        lambda: _rollback(fam, weights, config, saved, grown, tokens, m + 1, gsm))
    pos = anchor[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
    ring, ring_pos = _ring_write(ring, ring_pos, feats, pos, m + 1)
    return cache, ring, ring_pos


def _check_dspark_model(cfg: Any) -> None:
    _drafter(cfg).check_config(cfg)


def _draft_on_mesh(cfg: Any, draft: dict, mesh: Any) -> dict:
    """The draft tree placed on the backbone's mesh by the family's sharding rules (the
    stages' heads and shared expert split as a layer's, its routed experts expert-parallel,
    the Markov head and the rest replicated); unchanged on one device."""
    from gsm_jax.sharding import mesh_of, place_tree

    if mesh is None or mesh_of(draft) == mesh:  # one device, or placed already
        return draft
    return place_tree(cfg.family, draft, mesh)


def dspark_weights(params: ModelParams) -> dict:
    """The DSpark draft's weight tree of a loaded V4.1 checkpoint (`params.extra["mtp"]`),
    built on first use and kept with those tensors (on the backbone's mesh, if it has one)."""
    from gsm_jax.sharding import mesh_of

    cfg = params.config
    _check_dspark_model(cfg)
    mtp = params.extra.get("mtp")
    if not mtp:
        raise InvalidInputError("this DeepSeek-V4.1 checkpoint has no DSpark tensors (mtp.*); "
                                "pass draft weights with dspark_generate(..., draft=...)")
    dtype = jax.tree.leaves(params.weights["embed"])[0].dtype
    built = getattr(mtp, "_draft_trees", None)
    if built is None:
        built = {}
        mtp._draft_trees = built  # an MtpTensors: hashed by identity, may carry attributes
    mesh = mesh_of(params.weights)
    if (dtype, mesh) not in built:
        built[dtype, mesh] = _draft_on_mesh(cfg, _drafter(cfg).draft_weights(cfg, mtp, dtype),
                                             mesh)
    return built[dtype, mesh]


def dspark_generate(
    params: ModelParams,
    prompt_ids: Any,
    *,
    max_new_tokens: int,
    draft_len: int | None = None,
    gsm: Any = None,
    eos_ids: Sequence[int] | None = None,
    draft: dict | None = None,
) -> SpecResult:
    """Greedy-decode one prompt with DeepSeek-V4.1's DSpark drafter proposing `draft_len`
    (default: dspark_block_size) tokens per round, verified by the model in one chunked
    call. Returns the tokens of `generate_tokens(params, [prompt], gsm=gsm)` (up to the
    float rounding of a chunked forward, which could only flip an exact argmax tie); the
    draft only decides how many tokens a round yields.

    `draft`: the draft's weight tree (`deepseek_v41_dspark.draft_weights` /
    `init_weights`); default: built from the checkpoint's `mtp.*` tensors.

    On a mesh (`load(..., mesh=)` / `shard`) the draft is placed beside the backbone by the
    same rules and every round runs as SPMD programs on it."""
    from gsm_jax.sharding import mesh_of

    start = time.perf_counter()
    params = check_params(params)
    cfg = params.config
    _check_dspark_model(cfg)
    max_new = _check_int("max_new_tokens", max_new_tokens, 1)
    k = _drafter(cfg).block_size(cfg)
    n_draft = k if draft_len is None else _check_int("draft_len", draft_len, 1, k)
    _, eos, total, cache_len, tokens, lengths = _one_prompt(
        params, prompt_ids, max_new, n_draft, eos_ids, "dspark_generate")
    g = _gsm_inputs(gsm, cfg.num_layers, cfg.num_layers, total)
    mesh = mesh_of(params.weights)  # every input checked: now the draft (built once)
    dw = dspark_weights(params) if draft is None else _draft_on_mesh(cfg, draft, mesh)
    with on_mesh(mesh):
        return _dspark_loop(params, dw, g, max_new, n_draft, eos, cache_len, tokens, lengths,
                            start)


def _dspark_loop(params: ModelParams, dw: dict, g: GSMInputs, max_new: int, n_draft: int,
                 eos: set[int], cache_len: int, tokens: np.ndarray, lengths: np.ndarray,
                 start: float) -> SpecResult:
    """dspark_generate's rounds (under the backbone's mesh, if any)."""
    cfg = params.config
    cur, cache, ring, ring_pos = _dspark_prefill(params.weights, tokens, lengths, g,
                                                 config=cfg, cache_len=cache_len)
    anchor = jnp.asarray(lengths)
    out = [int(cur[0])]
    rounds = drafted = accepted = 0
    per_round: list[int] = []
    while len(out) < max_new and out[-1] not in eos:
        drafts = _dspark_draft(params.weights, dw, cur, anchor, ring, ring_pos, config=cfg,
                               draft_len=n_draft)
        v, m_dev, feats, grown = _dspark_verify(params.weights, cur, drafts, cache, g,
                                                config=cfg)
        m = int(m_dev[0])  # the one host sync per round
        v_host, d_host = np.asarray(v[0]), np.asarray(drafts[0])
        rounds, drafted, accepted = rounds + 1, drafted + n_draft, accepted + m
        per_round.append(m)
        if _take(out, [int(t) for t in d_host[:m]] + [int(v_host[m])], eos, max_new):
            break
        cache, ring, ring_pos = _dspark_commit(params.weights, cache, grown, cur, drafts,
                                               m_dev, g, ring, ring_pos, feats, anchor,
                                               config=cfg)
        anchor = anchor + m + 1
        cur = jnp.asarray(v_host[m : m + 1])
    return SpecResult(tokens=np.asarray(out, np.int32), rounds=rounds, drafted=drafted,
                      accepted=accepted, wall_s=time.perf_counter() - start,
                      accepted_per_round=tuple(per_round))
