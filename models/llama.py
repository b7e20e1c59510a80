"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3) in Flax: the config, one
`layer`, and the entry points, thin wrappers over `models/common.py`'s loop:

- `forward` / `hidden_states`: teacher-forced logits / hidden states over right-padded rows;
- `prefill`: a prompt batch into a fresh cache, logits of each row's last token;
- `extend`: a chunk of prompt after what each row holds (chunked prefill, a verifier);
- `decode_step`: one new token per row against the cache (donated by the jitted callers).

Positions are per sequence and equal the cache slot, so ragged batches and rows at
different stages (continuous batching) share one cache layout. The GSM sites are the two
`step.site(...)` calls in `DecoderLayer.__call__` (search `GSM site`).

Two weight layouts run the same layer. `gsm_jax.load` gives one array per layer
("layers" a tuple of dicts) and the layers run as an unrolled loop (XLA:CPU copies a
layer's slice of a stacked weight out before a dot; docs/performance_notes.md). Stacked
weights ("layers" a dict of [L, ...] arrays: `init_weights`, what SmoothQuant works on)
run under `lax.scan`, one compiled layer body. `stack_layers` / `unstack_layers` convert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from gsm_jax.errors import UnsupportedModelError
from gsm_jax.models import common
from gsm_jax.models.block_quant import projection_param
from gsm_jax.models.common import (  # noqa: F401  (re-exported: the family's public names)
    KVCache,
    apply_rope,
    attention,
    is_per_layer,
    rms_norm,
    stack_layers,
    unstack_layers,
)
from gsm_jax.models.family_planner import FamilyPlanner
from gsm_jax.models.hf_config import PRETRAINED_KEYS, ConfigReader, rope_settings
from gsm_jax.models.llama_checkpoint import weights_from_hf  # noqa: F401 (the contract)
from gsm_jax.models.rope import RopeSpec
from gsm_jax.models.sites import ATTN_OUT, FFN_MID, Sites, takes_sites

# Keys transformers' Llama / Qwen2 / Qwen3 / Mistral configs (and checkpoints on the Hub)
# write that do not change inference, with a one-word reason; every other key is read.
HARMLESS = {
    **PRETRAINED_KEYS,
    "pretraining_tp": "training",  # transformers 5 keeps it in the config, the model ignores it
    "is_llama_config": "metadata",  # nanotron's export (SmolLM2)
    "rope_interleaved": "metadata",  # nanotron's export; transformers rotates halves regardless
}

# per model_type: transformers' defaults for the keys a saved config may omit
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}
_ROPE_THETA = 10000.0  # transformers' `default_theta`


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
    attention_bias: bool = False  # biases on q, k and v (Qwen2; Llama / Qwen3 attention_bias)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"
    # keys and values in the KV cache: None (the activation dtype), "int8" or "fp8"
    # (`common.kv_quantize`; every attention then reads them rounded, the forward too)
    kv_cache_dtype: str | None = None
    # scaled RoPE (linear, llama3, YaRN) over the whole head, its theta `rope_theta`; None:
    # plain RoPE of `rope_theta`. A dict (`gsm_jax.save`'s JSON) is read back as a RopeSpec.
    rope: RopeSpec | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    o_bias: bool = False  # a bias on o_proj too (Llama / Qwen3 attention_bias=True)

    family = "llama"

    def __post_init__(self) -> None:
        common.check_kv_cache_dtype(self.kv_cache_dtype)
        rope = self.rope
        if isinstance(rope, dict):
            rope = RopeSpec(**rope)
        if rope is not None:
            if rope.dim != self.head_dim:
                raise UnsupportedModelError(
                    f"rope rotates {rope.dim} channels of a head of {self.head_dim}: partial "
                    "rotation is not supported (Llama family)")
            if float(rope.theta) != float(self.rope_theta):
                raise ValueError(f"rope.theta={rope.theta} differs from rope_theta="
                                 f"{self.rope_theta}")
            if rope.rope_type == "default":
                rope = None  # plain RoPE of rope_theta: one spelling, one config
        object.__setattr__(self, "rope", rope)

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
        """Build from a Hugging Face `config.json` dict (transformers 5's `rope_parameters`
        or the older `rope_scaling` / `rope_theta`). Every key is read, listed in
        `HARMLESS`, or refused by name (`models/hf_config.py`) before any weight is read;
        an unknown one is warned about once."""
        model_type = hf.get("model_type")
        r = ConfigReader(hf, str(model_type) if model_type in HF_MODEL_TYPES else "llama")
        model_type = r.expect("model_type", HF_MODEL_TYPES,
                              why="not a Llama-family model_type")
        heads = int(r.require("num_attention_heads"))
        hidden = int(r.require("hidden_size"))
        num_layers = int(r.require("num_hidden_layers"))
        # Qwen3Config's default head_dim is 128, not hidden / heads
        head_dim = int(r.get("head_dim") or (128 if model_type == "qwen3" else hidden // heads))
        max_pos = int(r.get("max_position_embeddings",
                            default=_DEFAULT_MAX_POSITIONS[model_type]))
        r.expect("hidden_act", ("silu",), default="silu")
        r.expect("mlp_bias", (False,), default=False, why="the MLP has no biases here")
        if model_type == "qwen2":
            # transformers' Qwen2 has q / k / v biases whatever the key says (Qwen2Config has
            # no such field; some exporters write attention_bias=false): read, and ignored
            # as the reference ignores it
            r.mark("attention_bias")
            qkv_bias, o_bias = True, False
        elif model_type == "mistral":
            r.expect("attention_bias", (False,), default=False,
                     why="Mistral's projections have no biases")
            qkv_bias = o_bias = False
        else:  # llama, qwen3: q, k, v and o alike
            qkv_bias = o_bias = bool(r.get("attention_bias", default=False))
        _check_sliding_window(r, model_type, num_layers, max_pos)
        rope = _rope_spec(r, model_type, head_dim, max_pos)
        eos = r.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        cfg = cls(
            vocab_size=int(r.require("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(r.require("intermediate_size")),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(r.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rope_theta=rope.theta,
            rms_norm_eps=float(r.get("rms_norm_eps", default=1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(r.get("tie_word_embeddings", default=False)),
            attention_bias=qkv_bias,
            bos_token_id=r.get("bos_token_id"),
            eos_token_ids=tuple(int(e) for e in eos_ids),
            model_type=model_type,
            rope=rope,
            qk_norm=model_type == "qwen3",
            o_bias=o_bias,
        )
        r.finish(HARMLESS)
        return cfg


def _check_sliding_window(r: ConfigReader, model_type: str, num_layers: int,
                          max_pos: int) -> None:
    """Refuse a sliding window that can bind. Mistral applies `sliding_window` to every
    layer; Qwen2 / Qwen3 only when `use_sliding_window`, to the layers `layer_types` marks
    "sliding_attention" (by default those from `max_window_layers` on). A window of at least
    max_position_embeddings never binds: sequences are refused past that context."""
    if model_type == "llama":
        return
    # MistralConfig's default window is 4096 (absent key); an explicit null is none
    window = r.value("sliding_window", 4096 if model_type == "mistral" else None)
    if model_type == "mistral":
        sliding = [] if window is None else list(range(num_layers))
    else:
        if not r.get("use_sliding_window", default=False):
            window = None
        first = int(r.get("max_window_layers", default=28))
        types = r.get("layer_types")
        if types is None:
            types = ["sliding_attention" if window is not None and i >= first
                     else "full_attention" for i in range(num_layers)]
        kinds = ("full_attention", "sliding_attention")
        bad = sorted({t for t in types if t not in kinds})
        if bad or len(types) != num_layers:
            raise r.refuse("layer_types", types, kinds,
                           f"one per layer ({num_layers}) of the supported kinds")
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and window is not None and int(window) < max_pos:
        raise UnsupportedModelError(
            f"{r.family} config: sliding_window={window} applies to layers {sliding} and is "
            f"shorter than max_position_embeddings={max_pos}; sliding-window attention is "
            "not supported (Llama family)")


def _rope_spec(r: ConfigReader, model_type: str, head_dim: int, max_pos: int) -> RopeSpec:
    """The config's RoPE as a `RopeSpec` (default, linear, llama3 or yarn), as transformers
    reads it: `rope_parameters` or `rope_scaling`, `rope_theta` (10000 when absent), and a
    top-level `original_max_position_embeddings`, which takes precedence for llama3 / yarn
    (transformers' `standardize_rope_params`); otherwise max_position_embeddings."""
    p = rope_settings(r)
    p.setdefault("rope_type", "default")
    p.setdefault("rope_theta", _ROPE_THETA)
    top_partial = r.get("partial_rotary_factor")  # standardize_rope_params moves it in
    if top_partial is not None:
        p.setdefault("partial_rotary_factor", top_partial)
    top_original = r.get("original_max_position_embeddings")
    if top_original is not None and p["rope_type"] in ("llama3", "yarn"):
        p["original_max_position_embeddings"] = top_original
    where = (f"{r.family} config: rope_parameters"
             if r.has("rope_parameters") or not r.has("rope_scaling")
             else f"{r.family} config: rope_scaling")
    spec = RopeSpec.from_hf(p, head_dim, max_pos, where=where)
    if spec.dim != head_dim:
        raise r.refuse("rope_parameters.partial_rotary_factor",
                       p.get("partial_rotary_factor"), (1.0,),
                       "the Llama family rotates the whole head")
    return spec


CONFIG_CLASS = LlamaConfig


def init_cache(
    cfg: LlamaConfig, batch_size: int, max_len: int, *, dtype: Any = jnp.float32,
    gsm_max_window: int | None = None, paged: tuple[int, int] | None = None,
) -> KVCache:
    """An empty KV cache of `batch_size` rows of `max_len` tokens; `paged` = (pages, page
    size): a pool of that many pages shared by the rows (`common.init_paged_kv_cache`,
    the serving engine's)."""
    if paged is not None:
        return common.init_paged_kv_cache(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.site_sizes, batch_size,
            max_len, int(paged[0]), int(paged[1]), dtype=dtype,
            gsm_max_window=gsm_max_window, kv_dtype=cfg.kv_cache_dtype)
    return common.init_kv_cache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.site_sizes,
                                batch_size, max_len, dtype=dtype, gsm_max_window=gsm_max_window,
                                kv_dtype=cfg.kv_cache_dtype)


def cache_insert(cache: KVCache, rows: KVCache, slots: jax.Array) -> KVCache:
    """Copy the rows of `rows` (same max_len) into `cache` at batch indices `slots` [b]:
    continuous batching, a request prefilled on its own joins a running batch."""
    return common.insert_rows(cache, rows, slots)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP with fused QKV and gate/up projections.

    Weights are stored [in, out] (x @ W); q/k/v and gate/up are concatenated so each is
    one matmul.
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
        if cfg.qk_norm:
            self.q_norm = self.param("q_norm", nn.initializers.ones, (cfg.head_dim,))
            self.k_norm = self.param("k_norm", nn.initializers.ones, (cfg.head_dim,))
        self.o = projection_param(self, "o", init, (cfg.q_size, d))
        if cfg.o_bias:
            self.o_bias = self.param("o_bias", nn.initializers.zeros, (d,))
        self.ffn_norm = self.param("ffn_norm", nn.initializers.ones, (d,))
        self.gate_up = projection_param(self, "gate_up", init, (d, 2 * cfg.intermediate_size))
        self.down = projection_param(self, "down", init, (cfg.intermediate_size, d))

    def create_params(self) -> None:
        _ = self.attn_norm  # reading an attribute runs setup(), which declares every weight

    def __call__(self, x, cache, step: common.Step, layer):
        """x [B, T, D] -> (x, this layer's (k, v) cache or None), in any step mode."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        b, t = x.shape[:2]
        h = rms_norm(x, self.attn_norm, eps)
        qkv = step.linear(layer, "qkv", h, self.qkv)
        if cfg.attention_bias:
            qkv = qkv + self.qkv_bias.astype(x.dtype)
        q, k, v = jnp.split(qkv, [cfg.q_size, cfg.q_size + cfg.kv_size], axis=-1)
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm of q and k, before RoPE
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        q, k = _rope(cfg, q, step.rope_positions), _rope(cfg, k, step.rope_positions)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        attn, cache = common.kv_attention(q, k, v, cache, step, kv_dtype=cfg.kv_cache_dtype)
        attn = step.site(layer, ATTN_OUT, attn, self.o)  # GSM site attn_out
        out = step.linear(layer, "o", attn, self.o)
        if cfg.o_bias:
            out = out + self.o_bias.astype(x.dtype)
        x = x + out
        h = rms_norm(x, self.ffn_norm, eps)
        gate, up = jnp.split(step.linear(layer, "gate_up", h, self.gate_up), 2, axis=-1)
        mid = step.site(layer, FFN_MID, jax.nn.silu(gate) * up, self.down)  # GSM site ffn_mid
        return x + step.linear(layer, "down", mid, self.down), cache


def _rope(cfg: LlamaConfig, x: jax.Array, positions: jax.Array) -> jax.Array:
    """Rotate-half RoPE of `cfg`: plain of rope_theta, or the scaled `cfg.rope`."""
    if cfg.rope is None:
        return apply_rope(x, positions, cfg.rope_theta)
    return apply_rope(x, positions, inv_freq=cfg.rope.inv_freq(),
                      attention_factor=cfg.rope.attention_factor)


def layer(cfg: LlamaConfig, weights: dict, index, x: jax.Array, cache, step: common.Step):
    """The family's one layer: `DecoderLayer` applied to one layer's weights."""
    return DecoderLayer(cfg).apply({"params": weights}, x, cache, step, index)


class Llama(nn.Module):
    """The (stacked) parameter tree, for `init` only (abstract-first with `jax.eval_shape`,
    and random models for tests); the entry points below run `layer` themselves."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.cfg
        self.param("embed", nn.initializers.normal(0.02), (cfg.vocab_size, cfg.hidden_size))
        nn.vmap(DecoderLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                in_axes=(), out_axes=0, axis_size=cfg.num_layers, methods=["create_params"],
                )(cfg, name="layers").create_params()
        self.param("final_norm", nn.initializers.ones, (cfg.hidden_size,))
        if not cfg.tie_word_embeddings:
            self.param("lm_head", nn.initializers.normal(0.02), (cfg.hidden_size, cfg.vocab_size))
        return tokens


def init_weights(cfg: LlamaConfig, rng: jax.Array, dtype: Any = jnp.float32) -> dict:
    """Random weights (tests, benchmarks): the same tree the loaders produce (stacked)."""
    tokens = jnp.zeros((1, 2), jnp.int32)
    params = Llama(cfg).init(rng, tokens)["params"]
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    return jax.tree.map(lambda a: a, dict(params))


def weight_shapes(cfg: LlamaConfig, dtype: Any = jnp.float32) -> dict:
    """The weight tree as ShapeDtypeStructs, without allocating (abstract-first init)."""
    return jax.eval_shape(lambda: init_weights(cfg, jax.random.key(0), dtype))


# ----------------------------------------------------------------------------- entry points


def embed(weights: dict, cfg: LlamaConfig, tokens: jax.Array) -> jax.Array:
    return common.embed(weights, tokens)


def logits(weights: dict, cfg: LlamaConfig, x: jax.Array) -> jax.Array:
    """Final norm + LM head: hidden states [..., D] -> logits [..., V] (f32)."""
    x = rms_norm(x, weights["final_norm"], cfg.rms_norm_eps)
    return common.lm_head(weights, x, cfg.tie_word_embeddings)


def _run(weights: dict, cfg: LlamaConfig, tokens: jax.Array, cache: KVCache | None,
         step: common.Step):
    x = embed(weights, cfg, tokens)
    layers = common.layer_weights(weights, cfg.num_layers, scan_ok=True)
    pieces = None if cache is None else common.kv_pieces(cache)
    x, pieces, sown = common.run_layers(layer, cfg, layers, x, pieces, step)
    return x, (None if cache is None else common.kv_from_pieces(pieces, step, cache)), sown


def hidden_states(weights: dict, cfg: LlamaConfig, tokens: jax.Array, lengths: jax.Array,
                  sites: Sites | None = None) -> tuple[jax.Array, dict]:
    """Teacher-forced hidden states [B, T, D] (before the final norm) and what the hooks
    sowed, {name: [L, ...]} (`models/sites.py`)."""
    x, _, sown = _run(weights, cfg, tokens, None,
                      common.forward_step(lengths, tokens.shape[1], sites))
    return x, sown


@takes_sites
def forward(weights: dict, cfg: LlamaConfig, tokens: jax.Array, lengths: jax.Array,
            sites: Sites | None = None) -> jax.Array:
    """Teacher-forced logits [B, T, V] (f32) over right-padded rows of `lengths` tokens."""
    return logits(weights, cfg, hidden_states(weights, cfg, tokens, lengths, sites)[0])


@takes_sites
def prefill(weights: dict, cfg: LlamaConfig, tokens: jax.Array, lengths: jax.Array,
            cache: KVCache, sites: Sites | None = None) -> tuple[jax.Array, KVCache]:
    """Fill a fresh cache with right-padded prompts; return each row's last-token logits [B, V]."""
    step = common.prefill_step(lengths, tokens.shape[1], cache, sites)
    x, cache, _ = _run(weights, cfg, tokens, cache, step)
    return logits(weights, cfg, common.last_token(x, lengths)), cache


@takes_sites
def extend(weights: dict, cfg: LlamaConfig, tokens: jax.Array, n_new: jax.Array,
           cache: KVCache, sites: Sites | None = None, *,
           all_logits: bool = False, hidden: bool = False) -> tuple[jax.Array, KVCache]:
    """Append a chunk of prompt tokens [B, C] (the first `n_new` [B] of each row real) to
    rows already holding `cache.lengths` tokens: chunked prefill. Returns the logits of
    each row's last new token [B, V] (all_logits: of every chunk position, [B, C, V],
    what a speculative verifier needs) and the cache; the same as one prefill over the
    whole prompt (tested), GSM windows included."""
    step = common.extend_step(n_new, tokens.shape[1], cache, sites)
    x, cache, _ = _run(weights, cfg, tokens, cache, step)
    if hidden:  # what `logits` takes, every position: the serving engine's
        return x, cache
    if all_logits:
        return logits(weights, cfg, x), cache
    return logits(weights, cfg, common.last_token(x, n_new)), cache


@takes_sites
def decode_step(weights: dict, cfg: LlamaConfig, tokens: jax.Array, cache: KVCache,
                sites: Sites | None = None,
                active: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """One token per row at position `cache.lengths`; returns logits [B, V] and the new cache.

    Rows with active=False still compute (static shapes) but do not advance and
    their GSM rings are left untouched; their cache slot is overwritten later.
    """
    step = common.decode_step_ctx(cache, active, sites)
    x, cache, _ = _run(weights, cfg, tokens[:, None], cache, step)
    return logits(weights, cfg, x[:, 0]), cache


# ----------------------------------------------------------------------------- family contract
# What the runtime (gsm_jax.families and the tools above it) reads from this module beside
# its entry points; docs/adding_a_family.md lists every name.

FAMILY = "llama"
TITLE = "Llama"  # in messages
HF_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")  # Hugging Face model_types it loads
DRAFTER = None  # no speculative drafter of its own (models/contract.py, `Drafter`)

# Logical axes of each weight of the float layout ([..., in, out] projections), by leaf name
# (mesh axes by `partitioning.RULES`); a leaf not listed is replicated whole, a leading
# stacked [L] axis is replicated.
LOGICAL_AXES = {
    "embed": ("vocab", None),
    "lm_head": (None, "vocab"),
    "qkv": (None, "heads"),
    "qkv_bias": ("heads",),
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
    gate_up and down, and whether `weights` held per-layer arrays instead."""
    return stack_layers(dict(weights)), is_per_layer(weights)


def unstack_dense(weights: dict, per_layer: bool) -> dict:
    """`weights` (stacked) back in the layout `stack_dense` found."""
    return unstack_layers(weights) if per_layer else weights
