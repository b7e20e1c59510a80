"""DeepSeek-V4.1's KV-cache formats: the released cache precisions, packed.

The released cache precisions (§4.2-4.4 of the project's V4.1 research note), on the last
axis in blocks:

  window K=V      "fp8":   FP8 e4m3, one power-of-two (E8M0) scale per 32 channels
  compressed KV   "nvfp4": FP4 e2m1, one E4M3 scale (amax / 6) per 16 channels
  index keys / q  "mxfp4": FP4 e2m1, one power-of-two (E8M0) scale per 32 channels

`*_qdq(x)` rounds x to the format and back (f32 inside, x's dtype out): what the
reference applies. The caches are held packed (`PackedEntries`: e4m3 bytes, or two
e2m1 codes per byte, plus the scale bytes): `pack_entries` /
`read_entries` round-trip to exactly `*_qdq(x)`, so a packed cache costs the release's
bytes (`released_cache_bytes`) and computes what a float cache of QDQ'd values would.
`models/deepseek_v41.py` holds its caches in these (`init_cache`, `cache_qdq`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

if TYPE_CHECKING:
    from gsm_jax.models.deepseek_v41 import DeepseekV41Config

_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
CACHE_FORMATS = {"fp8": 32, "nvfp4": 16, "mxfp4": 32}  # format -> channels per scale


def pow2_ceil(v: jax.Array) -> jax.Array:
    """The smallest power of two >= v, for positive normal f32 v (exponent bits: exact)."""
    bits = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
    exponent = (bits >> 23) & 255
    exponent = exponent + ((bits & 0x7FFFFF) != 0).astype(jnp.int32)
    return jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)


def _blocks(x: jax.Array, block: int) -> tuple[jax.Array, int]:
    c = x.shape[-1]
    g = x.astype(jnp.float32)
    if c % block:
        g = jnp.pad(g, [(0, 0)] * (x.ndim - 1) + [(0, -c % block)])
    return g.reshape(g.shape[:-1] + (-1, block)), c


def _unblock(g: jax.Array, c: int, dtype: Any) -> jax.Array:
    return g.reshape(g.shape[:-2] + (-1,))[..., :c].astype(dtype)


def _e2m1_codes(v: jax.Array) -> jax.Array:
    """The e2m1 code (0..7 the levels 0, .5, 1, 1.5, 2, 3, 4, 6; +8 negative) nearest to
    v (|v| <= 6), ties to the even level; a negative v rounding to 0 keeps its sign (-0)."""
    mag = jnp.abs(v)
    mids = jnp.asarray(_FP4_MIDPOINTS, jnp.float32)
    lower = jnp.sum(mag[..., None] > mids, axis=-1)  # bucket: mids[i-1] < mag <= mids[i]
    tie = mag == mids[jnp.minimum(lower, 6)]
    sel = lower + (tie & (lower % 2 == 1)).astype(lower.dtype)
    return (sel + 8 * (v < 0).astype(sel.dtype)).astype(jnp.uint8)


def _e2m1_values(codes: jax.Array) -> jax.Array:
    """e2m1 codes (0..15) -> f32 values, `E2M1_VALUES` built from the bits: magnitude code
    m >= 2 is 2 ** ((m >> 1) - 1) * (1 + (m & 1) / 2), i.e. f32 bits (m + 252) << 22; m = 1
    is 0.5; bit 3 the sign (XLA:CPU runs this ~1.3x faster than the 16-entry table)."""
    c = codes.astype(jnp.uint32)
    m = c & 7
    bits = jnp.where(m >= 2, (m + 252) << 22, jnp.where(m == 1, jnp.uint32(0x3F000000), 0))
    return jax.lax.bitcast_convert_type(bits | ((c & 8) << 28), jnp.float32)


def _quantize(fmt: str, x: jax.Array) -> tuple[jax.Array, jax.Array, int]:
    """x [..., C] -> (codes [..., nb, block]: e4m3 values ("fp8") or e2m1 codes (uint8),
    scales [..., nb, 1] f32, C)."""
    g, c = _blocks(x, CACHE_FORMATS[fmt])
    amax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    if fmt == "fp8":
        scale = pow2_ceil(jnp.maximum(amax, 1e-4) * np.float32(1 / 448))
        return jnp.clip(g / scale, -448, 448).astype(jnp.float8_e4m3fn), scale, c
    if fmt == "nvfp4":
        scale = (jnp.maximum(amax, 6 * 2.0**-9) / 6).astype(jnp.float8_e4m3fn).astype(jnp.float32)
    else:
        scale = pow2_ceil(jnp.maximum(amax, 6 * 2.0**-126) * np.float32(1 / 6))
    return _e2m1_codes(jnp.clip(g / scale, -6, 6)), scale, c


def _dequantize(fmt: str, codes: jax.Array, scale: jax.Array, c: int, dtype: Any) -> jax.Array:
    v = codes.astype(jnp.float32) if fmt == "fp8" else _e2m1_values(codes)
    return _unblock(v * scale, c, dtype)


def fp8_qdq(x: jax.Array) -> jax.Array:
    """The window KV's rounding: FP8 e4m3 with one E8M0 scale per 32 channels."""
    return _dequantize("fp8", *_quantize("fp8", x), x.dtype)


def nvfp4_qdq(x: jax.Array) -> jax.Array:
    """The compressed KV's rounding: FP4 e2m1 with one E4M3 scale (amax / 6) per 16."""
    return _dequantize("nvfp4", *_quantize("nvfp4", x), x.dtype)


