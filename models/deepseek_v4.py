"""DeepSeek-V4 decoder in Flax, with per-layer-type decode caches and GSM sites.

The family's model, laid out like `llama.py`: the config, the modules, one
`layer` (`DecoderLayer.__call__`, the same code in every step mode of
`models/common.py`), and the entry points, thin wrappers over `common.run_layers`:
`hidden_states` / `forward` (teacher forcing), `prefill`, `extend` (a chunk after what
each row holds: chunked prefill) and `decode_step`; plus `init_cache`, `cache_insert`,
`init_weights`. Beside it: `deepseek_v4_checkpoint.py` (checkpoints read and converted:
`weights_from_hf`, `load_checkpoint`), `deepseek_v4_plan.py` (the planner's `PLANNER`) and
`deepseek_common.py` (what V4.1 computes alike).

The architecture, block by block (names follow the Hugging Face reference,
`transformers.models.deepseek_v4`):

- Residual stream: `hc_mult` parallel streams [B, T, N, D] (manifold-constrained
  hyper-connections). Before each sub-block a `HyperConnection` computes, from the
  RMS-normalised flattened streams, `pre` (collapse weights), `post` (expand
  weights) and `comb` (an N x N mixing matrix projected onto the doubly
  stochastic matrices by Sinkhorn iterations). The block sees
  sum_n pre_n * h_n; the streams become post_n * block_out + sum_j comb[j, n] h_j.
  After the last layer a hyper head collapses the streams (sigmoid weights).
- Attention: one shared K=V head (multi-query), low-rank queries
  (q_a -> RMSNorm -> q_b, then a weightless per-head RMSNorm), partial interleaved
  RoPE on the trailing `rope_dim` channels, per-head attention sinks (an extra
  logit per head that takes probability mass but has no value). Because V = K
  carries RoPE, the output's rope slice is rotated back by the query position.
  The output goes through the grouped low-rank projection (o_a per head group,
  then o_b). Every layer attends to a sliding window of `sliding_window` raw
  tokens; the other two layer types add compressed entries:
  * heavily compressed attention (HCA): every `rate` tokens are pooled (softmax
    over the block, per channel, of a learned gate + position bias) into one
    entry, RoPE'd at the block's first position; a query sees the entries of the
    blocks that ended at or before it;
  * compressed sparse attention (CSA): same, but entry w pools two series over
    the previous block and block w (width 2*rate, stride rate), and a lightning
    indexer (its own smaller compressor + multi-head ReLU scores) keeps the
    `index_topk` best visible entries per query.
  Sliding layers use the "main" RoPE; CSA/HCA layers (their attention, compressor
  and indexer) use the "compress" RoPE, which may be YaRN-scaled.
- MoE feed-forward: routed experts (SwiGLU with the pre-activations clipped to
  `swiglu_limit`) plus one always-on shared expert. Routing is either learned
  top-k (sqrtsoftplus / sigmoid / softmax scores, a score-correction bias that
  only affects the choice) or a frozen token-id -> experts table (`hash_moe`).
  The chosen scores are renormalised and scaled by `routed_scaling_factor`.

Caches (per layer, per row; a position's slot is a function of the position, so
ragged rows share one layout): the sliding window is a ring of the last
min(sliding_window, max_len) K=V vectors; compressed layers add the compressed
entries emitted so far and a ring of the raw kv/gate projections of the block
still being compressed (for CSA also the previous block, whose first series
the next entry needs). Writes happen before reads; an inactive row's writes are
masked, so it neither advances nor changes its state.

Layers differ by type, so the layer loop is unrolled (a tuple of per-layer weights;
one traced body per layer, compile time grows with depth). Prefill attention
materialises [B, H, T, T + entries] scores and an extend chunk of C tokens
[B, H, C, window + C + entries]: fine for the prompt lengths used here, not for
very long contexts.

Hooks (`models/sites.py`): the GSM sites go through `step.site` (`attn_out`: the input
of the grouped output projection, all heads, after the inverse rotation; `ffn_mid`: the
shared expert's intermediate), the plain projections through `step.linear` under their
leaf names ("q_a", "q_b", "kv", "o_b", "router", "shared_gate_up", "shared_down"), the
nested ones prefixed ("compressor.kv_gate", "indexer.q_b", "indexer.weights_proj",
"indexer.compressor.kv_gate"). o_a (a grouped product), the routed experts and the
hyper-connections are not projections through the hooks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gsm_jax.errors import UnsupportedModelError
from gsm_jax.in_place import scatter_set
from gsm_jax.models import common
from gsm_jax.models import deepseek_common as dc
from gsm_jax.models.block_quant import projection_param
from gsm_jax.models.common import Step
from gsm_jax.models.deepseek_v4_checkpoint import (  # noqa: F401  (contract hooks)
    load_checkpoint,
    weights_from_hf,
)
from gsm_jax.models.deepseek_v4_plan import PLANNER  # noqa: F401  (contract: the planner's)
from gsm_jax.models.hf_config import PRETRAINED_KEYS, ConfigReader, rope_settings
from gsm_jax.models.linear import linear
from gsm_jax.models.moe import DISPATCHES, routed_experts, swiglu
from gsm_jax.models.rope import RopeSpec  # noqa: F401  (re-exported: old imports)
from gsm_jax.models.sites import ATTN_OUT, FFN_MID, Sites, takes_sites

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
_LEGACY_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class DeepseekV4Config:
    """Static model configuration (hashable: it is a static argument under jit)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    main_rope: RopeSpec
    compress_rope: RopeSpec
    sliding_window: int = 128
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    model_type: str = "deepseek_v4"
    # runtime knob, not a checkpoint key: how routed experts combine across the mesh's
    # "model" axis ("auto", "psum", "all_to_all"; see models/moe.py)
    expert_dispatch: str = "auto"

    family = "deepseek_v4"

    def __post_init__(self) -> None:
        # accept the dict/list forms `dataclasses.asdict` + JSON give back (saved checkpoints)
        for name in ("main_rope", "compress_rope"):
            value = getattr(self, name)
            if isinstance(value, dict):
                object.__setattr__(self, name, RopeSpec(**value))
        for name in ("layer_types", "mlp_layer_types", "eos_token_ids"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if self.expert_dispatch not in DISPATCHES:
            raise UnsupportedModelError(
                f"expert_dispatch {self.expert_dispatch!r} is not one of {DISPATCHES}")

    @property
    def site_sizes(self) -> tuple[int, int]:
        """Channel count of the `attn_out` and `ffn_mid` sites."""
        return (self.num_heads * self.head_dim, self.moe_intermediate_size)

    def compress_rate(self, layer: int) -> int:
        t = self.layer_types[layer]
        return {SLIDING: 0, CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}[t]

    def rope(self, layer: int) -> RopeSpec:
        return self.main_rope if self.layer_types[layer] == SLIDING else self.compress_rope

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> DeepseekV4Config:
        """Build from a Hugging Face `config.json` dict; refuse what is not implemented.

        Defaults and legacy keys follow `transformers`' DeepseekV4Config. Ignored on
        purpose (as in the reference): training-only knobs (dropout, router jitter,
        aux loss), `norm_topk_prob` (the reference always renormalises the chosen
        scores) and `num_nextn_predict_layers` (the MTP block's weights are loaded and
        kept, `weights["mtp"]`, but nothing runs it). `quantization_config` /
        `expert_dtype` (FP8 / FP4 checkpoints) are checked by
        `deepseek_v4_checkpoint.check_quantization_config`; the formats themselves are
        read off the tensors.
        """
        r = ConfigReader(hf, "deepseek_v4")
        hf = r.data
        if r.value("model_type") != "deepseek_v4":
            raise UnsupportedModelError(
                f"model_type {r.value('model_type')!r} is not deepseek_v4"
            )
        checks = [
            ("hidden_act", r.value("hidden_act", "silu") == "silu", "only silu is supported"),
            ("mlp_bias", not r.value("mlp_bias", False), "biases are not supported"),
            ("attention_bias", not r.value("attention_bias", False), "biases are not supported"),
            ("num_key_value_heads", int(r.value("num_key_value_heads", 1) or 1) == 1,
             "DeepSeek-V4 attention has one shared K=V head"),
            ("n_shared_experts", int(r.value("n_shared_experts", 1)) == 1,
             "only one shared expert (the reference's layout) is supported"),
            ("scoring_func", r.value("scoring_func", "sqrtsoftplus") in SCORING_FUNCS,
             f"supported: {SCORING_FUNCS}"),
        ]
        from gsm_jax.models.deepseek_v4_checkpoint import check_quantization_config

        check_quantization_config(hf)  # FP8 / FP4 checkpoints: refused only when unknown
        r.mark("quantization_config", "expert_dtype")
        for key, ok, why in checks:
            if not ok:
                raise UnsupportedModelError(f"config field {key}={r.value(key)!r}: {why}")

        n = int(r.value("num_hidden_layers", 43))
        head_dim = int(r.value("head_dim", 512))
        rates = {CSA: 4, HCA: 128, **(r.value("compress_rates") or {})}
        if r.value("compress_rate_csa") is not None:
            rates[CSA] = hf["compress_rate_csa"]
        if r.value("compress_rate_hca") is not None:
            rates[HCA] = hf["compress_rate_hca"]
        layer_types = r.value("layer_types")
        if layer_types is None and r.value("compress_ratios") is not None:
            bad = [x for x in hf["compress_ratios"] if x not in _LEGACY_RATIO_TO_TYPE]
            if bad:
                raise UnsupportedModelError(f"config field compress_ratios has values {bad}")
            layer_types = [_LEGACY_RATIO_TO_TYPE[x] for x in hf["compress_ratios"]]
        if layer_types is None:
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = r.value("mlp_layer_types")
        n_hash = r.value("num_hash_layers")  # the legacy form of mlp_layer_types
        if mlp_types is None:
            n_hash = 3 if n_hash is None else int(n_hash)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        for name, types, allowed in (("layer_types", layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", mlp_types, MLP_LAYER_TYPES)):
            if len(types) < n:
                raise UnsupportedModelError(f"config field {name} has {len(types)} entries "
                                            f"for {n} layers")
            bad = sorted({t for t in types[:n] if t not in allowed})
            if bad:
                raise UnsupportedModelError(f"config field {name} has unsupported values {bad}")

        prf = r.value("partial_rotary_factor")
        qk = r.value("qk_rope_head_dim")  # the same in channels (transformers 5 writes both)
        if prf is None:
            prf = qk / head_dim if qk is not None else 64 / 512
        elif qk is not None and round(float(prf) * head_dim) != int(qk):
            raise UnsupportedModelError(
                f"deepseek_v4 config: partial_rotary_factor={prf!r} x head_dim={head_dim} and "
                f"qk_rope_head_dim={qk!r} disagree")
        max_pos = int(r.value("max_position_embeddings", 1048576))
        # rope_parameters (transformers 5) or rope_scaling (earlier), refused when they
        # disagree; the top-level rope_theta is the main RoPE's (read below)
        rp = rope_settings(r, merge_theta=False)
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main_p, comp_p = rp["main"], rp["compress"]
            # transformers 5 writes the top-level thetas too, as legacy mirrors it does not
            # keep in sync (rope_parameters.compress.rope_theta 5e4 beside a default
            # compress_rope_theta 1.6e5); its model uses the nested ones, and so do we
            r.mark("rope_theta", "compress_rope_theta")
        else:
            main_p = {"rope_type": "default", "rope_theta": r.value("rope_theta", 10000.0),
                      "partial_rotary_factor": prf}
            comp_p = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            comp_p.update(rope_theta=r.value("compress_rope_theta", 160000.0),
                          partial_rotary_factor=prf)
            comp_p.setdefault("rope_type", "default")  # rope_settings read "type" already
            if comp_p["rope_type"] == "yarn":
                comp_p.setdefault("attention_factor", 1.0)
        main_rope = RopeSpec.from_hf(main_p, head_dim, max_pos, "main")
        compress_rope = RopeSpec.from_hf(comp_p, head_dim, max_pos, "compress")

        eos = r.value("eos_token_id", 1)
        eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
        cfg = cls(
            vocab_size=int(r.value("vocab_size", 129280)),
            hidden_size=int(r.value("hidden_size", 4096)),
            num_layers=n,
            num_heads=int(r.value("num_attention_heads", 64)),
            head_dim=head_dim,
            q_lora_rank=int(r.value("q_lora_rank", 1024)),
            o_groups=int(r.value("o_groups", 8)),
            o_lora_rank=int(r.value("o_lora_rank", 1024)),
            layer_types=tuple(layer_types[:n]),
            mlp_layer_types=tuple(mlp_types[:n]),
            n_routed_experts=int(r.value("n_routed_experts", 256)),
            num_experts_per_tok=int(r.value("num_experts_per_tok", 6)),
            moe_intermediate_size=int(r.value("moe_intermediate_size", 2048)),
            main_rope=main_rope,
            compress_rope=compress_rope,
            sliding_window=int(r.value("sliding_window", 128)),
            compress_rate_csa=int(rates[CSA]),
            compress_rate_hca=int(rates[HCA]),
            index_n_heads=int(r.value("index_n_heads", 64)),
            index_head_dim=int(r.value("index_head_dim", 128)),
            index_topk=int(r.value("index_topk", 512)),
            hc_mult=int(r.value("hc_mult", 4)),
            hc_sinkhorn_iters=int(r.value("hc_sinkhorn_iters", 20)),
            hc_eps=float(r.value("hc_eps", 1e-6)),
            scoring_func=r.value("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=float(r.value("routed_scaling_factor", 1.5)),
            swiglu_limit=float(r.value("swiglu_limit", 10.0)),
            rms_norm_eps=float(r.value("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(r.value("tie_word_embeddings", False)),
            bos_token_id=r.value("bos_token_id", 0),
            eos_token_ids=tuple(int(e) for e in eos_ids),
        )
        cfg.validate()
        r.finish(HARMLESS)
        return cfg

    def validate(self) -> None:
        """Shape constraints the reference assumes implicitly; violations are refused."""
        problems = []
        for label, spec in (("main", self.main_rope), ("compress", self.compress_rope)):
            if spec.dim % 2 or not 0 < spec.dim <= self.head_dim:
                problems.append(f"{label} rope dim {spec.dim} must be even and in (0, head_dim]")
        if CSA in self.layer_types and self.compress_rope.dim > self.index_head_dim:
            problems.append("the rope dim exceeds index_head_dim")
        if (self.num_heads * self.head_dim) % self.o_groups:
            problems.append("num_attention_heads * head_dim is not divisible by o_groups")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            problems.append("num_experts_per_tok must be in [1, n_routed_experts]")
        for name in ("sliding_window", "compress_rate_csa", "compress_rate_hca", "hc_mult",
                     "index_topk", "hc_sinkhorn_iters"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.scoring_func not in SCORING_FUNCS:
            problems.append(f"scoring_func {self.scoring_func!r} (supported: {SCORING_FUNCS})")
        if problems:
            raise UnsupportedModelError("unsupported DeepSeek-V4 config: " + "; ".join(problems))


# Keys transformers' DeepseekV4Config writes that do not change inference here (one word why).
HARMLESS: dict[str, str] = {
    **PRETRAINED_KEYS,
    "bos_token_id": "tokenizer",  # read for the config record; the model never reads it
    "norm_topk_prob": "reference",  # the reference always renormalises the chosen scores
    "num_nextn_predict_layers": "drafter",  # MTP weights are kept (weights["mtp"]), not run
    "topk_method": "reference",  # the reference routes one way whatever the key says
    "router_aux_loss_coef": "training",
    "router_jitter_noise": "training",
    "output_router_logits": "training",
}


CONFIG_CLASS = DeepseekV4Config


# ----------------------------------------------------------------------------- cache


@struct.dataclass
class LayerCache:
    """One layer's decode state (rows = batch; slots are functions of positions).

    window:     [B, Wc, hd] RoPE'd K=V of the last Wc = min(sliding_window, max_len)
                tokens; position p lives in slot p % Wc.
    comp:       [B, Nc, hd] compressed entries (CSA/HCA), entry w in slot w,
                Nc = ceil(max_len / rate). Entry w is written when the token at
                position (w + 1) * rate - 1 arrives.
    comp_ring:  [B, R, F] raw kv|gate projections of the block being compressed,
                position p in slot p % R (HCA: R = rate; CSA: R = 2 * rate, the
                previous block too, whose first series the next entry pools).
    index, index_ring: the same two for the CSA lightning indexer (at index_head_dim).
    """

    window: jax.Array
    comp: jax.Array | None = None
    comp_ring: jax.Array | None = None
    index: jax.Array | None = None
    index_ring: jax.Array | None = None


@struct.dataclass
class DeepseekV4Cache:
    """Per-layer caches, per-row lengths, and the GSM ring buffers.

    lengths: [B] tokens already in the cache (= the position of the next token).
    rings: per site [layers, B, max_window, C] raw site inputs (see gsm_sites), or None.
    max_len: the positions a row can hold (static; `init_cache`'s max_len).
    """

    layers: tuple[LayerCache, ...]
    lengths: jax.Array
    rings: tuple[jax.Array, jax.Array] | None = None
    max_len: int | None = struct.field(pytree_node=False, default=None)


def _layer_cache_shapes(cfg: DeepseekV4Config, layer: int, batch: int, max_len: int) -> dict:
    hd, t = cfg.head_dim, cfg.layer_types[layer]
    shapes = {"window": (batch, min(cfg.sliding_window, max_len), hd)}
    if t != SLIDING:
        rate = cfg.compress_rate(layer)
        n_entries = -(-max_len // rate)
        series = 2 if t == CSA else 1  # CSA keeps the previous block for the overlap
        shapes["comp"] = (batch, n_entries, hd)
        shapes["comp_ring"] = (batch, series * rate, 2 * series * hd)
        if t == CSA:
            ci = cfg.index_head_dim
            shapes["index"] = (batch, n_entries, ci)
            shapes["index_ring"] = (batch, 2 * rate, 4 * ci)
    return shapes


def init_cache(
    cfg: DeepseekV4Config, batch_size: int, max_len: int, *, dtype: Any = jnp.float32,
    gsm_max_window: int | None = None,
) -> DeepseekV4Cache:
    layers = tuple(
        LayerCache(**{k: jnp.zeros(s, dtype)
                      for k, s in _layer_cache_shapes(cfg, i, batch_size, max_len).items()})
        for i in range(cfg.num_layers)
    )
    rings = None
    if gsm_max_window is not None:
        rings = tuple(jnp.zeros((cfg.num_layers, batch_size, gsm_max_window, c), dtype)
                      for c in cfg.site_sizes)
    return DeepseekV4Cache(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32),
                           rings=rings, max_len=max_len)


def cache_insert(cache: DeepseekV4Cache, rows: DeepseekV4Cache,
                 slots: jax.Array) -> DeepseekV4Cache:
    """Copy the rows of `rows` (same max_len) into `cache` at batch indices `slots` [b].

    Continuous batching: a request prefilled on its own joins a running batch.
    """
    return common.insert_rows(cache, rows, slots)


def _ring_from_sequence(seq: jax.Array, lengths: jax.Array, size: int) -> jax.Array:
    """[B, T, F] -> [B, size, F]: slot s holds the last position q < length with q % size == s."""
    last = (lengths - 1)[:, None]
    q = last - ((last - jnp.arange(size)[None, :]) % size)
    got = jnp.take_along_axis(seq, jnp.clip(q, 0, seq.shape[1] - 1)[..., None], axis=1)
    return jnp.where((q >= 0)[..., None], got, 0).astype(seq.dtype)


def _write_rows(buf: jax.Array, slot: jax.Array, value: jax.Array, when: jax.Array) -> jax.Array:
    """buf[b, slot[b]] = value[b] for rows where `when`; other rows keep their slot.

    A scatter at batch 1 too (`scatter_set`): as a one-row `.at[].set` XLA:CPU made it a
    select-and-update over the whole buffer, copying each CSA layer's compressed KV and
    index keys (twice) every decode step: 12 copies of 4 MiB at a 64k-token context on
    the mid V4 (benchmarks/bench_long_context.py)."""
    rows = jnp.arange(buf.shape[0])
    old = buf[rows, slot]
    new = jnp.where(when.reshape((-1,) + (1,) * (value.ndim - 1)), value.astype(buf.dtype), old)
    return scatter_set(buf, (rows, slot), new, mode="promise_in_bounds")


# ----------------------------------------------------------------------------- numerics


def unweighted_rms_norm(x: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps).astype(x.dtype)


def pool_entries(kv: jax.Array, gate: jax.Array, norm: jax.Array, eps: float) -> jax.Array:
    """Softmax-over-slots pooling of [..., S, d] (per channel), then RMSNorm -> [..., d]."""
    weights = jax.nn.softmax(gate.astype(jnp.float32), axis=-2)
    return dc.rms_norm(jnp.sum(kv * weights.astype(kv.dtype), axis=-2), norm, eps)


# ----------------------------------------------------------------------------- modules

_init = nn.initializers.normal(0.02)
_small = nn.initializers.normal(0.5)  # sinks, biases: random so tests exercise them


def _weight(module: nn.Module, name: str, shape: tuple[int, ...]) -> Any:
    return projection_param(module, name, _init, shape)


class HyperConnection(nn.Module):
    """mHC weights from the N streams: (post [B,T,N], comb [B,T,N,N], collapsed [B,T,D])."""

    cfg: DeepseekV4Config

    def setup(self) -> None:
        n, d = self.cfg.hc_mult, self.cfg.hidden_size
        self.fn = self.param("fn", _init, (n * d, (2 + n) * n), jnp.float32)
        self.base = self.param("base", _small, ((2 + n) * n,), jnp.float32)
        self.scale = self.param("scale", nn.initializers.ones, (3,), jnp.float32)

    def __call__(self, h: jax.Array):
        cfg, n = self.cfg, self.cfg.hc_mult
        flat = h.reshape(h.shape[:2] + (-1,)).astype(jnp.float32)
        flat = unweighted_rms_norm(flat, cfg.rms_norm_eps)
        mixes = flat @ self.fn.astype(jnp.float32)
        pre_w, post_w, comb_w = jnp.split(mixes, [n, 2 * n], axis=-1)
        pre_b, post_b, comb_b = jnp.split(self.base.astype(jnp.float32), [n, 2 * n])
        s = self.scale.astype(jnp.float32)
        pre = jax.nn.sigmoid(pre_w * s[0] + pre_b) + cfg.hc_eps
        post = 2 * jax.nn.sigmoid(post_w * s[1] + post_b)
        comb = comb_w.reshape(comb_w.shape[:-1] + (n, n)) * s[2] + comb_b.reshape(n, n)
        comb = jax.nn.softmax(comb, axis=-1) + cfg.hc_eps
        # Sinkhorn: columns, then (rows, columns) x (iters - 1) -> doubly stochastic
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + cfg.hc_eps)

        def sinkhorn(_, c):
            c = c / (jnp.sum(c, axis=-1, keepdims=True) + cfg.hc_eps)
            return c / (jnp.sum(c, axis=-2, keepdims=True) + cfg.hc_eps)

        comb = jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, sinkhorn, comb)
        collapsed = dc.weighted_streams(pre, h)
        return post, comb, collapsed


class Compressor(nn.Module):
    """Pools blocks of `rate` tokens into single entries of `dim` channels.

    overlap=False (HCA): entry w pools block w. overlap=True (CSA and its indexer):
    projections carry two series, entry w pools series a of block w - 1 with series
    b of block w (the missing block before the first is given zero weight). The raw
    projections (`kv_gate`, [kv | gate]) are computed by the caller, through the hooks.
    """

    cfg: DeepseekV4Config
    rate: int
    dim: int
    overlap: bool

    @property
    def series(self) -> int:
        return 2 if self.overlap else 1

    def setup(self) -> None:
        d, f = self.cfg.hidden_size, self.series * self.dim
        self.kv_gate = _weight(self, "kv_gate", (d, 2 * f))  # [kv | gate]
        self.position_bias = self.param("position_bias", _small, (self.rate, f), jnp.float32)
        self.norm = self.param("norm", nn.initializers.ones, (self.dim,), jnp.float32)

    def _slots(self, cur: jax.Array, prev: jax.Array | None, prev_ok: jax.Array | None):
        """Raw [..., rate, 2F] block projections -> (kv, gate) [..., S, dim] to pool over."""
        f, dim = self.series * self.dim, self.dim
        kv, gate = cur[..., :f], cur[..., f:] + self.position_bias
        if not self.overlap:
            return kv, gate
        pkv, pgate = prev[..., :f], prev[..., f:] + self.position_bias
        pgate = jnp.where(prev_ok, pgate, -jnp.inf)
        kv = jnp.concatenate([pkv[..., :dim], kv[..., dim:]], axis=-2)
        gate = jnp.concatenate([pgate[..., :dim], gate[..., dim:]], axis=-2)
        return kv, gate

    def entries(self, kvg: jax.Array, rope: RopeSpec) -> jax.Array:
        """All blocks of a sequence [B, T, 2F] -> [B, ceil(T / rate), dim].

        The last block may hold padding; its entry is never visible to a real
        query (a query at p sees entries w < (p + 1) // rate).
        """
        b, t, f2 = kvg.shape
        n = -(-t // self.rate)
        kvg = jnp.pad(kvg, ((0, 0), (0, n * self.rate - t), (0, 0)))
        cur = kvg.reshape(b, n, self.rate, f2)
        prev = prev_ok = None
        if self.overlap:
            prev = jnp.concatenate([jnp.zeros_like(cur[:, :1]), cur[:, :-1]], axis=1)
            prev_ok = (jnp.arange(n) > 0)[None, :, None, None]
        kv, gate = self._slots(cur, prev, prev_ok)
        pooled = pool_entries(kv, gate, self.norm, self.cfg.rms_norm_eps)
        cos, sin = dc.rope_cos_sin(rope, jnp.arange(n) * self.rate)
        return dc.apply_rope(pooled, cos[None], sin[None])

    def entries_at(self, seq: jax.Array, seq_start: jax.Array, w: jax.Array,
                   rope: RopeSpec) -> jax.Array:
        """Entries w [B, n] of each row from raw projections seq [B, L, 2F] in which
        seq[b, i] is position seq_start[b] + i -> [B, n, dim]. The blocks an entry
        pools must lie in seq (other w give garbage, for the caller to drop)."""
        rows = jnp.arange(seq.shape[0])[:, None, None]
        j = jnp.arange(self.rate)

        def block(first):  # [B, n] first positions -> [B, n, rate, 2F]
            idx = first[..., None] + j - seq_start[:, None, None]
            return seq[rows, jnp.clip(idx, 0, seq.shape[1] - 1)]

        cur = block(w * self.rate)
        prev = prev_ok = None
        if self.overlap:
            prev, prev_ok = block((w - 1) * self.rate), (w > 0)[..., None, None]
        kv, gate = self._slots(cur, prev, prev_ok)
        pooled = pool_entries(kv, gate, self.norm, self.cfg.rms_norm_eps)
        cos, sin = dc.rope_cos_sin(rope, w * self.rate)
        return dc.apply_rope(pooled, cos, sin)

    def entry_from_ring(self, ring: jax.Array, w: jax.Array, rope: RopeSpec) -> jax.Array:
        """Entry w [B] of each row from its ring [B, R, 2F] (block w complete in it) -> [B, dim]."""
        j = jnp.arange(self.rate)[None, :]
        size = ring.shape[1]
        cur = jnp.take_along_axis(ring, ((w[:, None] * self.rate + j) % size)[..., None], axis=1)
        prev = prev_ok = None
        if self.overlap:
            prev_pos = (w[:, None] - 1) * self.rate + j
            prev = jnp.take_along_axis(ring, (prev_pos % size)[..., None], axis=1)
            prev_ok = (w > 0)[:, None, None]
        kv, gate = self._slots(cur, prev, prev_ok)
        pooled = pool_entries(kv, gate, self.norm, self.cfg.rms_norm_eps)
        cos, sin = dc.rope_cos_sin(rope, w * self.rate)
        return dc.apply_rope(pooled, cos, sin)


def topk_select(scores: jax.Array, visible: jax.Array, k: int) -> jax.Array:
    """[..., n] bool: the (up to) k highest-scoring visible entries (`topk_indices`)."""
    return dc.entries_mask(*dc.topk_indices(scores, visible, k), scores.shape[-1])


def _plain_linear(name: str, x: Any, w: Any) -> jax.Array:
    del name
    return linear(x, w)


class Indexer(nn.Module):
    """Lightning indexer: scores compressed entries per query, keeps the top `index_topk`."""

    cfg: DeepseekV4Config

    def setup(self) -> None:
        cfg = self.cfg
        self.compressor = Compressor(cfg, cfg.compress_rate_csa, cfg.index_head_dim, True)
        self.q_b = _weight(self, "q_b", (cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim))
        self.weights_proj = _weight(self, "weights_proj", (cfg.hidden_size, cfg.index_n_heads))

    def scores(self, x, q_res, positions, keys, lin=_plain_linear):
        """x [B,T,D], q_res [B,T,q_lora], keys [B,n,ci] -> index scores [B,T,n] (f32).
        lin(name, x, w): the projections (the layer's hooks)."""
        cfg = self.cfg
        hi, ci = cfg.index_n_heads, cfg.index_head_dim
        q = lin("indexer.q_b", q_res, self.q_b).reshape(q_res.shape[:2] + (hi, ci))
        cos, sin = dc.rope_cos_sin(cfg.compress_rope, positions)
        q = dc.apply_rope(q, cos[:, :, None], sin[:, :, None])
        head_w = lin("indexer.weights_proj", x, self.weights_proj).astype(jnp.float32) * hi**-0.5
        return dc.weighted_index_dots(q.astype(jnp.float32), keys.astype(jnp.float32),
                                   head_w) * ci**-0.5


class Attention(nn.Module):
    """Shared-KV MQA with sinks over a sliding window (+ compressed entries for CSA/HCA).

    One `__call__` for every step mode; what differs is where the keys come from
    (`_chunk_keys`: the call's own tokens, forward / prefill; `_extend_keys`: the cache's
    window and rings followed by the chunk; `_decode_keys`: one token against the cache)
    and how the layer cache is written. Projections go through `step.linear`, the GSM site
    `attn_out` through `step.site`.
    """

    cfg: DeepseekV4Config
    layer: int

    @property
    def kind(self) -> str:
        return self.cfg.layer_types[self.layer]

    def setup(self) -> None:
        cfg = self.cfg
        d, h, hd, g = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.o_groups
        self.q_a = _weight(self, "q_a", (d, cfg.q_lora_rank))
        self.q_a_norm = self.param("q_a_norm", nn.initializers.ones, (cfg.q_lora_rank,),
                                   jnp.float32)
        self.q_b = _weight(self, "q_b", (cfg.q_lora_rank, h * hd))
        self.kv = _weight(self, "kv", (d, hd))
        self.kv_norm = self.param("kv_norm", nn.initializers.ones, (hd,), jnp.float32)
        self.o_a = _weight(self, "o_a", (g, h * hd // g, cfg.o_lora_rank))
        self.o_b = _weight(self, "o_b", (g * cfg.o_lora_rank, d))
        self.sinks = self.param("sinks", _small, (h,), jnp.float32)
        if self.kind != SLIDING:
            rate = cfg.compress_rate(self.layer)
            self.compressor = Compressor(cfg, rate, hd, self.kind == CSA)
        if self.kind == CSA:
            self.indexer = Indexer(cfg)

    def create_params(self) -> None:
        _ = self.q_a
        if self.kind != SLIDING:
            _ = self.compressor.kv_gate
        if self.kind == CSA:
            _ = (self.indexer.q_b, self.indexer.compressor.kv_gate)

    def _project(self, x: jax.Array, positions: jax.Array, lin):
        """x [B,T,D] -> q [B,T,H,hd], kv [B,T,hd] (both RoPE'd), q_res [B,T,q_lora]."""
        cfg = self.cfg
        rope = cfg.rope(self.layer)
        q_res = dc.rms_norm(lin("q_a", x, self.q_a), self.q_a_norm, cfg.rms_norm_eps)
        q = lin("q_b", q_res, self.q_b).reshape(x.shape[:2] + (cfg.num_heads, cfg.head_dim))
        q = unweighted_rms_norm(q, cfg.rms_norm_eps)
        kv = dc.rms_norm(lin("kv", x, self.kv), self.kv_norm, cfg.rms_norm_eps)
        cos, sin = dc.rope_cos_sin(rope, positions)
        q = dc.apply_rope(q, cos[:, :, None], sin[:, :, None])
        return q, dc.apply_rope(kv, cos, sin), q_res

    def _output(self, attn, positions, step: Step, lin):
        """Un-rotate the rope slice, GSM site `attn_out`, grouped low-rank projection."""
        cfg = self.cfg
        cos, sin = dc.rope_cos_sin(cfg.rope(self.layer), positions)
        attn = dc.apply_rope(attn, cos[:, :, None], -sin[:, :, None])
        b, t = attn.shape[:2]
        flat = step.site(self.layer, ATTN_OUT, attn.reshape(b, t, -1))  # GSM site attn_out
        grouped = flat.reshape(b * t, cfg.o_groups, -1)
        # per group g: [B*T, I] @ o_a[g]; as a dot_general with g as the batch dimension
        # of both operands (docs/performance_notes.md, "DeepSeek-V4: grouped output
        # projection as a batched dot_general")
        low = jax.lax.dot_general(grouped, self.o_a.astype(flat.dtype),
                                  (((2,), (1,)), ((1,), (0,))))  # [G, B*T, O]
        low = jnp.swapaxes(low, 0, 1).reshape(b, t, -1)
        return lin("o_b", low, self.o_b)

    def __call__(self, x, cache: LayerCache | None, step: Step):
        """x [B,T,D] -> (out [B,T,D], the new LayerCache or None (forward))."""
        cfg = self.cfg
        t = x.shape[1]

        def lin(name, a, w):
            return step.linear(self.layer, name, a, w)

        # RoPE positions: each token's index in its row (padding too: it is masked out)
        positions = step.start[:, None] + jnp.arange(t)[None, :]
        q, kv, q_res = self._project(x, positions, lin)
        selected = None
        if step.mode == "decode":
            keys, mask, new, selected = self._decode_keys(x, q_res, positions, kv, cache,
                                                          step, lin)
            mask = mask[:, None]
        elif step.mode == "extend":
            keys, mask, new = self._extend_keys(x, q_res, positions, kv, cache, step, lin)
        else:
            keys, mask, new = self._chunk_keys(x, q_res, positions, kv, cache, step, lin)
        with jax.named_scope("attention"):
            attn = dc.sink_attention(q, keys, mask, self.sinks, cfg.head_dim**-0.5, selected)
        return self._output(attn, positions, step, lin), new

    def _chunk_keys(self, x, q_res, positions, kv, cache, step, lin):
        """Forward / prefill: right-padded whole prompts attend over themselves. Prefill
        also turns the per-token sequences (window: K=V; rings: raw compressor
        projections) and the entries into the layer's decode cache."""
        cfg = self.cfg
        b, t = x.shape[:2]
        steps = jnp.arange(t)
        # key j is visible to query i when i - sliding_window < j <= i
        band = ((steps[None, :] <= steps[:, None])
                & (steps[None, :] > steps[:, None] - cfg.sliding_window))
        keys, mask = kv, jnp.broadcast_to(band, (b, t, t))
        seqs = {"window": kv}
        if self.kind != SLIDING:
            rope, rate = cfg.compress_rope, cfg.compress_rate(self.layer)
            kvg = lin("compressor.kv_gate", x, self.compressor.kv_gate)
            comp = self.compressor.entries(kvg, rope)  # [B, n, hd]
            n = comp.shape[1]
            visible = jnp.arange(n)[None, None, :] < ((positions + 1) // rate)[..., None]
            seqs["comp"], seqs["comp_ring"] = comp, kvg
            if self.kind == CSA:
                ikvg = lin("indexer.compressor.kv_gate", x, self.indexer.compressor.kv_gate)
                ikeys = self.indexer.compressor.entries(ikvg, rope)
                scores = self.indexer.scores(x, q_res, positions, ikeys, lin)
                visible = topk_select(scores, visible, cfg.index_topk)
                seqs["index"], seqs["index_ring"] = ikeys, ikvg
            keys = jnp.concatenate([keys, comp], axis=1)
            mask = jnp.concatenate([mask, visible], axis=2)
        if step.mode == "forward":
            return keys, mask, None
        fields = {}
        for name, value in seqs.items():
            buf = getattr(cache, name)
            if name in ("comp", "index"):  # entries: slot w = entry w
                if buf.shape[1] < value.shape[1]:
                    raise ValueError(f"a prompt of {t} tokens does not fit the cache")
                fields[name] = jax.lax.dynamic_update_slice(
                    buf, value.astype(buf.dtype), (0,) * buf.ndim)
            else:  # rings: the last positions of each row's prompt
                fields[name] = _ring_from_sequence(value, step.n_new,
                                                   buf.shape[1]).astype(buf.dtype)
        return keys, mask, LayerCache(**fields)

    def _extend_entries(self, module: Compressor, entries, ring, kvg, step, rope):
        """A chunk's raw projections kvg [B, C, 2F] after the ring's: the entries of the
        blocks completed in the chunk written at their slots, and the ring advanced."""
        size, rate = ring.shape[1], module.rate
        start, end = step.start, step.start + step.n_new
        hist, _ = dc.ring_history(ring, start)
        seq = jnp.concatenate([hist, kvg.astype(ring.dtype)], axis=1)  # from start - size
        w = start[:, None] // rate + jnp.arange(kvg.shape[1] // rate + 1)[None, :]  # [B, n]
        done = w < (end // rate)[:, None]  # block w's last token is in the chunk
        new = module.entries_at(seq, start - size, w, rope)
        slot = jnp.where(done, w, entries.shape[1])  # not completed: dropped
        rows = jnp.arange(entries.shape[0])[:, None]
        entries = entries.at[rows, slot].set(new.astype(entries.dtype), mode="drop")
        return entries, dc.ring_after(seq, start - size, end, size)

    def _extend_keys(self, x, q_res, positions, kv, cache: LayerCache, step, lin):
        """A chunk after each row's cache.lengths tokens: keys are the window ring's
        positions start - Wc .. start - 1 followed by the chunk's own, then every
        compressed entry (those of blocks completed in the chunk pooled from the ring's
        and the chunk's raw projections, and written first). Masks go by position.
        Cost: [B, H, C, Wc + C + Nc] scores, and per compressed layer a gather of
        ceil(C / rate) + 1 blocks."""
        cfg = self.cfg
        valid = step.valid
        start, end = step.start, step.start + step.n_new
        size = cache.window.shape[1]
        hist, hist_pos = dc.ring_history(cache.window, start)
        seq = jnp.concatenate([hist, kv.astype(hist.dtype)], axis=1)
        key_pos = jnp.concatenate([jnp.where(hist_pos >= 0, hist_pos, -1),
                                   jnp.where(valid, positions, -1)], axis=1)
        qp, kp = positions[:, :, None], key_pos[:, None, :]
        mask = valid[:, :, None] & (kp >= 0) & (kp <= qp) & (kp > qp - cfg.sliding_window)
        keys = seq
        new = {"window": dc.ring_after(seq, start - size, end, size)}
        if self.kind != SLIDING:
            rope, rate = cfg.compress_rope, cfg.compress_rate(self.layer)
            kvg = lin("compressor.kv_gate", x, self.compressor.kv_gate)
            comp, new["comp_ring"] = self._extend_entries(self.compressor, cache.comp,
                                                          cache.comp_ring, kvg, step, rope)
            new["comp"] = comp
            visible = (jnp.arange(comp.shape[1])[None, None, :]
                       < ((positions + 1) // rate)[..., None]) & valid[..., None]
            if self.kind == CSA:
                ikvg = lin("indexer.compressor.kv_gate", x, self.indexer.compressor.kv_gate)
                ikeys, new["index_ring"] = self._extend_entries(
                    self.indexer.compressor, cache.index, cache.index_ring, ikvg, step, rope)
                new["index"] = ikeys
                scores = self.indexer.scores(x, q_res, positions, ikeys, lin)
                visible = topk_select(scores, visible, cfg.index_topk)
            keys = jnp.concatenate([keys, comp], axis=1)
            mask = jnp.concatenate([mask, visible], axis=2)
        return keys, mask, LayerCache(**new)

    def _decode_keys(self, x, q_res, positions, kv, cache: LayerCache, step, lin):
        """One token per row x [B,1,D] at positions [B,1] against the layer cache; an
        inactive row's writes are masked. A CSA layer whose indexer keeps fewer entries
        than the cache holds returns those entries gathered (`sink_attention`'s
        `selected`, [B,1,k,hd]) instead of appending the whole compressed cache to the
        keys: the step then reads k entries, not all of them."""
        cfg = self.cfg
        pos, active = positions[:, 0], step.active
        size = cache.window.shape[1]
        window = _write_rows(cache.window, pos % size, kv[:, 0], active)
        slot_pos = pos[:, None] - ((pos[:, None] - jnp.arange(size)[None, :]) % size)
        keys, mask = window, slot_pos >= 0
        new = {"window": window}
        if self.kind != SLIDING:
            rope, rate = cfg.compress_rope, cfg.compress_rate(self.layer)
            done = (pos + 1) % rate == 0  # this token completes block w
            w = jnp.maximum((pos + 1) // rate - 1, 0)

            def update(comp, ring, module, name):
                raw = lin(name, x, module.kv_gate)
                ring = _write_rows(ring, pos % ring.shape[1], raw[:, 0], active)
                entry = module.entry_from_ring(ring, w, rope)
                slot = jnp.minimum(w, comp.shape[1] - 1)
                return _write_rows(comp, slot, entry, active & done), ring

            comp, new["comp_ring"] = update(cache.comp, cache.comp_ring, self.compressor,
                                            "compressor.kv_gate")
            new["comp"] = comp
            visible = jnp.arange(comp.shape[1])[None, :] < ((pos + 1) // rate)[:, None]
            if self.kind == CSA:
                ikeys, new["index_ring"] = update(cache.index, cache.index_ring,
                                                  self.indexer.compressor,
                                                  "indexer.compressor.kv_gate")
                new["index"] = ikeys
                scores = self.indexer.scores(x, q_res, positions, ikeys, lin)[:, 0]
                idx, picked = dc.topk_indices(scores, visible, cfg.index_topk)
                if dc.gather_pays(1, idx.shape[-1], comp.shape[1]):
                    sel = dc.gather_entries(comp, idx[:, None])  # [B, 1, k, hd]
                    return keys, mask, LayerCache(**new), (sel, picked[:, None])
                visible = dc.entries_mask(idx, picked, comp.shape[1])
            keys = jnp.concatenate([keys, comp], axis=1)
            mask = jnp.concatenate([mask, visible], axis=1)
        return keys, mask, LayerCache(**new), None


class MoE(nn.Module):
    """Routed experts (top-k or hash routing) + one shared expert; SwiGLU with clipping."""

    cfg: DeepseekV4Config
    layer: int

    @property
    def is_hash(self) -> bool:
        return self.cfg.mlp_layer_types[self.layer] == "hash_moe"

    def setup(self) -> None:
        cfg = self.cfg
        d, e, i = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        self.router = _weight(self, "router", (d, e))
        if self.is_hash:
            def table(rng, shape):
                keys = jax.random.split(rng, shape[0])
                return jax.vmap(lambda r: jax.random.permutation(r, e)[: shape[1]])(keys)

            self.tid2eid = self.param("tid2eid", table, (cfg.vocab_size, cfg.num_experts_per_tok))
        else:
            self.score_bias = self.param("score_bias", _small, (e,), jnp.float32)
        self.experts_gate_up = _weight(self, "experts_gate_up", (e, d, 2 * i))
        self.experts_down = _weight(self, "experts_down", (e, i, d))
        self.shared_gate_up = _weight(self, "shared_gate_up", (d, 2 * i))
        self.shared_down = _weight(self, "shared_down", (i, d))

    def route(self, x: jax.Array, tokens: jax.Array, lin=_plain_linear):
        """x [M, D], tokens [M] -> (experts [M, k], weights [M, k] f32)."""
        cfg = self.cfg
        scores = dc.score_fn(cfg.scoring_func, lin("router", x, self.router).astype(jnp.float32))
        if self.is_hash:
            idx = self.tid2eid[tokens].astype(jnp.int32)  # frozen token -> experts table
        else:  # the correction bias only changes which experts are chosen
            _, idx = jax.lax.top_k(scores + self.score_bias, cfg.num_experts_per_tok)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        return idx, w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor

    def __call__(self, x: jax.Array, tokens: jax.Array, smooth, lin=_plain_linear):
        """x [B,T,D] -> (out [B,T,D], what `smooth` gave besides the activation).

        smooth(mid, next_weight) -> (mid, extra): the GSM site `ffn_mid`, the shared
        expert only (routed experts each see a data-dependent subset of a sequence's
        tokens, so a window along the sequence is not defined for their
        intermediates). lin(name, x, w): the plain projections (the layer's hooks).
        """
        cfg = self.cfg
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        with jax.named_scope("router"):
            idx, w = self.route(flat, tokens.reshape(-1), lin)
        with jax.named_scope("routed_experts"):
            routed = routed_experts(flat, idx, w, self.experts_gate_up, self.experts_down,
                                    cfg.swiglu_limit, dispatch=cfg.expert_dispatch)
        with jax.named_scope("shared_expert"):
            mid = swiglu(lin("shared_gate_up", x, self.shared_gate_up), cfg.swiglu_limit)
            # GSM site ffn_mid; with a W8A8 shared_down it comes back smoothed + int8
            mid, extra = smooth(mid, self.shared_down)
            shared = lin("shared_down", mid, self.shared_down)
        return routed.reshape(b, t, d) + shared, extra


class DecoderLayer(nn.Module):
    """Hyper-connected attention block, then hyper-connected MoE block: one `__call__`
    for every step mode (the attention picks its mode-specific parts from `step.mode`)."""

    cfg: DeepseekV4Config
    layer: int

    def setup(self) -> None:
        cfg = self.cfg
        self.attn_hc = HyperConnection(cfg)
        self.attn_norm = self.param("attn_norm", nn.initializers.ones, (cfg.hidden_size,),
                                    jnp.float32)
        self.attn = Attention(cfg, self.layer)
        self.ffn_hc = HyperConnection(cfg)
        self.ffn_norm = self.param("ffn_norm", nn.initializers.ones, (cfg.hidden_size,),
                                   jnp.float32)
        self.moe = MoE(cfg, self.layer)

    def create_params(self) -> None:
        # reading one attribute of a setup-defined submodule runs its setup()
        _ = (self.attn_hc.fn, self.ffn_hc.fn, self.moe.router, self.attn_norm)
        self.attn.create_params()

    def __call__(self, h, cache: LayerCache | None, step: Step, tokens: jax.Array):
        """Streams h [B,T,N,D] of tokens [B,T] -> (h, this layer's new LayerCache or None)."""
        layer, eps = self.layer, self.cfg.rms_norm_eps
        post, comb, x = self.attn_hc(h)
        out, cache = self.attn(dc.rms_norm(x, self.attn_norm, eps), cache, step)
        h = dc.hc_expand(post, comb, out, h)
        post, comb, x = self.ffn_hc(h)
        out, _ = self.moe(dc.rms_norm(x, self.ffn_norm, eps), tokens,
                          lambda m, w: (step.site(layer, FFN_MID, m, w), None),  # GSM site
                          lambda name, a, w: step.linear(layer, name, a, w))
        return dc.hc_expand(post, comb, out, h), cache


def layer(cfg: DeepseekV4Config, weights: dict, index: int, x, cache: LayerCache | None,
          step: Step):
    """The family's one layer (`common.run_layers`' layer_fn): `DecoderLayer` `index` applied
    to its weights. x is (streams [B,T,N,D], tokens [B,T]): hash routing reads the tokens."""
    h, tokens = x
    h, cache = DecoderLayer(cfg, index).apply({"params": weights}, h, cache, step, tokens)
    return (h, tokens), cache


class DeepseekV4(nn.Module):
    """Embedding + layers + hyper head + final norm + LM head (for `init` only)."""

    cfg: DeepseekV4Config

    def setup(self) -> None:
        cfg = self.cfg
        n, d = cfg.hc_mult, cfg.hidden_size
        self.embed = self.param("embed", _init, (cfg.vocab_size, d))
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        self.hc_head_fn = self.param("hc_head_fn", _init, (n * d, n), jnp.float32)
        self.hc_head_base = self.param("hc_head_base", _small, (n,), jnp.float32)
        self.hc_head_scale = self.param("hc_head_scale", nn.initializers.ones, (1,), jnp.float32)
        self.final_norm = self.param("final_norm", nn.initializers.ones, (d,), jnp.float32)
        if not cfg.tie_word_embeddings:
            self.lm_head = self.param("lm_head", _init, (d, cfg.vocab_size))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Run the prompt through all layers (returns the streams)."""
        cfg = self.cfg
        b, t = tokens.shape
        h = jnp.broadcast_to(self.embed[tokens][:, :, None], (b, t, cfg.hc_mult, cfg.hidden_size))
        step = common.forward_step(jnp.full((b,), t, jnp.int32), t)
        for block in self.layers:
            h, _ = block(h, None, step, tokens)
        return h

    def create_params(self) -> None:
        """Create every parameter without running the network (cheap `init`)."""
        for layer in self.layers:
            layer.create_params()
        _ = (self.embed, self.hc_head_fn, self.final_norm)


# ----------------------------------------------------------------------------- weights

# Kept in float32 whatever the model dtype (the reference's _keep_in_fp32_modules_strict).
_FP32_LEAVES = {"fn", "base", "scale", "sinks", "position_bias", "norm", "q_a_norm", "kv_norm",
                "attn_norm", "ffn_norm", "score_bias", "hc_head_fn", "hc_head_base",
                "hc_head_scale", "final_norm"}


def leaf_dtype(path, dtype: Any) -> Any:
    name = path[-1].key if hasattr(path[-1], "key") else str(path[-1])
    if name == "tid2eid":
        return jnp.int32
    return jnp.float32 if name in _FP32_LEAVES else dtype


def _cast_tree(tree: Any, dtype: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, a: jnp.asarray(a, leaf_dtype(path, dtype)), tree)


def _param_shapes(cfg: DeepseekV4Config) -> dict:
    shapes = jax.eval_shape(
        lambda r: DeepseekV4(cfg).init(r, method=DeepseekV4.create_params)["params"],
        jax.random.key(0))
    return _split_layers(dict(shapes), cfg.num_layers)


def _split_layers(params: dict, num_layers: int) -> dict:
    params = dict(params)
    params["layers"] = tuple(params.pop(f"layers_{i}") for i in range(num_layers))
    return params


def init_weights(cfg: DeepseekV4Config, rng: jax.Array, dtype: Any = jnp.float32) -> dict:
    """Random weights (tests, benchmarks): the same tree `weights_from_hf` produces."""
    shapes = _param_shapes(cfg)
    # Values are drawn with numpy by each parameter's role (the same distributions as
    # the initializers declared in setup), far cheaper than jit-compiling a hundred
    # threefry initializers (docs/performance_notes.md, "DeepSeek-V4: random weights drawn
    # with numpy").
    gen = np.random.default_rng(np.asarray(jax.random.key_data(rng)).ravel().tolist())

    def draw(path, sds):
        name = path[-1].key
        if name == "tid2eid":
            ranks = np.argsort(gen.random((sds.shape[0], cfg.n_routed_experts)), axis=1)
            return ranks[:, : sds.shape[1]].astype(np.int32)
        if name.endswith("norm") or name.endswith("scale"):
            return np.ones(sds.shape, np.float32)
        std = 0.5 if name in _SMALL_INIT else 0.02
        return (std * gen.standard_normal(sds.shape)).astype(np.float32)

    return _cast_tree(jax.tree_util.tree_map_with_path(draw, shapes), dtype)


_SMALL_INIT = {"sinks", "position_bias", "base", "score_bias", "hc_head_base"}


def weight_shapes(cfg: DeepseekV4Config, dtype: Any = jnp.float32) -> dict:
    """The weight tree as ShapeDtypeStructs, without allocating (abstract-first init)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, s: jax.ShapeDtypeStruct(s.shape, leaf_dtype(path, dtype)),
        _param_shapes(cfg))


# ----------------------------------------------------------------------------- entry points


def embed(weights: dict, cfg: DeepseekV4Config, tokens: jax.Array) -> jax.Array:
    """Tokens [...] -> the hc_mult residual streams [..., N, D] (copies of the embedding)."""
    x = jnp.take(weights["embed"], tokens, axis=0)
    return jnp.broadcast_to(x[..., None, :], x.shape[:-1] + (cfg.hc_mult, cfg.hidden_size))


def logits(weights: dict, cfg: DeepseekV4Config, h: jax.Array) -> jax.Array:
    """Hyper head (collapse the streams) -> final norm -> LM head. h [..., N, D] -> f32 [..., V]."""
    with jax.named_scope("hc_head"):
        flat = h.reshape(h.shape[:-2] + (-1,)).astype(jnp.float32)
        mixes = unweighted_rms_norm(flat, cfg.rms_norm_eps) @ weights["hc_head_fn"]
        pre = jax.nn.sigmoid(mixes * weights["hc_head_scale"] + weights["hc_head_base"])
        x = dc.weighted_streams(pre + cfg.hc_eps, h)
    x = dc.rms_norm(x, weights["final_norm"], cfg.rms_norm_eps)
    with jax.named_scope("lm_head"):
        if cfg.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", x, weights["embed"].astype(x.dtype),
                              preferred_element_type=jnp.float32)
        return jnp.einsum("...d,dv->...v", x, weights["lm_head"].astype(x.dtype),
                          preferred_element_type=jnp.float32)


def _run(weights: dict, cfg: DeepseekV4Config, tokens: jax.Array,
         cache: DeepseekV4Cache | None, step: Step, layer_fn=None):
    """Every layer (an unrolled loop: the layers differ by type) -> (streams, cache, sown)."""
    h = embed(weights, cfg, tokens)
    layers = common.layer_weights(weights, cfg.num_layers, scan_ok=False)
    pieces = None if cache is None else tuple(cache.layers)
    (h, _), pieces, sown = common.run_layers(layer_fn or layer, cfg, layers, (h, tokens),
                                             pieces, step)
    if cache is not None:
        cache = cache.replace(layers=pieces, lengths=common.new_lengths(step).astype(jnp.int32),
                              rings=common.rings_out(step, cache))
    return h, cache, sown


def hidden_states(weights: dict, cfg: DeepseekV4Config, tokens: jax.Array, lengths: jax.Array,
                  sites: Sites | None = None) -> tuple[jax.Array, dict]:
    """Teacher-forced streams [B, T, N, D] (before the hyper head) over right-padded rows
    of `lengths` tokens, and what the hooks sowed, {name: [L, ...]} (`models/sites.py`)."""
    h, _, sown = _run(weights, cfg, tokens, None,
                      common.forward_step(lengths, tokens.shape[1], sites))
    return h, sown


@takes_sites
def forward(weights: dict, cfg: DeepseekV4Config, tokens: jax.Array, lengths: jax.Array,
            sites: Sites | None = None) -> jax.Array:
    """Teacher-forced logits [B, T, V] (f32) over right-padded rows of `lengths` tokens."""
    return logits(weights, cfg, hidden_states(weights, cfg, tokens, lengths, sites)[0])


def layer_outputs(weights: dict, cfg: DeepseekV4Config, tokens: jax.Array,
                  lengths: jax.Array) -> list[jax.Array]:
    """Each layer's output streams [B, T, N, D] (tests: localising a mismatch), sown."""
    def sowing(cfg, lw, index, x, cache, step):
        x, cache = layer(cfg, lw, index, x, cache, step)
        step.sow("layer_output", x[0])
        return x, cache

    _, _, sown = _run(weights, cfg, tokens, None,
                      common.forward_step(lengths, tokens.shape[1]), sowing)
    return list(sown["layer_output"])


@takes_sites
def prefill(weights: dict, cfg: DeepseekV4Config, tokens: jax.Array, lengths: jax.Array,
            cache: DeepseekV4Cache, sites: Sites | None = None
            ) -> tuple[jax.Array, DeepseekV4Cache]:
    """Fill a fresh cache with right-padded prompts; return each row's last-token logits [B, V]."""
    step = common.prefill_step(lengths, tokens.shape[1], cache, sites)
    h, cache, _ = _run(weights, cfg, tokens, cache, step)
    return logits(weights, cfg, common.last_token(h, lengths)), cache


@takes_sites
def extend(weights: dict, cfg: DeepseekV4Config, tokens: jax.Array, n_new: jax.Array,
           cache: DeepseekV4Cache, sites: Sites | None = None, *,
           all_logits: bool = False, hidden: bool = False) -> tuple[jax.Array, DeepseekV4Cache]:
    """Append a chunk of prompt tokens [B, C] (the first `n_new` [B] of each row real) to
    rows already holding `cache.lengths` tokens: chunked prefill. Returns the logits of
    each row's last new token [B, V] (all_logits: of every chunk position, [B, C, V]) and
    the cache; the same as one prefill over the whole prompt (tested), with chunks that
    split compression blocks and the window, GSM windows included. The chunk attends over
    the window ring, itself and every compressed entry (`Attention._extend_keys`)."""
    step = common.extend_step(n_new, tokens.shape[1], cache, sites)
    h, cache, _ = _run(weights, cfg, tokens, cache, step)
    if hidden:  # what `logits` takes, every position: the serving engine's
        return h, cache
    if all_logits:
        return logits(weights, cfg, h), cache
    return logits(weights, cfg, common.last_token(h, n_new)), cache


@takes_sites
def decode_step(weights: dict, cfg: DeepseekV4Config, tokens: jax.Array, cache: DeepseekV4Cache,
                sites: Sites | None = None,
                active: jax.Array | None = None) -> tuple[jax.Array, DeepseekV4Cache]:
    """One token per row at position `cache.lengths`; returns logits [B, V] and the new cache.

    Rows with active=False still compute (static shapes) but do not advance, their
    cache writes are masked and GSM leaves their output unsmoothed (the ring slot it
    touches is the one the row's next real token overwrites).
    """
    step = common.decode_step_ctx(cache, active, sites)
    h, cache, _ = _run(weights, cfg, tokens[:, None], cache, step)
    return logits(weights, cfg, h[:, 0]), cache


# ----------------------------------------------------------------------------- family contract
# What the runtime (gsm_jax.families and the tools above it) reads from this module beside
# its entry points; docs/adding_a_family.md lists every name. Imported above from their own
# modules: `weights_from_hf` and `load_checkpoint` (models/deepseek_v4_checkpoint.py) and
# `PLANNER` (models/deepseek_v4_plan.py: what the planner and `sharding.check_model` ask).

FAMILY = "deepseek_v4"
TITLE = "DeepSeek-V4"  # in messages
HF_MODEL_TYPES = ("deepseek_v4",)  # Hugging Face model_type values it loads
DRAFTER = None  # no speculative drafter of its own (models/contract.py, `Drafter`)

# Logical axes of each weight of the float layout ([..., in, out] projections), by leaf
# name; a leaf not listed is replicated whole (norms, routers, compressors, the indexer,
# hyper-connections, the single K=V head and the low-rank q_a).
LOGICAL_AXES = {
    "embed": ("vocab", None),
    "lm_head": (None, "vocab"),
    "q_b": (None, "heads"),
    "o_a": ("heads", None, None),  # [groups, in, rank]: whole head groups
    "o_b": ("heads", None),
    "sinks": ("heads",),
    "experts_gate_up": ("experts", None, None),
    "experts_down": ("experts", None, None),
    "shared_gate_up": (None, "mlp"),
    "shared_down": ("mlp", None),
}
# leaves under these whose names recur elsewhere with another meaning (the indexer's q_b)
REPLICATED_UNDER = ("indexer", "compressor", "mtp")


def logical_axes(names: list[str], ndim: int) -> tuple[str | None, ...]:
    """The logical axes of the float weight at path `names`: by leaf name, except that
    everything under REPLICATED_UNDER is replicated."""
    from gsm_jax.models.partitioning import table_axes

    if any(n in REPLICATED_UNDER for n in names[:-1]):
        return (None,) * ndim
    return table_axes(LOGICAL_AXES, names[-1], ndim)


# Quantization: the dense attention projections (plus the compressors' kv_gate and the
# shared experts; routed experts on request). The router, the indexer, the
# hyper-connections and o_a (a grouped einsum) stay float: they select or mix.
QUANT_ATTN_LINEARS = ("q_a", "q_b", "kv", "o_b")


def quantize_weights(weights: dict, q: Any, routed_experts: bool) -> dict:
    """`gsm_jax.quantize`: `weights` with every projection above passed through `q` (a
    float weight -> its quantized container)."""
    def one(lw):
        lw, attn, moe = dict(lw), dict(lw["attn"]), dict(lw["moe"])
        for name in QUANT_ATTN_LINEARS:
            attn[name] = q(attn[name])
        if "compressor" in attn:
            attn["compressor"] = {**attn["compressor"],
                                  "kv_gate": q(attn["compressor"]["kv_gate"])}
        for name in ("shared_gate_up", "shared_down") + (
                ("experts_gate_up", "experts_down") if routed_experts else ()):
            moe[name] = q(moe[name])
        lw["attn"], lw["moe"] = attn, moe
        return lw

    return {**weights, "layers": tuple(one(lw) for lw in weights["layers"])}


