"""Block-scaled low-precision weights as DeepSeek-V4 stores them: FP8 e4m3 and packed FP4 e2m1.

Formats (facts pinned by `tests/test_block_quant.py` against plain numpy tables):

- FP8 e4m3 ("e4m3"): one byte per weight (`jnp.float8_e4m3fn`), one scale per
  block of [bo, bi] = [128, 128] (V4 dense linears; V4.1: 32 x 32) over the torch
  [out, in] layout. Edge blocks are partial: scale shape [ceil(out/bo), ceil(in/bi)].
- FP4 e2m1 ("e2m1", MXFP4): two weights per byte along the input axis, the low
  nibble holding the even input index; one scale per 1 x 32 block (V4 routed experts).
  Nibble codes: 0..7 = [0, .5, 1, 1.5, 2, 3, 4, 6], 8..15 the same negated.
- Scales: E8M0 bytes (unsigned exponent only, value 2 ** (byte - 127), 0xFF = NaN,
  refused at load) or float32 (V4-Flash-Base experts).

`BlockQuantWeight` keeps them as stored (values in the on-disk [..., out, in] or
[..., out, in/2] orientation, scales as bytes) so in memory an FP8 weight costs
1 byte and an FP4 weight half a byte, plus 1/32 byte of scale. `models/linear.py`
dequantizes per block inside the jitted step, right before the product (XLA:GPU
fuses the convert and the scale multiply into the GEMM's operand; XLA:CPU writes
the dequantized tile out first, see `benchmarks/bench_deepseek_v4_lowp.py`).

With `act="e4m3"` the activation entering the product is rounded per token and per
128-channel block to FP8 e4m3 with a power-of-two (UE8M0) scale, as V4's own
runtime quantizes its activations (`act_quant`). FP8 x FP8 products are exact in
float32 and every scale is a power of two, so multiplying the dequantized operands
in float32 gives the FP8 GEMM's result up to summation order.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

FORMATS = ("e4m3", "e2m1")
ACTIVATIONS = ("none", "e4m3")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E8M0_NAN = 0xFF
ACT_BLOCK = 128  # V4 act_quant: one activation scale per token per 128 channels
ACT_MIN_AMAX = 1e-4  # V4 act_quant clamps the block absmax from below


# ----------------------------------------------------------------------------- numpy side
# (loading, the checkpoint writer and the tests; independent of the jnp path below)


def e8m0_to_float(b: np.ndarray) -> np.ndarray:
    """E8M0 bytes -> float32 2 ** (b - 127); 0xFF (NaN) stays NaN."""
    b = np.asarray(b, np.uint8)
    with np.errstate(over="ignore"):  # 0xFF would be 2 ** 128: replaced by NaN below
        out = np.ldexp(np.float32(1.0), b.astype(np.int32) - 127).astype(np.float32)
    return np.where(b == E8M0_NAN, np.float32(np.nan), out)


def float_to_e8m0(scale: np.ndarray) -> np.ndarray:
    """Power-of-two float32 scales -> their E8M0 bytes (exact; anything else is refused)."""
    scale = np.asarray(scale, np.float32)
    mant, exp = np.frexp(scale)
    if not np.all(mant == 0.5):
        raise ValueError("E8M0 holds powers of two only")
    return (exp - 1 + 127).astype(np.uint8)


def unpack_e2m1(packed: np.ndarray) -> np.ndarray:
    """[..., n] bytes -> [..., 2n] float32: low nibble first (even index), then high."""
    u8 = np.asarray(packed).view(np.uint8)
    table = np.asarray(E2M1_VALUES, np.float32)
    pair = np.stack([table[u8 & 0xF], table[u8 >> 4]], axis=-1)
    return pair.reshape(u8.shape[:-1] + (2 * u8.shape[-1],))


def pack_e2m1(codes: np.ndarray) -> np.ndarray:
    """[..., 2n] nibble codes (0..15) -> [..., n] uint8, even index in the low nibble."""
    codes = np.asarray(codes, np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def e2m1_codes(x: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest E2M1 code (ties to the even code; |x| > 6 saturates)."""
    x = np.asarray(x, np.float32)
    grid = np.asarray(E2M1_VALUES[:8], np.float32)
    mid = (grid[1:] + grid[:-1]) / 2
    mag = np.abs(x)
    idx = np.searchsorted(mid, mag, side="left")  # a tie lands on the lower code
    tie = (idx < 7) & (mag == mid[np.minimum(idx, 6)]) & (idx % 2 == 1)
    idx = idx + tie
    return (idx + 8 * (np.signbit(x) & (idx > 0))).astype(np.uint8)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """[ceil(out / bo), ceil(in / bi)] for a logical [..., out, in] weight."""
    out, inp = shape[-2:]
    return -(-out // block[0]), -(-inp // block[1])


def expand_scale(scale: np.ndarray, out: int, inp: int, block: tuple[int, int]) -> np.ndarray:
    """[..., so, si] -> [..., out, in]: each block's scale repeated over it (edges cropped)."""
    s = np.repeat(np.repeat(scale, block[0], axis=-2), block[1], axis=-1)
    return s[..., :out, :inp]


def dequantize_np(values: np.ndarray, scale: np.ndarray, fmt: str,
                  block: tuple[int, int]) -> np.ndarray:
    """Stored [..., out, in(/2)] values + scales -> float32 [..., out, in]."""
    v = unpack_e2m1(values) if fmt == "e2m1" else np.asarray(values).astype(np.float32)
    s = e8m0_to_float(scale) if np.asarray(scale).dtype == np.uint8 else \
        np.asarray(scale, np.float32)
    return v * expand_scale(s, v.shape[-2], v.shape[-1], block)


def quantize_np(w: np.ndarray, fmt: str, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """float [..., out, in] -> (stored values, E8M0 scale bytes), the way V4 was quantized:
    per block, the smallest power-of-two scale that keeps |w| / scale within the format."""
    w = np.asarray(w, np.float32)
    out, inp = w.shape[-2:]
    so, si = scale_grid(w.shape, block)
    pad = [(0, 0)] * (w.ndim - 2) + [(0, so * block[0] - out), (0, si * block[1] - inp)]
    blocks = np.pad(w, pad).reshape(w.shape[:-2] + (so, block[0], si, block[1]))
    amax = np.abs(blocks).max(axis=(-3, -1))
    top = E2M1_MAX if fmt == "e2m1" else E4M3_MAX
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / top)).astype(np.int32)
    scale = np.ldexp(np.float32(1.0), np.clip(exp, -127, 127)).astype(np.float32)
    scaled = w / expand_scale(scale, out, inp, block)
    if fmt == "e2m1":
        values = pack_e2m1(e2m1_codes(scaled))
    else:
        import ml_dtypes

        values = np.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
    return values, float_to_e8m0(scale)


