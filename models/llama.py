"""Llama-family decoder (Llama, SmolLM2, Qwen2) in Flax, with a KV cache and GSM sites.

One file for the family: the config, the modules, and the three entry points the
generation code calls:

- `forward`: teacher-forced logits over right-padded rows (no cache);
- `prefill`: a prompt batch into a fresh cache, logits of each row's last token;
- `decode_step`: one new token per row against the cache (the cache is donated
  by the jitted callers, so XLA updates it in place).

Positions are per sequence and equal the cache slot, so ragged batches and rows
at different stages (continuous batching) share one cache layout. The GSM sites
are the two `smooth_site_*` calls in `DecoderLayer`.

Two weight layouts run the same layer code. `gsm_jax.load` gives one array per
layer ("layers" a tuple of dicts) and the layers run as an unrolled loop: XLA:CPU
cannot point a dot at one layer's slice of a stacked [L, ...] weight, so under
`lax.scan` it copies every layer's weights out first, which at batch-1 decode of
SmolLM2 costs more than the products (fp32 52.8 -> 34.7 ms per step with per-layer
arrays, `benchmarks/bench_quant.py`: fp32-stacked vs fp32).
Stacked weights ("layers" a dict of [L, ...] arrays: `init_weights`, and what
SmoothQuant and the activation captures work on) run under `lax.scan`, one
compiled layer body. `stack_layers` / `unstack_layers` convert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from gsm_jax.errors import InvalidInputError, UnsupportedModelError
from gsm_jax.models.block_quant import projection_param
from gsm_jax.models.gsm_sites import (
    ATTN_OUT,
    FFN_MID,
    GSMInputs,
    smooth_site_decode,
    smooth_site_extend,
    smooth_site_prefill,
)
from gsm_jax.models.linear import linear
from gsm_jax.models.partitioning import constrain_rings

_MASK_VALUE = -1e30  # finite, so a row with no valid key (a dummy batch row) gives no NaN


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static model configuration (hashable: it is a static argument under jit)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has biases on q, k and v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"

    family = "llama"

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def site_sizes(self) -> tuple[int, int]:
        """Channel count of the `attn_out` and `ffn_mid` sites."""
        return (self.q_size, self.intermediate_size)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> LlamaConfig:
        """Build from a Hugging Face `config.json` dict; refuse what is not implemented."""
        model_type = hf.get("model_type")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not a supported Llama-family type "
                "(supported: llama, qwen2, mistral)"
            )
        rope_scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
        if rope_scaling:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type != "default":
                raise UnsupportedModelError(f"rope_scaling type {rope_type!r} is not supported")
            hf = {**hf, "rope_theta": rope_scaling.get("rope_theta", hf.get("rope_theta"))}
        if hf.get("sliding_window") and hf.get("use_sliding_window", model_type == "mistral"):
            raise UnsupportedModelError("sliding-window attention is not supported (Llama family)")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} is not supported")
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rope_theta=float(hf.get("rope_theta") or 10000.0),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            model_type=model_type,
        )


CONFIG_CLASS = LlamaConfig


@struct.dataclass
class KVCache:
    """Per-row KV cache plus the GSM ring buffers (present only when GSM is compiled in).

    k, v: one [B, kv_heads, S, head_dim] array per layer (a tuple); slot s holds the
          token at position s. Heads before slots: the decode step's attention products
          read the cache in place ([B, K] batch dims, contiguous [S, hd] per head; the
          [B, S, K, hd] order made XLA:CPU transpose the whole cache every step), and a
          separate array per layer is updated and read in place (a layer's slice of one
          stacked [L, ...] array was copied out for the products every step: 4.3 of a
          100 ms SmolLM2 step at batch 16).
    lengths: [B] tokens already in the cache (= the position of the next token).
    rings: per site [layers, B, max_window, C] of raw site inputs (see gsm_sites).
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    lengths: jax.Array
    rings: tuple[jax.Array, jax.Array] | None = None

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]


def init_cache(
    cfg: LlamaConfig, batch_size: int, max_len: int, *, dtype: Any = jnp.float32,
    gsm_max_window: int | None = None,
) -> KVCache:
    shape = (batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
    rings = None
    if gsm_max_window is not None:
        rings = tuple(
            jnp.zeros((cfg.num_layers, batch_size, gsm_max_window, c), dtype)
            for c in cfg.site_sizes
        )
    def layers():
        return tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))

    return KVCache(k=layers(), v=layers(), lengths=jnp.zeros((batch_size,), jnp.int32),
                   rings=rings)


