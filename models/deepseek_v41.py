"""DeepSeek-V4.1-Flash decoder (`DeepseekV41ForCausalLM`, HF model_type "deepseek_v41").

Facts: the release's config, checkpoint and reference code, cited below by section of the
project's V4.1 research note (§n). The
pieces V4.1 shares with V4 are imported from `models/deepseek_common.py` (interleaved RoPE
with frequency-only YaRN `RopeSpec`, sink attention, the stream mixing helpers, RMSNorm, the
sqrtsoftplus score); what differs is written here:

- Single-pass mHC (§3): 4 residual streams; a sublayer collapses the streams with the
  `pre` its *previous* sublayer's mix computed (one-hot on stream 0 before layer 0), its
  own mix gives its `post`/`comb` and the next sublayer's `pre`; the final collapse uses
  the last FFN mix's `pre`; no hyper head.
- CSA2 attention (§4): every layer has its own window K=V (FP8 QDQ, RoPE tail included)
  and queries without a per-head q norm. Layer roles come from the config's source lists:
  SWA-only (ratio 0); Full (a KV source: compressor, indexer keys, its own top-k); Reindex
  (an index source that is not a KV source: re-scores the latest Full layer's index keys,
  candidate-masked, publishes its own top-k); Reuse (nothing owned: the latest compressed
  KV and the latest published top-k). Compressed KV is FP4 (E4M3 scale per 16), the
  index q/k MXFP4 (power-of-two scale per 32); the caches are held packed in these formats
  (`PackedEntries`, the release's bytes: 890 B per cached token) and unpacked where read.
- MoE (§5): sqrtsoftplus routing with `bias` (text tokens; `bias_vl` is loaded for image
  tokens, which this text-only model never sees), SwiGLU with clamp, one shared expert.

The layer threads, besides the streams, the collapse weights `pre` and the CSA2 state
the later layers read (compressed KV, index keys, published top-k mask, candidates)
through `common.run_layers`' x. Hooks (`models/sites.py`): GSM site `attn_out` is the
input of the grouped output projection (after the inverse RoPE), `ffn_mid` the shared
expert's down-projection input; plain projections go through `step.linear` under their
leaf names ("q_a", "q_b", "kv", "o_b", "router", "shared_gate_up", "shared_down",
"compressor.wkv", "compressor.wgate", "indexer.q_b", "indexer.weights_proj",
"indexer.wk", "engram.wkv").

Engram layers (§6, `models/engram.py`) run before their block's attention mHC mix and
update all 4 streams: the token ids are mapped to compressed classes (`engram_token_map`,
built from tokenizer.json at load time, an int32 leaf of the weights), hashed into 24 row
ids per layer inside the jitted call (the last 3 classes of each row carried in
`DeepseekV41Cache.engram_history`, so decode and chunked extend hash as one prefill), and
only those rows of the table are gathered, as stored (FP8 e4m3 + E8M0 per row per 32),
and dequantized. Padding and image tokens get gate 0 and block the n-gram lookback.
Prefill, extend (chunked prefill) and decode share one cached attention path
(`attention` with a `LayerCache`).

Weights (`weights_from_hf`, `load_checkpoint`, in `models/deepseek_v41_checkpoint.py`;
the packed cache formats are `models/deepseek_v41_cache.py`, the planner's `PLANNER`
`models/deepseek_v41_plan.py`): the released names (§9.2); FP8 (32 x 32
E8M0) and FP4 (1 x 32) weights are `BlockQuantWeight`s as stored with `keep_quantized`
(every projection goes through `step.linear` -> `models.linear.linear`, which multiplies
them block by block), else dequantized; Engram tables are always kept as stored. The
DSpark draft (`mtp.*`) is kept as read in `params.extra["mtp"]` and run by
`models/deepseek_v41_dspark.py` (its stages are built by the same `layer_tree`); its
target features (the stream mean of h before attention at `dspark_target_layer_ids`) come
from `prefill_with_features` / `extend_with_features`. The vision tower is reported unused
(text-only).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gsm_jax.errors import InvalidInputError, ModelLoadError, UnsupportedModelError
from gsm_jax.in_place import scatter_set
from gsm_jax.models import common
from gsm_jax.models.deepseek_common import (
    apply_rope,
    entries_mask,
    gather_entries,
    gather_pays,
    hc_expand,
    ring_after,
    ring_history,
    rms_norm,
    rope_cos_sin,
    score_fn,
    sink_attention,
    topk_indices,
    weighted_index_dots,
    weighted_streams,
)
from gsm_jax.models.deepseek_v41_cache import (
    cache_entries,
    empty_entries,
    qdq,
    read_entries,
)
from gsm_jax.models.deepseek_v41_checkpoint import (  # noqa: F401  (contract hooks)
    load_checkpoint,
    weights_from_hf,
)
from gsm_jax.models.deepseek_v41_plan import PLANNER  # noqa: F401  (contract: the planner's)
from gsm_jax.models.engram import engram_update, hash_ids, update_history
from gsm_jax.models.hf_config import PRETRAINED_KEYS, ConfigReader, rope_settings
from gsm_jax.models.moe import routed_experts, swiglu
from gsm_jax.models.rope import RopeSpec
from gsm_jax.models.sites import ATTN_OUT, FFN_MID, Sites, takes_sites

SWA, FULL, REINDEX, REUSE = "swa", "full", "reindex", "reuse"


# ----------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What one layer's attention owns and reads (derived from the config's lists)."""

    role: str  # SWA | FULL | REINDEX | REUSE
    ratio: int  # compress ratio (0: SWA-only)
    kv_source: int  # the Full layer whose compressed KV / index keys it reads (-1: none)
    topk_source: int  # the layer whose top-k it uses (itself when it selects; -1: none)
    candidate_source: bool  # publishes the candidate blocks
    uses_candidates: bool  # masks its scores to the candidate blocks


