"""DeepSeek-V4.1's DSpark drafter (research note §7): the released `mtp.0..2` stages as a
parallel block drafter for speculative decoding (`gsm_jax.speculative.dspark_generate`).

One draft call, for an anchor position p whose token the target has just produced (the
target's cache holds positions < p):
1. Block inputs: [token at p, noise x (block - 1)] at positions p .. p + block - 1, embedded
   with the target's embedding and copied into the hc_mult streams (pre = stream 0).
2. Target features: for each context position q in [p - sliding_window, p), the stream mean
   of h before attention at the target layers `dspark_target_layer_ids` (V4.1-Flash: 37, 38,
   39), concatenated; `main_x = main_norm(main_proj(features))` (stage 0; later stages reuse
   it).
3. Each stage: a V4.1 block with single-pass mHC, SWA-only attention whose keys are the
   stage's own `kv` projection of main_x at the context positions and of the block itself
   (FP8 32-block cache rounding on both, as NeMo's), all block positions visible to every
   block query, sinks; then a routed MoE of `dspark_n_routed_experts` experts, top
   `dspark_num_experts_per_tok`, plus the shared expert.
4. The last stage: collapse, `norm`, the target's LM head in f32, plus the Markov bias
   `markov_head(markov_embed(previous token))` of rank `dspark_markov_rank`; the tokens are
   picked in order (position j's previous token is the pick at j - 1, the anchor for j = 0).
   `confidence_head` scores each position from [normalized state, Markov embedding].

The draft keeps no cache: it recomputes the window's keys from the features every round
(`sliding_window` rows of one projection per stage). Parity: `tests/test_deepseek_v41_dspark.py`
against NeMo AutoModel's `DeepseekV41DSparkBackbone` (dspark.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import InvalidInputError
from gsm_jax.models import common
from gsm_jax.models import deepseek_v41 as dv
from gsm_jax.models.deepseek_common import hc_expand, rms_norm, sink_attention, weighted_streams
from gsm_jax.models.deepseek_v41_cache import qdq
from gsm_jax.models.deepseek_v41_checkpoint import draft_weights  # noqa: F401 (conversion)


@functools.lru_cache(maxsize=16)
def stage_config(cfg: dv.DeepseekV41Config) -> dv.DeepseekV41Config:
    """The config of the draft's stages as a model of `num_nextn_predict_layers` SWA-only
    layers (theta rope_theta, no YaRN) with the draft's expert count and top-k."""
    n = cfg.num_nextn_predict_layers
    return dataclasses.replace(
        cfg, num_layers=n, compress_ratios=(0,) * n, kv_source_layer_ids=(),
        index_source_layer_ids=(), candidate_source_layer_id=-1, candidate_topk_blocks=0,
        candidate_block_size=0, engram_layer_ids=(), engram_num_embeddings=(),
        n_routed_experts=cfg.dspark_n_routed_experts,
        num_experts_per_tok=cfg.dspark_num_experts_per_tok)


def check_config(cfg: dv.DeepseekV41Config) -> None:
    """Refuse a config DSpark cannot run on, naming the key."""
    if cfg.num_nextn_predict_layers <= 0:
        raise InvalidInputError("deepseek_v41: this model has no DSpark stages "
                                "(num_nextn_predict_layers = 0)")
    bad = [i for i in cfg.dspark_target_layer_ids if not 0 <= i < cfg.num_layers]
    if not cfg.dspark_target_layer_ids or bad:
        raise InvalidInputError(
            f"deepseek_v41: dspark_target_layer_ids {list(cfg.dspark_target_layer_ids)} must "
            f"be layers of this {cfg.num_layers}-layer model (a truncated config cannot draft)")
    if cfg.dspark_block_size < 2:
        raise InvalidInputError(f"deepseek_v41: dspark_block_size {cfg.dspark_block_size} "
                                "must be >= 2")
    if not 0 <= cfg.dspark_noise_token_id < cfg.vocab_size:
        raise InvalidInputError(f"deepseek_v41: dspark_noise_token_id "
                                f"{cfg.dspark_noise_token_id} is not a token id")


def weight_shapes(cfg: dv.DeepseekV41Config, dtype: Any = jnp.float32) -> dict:
    """The draft's weight tree as ShapeDtypeStructs ([in, out] projections)."""
    sc = stage_config(cfg)
    d, r, v = cfg.hidden_size, cfg.dspark_markov_rank, cfg.vocab_size
    f32 = jnp.float32
    n_feat = len(cfg.dspark_target_layer_ids) * d
    return {"stages": dv.weight_shapes(sc, dtype)["layers"],
            "main_proj": jax.ShapeDtypeStruct((n_feat, d), dtype),
            "main_norm": jax.ShapeDtypeStruct((d,), f32),
            "norm": jax.ShapeDtypeStruct((d,), f32),
            "markov_embed": jax.ShapeDtypeStruct((v, r), dtype),
            "markov_head": jax.ShapeDtypeStruct((r, v), dtype),
            "confidence": jax.ShapeDtypeStruct((d + r, 1), f32)}


