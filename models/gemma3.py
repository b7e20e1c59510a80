"""Gemma 3 text decoder (Gemma 3 270M, 1B) in Flax, with a KV cache and GSM sites.

The same entry points as the Llama family (`forward`, `prefill`, `decode_step`,
`extend`, `init_cache`, `cache_insert`), the same cache (`llama.KVCache`) and the
same weight names for the four projections (`qkv`, `o`, `gate_up`, `down`), so
generation, serving, quantization and sharding run it unchanged. Where it differs
from Llama, and where each difference lives:

- layers alternate between local sliding-window attention (`sliding_window` keys,
  RoPE base `rope_local_theta`) and global attention (RoPE base `rope_theta`):
  `Gemma3Config.sliding_layers`, `_masks`;
- query and key heads are RMS-normed before RoPE (`q_norm`, `k_norm`); scores are
  scaled by `query_pre_attn_scalar ** -0.5`;
- each block has a norm before *and* after attention and the MLP (the output of
  `o` and of `down` is normed before it joins the residual);
- the MLP is GeGLU with tanh GELU;
- embeddings are multiplied by sqrt(hidden_size); the LM head is the embedding.

Norm weights are stored as the multiplier Gemma applies, (1 + w) of the Hugging
Face checkpoint, so `llama.rms_norm` computes the same thing and SmoothQuant-style
channel folding into a norm is the same arithmetic as for Llama.

The two GSM sites are the `smooth_site_*` calls in `DecoderLayer`: `attn_out` (the
input of `o`) and `ffn_mid` (the input of `down`), as in Llama.

Every layer's cache holds the whole sequence (a sliding layer masks what lies
outside its window rather than keeping a ring of `sliding_window` slots): simple
and exact; for the 270M model at 2k tokens the cache is 2 x 18 x 2048 x 256 floats
per row (75 MB in f32), small next to its weights.

Weights: one dict per layer ("layers" a tuple, what `gsm_jax.load` gives); stacked
[L, ...] weights (`init_weights`, what quantization works on) are split per layer
on entry.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

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
from gsm_jax.models.llama import (  # the final norm + (tied) LM head is Llama's
    KVCache,
    _logits,
    apply_rope,
    attention,
    cache_insert,
    decode_attention,
    fill_cache,
    init_cache,
    is_per_layer,
    rms_norm,
    stack_layers,
    unstack_layers,
)
from gsm_jax.models.partitioning import constrain_rings

__all__ = ["CONFIG_CLASS", "Gemma3Config", "KVCache", "cache_insert", "decode_step", "extend",
           "forward", "init_cache", "init_weights", "prefill", "stack_layers",
           "unstack_layers", "weight_shapes", "weights_from_hf"]

_MODEL_TYPES = ("gemma3_text", "gemma3")


@dataclasses.dataclass(frozen=True)
class Gemma3Config:
    """Static model configuration (hashable: a static argument under jit)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_layers: tuple[bool, ...]  # per layer: local sliding-window attention or global
    sliding_window: int = 512
    rope_theta: float = 1_000_000.0  # global layers
    rope_local_theta: float = 10_000.0  # sliding layers
    query_pre_attn_scalar: float = 256.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "gemma3_text"

    family = "gemma3"
    attention_bias = False  # read by code shared with the Llama family

    def __post_init__(self) -> None:
        if len(self.sliding_layers) != self.num_layers:
            raise InvalidInputError(f"sliding_layers has {len(self.sliding_layers)} entries "
                                    f"for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise InvalidInputError(f"{self.num_heads} heads are not divisible by "
                                    f"{self.num_kv_heads} KV heads")

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

    @property
    def attn_scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Gemma3Config:
        """Build from a Hugging Face Gemma 3 `config.json` dict (text model, or the
        `text_config` of the multimodal one); refuse what is not implemented."""
        if hf.get("model_type") not in _MODEL_TYPES:
            raise UnsupportedModelError(f"model_type {hf.get('model_type')!r} is not Gemma 3 "
                                        f"(supported: {list(_MODEL_TYPES)})")
        if hf.get("model_type") == "gemma3":
            if "text_config" not in hf:
                raise UnsupportedModelError("a multimodal Gemma 3 config without text_config")
            hf = {**hf["text_config"], "model_type": "gemma3_text"}
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key):
                raise UnsupportedModelError(f"{key}={hf[key]} is not supported (Gemma 3 has none)")
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError("bidirectional attention (EmbeddingGemma) is not supported")
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise UnsupportedModelError(f"hidden_activation {act!r} is not supported")
        layers = int(hf["num_hidden_layers"])
        types = hf.get("layer_types")
        if types is None:
            pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
                          or 6)
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(layers)]
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown or len(types) != layers:
            raise UnsupportedModelError(f"layer_types {types!r}: expected {layers} entries of "
                                        "full_attention / sliding_attention")
        theta = float(hf.get("rope_theta") or 1_000_000.0)
        local = float(hf.get("rope_local_base_freq") or 10_000.0)
        rope = hf.get("rope_parameters") or {}
        if "full_attention" in rope or "sliding_attention" in rope:
            for kind, params in rope.items():
                if (params or {}).get("rope_type", "default") != "default":
                    raise UnsupportedModelError(
                        f"RoPE scaling {params.get('rope_type')!r} on {kind} layers is not "
                        "supported (Gemma 3 4B and larger scale their global RoPE)")
            theta = float(rope.get("full_attention", {}).get("rope_theta", theta))
            local = float(rope.get("sliding_attention", {}).get("rope_theta", local))
        elif hf.get("rope_scaling"):
            raise UnsupportedModelError(f"rope_scaling {hf['rope_scaling']!r} is not supported")
        heads = int(hf["num_attention_heads"])
        head_dim = int(hf.get("head_dim") or 256)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            sliding_layers=tuple(t == "sliding_attention" for t in types),
            sliding_window=int(hf.get("sliding_window") or 4096),
            rope_theta=theta,
            rope_local_theta=local,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )


CONFIG_CLASS = Gemma3Config


def _masks(cfg: Gemma3Config, q_pos: jax.Array, k_pos: jax.Array, valid: jax.Array
           ) -> tuple[jax.Array, jax.Array]:
    """(global, sliding) attention masks [B, T, S] for query positions [B, T] against
    key positions [B, S] or [S]; `valid` [B, T, S] marks real (query, key) pairs. A
    sliding layer sees the last `sliding_window` positions, itself included (HF's
    `kv_idx > q_idx - sliding_window`)."""
    k_pos = jnp.broadcast_to(k_pos, (q_pos.shape[0], k_pos.shape[-1]))
    causal = (k_pos[:, None, :] <= q_pos[:, :, None]) & valid
    local = causal & (q_pos[:, :, None] - k_pos[:, None, :] < cfg.sliding_window)
    return causal, local


class DecoderLayer(nn.Module):
    """Gemma 3 block: norm -> attention (q/k norms, RoPE) -> norm -> residual, then
    norm -> GeGLU MLP -> norm -> residual. Weights [in, out]; q/k/v and gate/up fused."""

    cfg: Gemma3Config
    layer: int  # its index: sliding or global, which RoPE base

    def setup(self) -> None:
        cfg, init, ones = self.cfg, nn.initializers.normal(0.02), nn.initializers.ones
        d = cfg.hidden_size
        self.attn_norm = self.param("attn_norm", ones, (d,))
        self.qkv = projection_param(self, "qkv", init, (d, cfg.q_size + 2 * cfg.kv_size))
        self.q_norm = self.param("q_norm", ones, (cfg.head_dim,))
        self.k_norm = self.param("k_norm", ones, (cfg.head_dim,))
        self.o = projection_param(self, "o", init, (cfg.q_size, d))
        self.post_attn_norm = self.param("post_attn_norm", ones, (d,))
        self.ffn_norm = self.param("ffn_norm", ones, (d,))
        self.gate_up = projection_param(self, "gate_up", init, (d, 2 * cfg.intermediate_size))
        self.down = projection_param(self, "down", init, (cfg.intermediate_size, d))
        self.post_ffn_norm = self.param("post_ffn_norm", ones, (d,))

    @property
    def sliding(self) -> bool:
        return self.cfg.sliding_layers[self.layer]

    def _qkv(self, x: jax.Array, positions: jax.Array):
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        h = rms_norm(x, self.attn_norm, eps)
        b, t = x.shape[:2]
        q, k, v = jnp.split(linear(h, self.qkv), [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
        q = rms_norm(q.reshape(b, t, cfg.num_heads, cfg.head_dim), self.q_norm, eps)
        k = rms_norm(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), self.k_norm, eps)
        theta = cfg.rope_local_theta if self.sliding else cfg.rope_theta
        q, k = apply_rope(q, positions, theta), apply_rope(k, positions, theta)
        return q, k, v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)

    def _mlp_in(self, x: jax.Array) -> jax.Array:
        h = rms_norm(x, self.ffn_norm, self.cfg.rms_norm_eps)
        gate, up = jnp.split(linear(h, self.gate_up), 2, axis=-1)
        return jax.nn.gelu(gate, approximate=True) * up

    def _attn_out(self, attn: Any) -> jax.Array:
        """The output projection, post-normed (what joins the residual)."""
        return rms_norm(linear(attn, self.o), self.post_attn_norm, self.cfg.rms_norm_eps)

    def _mlp_out(self, mid: Any) -> jax.Array:
        return rms_norm(linear(mid, self.down), self.post_ffn_norm, self.cfg.rms_norm_eps)

    def prefill(self, x, positions, masks, gsm: GSMInputs | None):
        """x [B,T,D], positions [B,T] (-1 = padding), masks (global, sliding) [B,T,T];
        returns (x, k, v, GSM rings for decode)."""
        q, k, v = self._qkv(x, jnp.maximum(positions, 0))
        with jax.named_scope("attention"):
            attn = attention(q, k, v, masks[self.sliding], self.cfg.attn_scale)
        # GSM site attn_out: the input of the output projection
        attn, ring_attn = smooth_site_prefill(gsm, self.layer, ATTN_OUT, attn, positions, self.o)
        x = x + self._attn_out(attn)
        # GSM site ffn_mid: the input of the down projection
        mid, ring_ffn = smooth_site_prefill(gsm, self.layer, FFN_MID, self._mlp_in(x), positions,
                                            self.down)
        return x + self._mlp_out(mid), k, v, (ring_attn, ring_ffn)

    def decode_qkv(self, x, positions):
        """x [B,T,D] -> q [B,T,H,hd], k and v [B,T,K,hd] (norms and RoPE applied)."""
        return self._qkv(x, positions)

    def decode_rest(self, x, q, k_cache, v_cache, masks, gsm, rings, position, active):
        """One token per row: attention over the layer's cache (which already holds the
        token), then the MLP; both GSM sites read and update the rings [layers, B, W, C]."""
        with jax.named_scope("attention"):
            attn = decode_attention(q[:, 0], k_cache, v_cache, masks[self.sliding][:, 0],
                                    self.cfg.attn_scale)
        ring_attn, ring_ffn = rings if rings is not None else (None, None)
        # GSM site attn_out, then ffn_mid (as in prefill)
        attn, ring_attn = smooth_site_decode(gsm, self.layer, ATTN_OUT, attn, ring_attn,
                                             position, active, self.o)
        x = x + self._attn_out(attn)[:, None]
        mid, ring_ffn = smooth_site_decode(gsm, self.layer, FFN_MID, self._mlp_in(x)[:, 0],
                                           ring_ffn, position, active, self.down)
        x = x + self._mlp_out(mid)[:, None]
        return x, None if rings is None else (ring_attn, ring_ffn)

    def extend_rest(self, x, q, k_cache, v_cache, masks, gsm, rings, start, positions):
        """A prompt chunk's attention over the layer's cache (which already holds the
        chunk), then the MLP; both GSM sites continue from the row's rings."""
        with jax.named_scope("attention"):
            attn = attention(q, jnp.swapaxes(k_cache, 1, 2), jnp.swapaxes(v_cache, 1, 2),
                             masks[self.sliding], self.cfg.attn_scale)
        ring_attn, ring_ffn = rings if rings is not None else (None, None)
        attn, ring_attn = smooth_site_extend(gsm, self.layer, ATTN_OUT, attn, ring_attn, start,
                                             positions)
        x = x + self._attn_out(attn)
        mid, ring_ffn = smooth_site_extend(gsm, self.layer, FFN_MID, self._mlp_in(x), ring_ffn,
                                           start, positions)
        return x + self._mlp_out(mid), None if rings is None else (ring_attn, ring_ffn)