@dataclasses.dataclass(frozen=True)
class DeepseekV41Config:
    """Static model configuration (hashable: a static argument under jit)."""

    family = "deepseek_v41"

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    compress_ratios: tuple[int, ...]  # one per backbone layer (the DSpark stages cut off)
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    sliding_window: int = 128
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 1.0  # 1: no YaRN on the compressed layers
    yarn_original_max_position: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    rms_norm_eps: float = 1e-20
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()  # all of them (the primes run over the list);
    # those >= num_layers (a truncated config) are inactive
    engram_max_ngram_size: int = 4
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_vocab_size: int = 16000000
    engram_compressed_vocab_size: int = 99092
    engram_pad_token_id: int = 2
    engram_num_embeddings: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    # DSpark (§7; models/deepseek_v41_dspark.py): a block of dspark_block_size draft
    # positions, [accepted token, noise x (block - 1)]; target features = the stream mean
    # of h before attention at dspark_target_layer_ids; stages: dspark_n_routed_experts
    # experts, top dspark_num_experts_per_tok; a rank dspark_markov_rank Markov bias
    dspark_block_size: int = 5
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = (37, 38, 39)
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 128
    dspark_num_experts_per_tok: int = 3
    image_token_id: int = -1
    weight_block_size: tuple[int, int] = (32, 32)
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = (1,)
    expert_dispatch: str = "auto"
    # The released cache precisions (§4.5): FP8 window KV, FP4 compressed KV and index
    # keys / queries, the caches held packed in them (`PackedEntries`; the index queries and
    # the forward's own keys rounded and back). False keeps them float (an ablation, and
    # how tests check the cache machinery alone: a QDQ is discontinuous, so an ulp of
    # difference in a value at a rounding midpoint moves it a whole FP8 / FP4 step).
    cache_qdq: bool = True

    def __post_init__(self) -> None:
        _plan(self)  # validates the schedule

    @property
    def num_hidden_layers(self) -> int:
        return self.num_layers

    @property
    def site_sizes(self) -> tuple[int, int]:
        """Channels of the GSM sites (attn_out, ffn_mid)."""
        return (self.num_heads * self.head_dim, self.moe_intermediate_size)

    def plan(self, layer: int) -> LayerPlan:
        return _plan(self)[layer]

    @property
    def active_engram_layers(self) -> tuple[int, ...]:
        """The Engram layers this (possibly truncated) model runs."""
        return tuple(i for i in self.engram_layer_ids if i < self.num_layers)

    def rope(self, layer: int) -> RopeSpec:
        """Theta 1e4 without YaRN on ratio-0 layers; compress_rope_theta with
        frequency-only YaRN (no attention factor) on the compressed ones (§1, §4.2)."""
        if self.compress_ratios[layer] == 0:
            return RopeSpec(theta=self.rope_theta, dim=self.rope_dim)
        return self.compress_rope

    @property
    def compress_rope(self) -> RopeSpec:
        if self.yarn_factor == 1.0 or self.yarn_original_max_position <= 0:
            return RopeSpec(theta=self.compress_rope_theta, dim=self.rope_dim)
        return RopeSpec(theta=self.compress_rope_theta, dim=self.rope_dim, rope_type="yarn",
                        factor=self.yarn_factor,
                        original_max_position_embeddings=self.yarn_original_max_position,
                        beta_fast=self.yarn_beta_fast, beta_slow=self.yarn_beta_slow,
                        attention_factor=1.0)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> DeepseekV41Config:
        """From a config.json dict as NeMo AutoModel's `DeepseekV41Config.save_pretrained`
        writes it (nested: `text_config`, `vision_config`, top-level `quantization_config`)
        or a flat text config; the reference's key names (rope_head_dim, window_size,
        kv_source_layers, route_scale, n_mtp_layers) too. Every key is read, listed in
        `HARMLESS`, or refused by name (`models/hf_config.py`); an unknown one is warned
        about once. The rotary default is NeMo's (YaRN factor 16 over 65,536 positions on
        the compressed layers when neither `rope_parameters` nor `rope_scaling` is given);
        the layer schedule (source layers, candidates, Engram layers) has none that fits a
        truncated config, so a config must name it (NeMo's serializer always writes it)."""
        top = ConfigReader(hf, "deepseek_v41")
        text_r = top.sub("text_config")
        r = text_r if text_r is not None else top
        if text_r is not None:
            # the nested form's top level: what the text model needs is in text_config
            top.expect("model_type", ("deepseek_v41", None))
        r.expect("model_type", ("deepseek_v41_text", "deepseek_v41", None))
        quant = top.get("quantization_config") or r.get("quantization_config")
        get = r.require

        def opt(key: str, *aliases: str, default: Any) -> Any:
            return r.get(key, *aliases, default=default)

        num_layers = int(get("num_hidden_layers", "n_layers"))
        ratios = [int(x) for x in get("compress_ratios")]
        if len(ratios) < num_layers:
            raise ModelLoadError(
                f"deepseek_v41 config: compress_ratios has {len(ratios)} entries for "
                f"num_hidden_layers={num_layers}")
        r.expect("num_key_value_heads", (1,), default=1, why="one shared K=V latent")
        r.expect("n_shared_experts", (1,), default=1)
        if opt("num_hash_layers", default=0):
            raise UnsupportedModelError("deepseek_v41 config: num_hash_layers (hash routing) "
                                        "is not part of V4.1")
        # Settings whose other values the reference (NeMo AutoModel 0.7.0) does not
        # implement either: refused rather than run differently from it.
        r.expect("hidden_act", ("silu",), default="silu")
        r.expect("attention_bias", (False,), default=False)
        r.expect("topk_method", ("noaux_tc",), default="noaux_tc",
                 why="the reference routes top-k over bias-corrected scores, no groups")
        r.expect("norm_topk_prob", (True,), default=True,
                 why="the chosen experts' weights are renormalised")
        scoring = r.get("scoring_func", "score_func", default="sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise r.refuse("scoring_func", scoring, ("sqrtsoftplus",),
                           "the reference routes with sqrtsoftplus whatever the key says")
        tie = r.expect("tie_word_embeddings", (False,), default=False,
                       why="V4.1 has its own LM head")
        if text_r is not None:
            top.expect("tie_word_embeddings", (False,), default=False)
        rope = rope_settings(r, default=NEMO_ROPE_SCALING)
        rope_type = rope.get("rope_type", "default")
        if rope_type not in ("yarn", "default"):
            raise r.refuse("rope_parameters.rope_type", rope_type, ("yarn", "default"),
                           "YaRN on the compressed layers, or none")
        known_rope = {"rope_type", "rope_theta", "factor", "original_max_position_embeddings",
                      "beta_fast", "beta_slow"}
        extra = sorted(set(rope) - known_rope)
        if extra:
            raise UnsupportedModelError(
                f"deepseek_v41 config: rope_parameters keys {extra} are not supported "
                f"(supported: {sorted(known_rope)}; the reference's YaRN has no attention "
                "factor)")
        yarn = rope if rope_type == "yarn" else {}
        block = (32, 32)
        if quant:
            if quant.get("quant_method", "fp8") != "fp8":
                raise UnsupportedModelError(
                    f"deepseek_v41 config: quantization_config.quant_method "
                    f"{quant.get('quant_method')!r} (only fp8)")
            block = tuple(int(b) for b in quant.get("weight_block_size", block))
            if len(block) != 2:
                raise ModelLoadError("deepseek_v41 config: quantization_config."
                                     f"weight_block_size must be [out, in], got {block}")
        engram = tuple(int(i) for i in opt("engram_layer_ids", default=()))
        # the nested form writes it at both levels: the top level's (generation) first
        text_eos = r.get("eos_token_id", default=1)
        eos = top.get("eos_token_id", default=text_eos) if text_r is not None else text_eos
        eos = tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))
        image = top.get("image_token_id") if text_r is not None else None
        image = r.get("image_token_id", default=-1) if image is None else image
        cfg = cls(
            vocab_size=int(get("vocab_size")),
            hidden_size=int(get("hidden_size", "dim")),
            num_layers=num_layers,
            num_heads=int(get("num_attention_heads", "n_heads")),
            head_dim=int(get("head_dim")),
            rope_dim=int(get("qk_rope_head_dim", "rope_head_dim")),
            q_lora_rank=int(get("q_lora_rank")),
            o_groups=int(get("o_groups")),
            o_lora_rank=int(get("o_lora_rank")),
            n_routed_experts=int(get("n_routed_experts")),
            num_experts_per_tok=int(get("num_experts_per_tok", "n_activated_experts")),
            moe_intermediate_size=int(get("moe_intermediate_size", "moe_inter_dim")),
            compress_ratios=tuple(ratios[:num_layers]),
            kv_source_layer_ids=tuple(int(i) for i in opt("kv_source_layer_ids",
                                                          "kv_source_layers", default=())),
            index_source_layer_ids=tuple(int(i) for i in opt("index_source_layer_ids",
                                                             "index_source_layers",
                                                             default=())),
            index_n_heads=int(get("index_n_heads")),
            index_head_dim=int(get("index_head_dim")),
            index_topk=int(get("index_topk")),
            candidate_source_layer_id=int(opt("candidate_source_layer_id", default=-1)),
            candidate_topk_blocks=int(opt("candidate_topk_blocks", default=0)),
            candidate_block_size=int(opt("candidate_block_size", default=0)),
            sliding_window=int(get("sliding_window", "window_size")),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            compress_rope_theta=float(opt("compress_rope_theta", default=160000.0)),
            yarn_factor=float(yarn.get("factor", 1.0)),
            yarn_original_max_position=int(yarn.get("original_max_position_embeddings", 0)),
            yarn_beta_fast=float(yarn.get("beta_fast", 32)),
            yarn_beta_slow=float(yarn.get("beta_slow", 1)),
            rms_norm_eps=float(opt("rms_norm_eps", "norm_eps", default=1e-20)),
            scoring_func=str(scoring),
            routed_scaling_factor=float(opt("routed_scaling_factor", "route_scale",
                                            default=1.5)),
            swiglu_limit=float(opt("swiglu_limit", default=10.0)),
            hc_mult=int(opt("hc_mult", default=4)),
            hc_sinkhorn_iters=int(opt("hc_sinkhorn_iters", default=20)),
            hc_eps=float(opt("hc_eps", default=1e-6)),
            engram_layer_ids=engram,
            engram_max_ngram_size=int(opt("engram_max_ngram_size", default=4)),
            engram_n_heads=int(opt("engram_n_heads", default=8)),
            engram_head_dim=int(opt("engram_head_dim", default=256)),
            engram_vocab_size=int(opt("engram_vocab_size", default=16000000)),
            engram_compressed_vocab_size=int(opt("engram_compressed_vocab_size",
                                                 default=99092)),
            engram_pad_token_id=int(opt("engram_pad_token_id", default=2)),
            engram_num_embeddings=tuple(int(x) for x in opt("engram_num_embeddings",
                                                            default=())),
            num_nextn_predict_layers=int(opt("num_nextn_predict_layers", "n_mtp_layers",
                                             default=0)),
            dspark_block_size=int(opt("dspark_block_size", default=5)),
            dspark_noise_token_id=int(opt("dspark_noise_token_id", default=128799)),
            dspark_target_layer_ids=tuple(int(i) for i in opt("dspark_target_layer_ids",
                                                              default=(37, 38, 39))),
            dspark_markov_rank=int(opt("dspark_markov_rank", default=256)),
            dspark_n_routed_experts=int(opt("dspark_n_routed_experts", default=128)),
            dspark_num_experts_per_tok=int(opt("dspark_num_experts_per_tok", default=3)),
            image_token_id=int(image),
            weight_block_size=block,
            max_position_embeddings=int(opt("max_position_embeddings", default=1048576)),
            tie_word_embeddings=bool(tie),
            eos_token_ids=eos,
        )
        top.finish(HARMLESS)
        return cfg


