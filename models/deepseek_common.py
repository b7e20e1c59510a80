"""What DeepSeek-V4 and V4.1 (and V4.1's DSpark draft) compute alike.

`models/deepseek_v4.py` and `models/deepseek_v41.py` both import these, so neither family
reads the other's module: RMSNorm, interleaved RoPE with the trailing-channel rotation,
shared-KV attention with per-head sinks, the lightning indexer's weighted dots and top-k
selection, the sqrtsoftplus / sigmoid / softmax router scores, the hyper-connection stream
sums, and the ring buffers a cache keeps of the last positions.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gsm_jax.models.rope import RopeSpec

_MASK_VALUE = -1e30  # finite: the sink logit keeps every softmax row well defined anyway


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in f32 with an f32 weight, cast back once (as the reference)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def rope_cos_sin(spec: RopeSpec, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [...] -> cos, sin [..., dim // 2] (f32, YaRN attention factor applied)."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(spec.inv_freq())
    return jnp.cos(angles) * spec.attention_factor, jnp.sin(angles) * spec.attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Interleaved RoPE on the trailing 2 * cos.shape[-1] channels of x (pairs (2i, 2i+1)).

    cos and sin must broadcast against x[..., :half]; pass -sin for the inverse rotation.
    """
    rd = 2 * cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - rd], x[..., x.shape[-1] - rd:]
    pairs = rope.astype(jnp.float32).reshape(rope.shape[:-1] + (rd // 2, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return jnp.concatenate([nope, rotated.reshape(rope.shape).astype(x.dtype)], axis=-1)


def sink_attention(q: jax.Array, keys: jax.Array, mask: jax.Array, sinks: jax.Array,
                   scale: float, selected: tuple[jax.Array, jax.Array] | None = None
                   ) -> jax.Array:
    """Shared-KV attention with per-head sinks.

    q [B, T, H, d]; keys [B, S, d] (one head, also the values); mask [B, T, S];
    sinks [H]: one extra logit per head that absorbs probability mass.
    selected: (entries [B, T, k, d], their mask [B, T, k]): compressed entries gathered
    per query (`gather_entries`), attended to beside the keys in the same softmax: what
    the keys [B, S + n, d] with the top-k mask compute, in O(k) instead of O(n) per
    query (decode reads only the entries its indexer picked).
    """
    scores = jnp.einsum("bthd,bsd->bhts", q, keys, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None], scores, _MASK_VALUE)
    s = keys.shape[1]
    if selected is not None:
        sel, sel_mask = selected
        extra = jnp.einsum("bthd,btkd->bhtk", q, sel.astype(q.dtype),
                           preferred_element_type=jnp.float32) * scale
        scores = jnp.concatenate([scores, jnp.where(sel_mask[:, None], extra, _MASK_VALUE)],
                                 axis=-1)
    sink = sinks.astype(jnp.float32)[None, :, None, None]
    top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
    e = jnp.exp(scores - top)
    probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    out = jnp.einsum("bhts,bsd->bthd", probs[..., :s].astype(keys.dtype), keys)
    if selected is not None:
        out = out + jnp.einsum("bhtk,btkd->bthd", probs[..., s:].astype(keys.dtype),
                               sel.astype(keys.dtype))
    return out


def weighted_index_dots(q: jax.Array, keys: jax.Array, head_w: jax.Array) -> jax.Array:
    """The indexer's sum over heads of head_w * relu(q . key): q [B,T,h,c], keys [B,n,c],
    head_w [B,T,h] -> [B,T,n].

    The cached keys are the dot's left operand ([n, c] as stored, times [c, T*h]), so the
    step reads them once in place; written as `einsum("bthc,bnc->bthn")` XLA's CPU dot
    first copied them to [c, n] every step (a quarter of a mid V4.1 decode step at 64k
    tokens, benchmarks/bench_long_context.py). The head sum over the [n, T, h] products is
    a second dot (a multiply-and-reduce took 2.5x as long)."""
    dots = jnp.einsum("bnc,bthc->bnth", keys, q)
    return jnp.einsum("bnth,bth->btn", jax.nn.relu(dots), head_w)


def topk_indices(scores: jax.Array, visible: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The (up to) k highest-scoring visible entries of scores [..., n]: (their indices
    [..., min(k, n)], picked [..., min(k, n)]: False where fewer than k are visible).

    Exact ties (the indexer's ReLU makes exact zeros common when few entries score
    positive) go to the lower index here; the reference's `torch.topk` leaves the
    order of ties unspecified, so on a tie at the k-th place the two may attend to
    different (equally scored) entries.
    """
    n = scores.shape[-1]
    _, idx = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), min(k, n))
    return idx, jnp.take_along_axis(visible, idx, axis=-1)


def entries_mask(idx: jax.Array, picked: jax.Array, n: int) -> jax.Array:
    """[..., n] bool from `topk_indices`' (idx, picked): a scatter, O(k) per query."""
    none = jnp.zeros(idx.shape[:-1] + (n,), bool)
    return jnp.put_along_axis(none, idx, picked, axis=-1, inplace=False)


def gather_entries(entries: jax.Array, idx: jax.Array) -> jax.Array:
    """entries [B, n, d], idx [B, T, k] -> [B, T, k, d]: each query's selected entries."""
    return entries[jnp.arange(entries.shape[0])[:, None, None], idx]


def gather_pays(t: int, k: int, n: int) -> bool:
    """Whether a chunk of t queries attends over gathered entries (t * k entries read)
    rather than over all n entries with a mask: decode and short chunks against a long
    cache. Static shapes only, so the choice is made at trace time."""
    return t * k < n


def score_fn(name: str, logits: jax.Array) -> jax.Array:
    if name == "sqrtsoftplus":
        return jnp.sqrt(jax.nn.softplus(logits))
    if name == "sigmoid":
        return jax.nn.sigmoid(logits)
    return jax.nn.softmax(logits, axis=-1)  # over the experts


def weighted_streams(w: jax.Array, h: jax.Array) -> jax.Array:
    """sum_j w[..., j] * h[..., j, :] for w [..., N], h [..., N, D] -> [..., D] in h's dtype.

    Unrolled over the few streams (N = hc_mult <= 4): as N fused multiply-adds it is an
    elementwise loop, where a reduction over the stream axis cost XLA:CPU a visible share
    of a decode step (docs/performance_notes.md, "DeepSeek-V4: hyper-connection stream
    sums unrolled").
    """
    acc = w[..., 0, None] * h[..., 0, :]  # in the promoted dtype (f32 weights: f32)
    for j in range(1, h.shape[-2]):
        acc = acc + w[..., j, None] * h[..., j, :]
    return acc.astype(h.dtype)


def hc_expand(post: jax.Array, comb: jax.Array, out: jax.Array, h: jax.Array) -> jax.Array:
    """New streams: post_n * out + sum_j comb[j, n] * h_j."""
    dt = h.dtype
    mixed = weighted_streams(jnp.swapaxes(comb.astype(dt), -1, -2), h[..., None, :, :])  # [B,T,N,D]
    return post.astype(dt)[..., None] * out[:, :, None, :] + mixed


def ring_after(seq: Any, seq_start: jax.Array, end: jax.Array, size: int) -> Any:
    """A ring [B, size, F] after a chunk: slot s holds the last position q < end [B] with
    q % size == s (zeros where q < 0), read from seq [B, L, F] in which seq[b, i] is
    position seq_start[b] + i (it must hold positions end - size .. end - 1 that are >= 0).
    seq may be a pytree of such arrays (packed cache entries: codes and scales), each
    leaf read alike."""
    last = (end - 1)[:, None]
    q = last - ((last - jnp.arange(size)[None, :]) % size)
    length = jax.tree.leaves(seq)[0].shape[1]
    idx = jnp.clip(q - seq_start[:, None], 0, length - 1)

    def one(a):
        got = jnp.take_along_axis(a, idx[..., None], axis=1)
        return jnp.where((q >= 0)[..., None], got, 0).astype(a.dtype)

    return jax.tree.map(one, seq)


def ring_history(ring: Any, start: jax.Array) -> tuple[Any, jax.Array]:
    """A ring [B, R, F] (position p in slot p % R) as the sequence of positions
    start - R .. start - 1 [B, R, F], and those positions [B, R]. The ring may be a
    pytree of such arrays (packed cache entries), each leaf read alike."""
    b, size = jax.tree.leaves(ring)[0].shape[:2]
    pos = start[:, None] - size + jnp.arange(size)[None, :]
    rows = jnp.arange(b)[:, None]
    return jax.tree.map(lambda a: a[rows, pos % size], ring), pos
