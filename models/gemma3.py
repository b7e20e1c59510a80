"""Gemma 3 text decoder (Gemma 3 270M, 1B) in Flax, with a KV cache and GSM sites.

One `layer` (`DecoderLayer.__call__`, every step mode) and the same thin entry points
as the Llama family over `models/common.py`'s loop, the same cache (`KVCache`) and the
same weight names for the four projections (`qkv`, `o`, `gate_up`, `down`), so
generation, serving, quantization and sharding run it unchanged. Where it differs
from Llama, and where each difference lives:

- layers alternate between local sliding-window attention (`sliding_window` keys,
  RoPE base `rope_local_theta`) and global attention (RoPE base `rope_theta`):
  `Gemma3Config.sliding_layers`, `_local`;
- query and key heads are RMS-normed before RoPE (`q_norm`, `k_norm`); scores are
  scaled by `query_pre_attn_scalar ** -0.5`;
- each block has a norm before *and* after attention and the MLP (the output of
  `o` and of `down` is normed before it joins the residual);
- the MLP is GeGLU with tanh GELU;
- embeddings are multiplied by sqrt(hidden_size); the LM head is the embedding.

Norm weights are stored as the multiplier Gemma applies, (1 + w) of the Hugging
Face checkpoint, so `common.rms_norm` computes the same thing and SmoothQuant-style
channel folding into a norm is the same arithmetic as for Llama.

The two GSM sites are the `step.site(...)` calls in `DecoderLayer`: `attn_out` (the
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
from gsm_jax.models import common
from gsm_jax.models.block_quant import projection_param
from gsm_jax.models.common import (
    KVCache,
    apply_rope,
    rms_norm,
    stack_layers,
    unstack_layers,
)
from gsm_jax.models.family_planner import FamilyPlanner
from gsm_jax.models.gemma3_checkpoint import weights_from_hf  # the checkpoint reader
from gsm_jax.models.hf_config import PRETRAINED_KEYS, ConfigReader, rope_settings
from gsm_jax.models.llama import cache_insert, init_cache  # the same KV cache as Llama
from gsm_jax.models.sites import ATTN_OUT, FFN_MID, Sites, takes_sites

__all__ = ["CONFIG_CLASS", "Gemma3Config", "KVCache", "cache_insert", "decode_step", "embed",
           "extend", "forward", "hidden_states", "init_cache", "init_weights", "layer",
           "logits", "prefill", "stack_layers", "unstack_layers", "weight_shapes",
           "weights_from_hf"]

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
    # keys and values in the KV cache: None (the activation dtype), "int8" or "fp8"
    # (`common.kv_quantize`; every attention then reads them rounded, the forward too)
    kv_cache_dtype: str | None = None

    family = "gemma3"
    attention_bias = False  # read by code shared with the Llama family

    def __post_init__(self) -> None:
        common.check_kv_cache_dtype(self.kv_cache_dtype)
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
        multimodal one, whose `text_config` is read), as transformers' `save_pretrained`
        writes it (`rope_parameters` per layer type) or earlier releases did (`rope_theta`,
        `rope_local_base_freq`, `rope_scaling`). Every key is read, listed in `HARMLESS` or
        refused by name (`models/hf_config.py`)."""
        top = ConfigReader(hf, "gemma3")
        model_type = top.get("model_type")
        if model_type not in _MODEL_TYPES:
            raise top.refuse("model_type", model_type, _MODEL_TYPES, "not Gemma 3")
        r = top
        if model_type == "gemma3":
            r = top.sub("text_config")
            if r is None:
                raise UnsupportedModelError("a multimodal Gemma 3 config without text_config")
            r.expect("model_type", ("gemma3_text", None))
            top_tie = top.get("tie_word_embeddings")
            if top_tie is not None and r.has("tie_word_embeddings") and (
                    bool(top_tie) != bool(r.get("tie_word_embeddings"))):
                raise UnsupportedModelError(
                    f"gemma3 config: tie_word_embeddings={top_tie!r} and text_config."
                    f"tie_word_embeddings={r.get('tie_word_embeddings')!r} disagree")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if r.get(key):
                raise r.refuse(key, r.get(key), "null", "Gemma 3 has no logit soft-capping")
        r.expect("use_bidirectional_attention", (False, None), why="bidirectional attention "
                 "(EmbeddingGemma) is not implemented")
        r.expect("attention_bias", (False,), default=False)
        act = r.get("hidden_activation", "hidden_act", default="gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise r.refuse("hidden_activation", act, ("gelu_pytorch_tanh",))
        layers = int(r.require("num_hidden_layers"))
        pattern = int(r.get("sliding_window_pattern", "_sliding_window_pattern", default=6))
        types = r.get("layer_types")
        if types is None:
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(layers)]
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown or len(types) != layers:
            raise UnsupportedModelError(f"layer_types {types!r}: expected {layers} entries of "
                                        "full_attention / sliding_attention")
        theta = float(r.get("rope_theta", default=1_000_000.0))
        local = float(r.get("rope_local_base_freq", default=10_000.0))
        rope = r.get("rope_parameters") or {}
        if "full_attention" in rope or "sliding_attention" in rope:
            for kind, params in rope.items():
                params = params or {}
                if kind not in ("full_attention", "sliding_attention"):
                    raise r.refuse(f"rope_parameters.{kind}", params,
                                   ("full_attention", "sliding_attention"))
                if params.get("rope_type", "default") != "default":
                    raise UnsupportedModelError(
                        f"gemma3 config: RoPE scaling rope_parameters.{kind}.rope_type="
                        f"{params.get('rope_type')!r} is not supported (supported: 'default'; "
                        "Gemma 3 4B and larger scale their global RoPE)")
                extra = sorted(set(params) - {"rope_type", "rope_theta"})
                if extra:
                    raise UnsupportedModelError(
                        f"gemma3 config: rope_parameters.{kind} keys {extra} are not supported "
                        "(supported: rope_type, rope_theta)")
            theta = float(rope.get("full_attention", {}).get("rope_theta", theta))
            local = float(rope.get("sliding_attention", {}).get("rope_theta", local))
        else:
            flat = rope_settings(r)  # one RoPE for all layers: only the default type
            if flat.get("rope_type", "default") != "default" or set(flat) - {"rope_type",
                                                                              "rope_theta"}:
                raise r.refuse("rope_scaling", r.get("rope_scaling") or rope, "null",
                               "Gemma 3 4B and larger scale their global RoPE")
            theta = float(flat.get("rope_theta", theta))
        heads = int(r.require("num_attention_heads"))
        head_dim = int(r.get("head_dim", default=256))
        eos = r.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        tie = r.get("tie_word_embeddings")
        tie = top.get("tie_word_embeddings", default=True) if tie is None else tie
        cfg = cls(
            vocab_size=int(r.require("vocab_size")),
            hidden_size=int(r.require("hidden_size")),
            intermediate_size=int(r.require("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(r.get("num_key_value_heads", default=heads)),
            head_dim=head_dim,
            sliding_layers=tuple(t == "sliding_attention" for t in types),
            sliding_window=int(r.get("sliding_window", default=4096)),
            rope_theta=theta,
            rope_local_theta=local,
            query_pre_attn_scalar=float(r.get("query_pre_attn_scalar", default=head_dim)),
            rms_norm_eps=float(r.get("rms_norm_eps", default=1e-6)),
            max_position_embeddings=int(r.get("max_position_embeddings", default=32768)),
            tie_word_embeddings=bool(tie),
            bos_token_id=r.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
        top.finish(HARMLESS)
        return cfg


# Keys transformers' Gemma3TextConfig / Gemma3Config write that do not change inference here.
HARMLESS: dict[str, str] = {
    **PRETRAINED_KEYS,
    "vision_config": "vision",  # the SigLIP tower: text-only here
    "mm_tokens_per_image": "vision",
    "boi_token_index": "vision",
    "eoi_token_index": "vision",
    "image_token_index": "vision",
    "image_token_id": "vision",
    "boi_token_id": "vision",
    "eoi_token_id": "vision",
}


CONFIG_CLASS = Gemma3Config


def _local(cfg: Gemma3Config, q_pos: jax.Array):
    """Narrows a causal mask [B, T, S] to a sliding layer's window: the last
    `sliding_window` positions, itself included (HF's `kv_idx > q_idx - sliding_window`);
    k_pos: the key positions, [B, S] or [S]."""
    def narrow(mask: jax.Array, k_pos: jax.Array) -> jax.Array:
        k_pos = jnp.broadcast_to(k_pos, (q_pos.shape[0], k_pos.shape[-1]))
        return mask & (q_pos[:, :, None] - k_pos[:, None, :] < cfg.sliding_window)
    return narrow


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

    def create_params(self) -> None:
        _ = self.attn_norm  # reading an attribute runs setup(), which declares every weight

    @property
    def sliding(self) -> bool:
        return self.cfg.sliding_layers[self.layer]

    def __call__(self, x, cache, step: common.Step):
        """x [B, T, D] -> (x, this layer's (k, v) cache or None), in any step mode."""
        cfg, eps, layer = self.cfg, self.cfg.rms_norm_eps, self.layer
        b, t = x.shape[:2]
        h = rms_norm(x, self.attn_norm, eps)
        qkv = step.linear(layer, "qkv", h, self.qkv)
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
        q = rms_norm(q.reshape(b, t, cfg.num_heads, cfg.head_dim), self.q_norm, eps)
        k = rms_norm(k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim), self.k_norm, eps)
        theta = cfg.rope_local_theta if self.sliding else cfg.rope_theta
        q, k = apply_rope(q, step.rope_positions, theta), apply_rope(k, step.rope_positions, theta)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        narrow = _local(cfg, step.positions) if self.sliding else None
        attn, cache = common.kv_attention(q, k, v, cache, step, narrow, cfg.attn_scale,
                                          kv_dtype=cfg.kv_cache_dtype)
        attn = step.site(layer, ATTN_OUT, attn, self.o)  # GSM site attn_out
        x = x + rms_norm(step.linear(layer, "o", attn, self.o), self.post_attn_norm, eps)
        h = rms_norm(x, self.ffn_norm, eps)
        gate, up = jnp.split(step.linear(layer, "gate_up", h, self.gate_up), 2, axis=-1)
        mid = step.site(layer, FFN_MID, jax.nn.gelu(gate, approximate=True) * up,
                        self.down)  # GSM site ffn_mid
        out = rms_norm(step.linear(layer, "down", mid, self.down), self.post_ffn_norm, eps)
        return x + out, cache


def layer(cfg: Gemma3Config, weights: dict, index: int, x: jax.Array, cache,
          step: common.Step):
    """The family's one layer: `DecoderLayer` (static index: sliding or global)."""
    return DecoderLayer(cfg, index).apply({"params": weights}, x, cache, step)


# ----------------------------------------------------------------------------- entry points


def embed(weights: dict, cfg: Gemma3Config, tokens: jax.Array) -> jax.Array:
    x = common.embed(weights, tokens)
    # HF multiplies by sqrt(hidden) cast to the activation dtype
    return x * jnp.asarray(math.sqrt(cfg.hidden_size), jnp.float32).astype(x.dtype)


def logits(weights: dict, cfg: Gemma3Config, x: jax.Array) -> jax.Array:
    """Final norm + the LM head (tied to the embedding): [..., D] -> [..., V] (f32)."""
    x = rms_norm(x, weights["final_norm"], cfg.rms_norm_eps)
    return common.lm_head(weights, x, cfg.tie_word_embeddings)


def _run(weights: dict, cfg: Gemma3Config, tokens: jax.Array, cache: KVCache | None,
         step: common.Step):
    x = embed(weights, cfg, tokens)
    layers = common.layer_weights(weights, cfg.num_layers, scan_ok=False)
    pieces = None if cache is None else common.kv_pieces(cache)
    x, pieces, sown = common.run_layers(layer, cfg, layers, x, pieces, step)
    return x, (None if cache is None else common.kv_from_pieces(pieces, step, cache)), sown


def hidden_states(weights: dict, cfg: Gemma3Config, tokens: jax.Array, lengths: jax.Array,
                  sites: Sites | None = None) -> tuple[jax.Array, dict]:
    """Teacher-forced hidden states [B, T, D] (before the final norm) and what the hooks
    sowed, {name: [L, ...]} (`models/sites.py`)."""
    x, _, sown = _run(weights, cfg, tokens, None,
                      common.forward_step(lengths, tokens.shape[1], sites))
    return x, sown


@takes_sites
def forward(weights: dict, cfg: Gemma3Config, tokens: jax.Array, lengths: jax.Array,
            sites: Sites | None = None) -> jax.Array:
    """Teacher-forced logits [B, T, V] (f32) over right-padded rows of `lengths` tokens."""
    return logits(weights, cfg, hidden_states(weights, cfg, tokens, lengths, sites)[0])


@takes_sites
def prefill(weights: dict, cfg: Gemma3Config, tokens: jax.Array, lengths: jax.Array,
            cache: KVCache, sites: Sites | None = None) -> tuple[jax.Array, KVCache]:
    """Fill a fresh cache with right-padded prompts; return each row's last-token logits."""
    step = common.prefill_step(lengths, tokens.shape[1], cache, sites)
    x, cache, _ = _run(weights, cfg, tokens, cache, step)
    return logits(weights, cfg, common.last_token(x, lengths)), cache


@takes_sites
def extend(weights: dict, cfg: Gemma3Config, tokens: jax.Array, n_new: jax.Array,
           cache: KVCache, sites: Sites | None = None, *,
           all_logits: bool = False, hidden: bool = False) -> tuple[jax.Array, KVCache]:
    """Append a chunk of prompt tokens [B, C] (the first `n_new` [B] of each row real) to
    rows holding `cache.lengths` tokens (chunked prefill). Returns the logits of each
    row's last new token [B, V] (all_logits: of every chunk position, [B, C, V]) and the
    cache; equal to one prefill over the whole prompt, GSM windows included."""
    step = common.extend_step(n_new, tokens.shape[1], cache, sites)
    x, cache, _ = _run(weights, cfg, tokens, cache, step)
    if hidden:  # what `logits` takes, every position: the serving engine's
        return x, cache
    if all_logits:
        return logits(weights, cfg, x), cache
    return logits(weights, cfg, common.last_token(x, n_new)), cache


@takes_sites
def decode_step(weights: dict, cfg: Gemma3Config, tokens: jax.Array, cache: KVCache,
                sites: Sites | None = None,
                active: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """One token per row at position `cache.lengths`; returns logits [B, V] and the cache.
    Rows with active=False compute but do not advance (as in `llama.decode_step`)."""
    step = common.decode_step_ctx(cache, active, sites)
    x, cache, _ = _run(weights, cfg, tokens[:, None], cache, step)
    return logits(weights, cfg, x[:, 0]), cache


# ----------------------------------------------------------------------------- weights


def init_weights(cfg: Gemma3Config, rng: jax.Array, dtype: Any = jnp.float32) -> dict:
    """Random weights (tests, benchmarks), layers stacked [L, ...] as `llama.init_weights`.
    Norm multipliers start at 1 (Hugging Face's zero-initialised (1 + w))."""
    keys = jax.random.split(rng, cfg.num_layers + 1)
    layers = [DecoderLayer(cfg, i).init(keys[i + 1], method="create_params")["params"]
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


# ----------------------------------------------------------------------------- family contract
# What the runtime (gsm_jax.families and the tools above it) reads from this module beside
# its entry points; docs/adding_a_family.md lists every name.

FAMILY = "gemma3"
TITLE = "Gemma 3"  # in messages
HF_MODEL_TYPES = ("gemma3_text", "gemma3")  # Hugging Face model_type values it loads
DRAFTER = None  # no speculative drafter of its own (models/contract.py, `Drafter`)

# Logical axes of each weight of the float layout ([..., in, out] projections), by leaf
# name: the same projection names as Llama; q/k norms and the four block norms replicated
# (a leaf not listed is replicated whole, a leading stacked [L] axis is replicated).
LOGICAL_AXES = {
    "embed": ("vocab", None),
    "lm_head": (None, "vocab"),
    "qkv": (None, "heads"),
    "o": ("heads", None),
    "gate_up": (None, "mlp"),
    "down": ("mlp", None),
}

# Planner (`models/family_planner.py`): the defaults, and the labels of the cache leaves
# (`init_cache`) by leaf name
PLANNER = FamilyPlanner(cache_kinds={"k": "K/V", "v": "K/V", "k_scale": "K/V scales",
                                     "v_scale": "K/V scales"})


def stack_dense(weights: dict) -> tuple[dict, bool]:
    """Quantization / SmoothQuant: the weights with stacked [L, ...] layers holding qkv, o,
    gate_up and down (Llama's layout conversion), and whether they were per-layer."""
    from gsm_jax.models.llama import is_per_layer, stack_layers

    return stack_layers(dict(weights)), is_per_layer(weights)


def unstack_dense(weights: dict, per_layer: bool) -> dict:
    """`weights` (stacked) back in the layout `stack_dense` found."""
    from gsm_jax.models.llama import unstack_layers

    return unstack_layers(weights) if per_layer else weights