# The reference's rotary default when a config names none (NeMo's DeepseekV41Config):
# frequency-only YaRN on the compressed layers.
NEMO_ROPE_SCALING = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536}

# Keys NeMo's DeepseekV41Config writes that do not change inference here (one-word reason).
HARMLESS: dict[str, str] = {
    **PRETRAINED_KEYS,
    "bos_token_id": "tokenizer",  # the chat template adds BOS; the model never reads it
    "vision_config": "vision",  # the vision tower: text-only here; image tokens are masked
    "expert_dtype": "checkpoint",  # read off the tensors (deepseek_v41_checkpoint)
}


@functools.lru_cache(maxsize=64)
def _plan(cfg: DeepseekV41Config) -> tuple[LayerPlan, ...]:
    """Each layer's CSA2 role; raises ModelLoadError naming the key of a bad schedule."""
    def bad(key: str, msg: str) -> ModelLoadError:
        return ModelLoadError(f"deepseek_v41 config: {key}: {msg}")

    n, ratios = cfg.num_layers, cfg.compress_ratios
    if len(ratios) != n:
        raise bad("compress_ratios", f"{len(ratios)} entries for {n} layers")
    if any(r < 0 for r in ratios):
        raise bad("compress_ratios", f"negative ratio in {list(ratios)}")
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        ids = getattr(cfg, key)
        top = None if key == "engram_layer_ids" else n  # Engram: all layers of the release
        if list(ids) != sorted(set(ids)) or any(i < 0 or (top and i >= top) for i in ids):
            raise bad(key, f"{list(ids)} must be increasing layer ids"
                      + (f" below {n}" if top else ""))
    if cfg.engram_layer_ids:
        from gsm_jax.models.engram import engram_specs

        try:
            engram_specs(cfg)
        except ValueError as e:
            raise bad("engram_layer_ids", str(e)) from None
    kv, idx, cand = set(cfg.kv_source_layer_ids), set(cfg.index_source_layer_ids), \
        cfg.candidate_source_layer_id
    if not kv <= idx:
        raise bad("index_source_layer_ids",
                  f"every KV source must be an index source; missing {sorted(kv - idx)}")
    if cand >= 0:
        if cand not in kv:
            raise bad("candidate_source_layer_id",
                      f"layer {cand} is not a Full layer (kv_source_layer_ids)")
        if cfg.candidate_topk_blocks <= 0 or cfg.candidate_block_size <= 0:
            raise bad("candidate_topk_blocks",
                      "candidate_topk_blocks and candidate_block_size must be positive")
        # candidate_topk_blocks * candidate_block_size < index_topk is allowed, as NeMo
        # allows it: a Reindex layer then has fewer candidates than picks, and the picks
        # without a finite score are not attended (NeMo's -1; `topk_indices`' picked=False).
    if cfg.rope_dim <= 0 or cfg.rope_dim % 2 or cfg.rope_dim > min(cfg.head_dim,
                                                                   cfg.index_head_dim):
        raise bad("qk_rope_head_dim", f"{cfg.rope_dim} must be even and fit head_dim "
                  f"{cfg.head_dim} and index_head_dim {cfg.index_head_dim}")
    if cfg.num_heads % cfg.o_groups:
        raise bad("o_groups", f"{cfg.o_groups} must divide num_attention_heads "
                  f"{cfg.num_heads}")
    plans: list[LayerPlan] = []
    full = -1  # the latest Full layer (its compressed KV is the current state)
    publisher = -1  # the latest layer that selected a top-k
    for layer, r in enumerate(ratios):
        if r == 0:
            if layer in kv or layer in idx:
                raise bad("kv_source_layer_ids" if layer in kv else "index_source_layer_ids",
                          f"SWA-only layer {layer} (compress_ratios[{layer}] = 0) cannot be "
                          "a source")
            plans.append(LayerPlan(SWA, 0, -1, -1, False, False))
            continue
        uses_cand = layer in idx and 0 <= cand < layer
        if uses_cand and ratios[cand] != r:
            raise bad("candidate_source_layer_id",
                      f"index source {layer} (ratio {r}) after candidate source {cand} "
                      f"(ratio {ratios[cand]}) needs the same ratio")
        if layer in kv:
            full = publisher = layer
            plans.append(LayerPlan(FULL, r, layer, layer, layer == cand, uses_cand))
            continue
        if full < 0 or ratios[full] != r:
            kind = "Reindex" if layer in idx else "Reuse"
            raise bad("compress_ratios",
                      f"{kind} layer {layer} (ratio {r}) has no earlier Full layer "
                      f"(kv_source_layer_ids) of ratio {r}")
        if layer in idx:
            if not uses_cand:
                raise bad("candidate_source_layer_id",
                          f"Reindex layer {layer} has no candidate source before it "
                          f"(candidate_source_layer_id={cand})")
            publisher = layer
            plans.append(LayerPlan(REINDEX, r, full, layer, False, True))
        else:
            plans.append(LayerPlan(REUSE, r, full, publisher, False, False))
    return tuple(plans)


CONFIG_CLASS = DeepseekV41Config


# ----------------------------------------------------------------------------- cache


@struct.dataclass
class LayerCache:
    """One layer's decode state (rows = batch; slots are functions of positions).

    window:     [B, Wc, hd] FP8 (packed) RoPE'd K=V of the last Wc = min(sliding_window,
                max_len) tokens, position p in slot p % Wc (every layer).
    comp:       [B, Nc, hd] the Full layer's NVFP4 (packed) compressed KV, group w in slot w,
                Nc = max_len // ratio (Reuse / Reindex layers read their Full layer's).
    index_keys: [B, Nc, ci] the Full layer's MXFP4 (packed) index keys.
    The three are `PackedEntries` (`cache_qdq`) or float arrays (`cache_qdq=False`).
    comp_ring:  [B, ratio, 2 hd] f32 raw kv|gate projections of the group being
                compressed, position p in slot p % ratio (ratio > 1 only).
    The published top-k and candidates are per query: recomputed, nothing cached.
    """

    window: jax.Array
    comp: jax.Array | None = None
    index_keys: jax.Array | None = None
    comp_ring: jax.Array | None = None


