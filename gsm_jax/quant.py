"""INT8 inference: `quantize(params, scheme)`, SmoothQuant, and the Hadamard baseline.

    q = gsm_jax.quantize(params, scheme="w8a8")      # or "w8a16" (weight-only)
    gsm_jax.generate(q, prompts, gsm=cfg)             # "quantize, then smooth"

Schemes (GSM_SPEC.md section 7, question 3):

- ``w8a16``: int8 weights, symmetric, one float32 scale per output channel;
  activations stay float. Moves a quarter of the fp32 weight bytes. With
  ``group_size=32``: a float16 scale and offset per 32 input channels and output
  channel instead (1/8 byte per weight more; a 4-bit or Q8_0 GGUF's weights are kept).
- ``w8a8``: the same weights, plus per-token dynamic symmetric int8
  activations; the product runs int8 x int8 -> int32 and is rescaled after.

What is quantized: every linear layer of the Llama and Gemma 3 families (qkv, o,
gate_up, down of every layer; Gemma 3's q/k norms and post-norms stay float).
DeepSeek-V4: the dense attention projections (q_a, q_b, kv, o_b), the compressors'
kv_gate and the shared experts; routed experts only with ``routed_experts=True``.
The router, the indexer, the hyper-connections and the grouped first half of the
output projection (o_a, an einsum) stay float: they select or mix rather than
project. Embedding and LM head stay float unless ``head=True`` (Llama and Gemma 3
families): the LM head then becomes an int8 weight-only `QuantizedWeight` (one scale
per vocabulary entry, the w8a16 product whatever the scheme: on CPU the int8 kernel at
decode), and a tied model's embedding table is rounded to the same grid (stored float,
for the lookup), so the two stay one matrix.

"Quantize, then smooth": at the GSM sites (``attn_out``, ``ffn_mid``) the filter
runs on the float activation, then the per-token scale is taken and it is cast
to int8 (`models/gsm_sites.py`, fused in `pallas_kernels/smooth_quant.py`).

Baselines along the channel axis, in the same tooling: `smoothquant(params, alpha=0.5)`
(SmoothQuant migration folded into the norms and weights, exact in float; then
`quantize`), and ``quantize(..., hadamard_down=block)`` (an online block Hadamard
rotation of the down projection's input, QuaRot-style).

Quantized params are ordinary `ModelParams` (``params.extra["quantization"]``
names the scheme) and save and load with orbax through `gsm_jax.save` /
`gsm_jax.load` (`restore_quantized` rebuilds the int8 containers from a restored
tree).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gsm_jax.errors import InvalidInputError, UnsupportedModelError
from gsm_jax.families import FamiliesWith, family_module
from gsm_jax.models.block_quant import ACT_BLOCK, BlockQuantWeight, quantize_np
from gsm_jax.models.linear import (
    SCHEMES,
    QuantizedActivation,
    QuantizedWeight,
    hadamard_rotate,
    linear,
)
from gsm_jax.models.sites import Sites
from gsm_jax.pallas_kernels import int8_matvec_cpu
from gsm_jax.pallas_kernels.quant_reference import (
    quantize_weight,
    quantize_weight_grouped,
)
from gsm_jax.params import ModelParams

__all__ = [
    "SCHEMES",
    "QuantizedActivation",
    "QuantizedWeight",
    "activation_absmax",
    "activation_samples",
    "apply_quantize_option",
    "quantize_option_kwargs",
    "apply_smoothquant",
    "dequantize",
    "quantization_of",
    "quantize",
    "restore_quantized",
    "smoothquant",
    "smoothquant_scales",
]

ALL_SCHEMES = (*SCHEMES, "fp8")
QUANTIZE_CHOICES = ("none", *ALL_SCHEMES)
LLAMA_LINEARS = ("qkv", "o", "gate_up", "down")
# Families whose layers hold these four projections under these names (same transforms):
# those whose module provides `stack_dense` / `unstack_dense` (lazy: imports on first use)
DENSE_FAMILIES = FamiliesWith("stack_dense")


# ----------------------------------------------------------------------------- helpers


def _check_scheme(scheme: Any) -> str:
    if scheme not in ALL_SCHEMES:
        raise InvalidInputError(
            f"quantization scheme {scheme!r} is unknown; choose from {ALL_SCHEMES}")
    return scheme


def _check_params(params: Any) -> ModelParams:
    if not isinstance(params, ModelParams):
        raise InvalidInputError(
            f"params must be what gsm_jax.load returns (ModelParams), got {type(params).__name__}"
        )
    return params


def quantization_of(params: ModelParams) -> str | None:
    """The scheme params were quantized with, or None for float params."""
    return dict(params.extra).get("quantization")


FP8_BLOCK = (128, 128)  # DeepSeek-V4's dense FP8 blocks, the default


def fp8_blocks(config: Any) -> tuple[tuple[int, int], int]:
    """(weight block [out, in], activation block) of the "fp8" scheme for a model: the
    config's `weight_block_size` (DeepSeek-V4.1: 32 x 32; absent: V4's 128 x 128), and
    activations rounded in blocks of the weight block's input width, as DeepSeek's FP8 GEMMs
    need (V4: 128 channels; V4.1: 32, before every FP8 and FP4 product)."""
    block = tuple(int(b) for b in (getattr(config, "weight_block_size", None) or FP8_BLOCK))
    if len(block) != 2 or min(block) < 1:
        raise UnsupportedModelError(f"config field weight_block_size={block!r} must be "
                                    "[out, in]")
    return block, block[1]


def with_fp8_activations(w: BlockQuantWeight, act_block: int = ACT_BLOCK) -> BlockQuantWeight:
    """`w` with its input activation rounded to FP8 e4m3 per token and `act_block` channels
    (power-of-two scales) before the product; the stored weight is unchanged."""
    return w.replace(act="e4m3", act_block=int(act_block))


def _fp8(w: Any, block: tuple[int, int] = FP8_BLOCK,
         act_block: int = ACT_BLOCK) -> BlockQuantWeight:
    """A float [..., in, out] weight as FP8 e4m3 in `block` blocks with E8M0 scales (the
    DeepSeek format: V4 128 x 128, V4.1 32 x 32), with per-token FP8 activations."""
    stored = np.swapaxes(np.asarray(w, np.float32), -1, -2)
    values, scale = quantize_np(stored, "e4m3", block)
    return with_fp8_activations(
        BlockQuantWeight(jnp.asarray(values), jnp.asarray(scale), "e4m3", block), act_block)


def _q(w: Any, scheme: str, hadamard: int = 0,
       fp8: tuple[tuple[int, int], int] = (FP8_BLOCK, ACT_BLOCK), group: int = 0
       ) -> QuantizedWeight | BlockQuantWeight:
    if scheme == "fp8":
        return _fp8(w, *fp8)
    if isinstance(w, BlockQuantWeight):  # an FP8 / FP4 checkpoint re-quantized to int8
        w = w.dequantize()
    w = jnp.asarray(w, jnp.float32)
    if hadamard:  # y = (x H)(H W): store H W, rotate x online (H is its own inverse)
        w = hadamard_rotate(w, hadamard, axis=-2)
    if group:
        values, scale, zero = quantize_weight_grouped(w, group)
        return QuantizedWeight(values, scale, scheme, hadamard, zero)
    values, scale = quantize_weight(w)
    return QuantizedWeight(values, scale, scheme, hadamard)


def _fake_quant_rows(w: jax.Array, group: int = 0) -> jax.Array:
    """Round [V, D] (one scale per vocabulary row, or per row and `group` columns) to the
    int8 grid of the head `_q` makes of w.T, keep it float."""
    return _q(jnp.asarray(w, jnp.float32).T, "w8a16", group=group).dequantize().T.astype(
        w.dtype)


MAX_GROUP = int8_matvec_cpu.MAX_GROUP


def _check_group_value(group_size: Any, label: str) -> None:
    """InvalidInputError unless `group_size` is an even integer from 2 to `MAX_GROUP` (the
    kernel sums each group exactly in int32, two k at a time); `label` names the option."""
    if (isinstance(group_size, bool) or not isinstance(group_size, int | np.integer)
            or group_size < 2 or group_size > MAX_GROUP or group_size % 2):
        raise InvalidInputError(f"{label}{group_size!r} must be an even integer from 2 to "
                                f"{MAX_GROUP}")


def _check_group(group_size: Any, scheme: str, family: str, shapes: dict[str, tuple]) -> int:
    """The w8a16 group size, refused by name unless it is an even number from 2 to
    `MAX_GROUP` dividing the input width of every weight it applies to (`shapes`)."""
    if group_size is None:
        return 0
    if scheme != "w8a16":
        raise InvalidInputError(f"group_size goes with the w8a16 scheme only, not {scheme!r}")
    if family not in DENSE_FAMILIES:
        raise UnsupportedModelError(f"group_size is implemented for the {_dense_titles()} "
                                    f"families only, not {family!r}")
    _check_group_value(group_size, "group_size=")
    for name, shape in shapes.items():
        if shape[-2] % group_size:
            raise InvalidInputError(f"group_size={group_size} does not divide the input width "
                                    f"{shape[-2]} of weight {name!r}")
    return int(group_size)


def _dense_titles() -> str:
    return " and ".join(family_module(f).TITLE for f in DENSE_FAMILIES)


def stacked_weights(params: ModelParams) -> tuple[dict, bool]:
    """Weights of a dense family (`DENSE_FAMILIES`: Llama, Gemma 3) with stacked [L, ...]
    layers (what quantization and SmoothQuant compute on), and whether params held
    per-layer arrays instead (the family's `stack_dense`)."""
    if params.config.family not in DENSE_FAMILIES:
        raise UnsupportedModelError(f"this weight transform is implemented for the "
                                    f"{' and '.join(DENSE_FAMILIES)} families only, not "
                                    f"{params.config.family!r}")
    return family_module(params.config.family).stack_dense(params.weights)


def _in_layout(weights: dict, per_layer: bool, family: str) -> dict:
    """`weights` (stacked) back in the layout `stacked_weights` found."""
    return family_module(family).unstack_dense(weights, per_layer)


# ----------------------------------------------------------------------------- quantize


def quantize(params: ModelParams, scheme: str = "w8a8", *, head: bool = False,
             routed_experts: bool = False, hadamard_down: int = 0,
             group_size: int | None = None) -> ModelParams:
    """Return params with the family's linear layers as int8 `QuantizedWeight`s.

    scheme: "w8a16" (weight-only), "w8a8" (plus per-token int8 activations) or "fp8"
    (FP8 e4m3 weights in the config's `weight_block_size` blocks, 128 x 128 unless it says
    otherwise, with power-of-two scales, plus activations rounded to e4m3 per token and
    block of the weight block's input width, as DeepSeek's own inference runs: V4 per 128
    channels, V4.1 per 32; on a loaded FP8 / FP4 checkpoint it keeps the stored weights,
    routed experts included, and switches their activations to FP8 — for V4.1 the
    release's rounding before every FP8 / FP4 product, which the NeMo reference and
    gsm_jax's default do not apply).
    head: the LM head as an int8 weight-only `QuantizedWeight` too (dense families).
    routed_experts: DeepSeek-V4 only, quantize the routed experts too.
    group_size: w8a16 with a float16 scale and offset per `group_size` (even, at most
    512) consecutive input channels and output channel instead of one scale per output
    channel (Llama and Gemma 3; the head too with head=True): each group the closer of
    an asymmetric grid over its [min, max] and a symmetric one
    (`quantize_weight_grouped`). 32 costs 1/8 byte per weight more and keeps a model
    read from a 4-bit GGUF (Q4_1, Q4_K: 16 equally spaced levels per 32 weights) to
    float16 rounding, and Q8_0 groups exactly.
    hadamard_down: > 0 (a power of two dividing d_ff): rotate the down
    projection's input online by a block-diagonal Hadamard matrix of that block
    size before it is quantized (the QuaRot-style baseline; dense families only).
    """
    params = _check_params(params)
    scheme = _check_scheme(scheme)
    if quantization_of(params) is not None:
        raise InvalidInputError(f"params are already quantized ({quantization_of(params)})")
    family = params.config.family
    w = dict(params.weights)
    if scheme == "fp8" and hadamard_down:
        raise InvalidInputError("hadamard_down goes with the int8 schemes, not fp8")
    is_block = lambda a: isinstance(a, BlockQuantWeight)  # noqa: E731
    fp8 = fp8_blocks(params.config) if scheme == "fp8" else (FP8_BLOCK, ACT_BLOCK)
    if scheme == "fp8" and any(is_block(a) for a in jax.tree.leaves(w, is_leaf=is_block)):
        # an FP8 / FP4 checkpoint: its stored weights get FP8 activations, nothing else moves
        act_block = fp8[1]
        w = jax.tree.map(lambda a: with_fp8_activations(a, act_block) if is_block(a) else a,
                         w, is_leaf=is_block)
        return dataclasses.replace(params, weights=w,
                                   extra={**dict(params.extra), "quantization": scheme,
                                          "fp8_activation_block": act_block})
    fam = family_module(family)
    if family in DENSE_FAMILIES:
        w, per_layer = stacked_weights(params)
        layers = dict(w["layers"])
        shapes = {name: tuple(layers[name].shape) for name in LLAMA_LINEARS}
        if head:
            shapes["lm_head"] = (w["embed"].shape[-1], w["embed"].shape[0])
        group = _check_group(group_size, scheme, family, shapes)
        for name in LLAMA_LINEARS:
            block = hadamard_down if name == "down" else 0
            if block and (block & (block - 1) or layers[name].shape[-2] % block):
                raise InvalidInputError(
                    f"hadamard_down={block} must be a power of two dividing "
                    f"intermediate_size={layers[name].shape[-2]}")
            layers[name] = _q(layers[name], scheme, block, group=group)
        w = _in_layout({**w, "layers": layers}, per_layer, family)
    elif hasattr(fam, "quantize_weights"):  # the family says which of its weights
        _check_group(group_size, scheme, family, {})
        if hadamard_down:
            raise UnsupportedModelError(f"hadamard_down is implemented for the "
                                        f"{_dense_titles()} families only")
        w = fam.quantize_weights(w, lambda a: _q(a, scheme, fp8=fp8), routed_experts)
    else:
        raise UnsupportedModelError(f"quantization of model family {family!r} is not implemented")
    if head:
        if family not in DENSE_FAMILIES:
            raise UnsupportedModelError(f"head=True is implemented for the {_dense_titles()} "
                                        f"families only, not {family!r}")
        # the head as int8 weight-only (one scale per vocabulary entry) whatever the scheme;
        # a tied model's lookup table is rounded to the same grid (kept float: a lookup
        # reads one row), so the embedding and the head stay one matrix
        tied = "lm_head" not in w
        table = jnp.asarray(w["embed"], jnp.float32).T if tied else w["lm_head"]
        w["lm_head"] = _q(table, "w8a16", group=group)
        if tied:
            w["embed"] = _fake_quant_rows(w["embed"], group)
    extra = {**dict(params.extra), "quantization": scheme}
    if head:
        extra["quantized_head"] = True
    if family in DENSE_FAMILIES and group:
        extra["group_size"] = group
    if scheme == "fp8":
        extra["fp8_activation_block"] = fp8[1]
    if routed_experts and family not in DENSE_FAMILIES:  # quantized by quantize_weights
        extra["quantized_routed_experts"] = True
    if hadamard_down:
        extra["hadamard_down"] = int(hadamard_down)
    return dataclasses.replace(params, weights=w, extra=extra)


def dequantize(params: ModelParams, dtype: Any = jnp.float32) -> ModelParams:
    """Float params whose linear weights are the dequantized int8 weights (for tests:
    w8a16 of `params` equals the float model of `dequantize(params)` up to rounding)."""
    def deq(x):
        return x.dequantize(dtype) if isinstance(x, QuantizedWeight) else x

    weights = jax.tree.map(deq, params.weights,
                           is_leaf=lambda x: isinstance(x, QuantizedWeight))
    extra = {k: v for k, v in dict(params.extra).items() if k != "quantization"}
    return dataclasses.replace(params, weights=weights, extra=extra)


# ----------------------------------------------------------------------------- SmoothQuant

# SmoothQuant (Xiao et al., 2023): migrate activation outliers into the weights, per
# input channel j of a linear layer: X' = X / s, W' = diag(s) W, with
#     s_j = max|X_j|^alpha / max_k |W_jk|^(1 - alpha)
# taken from calibration samples. The division by s is folded into whatever produces
# X, so nothing runs at inference and, in float, the model is unchanged:
#   qkv     <- attn_norm (X = rmsnorm(h) * attn_norm)
#   gate_up <- ffn_norm
#   o       <- the v columns of qkv (attention output = probs @ V is linear in V; with
#              grouped-query attention the query heads that share a kv head share s)
#   down    <- the up columns of gate_up (silu(gate) * up is linear in up)
SMOOTHQUANT_LINEARS = ("qkv", "o", "gate_up", "down")


@struct.dataclass
class LinearInputs(Sites):
    """The SmoothQuant capture hooks: each of `SMOOTHQUANT_LINEARS` sows its input, as the
    per-channel max |x| over real tokens (values=False) or the input itself [B, T, C]."""

    values: bool = struct.field(pytree_node=False, default=False)

    def linear(self, step, layer, name, x, w):
        if name in SMOOTHQUANT_LINEARS:
            if self.values:
                step.sow(name, x)
            else:
                absx = jnp.abs(x.astype(jnp.float32))
                step.sow(name, jnp.max(jnp.where(step.valid[..., None], absx, 0.0), axis=(0, 1)))
        return linear(x, w)


def smoothquant_inputs(weights: dict, cfg: Any, tokens: jax.Array, lengths: jax.Array,
                       values: bool = False) -> tuple[jax.Array, dict]:
    """The model's teacher-forced pass, returning the final hidden states and, per layer,
    the per-channel max |x| (over real tokens) at the inputs of the four projections
    (values=True: the inputs themselves, [L, B, T, C] each), through the family's hooks."""
    return family_module(cfg.family).hidden_states(weights, cfg, tokens, lengths,
                                                   LinearInputs(values))


def _check_calibration(params: Any, tokens: Any) -> tuple[ModelParams, np.ndarray]:
    params = _check_params(params)
    if params.config.family not in DENSE_FAMILIES or quantization_of(params) is not None:
        raise UnsupportedModelError("activation statistics need float Llama / Gemma 3 params")
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[0] < 1:
        raise InvalidInputError(f"calibration tokens must be [N, T], got {tokens.shape}")
    return params, tokens


_capture_jit = jax.jit(smoothquant_inputs, static_argnames=("cfg", "values"))


def activation_absmax(params: ModelParams, tokens: Any, *, batch_size: int = 8) -> dict:
    """Per layer and channel, max |x| at the inputs of qkv, o, gate_up and down over
    calibration token ids [N, T] (full rows; Llama family, float params):
    {"qkv": [L, D], "o": [L, H*hd], "gate_up": [L, D], "down": [L, d_ff]} float32."""
    params, tokens = _check_calibration(params, tokens)
    weights, _ = stacked_weights(params)
    out: dict[str, jax.Array] | None = None
    for i in range(0, tokens.shape[0], batch_size):
        rows = tokens[i: i + batch_size]
        real = rows.shape[0]
        if real < batch_size and tokens.shape[0] > batch_size:  # keep one compiled shape
            rows = np.concatenate([rows, np.repeat(rows[-1:], batch_size - real, axis=0)])
        lengths = jnp.full((rows.shape[0],), rows.shape[1], jnp.int32)
        _, stats = _capture_jit(weights, params.config, jnp.asarray(rows), lengths)
        out = stats if out is None else jax.tree.map(jnp.maximum, out, stats)
    return {k: np.asarray(v, np.float32) for k, v in out.items()}


def activation_samples(params: ModelParams, tokens: Any) -> dict:
    """The inputs of qkv, o, gate_up and down themselves for calibration token ids
    [N, T] (full rows; Llama family, float params): {"qkv": [L, N*T, D], "o":
    [L, N*T, H*hd], "gate_up": [L, N*T, D], "down": [L, N*T, d_ff]} float32, for
    layer-local searches
    (`gsm_jax.workflow.evidence.quant_quality.local_smoothquant_alphas`)."""
    params, tokens = _check_calibration(params, tokens)
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    weights, _ = stacked_weights(params)
    _, inputs = _capture_jit(weights, params.config, jnp.asarray(tokens), lengths, values=True)
    return {k: np.asarray(v, np.float32).reshape(v.shape[0], -1, v.shape[-1])
            for k, v in inputs.items()}


def smoothquant_scales(params: ModelParams, act_absmax: dict, alpha: Any = 0.5) -> dict:
    """s per layer and input channel of each linear (see the section comment); the o
    scales are shared by the query heads of one kv head, so they fold into V.

    alpha: one float for every layer, or one per layer ([L])."""
    cfg, layers = params.config, stacked_weights(params)[0]["layers"]
    alpha = np.asarray(alpha, np.float64)
    if alpha.ndim > 1 or (alpha.ndim == 1 and alpha.shape[0] != cfg.num_layers):
        raise InvalidInputError(f"SmoothQuant alpha must be a float or one per layer "
                                f"({cfg.num_layers}), got shape {alpha.shape}")
    if not np.all((alpha >= 0.0) & (alpha <= 1.0)):
        raise InvalidInputError(f"SmoothQuant alpha must be in [0, 1], got {alpha.tolist()}")
    eps = 1e-5

    def scale(a, w_rows):
        a = np.maximum(np.asarray(a, np.float64), eps)
        w_rows = np.maximum(np.asarray(w_rows, np.float64), eps)
        al = alpha.reshape(alpha.shape + (1,) * (a.ndim - 1)) if alpha.ndim else alpha
        return np.clip(a**al / w_rows ** (1.0 - al), 1e-4, 1e4)

    def row_max(name):
        return np.abs(np.asarray(layers[name], np.float32)).max(axis=-1)  # [L, in]

    scales = {name: scale(act_absmax[name], row_max(name))
              for name in ("qkv", "gate_up", "down")}
    # o: channel (head h, dim d) comes from V's (h // group, d); one s per kv channel
    L, g = cfg.num_layers, cfg.num_heads // cfg.num_kv_heads
    grouped = (L, cfg.num_kv_heads, g, cfg.head_dim)
    a_o = np.asarray(act_absmax["o"]).reshape(grouped).max(axis=2)
    w_o = row_max("o").reshape(grouped).max(axis=2)
    s_v = scale(a_o, w_o)  # [L, K, hd]
    scales["o"] = np.repeat(s_v[:, :, None, :], g, axis=2).reshape(L, -1)
    scales["v"] = s_v.reshape(L, -1)
    return {k: v.astype(np.float32) for k, v in scales.items()}


def apply_smoothquant(params: ModelParams, scales: dict) -> ModelParams:
    """Fold SmoothQuant scales into float Llama-family params (exact in float)."""
    cfg = params.config
    if quantization_of(params) is not None:
        raise InvalidInputError("SmoothQuant migrates float params; apply it before quantize()")
    stacked, per_layer = stacked_weights(params)
    dtype = stacked["layers"]["qkv"].dtype
    f32 = {k: np.asarray(v, np.float32) for k, v in stacked["layers"].items()}
    s_qkv, s_gu, s_o, s_down, s_v = (scales[k] for k in ("qkv", "gate_up", "o", "down", "v"))
    qkv = f32["qkv"] * s_qkv[:, :, None]
    v0 = cfg.q_size + cfg.kv_size
    qkv[:, :, v0:] /= s_v[:, None, :]
    gate_up = f32["gate_up"] * s_gu[:, :, None]
    gate_up[:, :, cfg.intermediate_size:] /= s_down[:, None, :]
    new = dict(stacked["layers"])
    new["attn_norm"] = f32["attn_norm"] / s_qkv
    new["ffn_norm"] = f32["ffn_norm"] / s_gu
    new["qkv"] = qkv
    new["gate_up"] = gate_up
    new["o"] = f32["o"] * s_o[:, :, None]
    new["down"] = f32["down"] * s_down[:, :, None]
    if "qkv_bias" in new:
        bias = np.array(f32["qkv_bias"])
        bias[:, v0:] /= s_v
        new["qkv_bias"] = bias
    for k in ("attn_norm", "ffn_norm", "qkv", "gate_up", "o", "down", "qkv_bias"):
        if k in new:
            new[k] = jnp.asarray(new[k], dtype)
    weights = _in_layout({**stacked, "layers": new}, per_layer, cfg.family)
    return dataclasses.replace(params, weights=weights)


def smoothquant(params: ModelParams, tokens: Any = None, *, alpha: float = 0.5,
                batch_size: int = 8,
                act_absmax: dict | None = None) -> ModelParams:
    """SmoothQuant channel migration of float Llama-family params, ready for
    `quantize(..., "w8a8")`. Calibration: `tokens` [N, T] int ids (e.g.
    `gsm_jax.workflow.data.as_token_sequences(path, params.tokenizer)` of a text file),
    or precomputed `act_absmax`. The result is the same function in float (to fp32
    rounding)."""
    params = _check_params(params)
    if params.config.family not in DENSE_FAMILIES:
        raise UnsupportedModelError(f"SmoothQuant is implemented for the {_dense_titles()} "
                                    "families only")
    if quantization_of(params) is not None:
        raise InvalidInputError("SmoothQuant migrates float params; apply it before quantize()")
    # one stacked view for the capture, the scales and the migration (each would stack
    # per-layer weights on its own), back to the caller's layout at the end
    weights, per_layer = stacked_weights(params)
    layout = params
    params = dataclasses.replace(params, weights=weights)
    if act_absmax is None:
        if tokens is None or isinstance(tokens, str | os.PathLike):
            raise InvalidInputError(
                "smoothquant needs calibration token ids [N, T] (tokens=) or act_absmax=; "
                "from a text file: gsm_jax.workflow.data.as_token_sequences(path, "
                "params.tokenizer, seq_len=..., num_sequences=...)")
        act_absmax = activation_absmax(params, tokens, batch_size=batch_size)
    out = apply_smoothquant(params, smoothquant_scales(params, act_absmax, alpha))
    return dataclasses.replace(out, weights=_in_layout(out.weights, per_layer,
                                                       layout.config.family),
                               extra={**dict(layout.extra), "smoothquant_alpha": float(alpha)})


# ----------------------------------------------------------------------------- orbax


def restore_quantized(params: ModelParams) -> ModelParams:
    """Rebuild `QuantizedWeight`s in a tree restored by orbax (which returns each as a
    {"values", "scale"} dict), using the scheme recorded in ``params.extra``."""
    scheme = quantization_of(params)
    if scheme is None:
        return params
    hadamard = int(dict(params.extra).get("hadamard_down", 0))

    def stored(x):  # orbax's form: {"values", "scale"} (+ "zero": grouped, maybe None)
        return isinstance(x, dict) and {"values", "scale"} <= set(x) <= {"values", "scale",
                                                                          "zero"}

    def is_q(x):
        return isinstance(x, QuantizedWeight) or stored(x)

    def rebuild(path, x):
        if isinstance(x, QuantizedWeight):
            return x
        if stored(x):
            name = path[-1].key if hasattr(path[-1], "key") else ""
            zero = x.get("zero")
            grouped = zero is not None
            return QuantizedWeight(jnp.asarray(x["values"], jnp.int8),
                                   jnp.asarray(x["scale"],
                                               jnp.float16 if grouped else jnp.float32),
                                   scheme, hadamard if name == "down" else 0,
                                   jnp.asarray(zero, jnp.float16) if grouped else None)
        return x

    weights = jax.tree_util.tree_map_with_path(rebuild, params.weights, is_leaf=is_q)
    return dataclasses.replace(params, weights=weights)


# ----------------------------------------------------------------------------- workflow


def apply_quantize_option(params: ModelParams, scheme: str | None, **kwargs: Any) -> ModelParams:
    """What a workflow command's ``--quantize {none,w8a16,w8a8}`` does: None or "none"
    returns params unchanged; otherwise `quantize(params, scheme, **kwargs)`.
    Already-quantized params with the same scheme pass through."""
    if scheme in (None, "none"):
        return params
    current = quantization_of(params)
    if current == scheme:
        return params
    if current is not None:
        raise InvalidInputError(f"params are quantized with {current}; cannot requantize as "
                                f"{scheme}")
    return quantize(params, scheme, **kwargs)


def add_quantize_argument(parser: Any) -> None:
    """``--quantize {none,w8a16,w8a8}``, ``--quantize-head`` and ``--quantize-group-size``
    for an argparse (sub)parser (read back by `quantize_option_kwargs`)."""
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                        help="run on int8-quantized params: w8a16 (weight-only; on CPU the "
                             "int8 matrix-vector kernel at decode) or w8a8 (plus per-token "
                             "int8 activations); GSM smooths before the activation "
                             "quantization")
    parser.add_argument("--quantize-head", action="store_true",
                        help="with --quantize: the LM head int8 weight-only too "
                             "(quantize(..., head=True); Llama and Gemma 3 families)")
    parser.add_argument("--quantize-group-size", type=int, default=None, metavar="N",
                        help="with --quantize w8a16: a float16 scale and offset per N input "
                             "channels (even, at most 512; 32 keeps a 4-bit GGUF's weights) "
                             "instead of one scale per output channel")


def quantize_option_kwargs(args: Any) -> dict:
    """`apply_quantize_option`'s keyword arguments from `add_quantize_argument`'s options;
    --quantize-head or --quantize-group-size without the --quantize they need, or a group
    size out of range, is refused by name (before any model loads)."""
    scheme = getattr(args, "quantize", "none")
    head = bool(getattr(args, "quantize_head", False))
    group = getattr(args, "quantize_group_size", None)
    if head and scheme in (None, "none"):
        raise InvalidInputError("--quantize-head needs --quantize w8a16 or w8a8")
    out: dict = {"head": True} if head else {}
    if group is not None:
        if scheme != "w8a16":
            raise InvalidInputError("--quantize-group-size needs --quantize w8a16")
        _check_group_value(group, "--quantize-group-size ")
        out["group_size"] = int(group)
    return out