def init_weights(cfg: dv.DeepseekV41Config, rng: jax.Array, dtype: Any = jnp.float32) -> dict:
    """Random draft weights (tests, benchmarks), drawn as `deepseek_v41.init_weights`."""
    gen = np.random.default_rng(np.asarray(jax.random.key_data(rng)).ravel().tolist())

    def draw(path, sds):
        name = path[-1].key
        if name.endswith("norm") or name == "scale":
            return jnp.asarray(1 + 0.1 * gen.standard_normal(sds.shape), sds.dtype)
        std = 0.5 if name in dv._SMALL_INIT else 0.02
        return jnp.asarray(std * gen.standard_normal(sds.shape), sds.dtype)

    return jax.tree_util.tree_map_with_path(draw, weight_shapes(cfg, dtype))


# ----------------------------------------------------------------------------- forward


def _attention(cfg, w: dict, s: int, x, target, block_pos, ctx_pos, anchor, step):
    """A stage's attention: block queries x [B,K,D] over the stage's keys of the context
    target [B,W,D] (positions ctx_pos [B,W], -1 = none; visible when in
    [anchor - sliding_window, anchor)) and of the block itself (all visible)."""
    sc = stage_config(cfg)
    spec = sc.rope(s)
    eps = cfg.rms_norm_eps
    b, k, _ = x.shape

    def lin(name, a, wt):
        return step.linear(s, name, a, wt)

    def keys_of(a, pos):
        kv = rms_norm(lin("kv", a, w["kv"]), w["kv_norm"], eps)
        return qdq(cfg, "fp8", dv._rope(kv, spec, jnp.maximum(pos, 0)))

    q = lin("q_b", rms_norm(lin("q_a", x, w["q_a"]), w["q_norm"], eps), w["q_b"])
    q = dv._rope(q.reshape(b, k, cfg.num_heads, cfg.head_dim), spec, block_pos)
    keys = jnp.concatenate([keys_of(target, ctx_pos), keys_of(x, block_pos)], axis=1)
    a = anchor[:, None]
    ctx_ok = (ctx_pos >= 0) & (ctx_pos < a) & (ctx_pos >= a - cfg.sliding_window)
    mask = jnp.concatenate([ctx_ok, jnp.ones((b, k), bool)], axis=1)
    attn = sink_attention(q, keys, jnp.broadcast_to(mask[:, None, :], (b, k, mask.shape[1])),
                          w["sinks"], cfg.head_dim**-0.5)
    attn = dv._rope(attn, spec, block_pos, inverse=True).reshape(b, k, -1)
    grouped = attn.reshape(b * k, cfg.o_groups, -1)
    low = jax.lax.dot_general(grouped, w["o_a"].astype(attn.dtype),
                              (((2,), (1,)), ((1,), (0,))))  # [G, B*K, O]
    return lin("o_b", jnp.swapaxes(low, 0, 1).reshape(b, k, -1), w["o_b"])


def draft_states(weights: dict, dw: dict, cfg: dv.DeepseekV41Config, block_ids: jax.Array,
                 anchor: jax.Array, features: jax.Array, ctx_pos: jax.Array) -> jax.Array:
    """The last stage's normalized states [B, K, D] of one block.

    weights: the target's (embedding); dw: `draft_weights`; block_ids [B, K] (the anchor
    token, then noise); anchor [B] its position; features [B, W, n_target * D] at positions
    ctx_pos [B, W] (-1: an empty slot)."""
    sc = stage_config(cfg)
    b, k = block_ids.shape
    block_pos = anchor[:, None] + jnp.arange(k)[None, :]
    step = common.forward_step(jnp.full((b,), k, jnp.int32), k)
    eps = cfg.rms_norm_eps
    h, pre = dv.embed(weights, cfg, block_ids)
    target = rms_norm(step.linear(0, "main_proj", features, dw["main_proj"]), dw["main_norm"], eps)
    for s, w in enumerate(dw["stages"]):
        with jax.named_scope("dspark_stage"):
            a_pre, a_post, a_comb = dv.hc_mix(w["hc_attn"], h, cfg)
            x = rms_norm(weighted_streams(pre, h), w["attn_norm"], eps)
            out = _attention(cfg, w["attn"], s, x, target, block_pos, ctx_pos, anchor, step)
            h = hc_expand(a_post, a_comb, out, h)
            f_pre, f_post, f_comb = dv.hc_mix(w["hc_ffn"], h, cfg)
            out = dv.moe(sc, w["moe"], s, rms_norm(weighted_streams(a_pre, h), w["ffn_norm"],
                                                   eps), step)
            h = hc_expand(f_post, f_comb, out, h)
            pre = f_pre
    return rms_norm(weighted_streams(pre, h), dw["norm"], eps)