# ----------------------------------------------------------------------------- jnp side


def _scale_f32(scale: jax.Array) -> jax.Array:
    if scale.dtype == jnp.uint8:  # E8M0 bytes
        return jax.lax.bitcast_convert_type(scale, jnp.float8_e8m0fnu).astype(jnp.float32)
    return scale.astype(jnp.float32)


def _unpack_e2m1_jnp(packed: jax.Array, dtype=jnp.float32) -> jax.Array:
    """[..., n] uint8 -> [..., 2n] `dtype`, low nibble first.

    Two equal routes, picked by what XLA:CPU runs faster: to float32 through the
    16-entry table, to bfloat16 through `bitcast_convert_type` to float4_e2m1fn, which
    yields [low, high] pairs (docs/performance_notes.md, "FP4 unpack: table for
    float32, float4 bitcast for bfloat16").
    """
    if jnp.dtype(dtype) == jnp.bfloat16:
        pairs = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)  # [..., n, 2]
        return pairs.reshape(packed.shape[:-1] + (2 * packed.shape[-1],)).astype(dtype)
    table = jnp.asarray(E2M1_VALUES, dtype)
    p = packed.astype(jnp.int32)
    nibbles = jnp.stack([p & 0xF, p >> 4], axis=-1)
    return table[nibbles.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))]


def _times_block_scale(v: jax.Array, s: jax.Array, block: tuple[int, int]) -> jax.Array:
    """v [..., out, in] * its block scales s [..., so, si]."""
    out, inp = v.shape[-2:]
    so, si = s.shape[-2:]
    if so * block[0] == out and si * block[1] == inp:  # whole blocks: a broadcast
        lead = v.shape[:-2]
        vb = v.reshape(lead + (so, block[0], si, block[1]))
        return (vb * s[..., :, None, :, None]).reshape(v.shape)
    full = jnp.repeat(jnp.repeat(s, block[0], axis=-2), block[1], axis=-1)
    return v * full[..., :out, :inp]