@struct.dataclass
class DeepseekV41Cache:
    """Per-layer caches, per-row lengths (= the next position), the GSM rings."""

    layers: tuple[LayerCache, ...]
    lengths: jax.Array
    rings: tuple[jax.Array, jax.Array] | None = None
    max_len: int | None = struct.field(pytree_node=False, default=None)
    # [B, max_ngram - 1] int32: each row's last compressed token classes, oldest first
    # (-1: blocked / before the start), for the Engram hash (None without Engram layers)
    engram_history: jax.Array | None = None


# each cached entry kind: its released format (held packed when `cache_qdq`)
ENTRY_FORMATS = {"window": "fp8", "comp": "nvfp4", "index_keys": "mxfp4"}


def _layer_cache_shapes(cfg: DeepseekV41Config, layer: int, batch: int, max_len: int) -> dict:
    """{field: (logical shape, dtype: None = the cache's entries)}."""
    plan = cfg.plan(layer)
    shapes = {"window": ((batch, min(cfg.sliding_window, max_len), cfg.head_dim), None)}
    if plan.role == FULL:
        n = max_len // plan.ratio
        shapes["comp"] = ((batch, n, cfg.head_dim), None)
        shapes["index_keys"] = ((batch, n, cfg.index_head_dim), None)
        if plan.ratio > 1:
            shapes["comp_ring"] = ((batch, plan.ratio, 2 * cfg.head_dim), jnp.float32)
    return shapes


def init_cache(cfg: DeepseekV41Config, batch_size: int, max_len: int, *,
               dtype: Any = jnp.float32, gsm_max_window: int | None = None) -> DeepseekV41Cache:
    """Zeroed caches: window / compressed KV / index keys packed in the released formats
    (`cache_qdq`, the default) or float in `dtype`; the compressor rings float32."""
    def field(name, shape, dt):
        if dt is not None:
            return jnp.zeros(shape, dt)
        return empty_entries(cfg, ENTRY_FORMATS[name], shape, dtype)

    layers = tuple(
        LayerCache(**{k: field(k, s, dt) for k, (s, dt)
                      in _layer_cache_shapes(cfg, i, batch_size, max_len).items()})
        for i in range(cfg.num_layers))
    rings = None
    if gsm_max_window is not None:
        rings = tuple(jnp.zeros((cfg.num_layers, batch_size, gsm_max_window, c), dtype)
                      for c in cfg.site_sizes)
    history = None
    if active_engram_specs(cfg):
        history = jnp.full((batch_size, cfg.engram_max_ngram_size - 1), -1, jnp.int32)
    return DeepseekV41Cache(layers=layers, lengths=jnp.zeros((batch_size,), jnp.int32),
                            rings=rings, max_len=max_len, engram_history=history)


def cache_insert(cache: DeepseekV41Cache, rows: DeepseekV41Cache,
                 slots: jax.Array) -> DeepseekV41Cache:
    """Copy the rows of `rows` (same max_len) into `cache` at batch indices `slots` [b]."""
    return common.insert_rows(cache, rows, slots)


# ----------------------------------------------------------------------------- numerics


def hc_mix(w: dict, h: jax.Array, cfg: DeepseekV41Config):
    """One mix projection of the streams h [B,T,N,D] (f32): pre [B,T,N] (the *next*
    sublayer's collapse weights), post [B,T,N] and comb [B,T,N,N] (this sublayer's expand)."""
    n = cfg.hc_mult
    flat = h.reshape(h.shape[:2] + (-1,)).astype(jnp.float32)
    rs = jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + cfg.rms_norm_eps)
    m = (flat @ w["fn"].astype(jnp.float32)) * rs
    s, base = w["scale"].astype(jnp.float32), w["base"].astype(jnp.float32)
    pre = jax.nn.sigmoid(m[..., :n] * s[0] + base[:n]) + cfg.hc_eps
    post = 2 * jax.nn.sigmoid(m[..., n:2 * n] * s[1] + base[n:2 * n])
    comb = (m[..., 2 * n:] * s[2] + base[2 * n:]).reshape(m.shape[:-1] + (n, n))
    comb = jax.nn.softmax(comb, axis=-1) + cfg.hc_eps
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + cfg.hc_eps)

    def sinkhorn(_, c):  # a loop, not unrolled: 19 unrolled passes per sublayer is ~70K HLO lines
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + cfg.hc_eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + cfg.hc_eps)

    comb = jax.lax.fori_loop(0, cfg.hc_sinkhorn_iters - 1, sinkhorn, comb)
    return pre, post, comb


def _rope(x: jax.Array, spec: RopeSpec, positions: jax.Array, inverse: bool = False):
    """Interleaved RoPE on the trailing spec.dim channels; x [B, T, (H,) C], positions [B, T]."""
    cos, sin = rope_cos_sin(spec, positions)
    if x.ndim == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    return apply_rope(x, cos, -sin if inverse else sin)


def compress_latent(cfg: DeepseekV41Config, w: dict, x: jax.Array, ratio: int, lin) -> jax.Array:
    """The Full layer's compressor (§4.3): x [B,T,D] -> latents [B, T // ratio, hd], before
    RoPE. Ratio > 1: per channel softmax pooling over each group of `ratio` tokens (f32);
    ratio 1: the projection. Then RMSNorm."""
    if ratio == 1:
        return rms_norm(lin("compressor.wkv", x, w["wkv"]), w["norm"], cfg.rms_norm_eps)
    b, t, _ = x.shape
    n = t // ratio
    xs = x[:, :n * ratio].astype(jnp.float32)
    kv = lin("compressor.wkv", xs, w["wkv"]).reshape(b, n, ratio, -1)
    gate = lin("compressor.wgate", xs, w["wgate"]).reshape(b, n, ratio, -1)
    pooled = jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2).astype(x.dtype)
    return rms_norm(pooled, w["norm"], cfg.rms_norm_eps)


def _cached_latents(cfg: DeepseekV41Config, w: dict, x: jax.Array, ratio: int, positions,
                    start, end, ring, lin):
    """The groups a chunk x [B,C,D] (positions start..) completes: (latents [B, n, hd]
    before RoPE, their group ids w [B, n], done [B, n]) and the advanced ring. A group may
    start before the chunk: its raw projections then come from the ring."""
    c = x.shape[1]
    if ratio == 1:
        lat = rms_norm(lin("compressor.wkv", x, w["wkv"]), w["norm"], cfg.rms_norm_eps)
        return lat, positions, positions < end[:, None], ring
    xs = x.astype(jnp.float32)
    raw = jnp.concatenate([lin("compressor.wkv", xs, w["wkv"]),
                           lin("compressor.wgate", xs, w["wgate"])], axis=-1)
    hist, _ = ring_history(ring, start)
    seq = jnp.concatenate([hist, raw.astype(ring.dtype)], axis=1)  # from start - ratio
    g = start[:, None] // ratio + jnp.arange(c // ratio + 1)[None, :]  # [B, n]
    last = (g + 1) * ratio - 1
    done = (last >= start[:, None]) & (last < end[:, None])
    idx = g[..., None] * ratio + jnp.arange(ratio) - (start - ratio)[:, None, None]
    rows = jnp.arange(x.shape[0])[:, None, None]
    grp = seq[rows, jnp.clip(idx, 0, seq.shape[1] - 1)]  # [B, n, ratio, 2hd]
    hd = cfg.head_dim
    pooled = jnp.sum(grp[..., :hd] * jax.nn.softmax(grp[..., hd:], axis=2), axis=2)
    lat = rms_norm(pooled.astype(x.dtype), w["norm"], cfg.rms_norm_eps)
    return lat, g, done, ring_after(seq, start - ratio, end, ratio)


def _write_slots(buf, slot: jax.Array, value, done: jax.Array):
    """buf[b, slot[b, j]] = value[b, j] where done (others dropped); float or packed
    entries (each leaf written alike)."""
    slot = jnp.where(done, slot, buf.shape[1])
    rows = jnp.arange(slot.shape[0])[:, None]
    return jax.tree.map(  # in place at batch 1 too
        lambda bf, v: scatter_set(bf, (rows, slot), v.astype(bf.dtype), mode="drop"),
        buf, value)