def head_logits(weights: dict, states: jax.Array) -> jax.Array:
    """The target's LM head on draft states, f32: [..., D] -> [..., V]."""
    return states.astype(jnp.float32) @ weights["lm_head"].astype(jnp.float32)


def markov(dw: dict, prev: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(the Markov bias [..., V] f32, the embedding [..., R]) of the previous tokens."""
    e = jnp.take(dw["markov_embed"], prev, axis=0)
    return e.astype(jnp.float32) @ dw["markov_head"].astype(jnp.float32), e


def confidence(dw: dict, states: jax.Array, markov_embedding: jax.Array) -> jax.Array:
    """The confidence head's logits [...] (f32) from [normalized state, Markov embedding]."""
    x = jnp.concatenate([states.astype(jnp.float32), markov_embedding.astype(jnp.float32)], -1)
    return (x @ dw["confidence"].astype(jnp.float32))[..., 0]


def draft_logits(weights: dict, dw: dict, cfg: dv.DeepseekV41Config, block_ids: jax.Array,
                 anchor: jax.Array, features: jax.Array, ctx_pos: jax.Array,
                 previous: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Teacher-forced draft logits [B, K, V] (head + Markov bias of `previous` [B, K]) and
    confidence logits [B, K]: what NeMo's DSpark model computes for one anchor per row."""
    states = draft_states(weights, dw, cfg, block_ids, anchor, features, ctx_pos)
    bias, emb = markov(dw, previous)
    return head_logits(weights, states) + bias, confidence(dw, states, emb)


def propose(weights: dict, dw: dict, cfg: dv.DeepseekV41Config, token: jax.Array,
            anchor: jax.Array, features: jax.Array, ctx_pos: jax.Array
            ) -> tuple[jax.Array, jax.Array]:
    """Greedy proposals [B, K] for the K = dspark_block_size positions after the anchor
    token [B] at position anchor [B], picked in order (the Markov bias of position j reads
    the pick at j - 1); and their confidence logits [B, K]."""
    k = cfg.dspark_block_size
    block = jnp.concatenate([token[:, None], jnp.full((token.shape[0], k - 1),
                                                      cfg.dspark_noise_token_id, token.dtype)],
                            axis=1)
    states = draft_states(weights, dw, cfg, block, anchor, features, ctx_pos)
    base = head_logits(weights, states)

    def pick(prev, j):
        bias, emb = markov(dw, prev)
        nxt = jnp.argmax(base[:, j] + bias, axis=-1).astype(token.dtype)
        return nxt, (nxt, confidence(dw, states[:, j], emb))

    _, (picks, conf) = jax.lax.scan(pick, token, jnp.arange(k))
    return picks.T, conf.T


# ----------------------------------------------------------------------------- the drafter
class DSparkDrafter:
    """This module as DeepSeek-V4.1's `Drafter` (models/contract.py): what
    `gsm_jax.speculative.dspark_generate` runs, reached as the family module's `DRAFTER`."""

    def check_config(self, cfg: dv.DeepseekV41Config) -> None:
        check_config(cfg)

    def feature_window(self, cfg: dv.DeepseekV41Config) -> int:
        return cfg.sliding_window

    def block_size(self, cfg: dv.DeepseekV41Config) -> int:
        return cfg.dspark_block_size

    def prefill_with_features(self, weights, cfg, tokens, lengths, cache, gsm):
        return dv.prefill_with_features(weights, cfg, tokens, lengths, cache, gsm)

    def extend_with_features(self, weights, cfg, tokens, n_new, cache, gsm):
        return dv.extend_with_features(weights, cfg, tokens, n_new, cache, gsm)

    def propose(self, weights, draft, cfg, cur, anchor, ring, ring_pos):
        return propose(weights, draft, cfg, cur, anchor, ring, ring_pos)

    def draft_weights(self, cfg, tensors, dtype):
        return draft_weights(cfg, tensors, dtype)


DRAFTER = DSparkDrafter()