def _apply(cfg: Gemma3Config, layer: int, layer_weights: dict, method: str, *args):
    return DecoderLayer(cfg, layer).apply({"params": layer_weights}, *args, method=method)


def _layers(weights: dict, cfg: Gemma3Config) -> tuple:
    """Per-layer weight dicts (stacked [L, ...] weights are sliced)."""
    if not is_per_layer(weights):
        weights = unstack_layers(weights)
    if len(weights["layers"]) != cfg.num_layers:
        raise InvalidInputError(f"the weights hold {len(weights['layers'])} layers but the "
                                f"config says num_layers={cfg.num_layers}")
    return tuple(weights["layers"])


def _embed(weights: dict, cfg: Gemma3Config, tokens: jax.Array) -> jax.Array:
    x = jnp.take(weights["embed"], tokens, axis=0)
    # HF multiplies by sqrt(hidden) cast to the activation dtype
    return x * jnp.asarray(math.sqrt(cfg.hidden_size), jnp.float32).astype(x.dtype)


def _prefill_layers(weights, cfg, tokens, lengths, gsm):
    """All layers over right-padded prompts: hidden states, per-layer k, v ([L, B, T, K, hd]),
    GSM rings (per site [L, ...]) and positions."""
    b, t = tokens.shape
    steps = jnp.arange(t)
    valid = steps[None, :] < lengths[:, None]
    positions = jnp.where(valid, steps[None, :], -1)
    masks = _masks(cfg, steps[None, :].repeat(b, 0), steps, valid[:, None, :])
    x = _embed(weights, cfg, tokens)
    outs = []
    for layer, lw in enumerate(_layers(weights, cfg)):
        with jax.named_scope("layer"):
            x, k, v, rings = _apply(cfg, layer, lw, "prefill", x, positions, masks, gsm)
        outs.append((k, v, rings))
    k, v, rings = jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return x, k, v, rings, positions