def _gather(entries, idx: jax.Array, dtype: Any) -> jax.Array:
    """`gather_entries` of float or packed entries, as `dtype` values (only the gathered
    entries are unpacked)."""
    return read_entries(jax.tree.map(lambda a: gather_entries(a, idx), entries), dtype)


def index_scores(cfg: DeepseekV41Config, w: dict, x, q_res, positions, keys, spec, lin):
    """Indexer scores (§4.4): x [B,T,D], q_res [B,T,q_lora], keys [B,n,ci] (float or
    packed entries: read once, in the query's dtype) -> [B,T,n] f32."""
    hi, ci = cfg.index_n_heads, cfg.index_head_dim
    q = lin("indexer.q_b", q_res, w["q_b"]).reshape(q_res.shape[:2] + (hi, ci))
    q = qdq(cfg, "mxfp4", _rope(q, spec, positions))
    head_w = lin("indexer.weights_proj", x, w["weights_proj"]) * (ci**-0.5 * hi**-0.5)
    return weighted_index_dots(q, read_entries(keys, q.dtype), head_w).astype(jnp.float32)


def candidate_slots(cfg: DeepseekV41Config, scores: jax.Array, visible: jax.Array,
                    n_visible: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The candidate source's slots (§4.4): blocks of `candidate_block_size` slots scored
    by their max, the block of the newest visible slot forced in, the best
    `candidate_topk_blocks` kept (those with a finite score).

    The tie rule, here and in every top-k of the indexer (`topk_indices`): equal scores
    go to the lower index (`jax.lax.top_k`). Ties are real: the ReLU makes all-zero score
    rows, and FP4 queries and keys with few index heads make equal sums common. NeMo's
    `torch.topk` leaves the order of ties to the implementation; the parity tests make it
    deterministic with a stable descending sort in its place, which breaks ties the same
    way (tests/v41_reference.py, `stable_topk`). Returns (slots [B,T,C],
    ok [B,T,C]), C = kept blocks x block size, the blocks in ascending order (a Reindex
    top-k over them then breaks ties toward the lower slot, as over the whole mask);
    ok: a kept, visible slot. The masked form is `entries_mask(slots, ok, n)` (the slots of
    dropped blocks lie past n: the scatter drops them)."""
    bs = cfg.candidate_block_size
    n = scores.shape[-1]
    s = jnp.where(visible, scores, -jnp.inf)
    s = jnp.pad(s, [(0, 0), (0, 0), (0, -n % bs)], constant_values=-jnp.inf)
    block = jnp.max(s.reshape(s.shape[:-1] + (-1, bs)), axis=-1)
    nb = block.shape[-1]
    last = jnp.floor_divide(n_visible - 1, bs)
    block = jnp.where(jnp.arange(nb) == last[..., None], jnp.inf, block)
    vals, idx = jax.lax.top_k(block, min(cfg.candidate_topk_blocks, nb))
    blocks = jnp.sort(jnp.where(vals > -jnp.inf, idx, nb), axis=-1)  # dropped ones last
    slots = (blocks[..., None] * bs + jnp.arange(bs)).reshape(blocks.shape[:-1] + (-1,))
    ok = (jnp.repeat(blocks < nb, bs, axis=-1) & (slots < n)
          & jnp.take_along_axis(visible, jnp.minimum(slots, n - 1), axis=-1))
    return slots, ok


# ----------------------------------------------------------------------------- layer


def attention(cfg: DeepseekV41Config, w: dict, layer: int, x: jax.Array, state: dict,
              cache: LayerCache | None, step: common.Step):
    """CSA2 attention: x [B,T,D] -> (out [B,T,D], the new CSA2 state, the new LayerCache).

    Without a cache (forward) the keys are the call's own tokens; with one (prefill,
    extend, decode: one code path) the window ring's then the chunk's, and the Full
    layer's compressed KV / index keys are the cache's with the groups the chunk completes
    written first (a group split by chunks pools the ring's and the chunk's projections).
    Masks go by position, so a chunk equals the same tokens in one call."""
    plan = cfg.plan(layer)
    spec = cfg.rope(layer)
    eps = cfg.rms_norm_eps
    b, t, _ = x.shape

    def lin(name, a, wt):
        return step.linear(layer, name, a, wt)

    positions = step.start[:, None] + jnp.arange(t)[None, :]
    q_res = rms_norm(lin("q_a", x, w["q_a"]), w["q_norm"], eps)
    q = lin("q_b", q_res, w["q_b"]).reshape(b, t, cfg.num_heads, cfg.head_dim)
    q = _rope(q, spec, positions)
    kv = rms_norm(lin("kv", x, w["kv"]), w["kv_norm"], eps)
    kv = _rope(kv, spec, positions)
    kv_entries = None if cache is None else cache_entries(cfg, "fp8", kv)
    kv = qdq(cfg, "fp8", kv) if kv_entries is None else read_entries(kv_entries, kv.dtype)
    valid = step.valid
    new = selected = None
    if cache is None:  # forward: the call's own tokens
        steps = jnp.arange(t)
        band = ((steps[None, :] <= steps[:, None])
                & (steps[None, :] > steps[:, None] - cfg.sliding_window))
        keys, mask = kv, jnp.broadcast_to(band, (b, t, t)) & valid[:, None, :]
    else:  # the window ring's positions start - Wc .. start - 1, then the chunk
        start, end = step.start, step.start + step.n_new
        size = cache.window.shape[1]
        hist, hist_pos = ring_history(cache.window, start)
        seq = jax.tree.map(lambda h, e: jnp.concatenate([h, e.astype(h.dtype)], axis=1),
                           hist, kv_entries)
        keys = jnp.concatenate([read_entries(hist, kv.dtype), kv], axis=1)
        key_pos = jnp.concatenate([jnp.where(hist_pos >= 0, hist_pos, -1),
                                   jnp.where(valid, positions, -1)], axis=1)
        qp, kp = positions[:, :, None], key_pos[:, None, :]
        mask = valid[:, :, None] & (kp >= 0) & (kp <= qp) & (kp > qp - cfg.sliding_window)
        new = {"window": ring_after(seq, start - size, end, size)}
    if plan.role != SWA:
        r = plan.ratio
        if plan.role == FULL:
            if cache is None:
                latent = compress_latent(cfg, w["compressor"], x, r, lin)  # [B, n, hd]
                g = jnp.broadcast_to(jnp.arange(latent.shape[1]), latent.shape[:2])
            else:
                latent, g, done, ring = _cached_latents(cfg, w["compressor"], x, r, positions,
                                                        start, end, cache.comp_ring, lin)
            ik = rms_norm(lin("indexer.wk", latent, w["indexer"]["wk"]),
                          w["indexer"]["k_norm"], eps)
            comp, ikeys = _rope(latent, spec, g * r), _rope(ik, spec, g * r)
            if cache is None:
                comp, ikeys = qdq(cfg, "nvfp4", comp), qdq(cfg, "mxfp4", ikeys)
            else:
                # written first, then read (this layer's indexer and the Reuse / Reindex
                # layers after it): the caches are updated in place (`_write_slots`)
                comp = _write_slots(cache.comp, g, cache_entries(cfg, "nvfp4", comp), done)
                ikeys = _write_slots(cache.index_keys, g, cache_entries(cfg, "mxfp4", ikeys),
                                     done)
                new.update(comp=comp, index_keys=ikeys)
                if ring is not None:
                    new["comp_ring"] = ring
            state = {**state, "comp": comp, "index_keys": ikeys}
        comp = state["comp"]
        n = comp.shape[1]
        n_visible = (positions + 1) // r  # [B, T]
        visible = (jnp.arange(n)[None, None, :] < n_visible[..., None]) & valid[..., None]
        if plan.uses_candidates and not plan.candidate_source and cache is not None and t == 1:
            # decode: a Reindex layer scores only the candidate slots (gathered), not every
            # compressed entry; its top-k is the masked form's (ties: the lower slot)
            slots, ok = state["candidates"]
            keys_c = jax.tree.map(lambda a: gather_entries(a, slots)[:, 0],  # [B, C, ci]
                                  state["index_keys"])
            scores = index_scores(cfg, w["indexer"], x, q_res, positions, keys_c, spec, lin)
            pick, picked = topk_indices(scores, ok, cfg.index_topk)
            state = {**state, "selected": (jnp.take_along_axis(slots, pick, axis=-1), picked)}
        elif plan.role in (FULL, REINDEX):
            scores = index_scores(cfg, w["indexer"], x, q_res, positions,
                                  state["index_keys"], spec, lin)
            allowed = visible
            if plan.candidate_source:
                state = {**state,
                         "candidates": candidate_slots(cfg, scores, visible, n_visible)}
            elif plan.uses_candidates:
                allowed = visible & entries_mask(*state["candidates"], n)
            # (indices, picked) [B,T,k]; the reference's ties and visibility: `topk_indices`
            state = {**state, "selected": topk_indices(scores, allowed, cfg.index_topk)}
        idx, picked = state["selected"]
        if cache is not None and gather_pays(t, idx.shape[-1], n):
            # decode / short chunks: only the selected entries are read (sink_attention)
            selected = (_gather(comp, idx, kv.dtype), picked)
        else:
            keys = jnp.concatenate([keys, read_entries(comp, kv.dtype)], axis=1)
            mask = jnp.concatenate([mask, entries_mask(idx, picked, n)], axis=2)
    with jax.named_scope("attention"):
        attn = sink_attention(q, keys, mask, w["sinks"], cfg.head_dim**-0.5, selected)
    attn = _rope(attn, spec, positions, inverse=True)
    flat = step.site(layer, ATTN_OUT, attn.reshape(b, t, -1))  # GSM site attn_out
    grouped = flat.reshape(b * t, cfg.o_groups, -1)
    low = jax.lax.dot_general(grouped, w["o_a"].astype(flat.dtype),
                              (((2,), (1,)), ((1,), (0,))))  # [G, B*T, O]
    low = jnp.swapaxes(low, 0, 1).reshape(b, t, -1)
    out = lin("o_b", low, w["o_b"])
    return out, state, None if new is None else LayerCache(**new)


def moe(cfg: DeepseekV41Config, w: dict, layer: int, x: jax.Array, step: common.Step):
    """Routed experts (sqrtsoftplus + text bias) + the shared expert: x [B,T,D] -> [B,T,D]."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    with jax.named_scope("router"):
        logits = step.linear(layer, "router", flat.astype(jnp.float32), w["router"])
        scores = score_fn(cfg.scoring_func, logits.astype(jnp.float32))
        # bias_vl would replace bias for image-span tokens; this model is text-only
        _, idx = jax.lax.top_k(scores + w["bias"].astype(jnp.float32), cfg.num_experts_per_tok)
        wts = jnp.take_along_axis(scores, idx, axis=-1)
        wts = wts / (jnp.sum(wts, axis=-1, keepdims=True) + 1e-20) * cfg.routed_scaling_factor
    with jax.named_scope("routed_experts"):
        routed = routed_experts(flat, idx, wts, w["experts_gate_up"], w["experts_down"],
                                cfg.swiglu_limit, dispatch=cfg.expert_dispatch)
    with jax.named_scope("shared_expert"):
        mid = swiglu(step.linear(layer, "shared_gate_up", x, w["shared_gate_up"]),
                     cfg.swiglu_limit)
        mid = step.site(layer, FFN_MID, mid, w["shared_down"])  # GSM site ffn_mid
        shared = step.linear(layer, "shared_down", mid, w["shared_down"])
    return routed.reshape(b, t, d).astype(x.dtype) + shared


