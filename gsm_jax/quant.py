"""INT8 inference: `quantize(params, scheme)`, SmoothQuant, and the Hadamard baseline.

    q = gsm_jax.quantize(params, scheme="w8a8")      # or "w8a16" (weight-only)
    gsm_jax.generate(q, prompts, gsm=cfg)             # "quantize, then smooth"

Schemes (GSM_SPEC.md section 7, question 3):

- ``w8a16``: int8 weights, symmetric, one float32 scale per output channel;
  activations stay float. Moves a quarter of the fp32 weight bytes.
- ``w8a8``: the same weights, plus per-token dynamic symmetric int8
  activations; the product runs int8 x int8 -> int32 and is rescaled after.

What is quantized: every linear layer of the Llama family (qkv, o, gate_up,
down of every layer). DeepSeek-V4: the dense attention projections (q_a, q_b,
kv, o_b), the compressors' kv_gate and the shared experts; routed experts only
with ``routed_experts=True``. The router, the indexer, the hyper-connections and
the grouped first half of the output projection (o_a, an einsum) stay float:
they select or mix rather than project. Embedding and LM head stay float unless
``head=True``, which rounds them to the int8 grid (one scale per vocabulary row)
but stores them dequantized: a quality study of the head, not a speed path.

"Quantize, then smooth": at the GSM sites (``attn_out``, ``ffn_mid``) the filter
runs on the float activation, then the per-token scale is taken and it is cast
to int8 (`models/gsm_sites.py`, fused in `pallas_kernels/smooth_quant.py`).

Quantized params are ordinary `ModelParams` (``params.extra["quantization"]``
names the scheme) and save and load with orbax through `gsm_jax.save` /
`gsm_jax.load` (`restore_quantized` rebuilds the int8 containers from a restored
tree).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from gsm_jax.errors import InvalidInputError, UnsupportedModelError
from gsm_jax.models.linear import (
    SCHEMES,
    QuantizedActivation,
    QuantizedWeight,
    hadamard_rotate,
)
from gsm_jax.pallas_kernels.quant_reference import dequantize_weight, quantize_weight
from gsm_jax.params import ModelParams

__all__ = [
    "SCHEMES",
    "QuantizedActivation",
    "QuantizedWeight",
    "apply_quantize_option",
    "dequantize",
    "quantization_of",
    "quantize",
    "restore_quantized",
]

QUANTIZE_CHOICES = ("none", *SCHEMES)
LLAMA_LINEARS = ("qkv", "o", "gate_up", "down")
DSV4_ATTN_LINEARS = ("q_a", "q_b", "kv", "o_b")


# ----------------------------------------------------------------------------- helpers


def _check_scheme(scheme: Any) -> str:
    if scheme not in SCHEMES:
        raise InvalidInputError(f"quantization scheme {scheme!r} is unknown; choose from {SCHEMES}")
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


def _q(w: jax.Array, scheme: str, hadamard: int = 0) -> QuantizedWeight:
    w = jnp.asarray(w, jnp.float32)
    if hadamard:  # y = (x H)(H W): store H W, rotate x online (H is its own inverse)
        w = hadamard_rotate(w, hadamard, axis=-2)
    values, scale = quantize_weight(w)
    return QuantizedWeight(values, scale, scheme, hadamard)


def _fake_quant_rows(w: jax.Array) -> jax.Array:
    """Round [V, D] (one scale per vocabulary row) to the int8 grid, keep it float."""
    values, scale = quantize_weight(jnp.asarray(w, jnp.float32).T)
    return dequantize_weight(values, scale).T.astype(w.dtype)


def _fake_quant_cols(w: jax.Array) -> jax.Array:
    values, scale = quantize_weight(jnp.asarray(w, jnp.float32))
    return dequantize_weight(values, scale).astype(w.dtype)


# ----------------------------------------------------------------------------- quantize


def quantize(params: ModelParams, scheme: str = "w8a8", *, head: bool = False,
             routed_experts: bool = False, hadamard_down: int = 0) -> ModelParams:
    """Return params with the family's linear layers as int8 `QuantizedWeight`s.

    scheme: "w8a16" (weight-only) or "w8a8" (plus per-token int8 activations).
    head: also round the embedding / LM head to the int8 grid (stored float).
    routed_experts: DeepSeek-V4 only, quantize the routed experts too.
    hadamard_down: > 0 (a power of two dividing d_ff): rotate the down
    projection's input online by a block-diagonal Hadamard matrix of that block
    size before it is quantized (the QuaRot-style baseline; Llama family only).
    """
    params = _check_params(params)
    scheme = _check_scheme(scheme)
    if quantization_of(params) is not None:
        raise InvalidInputError(f"params are already quantized ({quantization_of(params)})")
    family = params.config.family
    w = dict(params.weights)
    if family == "llama":
        layers = dict(w["layers"])
        for name in LLAMA_LINEARS:
            block = hadamard_down if name == "down" else 0
            if block and (block & (block - 1) or layers[name].shape[-2] % block):
                raise InvalidInputError(
                    f"hadamard_down={block} must be a power of two dividing "
                    f"intermediate_size={layers[name].shape[-2]}")
            layers[name] = _q(layers[name], scheme, block)
        w["layers"] = layers
    elif family == "deepseek_v4":
        if hadamard_down:
            raise UnsupportedModelError("hadamard_down is implemented for the Llama family only")
        w["layers"] = tuple(_quantize_dsv4_layer(lw, scheme, routed_experts)
                            for lw in w["layers"])
    else:
        raise UnsupportedModelError(f"quantization of model family {family!r} is not implemented")
    if head:
        w["embed"] = _fake_quant_rows(w["embed"])
        if "lm_head" in w:
            w["lm_head"] = _fake_quant_cols(w["lm_head"])
    extra = {**dict(params.extra), "quantization": scheme}
    if head:
        extra["quantized_head"] = True
    if routed_experts and family == "deepseek_v4":
        extra["quantized_routed_experts"] = True
    if hadamard_down:
        extra["hadamard_down"] = int(hadamard_down)
    return dataclasses.replace(params, weights=w, extra=extra)


def _quantize_dsv4_layer(lw: dict, scheme: str, routed_experts: bool) -> dict:
    lw = dict(lw)
    attn = dict(lw["attn"])
    for name in DSV4_ATTN_LINEARS:
        attn[name] = _q(attn[name], scheme)
    for sub in ("compressor",):
        if sub in attn:
            attn[sub] = {**attn[sub], "kv_gate": _q(attn[sub]["kv_gate"], scheme)}
    lw["attn"] = attn
    moe = dict(lw["moe"])
    for name in ("shared_gate_up", "shared_down"):
        moe[name] = _q(moe[name], scheme)
    if routed_experts:
        for name in ("experts_gate_up", "experts_down"):
            moe[name] = _q(moe[name], scheme)
    lw["moe"] = moe
    return lw


def dequantize(params: ModelParams, dtype: Any = jnp.float32) -> ModelParams:
    """Float params whose linear weights are the dequantized int8 weights (for tests:
    w8a16 of `params` equals the float model of `dequantize(params)` up to rounding)."""
    def deq(x):
        return x.dequantize(dtype) if isinstance(x, QuantizedWeight) else x

    weights = jax.tree.map(deq, params.weights,
                           is_leaf=lambda x: isinstance(x, QuantizedWeight))
    extra = {k: v for k, v in dict(params.extra).items() if k != "quantization"}
    return dataclasses.replace(params, weights=weights, extra=extra)


# ----------------------------------------------------------------------------- orbax


def restore_quantized(params: ModelParams) -> ModelParams:
    """Rebuild `QuantizedWeight`s in a tree restored by orbax (which returns each as a
    {"values", "scale"} dict), using the scheme recorded in ``params.extra``."""
    scheme = quantization_of(params)
    if scheme is None:
        return params
    hadamard = int(dict(params.extra).get("hadamard_down", 0))

    def is_q(x):
        return isinstance(x, QuantizedWeight) or (
            isinstance(x, dict) and set(x) == {"values", "scale"})

    def rebuild(path, x):
        if isinstance(x, QuantizedWeight):
            return x
        if isinstance(x, dict) and set(x) == {"values", "scale"}:
            name = path[-1].key if hasattr(path[-1], "key") else ""
            return QuantizedWeight(jnp.asarray(x["values"], jnp.int8),
                                   jnp.asarray(x["scale"], jnp.float32), scheme,
                                   hadamard if name == "down" else 0)
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
    """``--quantize {none,w8a16,w8a8}`` for an argparse (sub)parser."""
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="none",
                        help="run on int8-quantized params: w8a16 (weight-only) or w8a8 "
                             "(plus per-token int8 activations); GSM smooths before the "
                             "activation quantization")