def forward(weights: dict, cfg: Gemma3Config, tokens: jax.Array, lengths: jax.Array,
            gsm: GSMInputs | None = None) -> jax.Array:
    """Teacher-forced logits [B, T, V] (f32) over right-padded rows of `lengths` tokens."""
    x, *_ = _prefill_layers(weights, cfg, tokens, lengths, gsm)
    return _logits(weights, cfg, x)


def prefill(weights: dict, cfg: Gemma3Config, tokens: jax.Array, lengths: jax.Array,
            cache: KVCache, gsm: GSMInputs | None = None) -> tuple[jax.Array, KVCache]:
    """Fill a fresh cache with right-padded prompts; return each row's last-token logits."""
    x, k, v, rings, _ = _prefill_layers(weights, cfg, tokens, lengths, gsm)
    last = jnp.take_along_axis(x, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return _logits(weights, cfg, last), fill_cache(cache, k, v, rings, lengths, gsm)


def decode_step(weights: dict, cfg: Gemma3Config, tokens: jax.Array, cache: KVCache,
                gsm: GSMInputs | None = None,
                active: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """One token per row at position `cache.lengths`; returns logits [B, V] and the cache.
    Rows with active=False compute but do not advance (as in `llama.decode_step`)."""
    b = tokens.shape[0]
    if active is None:
        active = jnp.ones((b,), bool)
    batch = jnp.arange(b)
    slot = jnp.minimum(cache.lengths, cache.max_len - 1)
    masks = _masks(cfg, slot[:, None], jnp.arange(cache.max_len),
                   jnp.ones((b, 1, cache.max_len), bool))
    x = _embed(weights, cfg, tokens[:, None])
    rings = cache.rings if gsm is not None else None
    k_all, v_all = list(cache.k), list(cache.v)
    for layer, lw in enumerate(_layers(weights, cfg)):
        with jax.named_scope("layer"):
            q, k, v = _apply(cfg, layer, lw, "decode_qkv", x, slot[:, None])
            # write this token's k, v first, then read (see llama.decode_step)
            k_all[layer] = k_all[layer].at[batch, :, slot].set(
                k[:, 0].astype(k_all[layer].dtype), mode="promise_in_bounds")
            v_all[layer] = v_all[layer].at[batch, :, slot].set(
                v[:, 0].astype(v_all[layer].dtype), mode="promise_in_bounds")
            x, rings = _apply(cfg, layer, lw, "decode_rest", x, q, k_all[layer], v_all[layer],
                              masks, gsm, rings, slot, active)
    return _logits(weights, cfg, x[:, 0]), KVCache(
        k=tuple(k_all), v=tuple(v_all), lengths=cache.lengths + active.astype(jnp.int32),
        rings=rings if gsm is not None else cache.rings)


def extend(weights: dict, cfg: Gemma3Config, tokens: jax.Array, n_new: jax.Array,
           cache: KVCache, gsm: GSMInputs | None = None, *,
           all_logits: bool = False) -> tuple[jax.Array, KVCache]:
    """Append a chunk of prompt tokens [B, C] (the first `n_new` [B] of each row real) to
    rows holding `cache.lengths` tokens (chunked prefill). Returns the logits of each
    row's last new token [B, V] (all_logits: of every chunk position, [B, C, V]) and the
    cache; equal to one prefill over the whole prompt, GSM windows included."""
    b, c = tokens.shape
    steps = jnp.arange(c)
    valid = steps[None, :] < n_new[:, None]
    start = cache.lengths
    positions = jnp.where(valid, start[:, None] + steps[None, :], -1)
    write = jnp.where(valid, positions, cache.max_len)  # padding: out of range, dropped
    rows = jnp.arange(b)[:, None]
    masks = _masks(cfg, positions, jnp.arange(cache.max_len),
                   jnp.broadcast_to(valid[..., None], (b, c, cache.max_len)))
    x = _embed(weights, cfg, tokens)
    rings = cache.rings if gsm is not None else None
    k_all, v_all = list(cache.k), list(cache.v)
    for layer, lw in enumerate(_layers(weights, cfg)):
        with jax.named_scope("layer"):
            q, k, v = _apply(cfg, layer, lw, "decode_qkv", x, jnp.maximum(positions, 0))
            k_all[layer] = k_all[layer].at[rows, :, write].set(
                k.astype(k_all[layer].dtype), mode="drop")
            v_all[layer] = v_all[layer].at[rows, :, write].set(
                v.astype(v_all[layer].dtype), mode="drop")
            x, rings = _apply(cfg, layer, lw, "extend_rest", x, q, k_all[layer], v_all[layer],
                              masks, gsm, rings, start, positions)
    new_cache = KVCache(k=tuple(k_all), v=tuple(v_all), lengths=start + n_new.astype(jnp.int32),
                        rings=constrain_rings(rings) if gsm is not None else cache.rings)
    if all_logits:
        return _logits(weights, cfg, x), new_cache
    last = jnp.take_along_axis(x, jnp.maximum(n_new - 1, 0)[:, None, None], axis=1)[:, 0]
    return _logits(weights, cfg, last), new_cache


def linear_inputs(weights: dict, cfg: Gemma3Config, tokens: jax.Array, lengths: jax.Array
                  ) -> tuple[jax.Array, dict]:
    """The prefill again, returning the final hidden states and, per layer, the inputs of
    the four projections {"qkv", "o", "gate_up", "down"} ([L, B, T, C] each): what
    SmoothQuant calibrates on (`gsm_jax.quant`). Built from `DecoderLayer`'s methods."""
    b, t = tokens.shape
    steps = jnp.arange(t)
    valid = steps[None, :] < lengths[:, None]
    positions = jnp.maximum(jnp.where(valid, steps[None, :], -1), 0)
    masks = _masks(cfg, steps[None, :].repeat(b, 0), steps, valid[:, None, :])
    x = _embed(weights, cfg, tokens)
    eps = cfg.rms_norm_eps

    def run(mdl: DecoderLayer, x: jax.Array):
        h_attn = rms_norm(x, mdl.attn_norm, eps)
        q, k, v = mdl._qkv(x, positions)
        attn = attention(q, k, v, masks[mdl.sliding], cfg.attn_scale)
        x = x + mdl._attn_out(attn)
        h_ffn = rms_norm(x, mdl.ffn_norm, eps)
        mid = mdl._mlp_in(x)
        return x + mdl._mlp_out(mid), {"qkv": h_attn, "o": attn, "gate_up": h_ffn, "down": mid}

    captured = []
    for layer, lw in enumerate(_layers(weights, cfg)):
        x, inputs = nn.apply(run, DecoderLayer(cfg, layer))({"params": lw}, x)
        captured.append(inputs)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *captured)


# ----------------------------------------------------------------------------- weights


def init_weights(cfg: Gemma3Config, rng: jax.Array, dtype: Any = jnp.float32) -> dict:
    """Random weights (tests, benchmarks), layers stacked [L, ...] as `llama.init_weights`.
    Norm multipliers start at 1 (Hugging Face's zero-initialised (1 + w))."""
    keys = jax.random.split(rng, cfg.num_layers + 1)
    x = jnp.zeros((1, 2, cfg.hidden_size), dtype)
    positions = jnp.zeros((1, 2), jnp.int32)
    masks = (jnp.ones((1, 2, 2), bool),) * 2
    layers = [DecoderLayer(cfg, i).init(keys[i + 1], x, positions, masks, None,
                                        method="prefill")["params"]
              for i in range(cfg.num_layers)]
    weights = {
        "embed": 0.02 * jax.random.normal(keys[0], (cfg.vocab_size, cfg.hidden_size)),
        "layers": jax.tree.map(lambda *a: jnp.stack(a), *layers),
        "final_norm": jnp.ones((cfg.hidden_size,)),
    }
    if not cfg.tie_word_embeddings:
        weights["lm_head"] = 0.02 * jax.random.normal(keys[0], (cfg.hidden_size, cfg.vocab_size))
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), weights)