def engram_layer(cfg: DeepseekV41Config, w: dict, index: int, h: jax.Array, state: dict,
                 step: common.Step) -> jax.Array:
    """Engram (§6.3): the layer's table rows of the hashed n-grams (state["engram_ids"],
    computed once per call in `_run`) gathered as stored, dequantized, projected by `wkv`
    ("engram.wkv") into a key per stream and a shared value; the gated update of h
    [B,T,N,D]. Invalid (padding, image) tokens get gate 0."""
    ids = state["engram_ids"][index]

    def wkv(e):
        return step.linear(index, "engram.wkv", e, w["wkv"])

    with jax.named_scope("engram"):
        return engram_update(h, w["table"], w["table_scale"], ids, wkv, w["q_weight"],
                             w["k_weight"], cfg.rms_norm_eps, state["engram_valid"],
                             embed_dtype=h.dtype)


def layer(cfg: DeepseekV41Config, w: dict, index: int, x, cache, step: common.Step):
    """`common.run_layers`' layer_fn. x = (streams [B,T,N,D], pre [B,T,N], CSA2 state)."""
    h, pre, state = x
    eps = cfg.rms_norm_eps
    if "engram" in w:  # before the block's mHC mix, on all streams (§6.3)
        h = engram_layer(cfg, w["engram"], index, h, state, step)
    if index in state.get("feature_layers", ()):  # DSpark's target feature (§2 step 5.2)
        state = {**state, "features": state["features"] + (jnp.mean(h, axis=2),)}
    a_pre, a_post, a_comb = hc_mix(w["hc_attn"], h, cfg)
    out, state, cache = attention(cfg, w["attn"], index,
                                  rms_norm(weighted_streams(pre, h), w["attn_norm"], eps),
                                  state, cache, step)
    h = hc_expand(a_post, a_comb, out, h)
    f_pre, f_post, f_comb = hc_mix(w["hc_ffn"], h, cfg)
    out = moe(cfg, w["moe"], index, rms_norm(weighted_streams(a_pre, h), w["ffn_norm"], eps),
              step)
    h = hc_expand(f_post, f_comb, out, h)
    return (h, f_pre, state), cache


# ----------------------------------------------------------------------------- weights