def cache_insert(cache: KVCache, rows: KVCache, slots: jax.Array) -> KVCache:
    """Copy the rows of `rows` (same max_len) into `cache` at batch indices `slots` [b].

    Continuous batching: a request prefilled on its own joins a running batch.
    """
    def put(big, small, axis=0):
        index = (slice(None),) * axis + (slots,)
        return big.at[index].set(small.astype(big.dtype))

    def put_layers(big, small):
        return tuple(put(b, s) for b, s in zip(big, small, strict=True))

    rings = cache.rings
    if cache.rings is not None and rows.rings is not None:
        rings = tuple(put(b, s, axis=1) for b, s in zip(cache.rings, rows.rings, strict=True))
    return KVCache(k=put_layers(cache.k, rows.k), v=put_layers(cache.v, rows.v),
                   lengths=cache.lengths.at[slots].set(rows.lengths), rings=rings)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32 * weight.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face convention). x [B, T, N, hd], positions [B, T]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(0, half, dtype=jnp.float32) * 2.0 / x.shape[-1]))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
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
    scores = jnp.where(mask[:, None, None], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h * hd)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                     scale: float | None = None) -> jax.Array:
    """One query per row against the cache. q [B,H,hd]; k, v [B,K,S,hd] (the cache's
    layout); mask [B,S] -> [B,H*hd]. Per (row, kv head) both products are plain
    [G, hd] x [hd, S] and [G, S] x [S, hd] matrix products reading the cache in place
    (with the generic `attention` einsums XLA:CPU turned the second into a transposed
    dot: 6.5 of a 100 ms SmolLM2 step at batch 16, against ~0 now)."""
    b, h, hd = q.shape
    kv_heads = k.shape[1]
    q = q.reshape(b, kv_heads, h // kv_heads, hd)
    scores = jnp.einsum("bkgd,bksd->bkgs", q, k, preferred_element_type=jnp.float32)
    scale = hd**-0.5 if scale is None else scale
    scores = jnp.where(mask[:, None, None], scores * scale, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgs,bksd->bkgd", probs, v).reshape(b, h * hd)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP with fused QKV and gate/up projections.

    Weights are stored [in, out] (x @ W), the layout XLA:CPU multiplies fastest at
    batch 16; q/k/v and gate/up are concatenated so each is one matmul.
    """

    cfg: LlamaConfig

    def setup(self) -> None:
        cfg, init = self.cfg, nn.initializers.normal(0.02)
        d = cfg.hidden_size
        self.attn_norm = self.param("attn_norm", nn.initializers.ones, (d,))
        self.qkv = projection_param(self, "qkv", init, (d, cfg.q_size + 2 * cfg.kv_size))
        if cfg.attention_bias:
            self.qkv_bias = self.param("qkv_bias", nn.initializers.zeros,
                                       (cfg.q_size + 2 * cfg.kv_size,))
        self.o = projection_param(self, "o", init, (cfg.q_size, d))
        self.ffn_norm = self.param("ffn_norm", nn.initializers.ones, (d,))
        self.gate_up = projection_param(self, "gate_up", init, (d, 2 * cfg.intermediate_size))
        self.down = projection_param(self, "down", init, (cfg.intermediate_size, d))

    def _qkv(self, x: jax.Array, positions: jax.Array):
        cfg = self.cfg
        h = rms_norm(x, self.attn_norm, cfg.rms_norm_eps)
        qkv = linear(h, self.qkv)
        if cfg.attention_bias:
            qkv = qkv + self.qkv_bias.astype(x.dtype)
        b, t = x.shape[:2]
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
        q = apply_rope(q.reshape(b, t, cfg.num_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = apply_rope(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        return q, k, v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)

    def _mlp_in(self, x: jax.Array) -> jax.Array:
        h = rms_norm(x, self.ffn_norm, self.cfg.rms_norm_eps)
        gate, up = jnp.split(linear(h, self.gate_up), 2, axis=-1)
        return jax.nn.silu(gate) * up

    def prefill(self, x, positions, mask, layer, gsm: GSMInputs | None):
        """x [B,T,D], positions [B,T] (-1 = padding); returns (x, k, v, GSM rings for decode)."""
        q, k, v = self._qkv(x, jnp.maximum(positions, 0))
        with jax.named_scope("attention"):
            attn = attention(q, k, v, mask)
        attn, ring_attn = smooth_site_prefill(gsm, layer, ATTN_OUT, attn, positions,  # GSM site
                                              self.o)
        x = x + linear(attn, self.o)
        mid, ring_ffn = smooth_site_prefill(gsm, layer, FFN_MID, self._mlp_in(x), positions,
                                            self.down)
        x = x + linear(mid, self.down)
        return x, k, v, (ring_attn, ring_ffn)

    def decode_qkv(self, x, positions):
        """x [B,1,D] -> this token's q [B,1,H,hd], k and v [B,1,K,hd] (RoPE applied)."""
        return self._qkv(x, positions)

    def decode_rest(self, x, q, k_cache, v_cache, mask, layer, gsm, rings, position, active):
        """Attention over the layer's cache (which already holds this token), then the MLP.

        `rings`: both sites' stacked GSM rings [layers, B, W, C] (or None); returned updated.
        """
        with jax.named_scope("attention"):
            attn = decode_attention(q[:, 0], k_cache, v_cache, mask[:, 0])
        ring_attn, ring_ffn = rings if rings is not None else (None, None)
        # GSM site attn_out: the input of the output projection
        attn, ring_attn = smooth_site_decode(gsm, layer, ATTN_OUT, attn, ring_attn, position,
                                             active, self.o)
        x = x + linear(attn, self.o)[:, None]
        # GSM site ffn_mid: the input of the down projection
        mid, ring_ffn = smooth_site_decode(
            gsm, layer, FFN_MID, self._mlp_in(x)[:, 0], ring_ffn, position, active, self.down
        )
        x = x + linear(mid, self.down)[:, None]
        return x, None if rings is None else (ring_attn, ring_ffn)


    def extend_rest(self, x, q, k_cache, v_cache, mask, layer, gsm, rings, start, positions):
        """A prompt chunk's attention over the layer's cache (which already holds the
        chunk), then the MLP; both GSM sites continue from the row's rings."""
        with jax.named_scope("attention"):
            attn = attention(q, jnp.swapaxes(k_cache, 1, 2), jnp.swapaxes(v_cache, 1, 2), mask)
        ring_attn, ring_ffn = rings if rings is not None else (None, None)
        # GSM site attn_out, then ffn_mid (as in prefill)
        attn, ring_attn = smooth_site_extend(gsm, layer, ATTN_OUT, attn, ring_attn, start,
                                             positions)
        x = x + linear(attn, self.o)
        mid, ring_ffn = smooth_site_extend(gsm, layer, FFN_MID, self._mlp_in(x), ring_ffn,
                                           start, positions)
        x = x + linear(mid, self.down)
        return x, None if rings is None else (ring_attn, ring_ffn)


class Llama(nn.Module):
    """Embedding + stacked decoder layers + final norm + LM head (for `init` only).

    The entry points below apply `DecoderLayer` themselves (under `lax.scan` or as
    an unrolled loop, by weight layout); this module exists so `Llama(cfg).init`
    gives the (stacked) parameter tree (abstract-first with `jax.eval_shape`) and
    random models for tests.
    """

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        embed = self.param("embed", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size))
        layers = nn.vmap(
            DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
            in_axes=None, out_axes=0, axis_size=cfg.num_layers, methods=["prefill"],
        )(cfg, name="layers")
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = embed[tokens]
        mask = jnp.ones(tokens.shape + (tokens.shape[1],), bool)
        layers.prefill(x, positions, mask, 0, None)
        self.param("final_norm", nn.initializers.ones, (cfg.hidden_size,))
        if not cfg.tie_word_embeddings:
            self.param("lm_head", nn.initializers.normal(0.02), (cfg.hidden_size, cfg.vocab_size))
        return x


def init_weights(cfg: LlamaConfig, rng: jax.Array, dtype: Any = jnp.float32) -> dict:
    """Random weights (tests, benchmarks): the same tree the loaders produce."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    params = Llama(cfg).init(rng, tokens)["params"]
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    return jax.tree.map(lambda a: a, dict(params))


def weight_shapes(cfg: LlamaConfig, dtype: Any = jnp.float32) -> dict:
    """The weight tree as ShapeDtypeStructs, without allocating (abstract-first init)."""
    return jax.eval_shape(lambda: init_weights(cfg, jax.random.key(0), dtype))


def is_per_layer(weights: dict) -> bool:
    """True when weights["layers"] is a tuple of per-layer trees (see `unstack_layers`)."""
    return isinstance(weights["layers"], tuple | list)


def unstack_layers(weights: dict) -> dict:
    """The same weights with "layers" as a tuple of per-layer trees.

    The model then runs its layers as an unrolled loop over separate arrays instead of
    `lax.scan` over stacked [L, ...] arrays. On XLA:CPU a dot cannot read a layer's
    slice of a stacked weight in place, so under scan every layer's weights are copied
    out first (in a SmolLM2 decode step that copy outweighs the products themselves).
    """
    if is_per_layer(weights):
        return weights
    stacked = weights["layers"]
    n = jax.tree.leaves(stacked)[0].shape[0]
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n))
    return {**weights, "layers": layers}


def _per_layer_weights(weights: dict, cfg: LlamaConfig) -> tuple:
    layers = weights["layers"]
    if len(layers) != cfg.num_layers:  # lax.scan fails on this by itself; a loop would not
        raise InvalidInputError(f"the weights hold {len(layers)} layers but the config "
                                f"says num_layers={cfg.num_layers}")
    return tuple(layers)


def stack_layers(weights: dict) -> dict:
    """The inverse of `unstack_layers`: "layers" as one tree of stacked [L, ...] arrays."""
    if not is_per_layer(weights):
        return weights
    return {**weights, "layers": jax.tree.map(lambda *a: jnp.stack(a), *weights["layers"])}


def _layer_apply(cfg: LlamaConfig, layer_weights: dict, method: str, *args):
    return DecoderLayer(cfg).apply({"params": layer_weights}, *args, method=method)


def _embed(weights: dict, tokens: jax.Array) -> jax.Array:
    return jnp.take(weights["embed"], tokens, axis=0)


def _logits(weights: dict, cfg: LlamaConfig, x: jax.Array) -> jax.Array:
    x = rms_norm(x, weights["final_norm"], cfg.rms_norm_eps)
    with jax.named_scope("lm_head"):
        if cfg.tie_word_embeddings:
            embed = weights["embed"].astype(x.dtype)
            return jnp.einsum("...d,vd->...v", x, embed, preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", x, weights["lm_head"].astype(x.dtype),
                          preferred_element_type=jnp.float32)


def _prefill_layers(weights, cfg, tokens, lengths, gsm):
    """Run all layers over right-padded prompts. Returns hidden states and per-layer k, v, rings."""
    b, t = tokens.shape
    steps = jnp.arange(t)
    valid = steps[None, :] < lengths[:, None]
    positions = jnp.where(valid, steps[None, :], -1)
    # causal, and keys must be real tokens of the same row
    mask = (steps[None, :, None] >= steps[None, None, :]) & valid[:, None, :]
    x = _embed(weights, tokens)

    def body(x, layer_in):
        layer_weights, layer = layer_in
        with jax.named_scope("layer"):
            x, k, v, rings = _layer_apply(
                cfg, layer_weights, "prefill", x, positions, mask, layer, gsm
            )
        return x, (k, v, rings)

    if is_per_layer(weights):
        outs = []
        for layer, layer_weights in enumerate(_per_layer_weights(weights, cfg)):
            x, out = body(x, (layer_weights, layer))
            outs.append(out)
        k, v, rings = jax.tree.map(lambda *a: jnp.stack(a), *outs)
    else:
        layers = (weights["layers"], jnp.arange(cfg.num_layers))
        x, (k, v, rings) = jax.lax.scan(body, x, layers)
    return x, k, v, rings, positions


def forward(weights: dict, cfg: LlamaConfig, tokens: jax.Array, lengths: jax.Array,
            gsm: GSMInputs | None = None) -> jax.Array:
    """Teacher-forced logits [B, T, V] (f32) over right-padded rows of `lengths` tokens."""
    x, *_ = _prefill_layers(weights, cfg, tokens, lengths, gsm)
    return _logits(weights, cfg, x)


def prefill(weights: dict, cfg: LlamaConfig, tokens: jax.Array, lengths: jax.Array,
            cache: KVCache, gsm: GSMInputs | None = None) -> tuple[jax.Array, KVCache]:
    """Fill a fresh cache with right-padded prompts; return each row's last-token logits [B, V]."""
    x, k, v, rings, _ = _prefill_layers(weights, cfg, tokens, lengths, gsm)
    last = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return _logits(weights, cfg, last), fill_cache(cache, k, v, rings, lengths, gsm)


def fill_cache(cache: KVCache, k: jax.Array, v: jax.Array, rings: Any, lengths: jax.Array,
               gsm: GSMInputs | None) -> KVCache:
    """A fresh cache holding a prefill's k, v ([L, B, T, K, hd]) and GSM rings."""
    def fill(layers, new):  # new [L, B, T, K, hd] -> each layer's [B, K, T, hd] slots
        return tuple(jax.lax.dynamic_update_slice(
            c, jnp.swapaxes(new[i], 1, 2).astype(c.dtype), (0, 0, 0, 0))
            for i, c in enumerate(layers))

    new_rings = cache.rings
    if gsm is not None and cache.rings is not None:
        new_rings = constrain_rings(tuple(r.astype(c.dtype)
                                          for r, c in zip(rings, cache.rings, strict=True)))
    return KVCache(k=fill(cache.k, k), v=fill(cache.v, v), lengths=lengths.astype(jnp.int32),
                   rings=new_rings)


def decode_step(weights: dict, cfg: LlamaConfig, tokens: jax.Array, cache: KVCache,
                gsm: GSMInputs | None = None,
                active: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """One token per row at position `cache.lengths`; returns logits [B, V] and the new cache.

    Rows with active=False still compute (static shapes) but do not advance and
    their GSM rings are left untouched; their cache slot is overwritten later.
    """
    b = tokens.shape[0]
    if active is None:
        active = jnp.ones((b,), bool)
    batch = jnp.arange(b)
    slot = jnp.minimum(cache.lengths, cache.max_len - 1)
    positions = slot[:, None]
    mask = (jnp.arange(cache.max_len)[None, :] <= slot[:, None])[:, None, :]  # [B, 1, S]
    x = _embed(weights, tokens[:, None])

    def layer_step(x, k_cache, v_cache, rings_all, layer_weights, layer):
        """k_cache, v_cache: this layer's [B, K, S, hd]; returns them with the token in."""
        with jax.named_scope("layer"):
            q, k, v = _layer_apply(cfg, layer_weights, "decode_qkv", x, positions)
            # Write this token's k, v first, then read: reading before the scatter makes
            # XLA keep (copy) the old cache alive. In range by construction (slot is
            # clamped): no bounds-guarding select.
            k_cache = k_cache.at[batch, :, slot].set(k[:, 0].astype(k_cache.dtype),
                                                     mode="promise_in_bounds")
            v_cache = v_cache.at[batch, :, slot].set(v[:, 0].astype(v_cache.dtype),
                                                     mode="promise_in_bounds")
            x, rings_all = _layer_apply(
                cfg, layer_weights, "decode_rest", x, q, k_cache, v_cache, mask,
                layer, gsm, rings_all, slot, active,
            )
        return x, k_cache, v_cache, rings_all

    rings_all = cache.rings if gsm is not None else None
    if is_per_layer(weights):
        k_all, v_all = list(cache.k), list(cache.v)
        for layer, layer_weights in enumerate(_per_layer_weights(weights, cfg)):
            x, k_all[layer], v_all[layer], rings_all = layer_step(
                x, k_all[layer], v_all[layer], rings_all, layer_weights, layer)
        k_all, v_all = tuple(k_all), tuple(v_all)
    else:  # stacked weights (lax.scan): the per-layer caches are stacked around the scan
        def body(carry, layer_in):
            x, rings_c = carry
            layer_weights, layer, k_l, v_l = layer_in
            x, k_l, v_l, rings_c = layer_step(x, k_l, v_l, rings_c, layer_weights, layer)
            return (x, rings_c), (k_l, v_l)

        (x, rings_all), (k_st, v_st) = jax.lax.scan(
            body, (x, rings_all),
            (weights["layers"], jnp.arange(cfg.num_layers), jnp.stack(cache.k),
             jnp.stack(cache.v)))
        k_all, v_all = tuple(k_st), tuple(v_st)
    logits = _logits(weights, cfg, x[:, 0])
    new_rings = rings_all if gsm is not None else cache.rings
    new_cache = KVCache(
        k=k_all, v=v_all, lengths=cache.lengths + active.astype(jnp.int32), rings=new_rings
    )
    return logits, new_cache


def extend(weights: dict, cfg: LlamaConfig, tokens: jax.Array, n_new: jax.Array,
           cache: KVCache, gsm: GSMInputs | None = None, *,
           all_logits: bool = False) -> tuple[jax.Array, KVCache]:
    """Append a chunk of prompt tokens [B, C] (the first `n_new` [B] of each row real) to
    rows already holding `cache.lengths` tokens: chunked prefill. Returns the logits of
    each row's last new token [B, V] (all_logits: of every chunk position, [B, C, V],
    what a speculative verifier needs) and the cache; the same as one prefill over the
    whole prompt (tested), GSM windows included."""
    b, c = tokens.shape
    steps = jnp.arange(c)
    valid = steps[None, :] < n_new[:, None]
    start = cache.lengths
    positions = jnp.where(valid, start[:, None] + steps[None, :], -1)  # [B, C]
    write = jnp.where(valid, positions, cache.max_len)  # padding: out of range, dropped
    batch = jnp.arange(b)[:, None]
    mask = (jnp.arange(cache.max_len)[None, None, :] <= positions[:, :, None]) & valid[..., None]
    x = _embed(weights, tokens)
    rings = cache.rings if gsm is not None else None
    k_all, v_all = list(cache.k), list(cache.v)
    per_layer = (_per_layer_weights(weights, cfg) if is_per_layer(weights) else
                 [jax.tree.map(lambda a, i=i: a[i], weights["layers"])
                  for i in range(cfg.num_layers)])
    for layer, layer_weights in enumerate(per_layer):
        with jax.named_scope("layer"):
            q, k, v = _layer_apply(cfg, layer_weights, "decode_qkv", x,
                                   jnp.maximum(positions, 0))
            k_all[layer] = k_all[layer].at[batch, :, write].set(
                k.astype(k_all[layer].dtype), mode="drop")
            v_all[layer] = v_all[layer].at[batch, :, write].set(
                v.astype(v_all[layer].dtype), mode="drop")
            x, rings = _layer_apply(cfg, layer_weights, "extend_rest", x, q, k_all[layer],
                                    v_all[layer], mask, layer, gsm, rings, start, positions)
    new_rings = constrain_rings(rings) if gsm is not None else cache.rings
    new_cache = KVCache(k=tuple(k_all), v=tuple(v_all), lengths=start + n_new.astype(jnp.int32),
                        rings=new_rings)
    if all_logits:
        return _logits(weights, cfg, x), new_cache
    last = jnp.take_along_axis(x, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
    return _logits(weights, cfg, last), new_cache


def weights_from_hf(cfg: LlamaConfig, tensors: dict[str, Any], dtype: Any = jnp.float32) -> dict:
    """Hugging Face state-dict names and [out, in] shapes -> this module's per-layer tree.

    Fuses q/k/v and gate/up and transposes to [in, out]; "layers" is a tuple of one
    dict per layer (the layout `unstack_layers` gives, built directly so loading never
    holds the weights twice). Raises UnsupportedModelError naming any missing tensor.
    """
    import numpy as np

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise UnsupportedModelError(f"weight {name!r} is missing from the checkpoint")
        return np.asarray(tensors[name], dtype=np.float32)

    def layer(p: str) -> dict:
        lw = {
            "attn_norm": get(p + "input_layernorm.weight"),
            "qkv": np.concatenate([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).T,
            "o": get(p + "self_attn.o_proj.weight").T,
            "ffn_norm": get(p + "post_attention_layernorm.weight"),
            "gate_up": np.concatenate([get(p + "mlp.gate_proj.weight"),
                                       get(p + "mlp.up_proj.weight")]).T,
            "down": get(p + "mlp.down_proj.weight").T,
        }
        if cfg.attention_bias:
            lw["qkv_bias"] = np.concatenate([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        return {k: jnp.asarray(v, dtype=dtype) for k, v in lw.items()}

    weights = {
        "embed": jnp.asarray(get("model.embed_tokens.weight"), dtype=dtype),
        "layers": tuple(layer(f"model.layers.{i}.") for i in range(cfg.num_layers)),
        "final_norm": jnp.asarray(get("model.norm.weight"), dtype=dtype),
    }
    if not cfg.tie_word_embeddings:
        weights["lm_head"] = jnp.asarray(get("lm_head.weight").T, dtype=dtype)
    return weights