def weight_shapes(cfg: Gemma3Config, dtype: Any = jnp.float32) -> dict:
    """The weight tree as ShapeDtypeStructs, without allocating (abstract-first init)."""
    return jax.eval_shape(lambda: init_weights(cfg, jax.random.key(0), dtype))


def weights_from_hf(cfg: Gemma3Config, tensors: dict[str, Any], dtype: Any = jnp.float32) -> dict:
    """Hugging Face Gemma3ForCausalLM names and [out, in] shapes -> this module's tree.

    Fuses q/k/v and gate/up, transposes to [in, out], turns every norm weight w into
    the multiplier 1 + w. Raises UnsupportedModelError naming a missing tensor.
    """
    import numpy as np

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise UnsupportedModelError(f"weight {name!r} is missing from the checkpoint")
        return np.asarray(tensors[name], dtype=np.float32)

    def norm(name: str) -> np.ndarray:
        return 1.0 + get(name)

    def layer(p: str) -> dict:
        lw = {
            "attn_norm": norm(p + "input_layernorm.weight"),
            "qkv": np.concatenate([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).T,
            "q_norm": norm(p + "self_attn.q_norm.weight"),
            "k_norm": norm(p + "self_attn.k_norm.weight"),
            "o": get(p + "self_attn.o_proj.weight").T,
            "post_attn_norm": norm(p + "post_attention_layernorm.weight"),
            "ffn_norm": norm(p + "pre_feedforward_layernorm.weight"),
            "gate_up": np.concatenate([get(p + "mlp.gate_proj.weight"),
                                       get(p + "mlp.up_proj.weight")]).T,
            "down": get(p + "mlp.down_proj.weight").T,
            "post_ffn_norm": norm(p + "post_feedforward_layernorm.weight"),
        }
        return {k: jnp.asarray(v, dtype=dtype) for k, v in lw.items()}

    weights = {
        "embed": jnp.asarray(get("model.embed_tokens.weight"), dtype=dtype),
        "layers": tuple(layer(f"model.layers.{i}.") for i in range(cfg.num_layers)),
        "final_norm": jnp.asarray(norm("model.norm.weight"), dtype=dtype),
    }
    if not cfg.tie_word_embeddings:
        weights["lm_head"] = jnp.asarray(get("lm_head.weight").T, dtype=dtype)
    return weights