@struct.dataclass
class BlockQuantWeight:
    """An FP8 or FP4 block-scaled weight, kept as stored.

    values: float8_e4m3fn [..., out, in] or uint8 [..., out, in / 2] (packed e2m1);
    scale: uint8 E8M0 bytes or float32, [..., ceil(out / bo), ceil(in / bi)].
    Leading axes (experts) index like an array: w[e]. `shape` is the logical
    [..., in, out] of the float weight it stands for (the model's layout).
    """

    values: jax.Array
    scale: jax.Array
    fmt: str = struct.field(pytree_node=False, default="e4m3")
    block: tuple[int, int] = struct.field(pytree_node=False, default=(128, 128))
    act: str = struct.field(pytree_node=False, default="none")
    # act="e4m3": channels per activation scale (V4: 128; V4.1: 32, its weight block's width)
    act_block: int = struct.field(pytree_node=False, default=ACT_BLOCK)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """[..., out, in] of the float weight, in the stored orientation."""
        *lead, out, packed = self.values.shape
        return (*lead, out, packed * 2 if self.fmt == "e2m1" else packed)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out, inp = self.stored_shape
        return (*lead, inp, out)

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes) + int(self.scale.nbytes)

    def __getitem__(self, index) -> BlockQuantWeight:
        return self.replace(values=self.values[index], scale=self.scale[index])

    def dequantize_stored(self, dtype=jnp.float32) -> jax.Array:
        """The float weight [..., out, in] (stored orientation)."""
        # bf16 has float32's exponent range, so power-of-two scales times e4m3 / e2m1
        # values are exact in it: no float32 detour (docs/performance_notes.md, "FP4 into
        # a bf16 product: no float32 detour")
        work = jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32
        v = _unpack_e2m1_jnp(self.values, work) if self.fmt == "e2m1" else \
            self.values.astype(work)
        return _times_block_scale(v, _scale_f32(self.scale).astype(work),
                                  self.block).astype(dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The float weight in the model's [..., in, out] layout."""
        return jnp.swapaxes(self.dequantize_stored(dtype), -1, -2)

    def astype(self, dtype) -> jax.Array:
        """Code that multiplies `w.astype(x.dtype)` itself (einsum, ragged_dot) gets the
        dequantized weight, never a wrong product."""
        return self.dequantize(dtype)


def is_block_quantized(w) -> bool:
    return isinstance(w, BlockQuantWeight)


def projection_param(module: Any, name: str, init: Any, shape: tuple[int, ...]) -> Any:
    """`module.param(name, init, shape)` for a projection weight [..., in, out] that may be
    a float array or a `BlockQuantWeight`.

    Flax checks a parameter's shape against its first leaf; a block-quantized weight's
    first leaf is its stored [..., out, in(/2)] values, so its logical shape is checked
    here instead.
    """
    if module.has_variable("params", name):
        value = module.get_variable("params", name)
        if isinstance(value, BlockQuantWeight):
            if value.shape != tuple(shape):
                raise ValueError(f"{module.name}.{name}: a block-quantized weight of logical "
                                 f"shape {value.shape} where {tuple(shape)} is expected")
            return value
    return module.param(name, init, shape)


def quantize_activation_e4m3(x: jax.Array, block: int = ACT_BLOCK) -> jax.Array:
    """x rounded per token and per `block` channels to FP8 e4m3 with a power-of-two scale,
    returned dequantized in x's dtype (V4's act_quant with scale_fmt ue8m0).

    scale = 2 ** ceil(log2(max(absmax, 1e-4) / 448)), q = e4m3(x / scale).
    A partial last block (channels not a multiple of `block`) gets its own scale.
    """
    c = x.shape[-1]
    n = -(-c // block)
    x32 = x.astype(jnp.float32)
    padded = jnp.pad(x32, [(0, 0)] * (x.ndim - 1) + [(0, n * block - c)])
    blocks = padded.reshape(x.shape[:-1] + (n, block))
    amax = jnp.maximum(jnp.max(jnp.abs(blocks), axis=-1, keepdims=True), ACT_MIN_AMAX)
    # 2 ** ceil(log2(amax / 448)), exactly (XLA:CPU's exp2 / log2 are a few ulps off)
    mant, exp = jnp.frexp(amax / E4M3_MAX)
    scale = jnp.ldexp(jnp.float32(1.0), jnp.where(mant == 0.5, exp - 1, exp))
    q = (blocks / scale).astype(jnp.float8_e4m3fn)
    back = (q.astype(jnp.float32) * scale).reshape(padded.shape)[..., :c]
    return back.astype(x.dtype)