def weight_shapes(cfg: DeepseekV41Config, dtype: Any = jnp.float32) -> dict:
    """The float weight tree ([in, out] projections) as ShapeDtypeStructs.

    An Engram layer's `engram` subtree: `table` [rows, d] (FP8 e4m3 as stored, or a float
    table) with `table_scale` [rows, d / 32] (E8M0 bytes, or float32 scales),
    `wkv` [n_ids * d, (hc_mult + 1) * D], `q_weight` / `k_weight` [hc_mult, D]; the model
    then also holds `engram_token_map` int32 [vocab] (vocab id -> compressed class)."""
    f32 = jnp.float32
    d, h, hd, n = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.hc_mult
    e, i, g = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.o_groups
    hi, ci = cfg.index_n_heads, cfg.index_head_dim

    def s(shape, dt=dtype):
        return jax.ShapeDtypeStruct(tuple(shape), dt)

    def hc():
        return {"fn": s((n * d, (2 + n) * n), f32), "base": s(((2 + n) * n,), f32),
                "scale": s((3,), f32)}

    specs = {sp.layer_id: sp for sp in active_engram_specs(cfg)}
    layers = []
    for li in range(cfg.num_layers):
        plan = cfg.plan(li)
        attn = {"q_a": s((d, cfg.q_lora_rank)), "q_norm": s((cfg.q_lora_rank,), f32),
                "q_b": s((cfg.q_lora_rank, h * hd)), "kv": s((d, hd)), "kv_norm": s((hd,), f32),
                "o_a": s((g, h * hd // g, cfg.o_lora_rank)),
                "o_b": s((g * cfg.o_lora_rank, d)), "sinks": s((h,), f32)}
        if plan.role == FULL:
            attn["compressor"] = {"wkv": s((d, hd), f32), "norm": s((hd,), f32)}
            if plan.ratio > 1:
                attn["compressor"]["wgate"] = s((d, hd), f32)
        if plan.role in (FULL, REINDEX):
            attn["indexer"] = {"q_b": s((cfg.q_lora_rank, hi * ci)),
                               "weights_proj": s((d, hi))}
            if plan.role == FULL:
                attn["indexer"].update(wk=s((hd, ci)), k_norm=s((ci,), f32))
        lw = {
            "attn_norm": s((d,), f32), "ffn_norm": s((d,), f32),
            "hc_attn": hc(), "hc_ffn": hc(), "attn": attn,
            "moe": {"router": s((d, e), f32), "bias": s((e,), f32), "bias_vl": s((e,), f32),
                    "experts_gate_up": s((e, d, 2 * i)), "experts_down": s((e, i, d)),
                    "shared_gate_up": s((d, 2 * i)), "shared_down": s((i, d))},
        }
        if li in specs:
            sp, ed = specs[li], cfg.engram_head_dim
            lw["engram"] = {"table": s((sp.num_embeddings, ed)),
                            "table_scale": s((sp.num_embeddings, -(-ed // 32)), f32),
                            "wkv": s((sp.n_ids * ed, (n + 1) * d)),
                            "q_weight": s((n, d), f32), "k_weight": s((n, d), f32)}
        layers.append(lw)
    out = {"embed": s((cfg.vocab_size, d)), "lm_head": s((d, cfg.vocab_size)),
           "final_norm": s((d,), f32), "layers": tuple(layers)}
    if specs:
        out["engram_token_map"] = s((cfg.vocab_size,), jnp.int32)
    return out


_SMALL_INIT = {"sinks", "base", "bias", "bias_vl"}


def init_weights(cfg: DeepseekV41Config, rng: jax.Array, dtype: Any = jnp.float32) -> dict:
    """Random weights (tests): the tree `weights_from_hf` produces; sinks and biases random.
    An Engram model gets float tables (scales 1) and the token map id % classes."""
    gen = np.random.default_rng(np.asarray(jax.random.key_data(rng)).ravel().tolist())

    def draw(path, sds):
        name = path[-1].key
        if name == "engram_token_map":
            return jnp.asarray(np.arange(sds.shape[0]) % cfg.engram_compressed_vocab_size,
                               jnp.int32)
        if name == "table_scale":
            return jnp.ones(sds.shape, sds.dtype)
        if name.endswith("norm") or name == "scale" or name in ("q_weight", "k_weight"):
            return jnp.asarray(1 + 0.1 * gen.standard_normal(sds.shape), sds.dtype)
        std = 0.5 if name in _SMALL_INIT else 0.02
        return jnp.asarray(std * gen.standard_normal(sds.shape), sds.dtype)

    return jax.tree_util.tree_map_with_path(draw, weight_shapes(cfg, dtype))


@functools.lru_cache(maxsize=64)
def active_engram_specs(cfg: DeepseekV41Config) -> tuple:
    """The hash constants of the active Engram layers (pad class: the pad token's id; the
    model reads the real one from its token map)."""
    if not cfg.engram_layer_ids:
        return ()
    from gsm_jax.models.engram import engram_specs

    return tuple(sp for sp in engram_specs(cfg) if sp.layer_id < cfg.num_layers)


# ----------------------------------------------------------------------------- entry points


def embed(weights: dict, cfg: DeepseekV41Config, tokens: jax.Array):
    """Tokens [B, T] -> (streams [B,T,N,D] (copies of the embedding), pre (one-hot on 0))."""
    x = jnp.take(weights["embed"], tokens, axis=0)
    h = jnp.broadcast_to(x[..., None, :], x.shape[:-1] + (cfg.hc_mult, cfg.hidden_size))
    pre = jnp.broadcast_to(jax.nn.one_hot(0, cfg.hc_mult, dtype=jnp.float32),
                           tokens.shape + (cfg.hc_mult,))
    return h, pre


def logits(weights: dict, cfg: DeepseekV41Config, x: jax.Array) -> jax.Array:
    """Final norm + LM head: the collapsed hidden states [..., D] (`hidden_states`) ->
    logits [..., V] (f32)."""
    x = rms_norm(x, weights["final_norm"], cfg.rms_norm_eps)
    with jax.named_scope("lm_head"):
        return jnp.einsum("...d,dv->...v", x.astype(jnp.float32),
                          weights["lm_head"].astype(jnp.float32))


def _engram_inputs(weights: dict, cfg: DeepseekV41Config, tokens: jax.Array,
                   step: common.Step, cache: DeepseekV41Cache | None):
    """The Engram state of a call: (row ids per Engram layer {layer: [B,T,n_ids]}, valid
    [B,T], the cache's next n-gram history or None). Padding and image tokens are
    invalid: gate 0, and they block the n-gram lookback (NeMo's token_mask)."""
    specs = active_engram_specs(cfg)
    if not specs:
        return {}, None, None
    if "engram_token_map" not in weights:
        raise InvalidInputError("deepseek_v41: Engram layers need weights['engram_token_map'] "
                                "(the token class map built from tokenizer.json)")
    token_map = weights["engram_token_map"]
    compressed = jnp.take(token_map, jnp.clip(tokens, 0, token_map.shape[0] - 1))
    valid = step.valid & (tokens != cfg.image_token_id)
    pad = token_map[cfg.engram_pad_token_id]
    history = None if cache is None else cache.engram_history
    ids = {sp.layer_id: hash_ids(compressed, sp, valid, history, pad_class=pad)
           for sp in specs}
    new_history = None
    if cache is not None:
        new_history = update_history(history, compressed, specs[0], valid, step.n_new)
    return ids, valid, new_history


def _run(weights: dict, cfg: DeepseekV41Config, tokens: jax.Array, step: common.Step,
         cache: DeepseekV41Cache | None = None, features: bool = False):
    """The layer stack. features: also the DSpark target features [B, T, n_target * D] (the
    stream mean of h before attention at cfg.dspark_target_layer_ids, concatenated), else
    None."""
    h, pre = embed(weights, cfg, tokens)
    ids, valid, history = _engram_inputs(weights, cfg, tokens, step, cache)
    state = {"engram_ids": ids, "engram_valid": valid} if ids else {}
    if features:
        missing = [i for i in cfg.dspark_target_layer_ids if i >= cfg.num_layers]
        if missing or not cfg.dspark_target_layer_ids:
            raise InvalidInputError(
                f"deepseek_v41: dspark_target_layer_ids {list(cfg.dspark_target_layer_ids)} "
                f"must be layers of this {cfg.num_layers}-layer model")
        state.update(feature_layers=cfg.dspark_target_layer_ids, features=())
    layers = common.layer_weights(weights, cfg.num_layers, scan_ok=False)
    pieces = None if cache is None else tuple(cache.layers)
    (h, pre, state), pieces, sown = common.run_layers(layer, cfg, layers, (h, pre, state),
                                                      pieces, step)
    if cache is not None:
        cache = cache.replace(layers=pieces,
                              lengths=common.new_lengths(step).astype(jnp.int32),
                              rings=common.rings_out(step, cache), engram_history=history)
    feats = jnp.concatenate(state["features"], axis=-1) if features else None
    return h, pre, sown, cache, feats


def hidden_states(weights: dict, cfg: DeepseekV41Config, tokens: jax.Array, lengths: jax.Array,
                  sites: Sites | None = None) -> tuple[jax.Array, dict]:
    """Teacher-forced hidden states [B, T, D] over right-padded rows of `lengths` tokens
    (the streams collapsed with the last FFN mix's pre weights, before the final norm: what
    `logits` takes), and what the hooks sowed {name: [L, ...]}."""
    h, pre, sown, _, _ = _run(weights, cfg, tokens,
                              common.forward_step(lengths, tokens.shape[1], sites))
    return weighted_streams(pre, h), sown


@takes_sites
def forward(weights: dict, cfg: DeepseekV41Config, tokens: jax.Array, lengths: jax.Array,
            sites: Sites | None = None) -> jax.Array:
    """Teacher-forced logits [B, T, V] (f32) over right-padded rows of `lengths` tokens."""
    return logits(weights, cfg, hidden_states(weights, cfg, tokens, lengths, sites)[0])


@takes_sites
def prefill(weights: dict, cfg: DeepseekV41Config, tokens: jax.Array, lengths: jax.Array,
            cache: DeepseekV41Cache, sites: Sites | None = None
            ) -> tuple[jax.Array, DeepseekV41Cache]:
    """Right-padded prompts into a fresh cache; each row's last-token logits [B, V]."""
    step = common.prefill_step(lengths, tokens.shape[1], cache, sites)
    h, pre, _, cache, _ = _run(weights, cfg, tokens, step, cache)
    last = weighted_streams(common.last_token(pre, lengths), common.last_token(h, lengths))
    return logits(weights, cfg, last), cache


@takes_sites
def prefill_with_features(weights: dict, cfg: DeepseekV41Config, tokens: jax.Array,
                          lengths: jax.Array, cache: DeepseekV41Cache, sites: Sites | None = None
                          ) -> tuple[jax.Array, jax.Array, DeepseekV41Cache]:
    """`prefill` that also returns the DSpark target features [B, T, n_target * D] of every
    prompt position: (last-token logits [B, V], features, cache)."""
    step = common.prefill_step(lengths, tokens.shape[1], cache, sites)
    h, pre, _, cache, feats = _run(weights, cfg, tokens, step, cache, features=True)
    last = weighted_streams(common.last_token(pre, lengths), common.last_token(h, lengths))
    return logits(weights, cfg, last), feats, cache


@takes_sites
def extend_with_features(weights: dict, cfg: DeepseekV41Config, tokens: jax.Array,
                         n_new: jax.Array, cache: DeepseekV41Cache, sites: Sites | None = None
                         ) -> tuple[jax.Array, jax.Array, DeepseekV41Cache]:
    """`extend(..., all_logits=True)` that also returns the DSpark target features
    [B, C, n_target * D] of every position of the chunk (a fresh cache: a prefill):
    (logits [B, C, V], features, cache). Speculative decoding's verifier."""
    step = common.extend_step(n_new, tokens.shape[1], cache, sites)
    h, pre, _, cache, feats = _run(weights, cfg, tokens, step, cache, features=True)
    return logits(weights, cfg, weighted_streams(pre, h)), feats, cache


@takes_sites
def extend(weights: dict, cfg: DeepseekV41Config, tokens: jax.Array, n_new: jax.Array,
           cache: DeepseekV41Cache, sites: Sites | None = None, *,
           all_logits: bool = False, hidden: bool = False) -> tuple[jax.Array, DeepseekV41Cache]:
    """A chunk [B, C] (the first n_new [B] real) after each row's cache.lengths tokens:
    chunked prefill; logits of each row's last new token [B, V] (all_logits: [B, C, V])."""
    step = common.extend_step(n_new, tokens.shape[1], cache, sites)
    h, pre, _, cache, _ = _run(weights, cfg, tokens, step, cache)
    if hidden:  # what `logits` takes, every position: the serving engine's
        return weighted_streams(pre, h), cache
    if all_logits:
        return logits(weights, cfg, weighted_streams(pre, h)), cache
    last = weighted_streams(common.last_token(pre, n_new), common.last_token(h, n_new))
    return logits(weights, cfg, last), cache


@takes_sites
def decode_step(weights: dict, cfg: DeepseekV41Config, tokens: jax.Array,
                cache: DeepseekV41Cache, sites: Sites | None = None,
                active: jax.Array | None = None) -> tuple[jax.Array, DeepseekV41Cache]:
    """One token per row at position cache.lengths -> logits [B, V] and the new cache.
    Inactive rows compute but neither advance nor write."""
    step = common.decode_step_ctx(cache, active, sites)
    h, pre, _, cache, _ = _run(weights, cfg, tokens[:, None], step, cache)
    return logits(weights, cfg, weighted_streams(pre[:, 0], h[:, 0])), cache


# ----------------------------------------------------------------------------- family contract
# What the runtime reads from this module beside its entry points (docs/adding_a_family.md).
# Imported above from their own modules: `weights_from_hf` and `load_checkpoint`
# (models/deepseek_v41_checkpoint.py) and `PLANNER` (models/deepseek_v41_plan.py: what the
# planner and `sharding.check_model` ask).

FAMILY = "deepseek_v41"
TITLE = "DeepSeek-V4.1"
HF_MODEL_TYPES = ("deepseek_v41",)

# Logical axes of the float layout ([..., in, out]) by leaf name; unlisted leaves replicate
# (norms, router, hyper-connections, the single K=V head, q_a, compressor and indexer).
LOGICAL_AXES = {
    "embed": ("vocab", None),
    "lm_head": (None, "vocab"),
    "q_b": (None, "heads"),
    "o_a": ("heads", None, None),
    "o_b": ("heads", None),
    "sinks": ("heads",),
    "experts_gate_up": ("experts", None, None),
    "experts_down": ("experts", None, None),
    "shared_gate_up": (None, "mlp"),
    "shared_down": ("mlp", None),
    # Engram: the tables row-sharded (each device gathers its own rows), in device memory
    # or, with engram_memory="host", pinned host memory: models/engram.py weighs the two;
    # wkv / q / k replicated
    "table": ("engram_rows", None),
    "table_scale": ("engram_rows", None),
}
REPLICATED_UNDER = ("indexer", "compressor")


def __getattr__(name: str):
    """`DRAFTER`: the family's own speculative drafter, DSpark (models/deepseek_v41_dspark.py:
    a `Drafter`, models/contract.py), imported on first use (that module imports this one)."""
    if name == "DRAFTER":
        from gsm_jax.models.deepseek_v41_dspark import DRAFTER

        return DRAFTER
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def first_layers_config(cfg: DeepseekV41Config, k: int) -> DeepseekV41Config:
    """The config of the model's first k layers (a self-speculative drafter,
    `gsm_jax.speculative.draft_config`): `compress_ratios` cut, the KV / index source
    ids and the candidate source kept where below k. The cut schedule stays valid (a
    Reindex layer needs the candidate source before it, and a Reuse layer a Full layer
    of its ratio, both earlier layers). Engram ids are all of the release's (those >= k
    are inactive); the DSpark fields describe the release's drafter and are kept."""
    def below(ids):
        return tuple(i for i in ids if i < k)

    cand = cfg.candidate_source_layer_id
    return dataclasses.replace(
        cfg, num_layers=k, compress_ratios=cfg.compress_ratios[:k],
        kv_source_layer_ids=below(cfg.kv_source_layer_ids),
        index_source_layer_ids=below(cfg.index_source_layer_ids),
        candidate_source_layer_id=cand if cand < k else -1)


def logical_axes(names: list[str], ndim: int) -> tuple[str | None, ...]:
    """By leaf name, except everything under REPLICATED_UNDER (the indexer's q_b too)."""
    from gsm_jax.models.partitioning import table_axes

    if any(n in REPLICATED_UNDER for n in names[:-1]):
        return (None,) * ndim
    return table_axes(LOGICAL_AXES, names[-1], ndim)


# Quantization (`gsm_jax.quantize`): the dense attention projections and the shared expert
# (routed experts on request). Router, compressor, indexer, hyper-connections and o_a (a
# grouped product) stay float: they select, pool or mix.
QUANT_ATTN_LINEARS = ("q_a", "q_b", "kv", "o_b")


def quantize_weights(weights: dict, q: Any, routed_experts: bool) -> dict:
    """`weights` with every projection above passed through `q` (float -> container)."""
    def one(lw):
        attn, moe_w = dict(lw["attn"]), dict(lw["moe"])
        for name in QUANT_ATTN_LINEARS:
            attn[name] = q(attn[name])
        for name in ("shared_gate_up", "shared_down") + (
                ("experts_gate_up", "experts_down") if routed_experts else ()):
            moe_w[name] = q(moe_w[name])
        return {**lw, "attn": attn, "moe": moe_w}

    return {**weights, "layers": tuple(one(lw) for lw in weights["layers"])}