def mxfp4_qdq(x: jax.Array) -> jax.Array:
    """The index q / k rounding: FP4 e2m1 with one power-of-two scale per 32 channels."""
    return _dequantize("mxfp4", *_quantize("mxfp4", x), x.dtype)


_QDQ = {"fp8": fp8_qdq, "nvfp4": nvfp4_qdq, "mxfp4": mxfp4_qdq}


@struct.dataclass
class PackedEntries:
    """Cache entries [..., width] held in a released format (`CACHE_FORMATS`).

    codes:  [..., W] uint8 for "fp8" (the e4m3 bytes: XLA:CPU gathers and selects bytes
            faster than float8, 3.5 ms of a 16 ms V4.1-mid decode step); FP4: [..., W / 2]
            uint8, two e2m1 codes per byte: byte j holds channel j in its low nibble and
            channel j + W / 2 in its high one (unpacked as two halves side by side; the
            weights' even / odd interleave unpacked 3-5x slower on XLA:CPU)
    scales: [..., W / block]: E8M0 bytes (uint8, 2 ** (byte - 127)) for "fp8" / "mxfp4",
            float8_e4m3fn for "nvfp4"
    W is `width` rounded up to whole blocks. Leading axes (batch, slot) are the leaves'
    own, so ring reads, slot writes, gathers and row inserts map over both leaves."""

    codes: jax.Array
    scales: jax.Array
    fmt: str = struct.field(pytree_node=False, default="fp8")
    width: int = struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [..., width] of the float entries."""
        return tuple(self.codes.shape[:-1]) + (self.width,)


def _e8m0_byte(scale: jax.Array) -> jax.Array:
    """A power-of-two f32 scale (normal) -> its E8M0 byte: the exponent bits."""
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    return (bits >> 23).astype(jnp.uint8)


def _e8m0_value(byte: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(byte.astype(jnp.uint32) << 23, jnp.float32)


def pack_entries(fmt: str, x: jax.Array) -> PackedEntries:
    """x [..., C] -> its packed form in `fmt`; `read_entries` gives back `*qdq(x)`."""
    codes, scale, c = _quantize(fmt, x)
    lead = codes.shape[:-2]
    codes = codes.reshape(lead + (-1,))
    if fmt == "fp8":  # as bytes: XLA:CPU moves uint8 faster than float8 (gathers, selects)
        codes = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    else:  # byte j: channel j (low nibble), channel j + W / 2 (high nibble)
        half = codes.shape[-1] // 2
        codes = codes[..., :half] | (codes[..., half:] << 4)
    scales = scale[..., 0]
    scales = scales.astype(jnp.float8_e4m3fn) if fmt == "nvfp4" else _e8m0_byte(scales)
    return PackedEntries(codes=codes, scales=scales, fmt=fmt, width=c)


def read_entries(e: jax.Array | PackedEntries, dtype: Any) -> jax.Array:
    """Cache entries as `dtype` values: a float cache cast, a packed one unpacked (the
    released formats' values are exact in bfloat16 and float32)."""
    if not isinstance(e, PackedEntries):
        return e.astype(dtype)
    block = CACHE_FORMATS[e.fmt]
    scale = (e.scales.astype(jnp.float32) if e.fmt == "nvfp4" else _e8m0_value(e.scales))
    nb, lead = scale.shape[-1], e.codes.shape[:-1]
    if e.fmt == "fp8":
        codes = jax.lax.bitcast_convert_type(e.codes, jnp.float8_e4m3fn)
    elif nb % 2 == 0:  # each half whole blocks, scaled apart, then side by side: on XLA:CPU
        # 3x faster than scaling the joined halves at 64-128 channels, 5x than an interleave
        h = nb // 2
        lo = _e2m1_values(e.codes & 0xF).reshape(lead + (h, block)) * scale[..., :h, None]
        hi = _e2m1_values(e.codes >> 4).reshape(lead + (h, block)) * scale[..., h:, None]
        return _unblock(jnp.concatenate([lo, hi], axis=-2), e.width, dtype)
    else:
        codes = jnp.concatenate([e.codes & 0xF, e.codes >> 4], axis=-1)
    return _dequantize(e.fmt, codes.reshape(lead + (nb, block)), scale[..., None], e.width,
                       dtype)


def empty_entries(cfg: DeepseekV41Config, fmt: str, shape: tuple[int, ...],
                  dtype: Any) -> jax.Array | PackedEntries:
    """Zeroed cache entries of logical `shape`: packed in `fmt` (`cache_qdq`), else float."""
    if not cfg.cache_qdq:
        return jnp.zeros(shape, dtype)
    want = jax.eval_shape(lambda: pack_entries(fmt, jnp.zeros(shape, jnp.float32)))
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), want)


def cache_entries(cfg: DeepseekV41Config, fmt: str, x: jax.Array) -> jax.Array | PackedEntries:
    """New entries x as the cache holds them: packed in `fmt` (`cache_qdq`), else x."""
    return pack_entries(fmt, x) if cfg.cache_qdq else x


def qdq(cfg: DeepseekV41Config, fmt: str, x: jax.Array) -> jax.Array:
    """x rounded to `fmt` and back, or x itself when the config keeps its caches float
    (`cache_qdq=False`)."""
    return _QDQ[fmt](x) if cfg.cache_qdq else x
