"""Every projection of the model families goes through `linear`.

A weight is either a float array stored [in, out], a `QuantizedWeight`
(int8 values [in, out] + one float32 scale per output channel, see
`gsm_jax.quant.quantize`), or a `BlockQuantWeight` (FP8 e4m3 / packed FP4 e2m1
with block scales, as DeepSeek-V4 checkpoints store them: `models/block_quant.py`).
Model files never change when a scheme arrives: `linear` dispatches on what it is
given.

- float weight: x @ w in x's dtype.
- "w8a16" (weight-only): activations stay float; y = (x @ values) * scale, the
  per-channel scale applied after the product (exact refactoring of
  x @ dequant(w)); or, grouped, a float16 scale and offset per 32 (`group`) input
  channels and output channel (`quantize(..., group_size=32)`). Decode-sized products
  on CPU run on the int8 matrix-vector kernel (`pallas_kernels/int8_matvec_cpu.py`),
  activations rounded to int16 per row.
- "w8a8": x is quantized per token (dynamic symmetric int8, absmax over the
  channels), the product runs int8 x int8 -> int32 (`lax.dot_general` with
  preferred_element_type=int32, exact integer arithmetic), then it is rescaled
  by the token scale and the channel scale, in float32, and cast to x's dtype.
  `x` may also arrive already quantized, as a `QuantizedActivation`: that is
  what a GSM site hands over when it ran the fused smooth + quantize kernel
  ("quantize, then smooth": the filter sees the float activation, the int8
  cast happens after it).

Optional online Hadamard rotation (`hadamard` > 0 on a weight): x is rotated
by a block-diagonal normalised Hadamard matrix (blocks of `hadamard` channels)
before it is quantized; the stored weight was rotated the other way when it
was quantized, so in float the product is unchanged (QuaRot-style, exact up
to rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gsm_jax.models.block_quant import BlockQuantWeight, quantize_activation_e4m3
from gsm_jax.pallas_kernels import int8_matvec_cpu
from gsm_jax.pallas_kernels.quant_reference import (
    dequantize_weight_grouped,
    int8_dot,
    quantize_rows,
    quantize_with_scale,
)

SCHEMES = ("w8a16", "w8a8")
DIGIT_RATIO = 128.0  # scale ratio of successive int8 digits (see `_int8_digits`)
W8A16_DIGITS = 3  # digits per activation row (see `_int8_digits`)
# Up to this many rows (decode batches) a CPU w8a16 product runs as int8 digit products
# (see `_w8a16_matmul`); prefill-sized products keep the converted-weight dot.
W8A16_DIGIT_MAX_ROWS = 16
# Up to this many rows a CPU w8a16 product runs on the int8 matrix-vector kernel
# (pallas_kernels/int8_matvec_cpu.py) when it is available.
W8A16_KERNEL_MAX_ROWS = 16


@struct.dataclass
class QuantizedWeight:
    """An int8 weight: values [..., in, out] (stacked layers keep their leading axis),
    scale float32 [..., out]. `values` comes first, so Flax's parameter shape check
    (which compares the first leaf) sees the [in, out] shape it expects.

    Grouped (w8a16 only, `zero` set): groups of `group` consecutive input channels have
    their own float16 scale and offset per output channel, scale and zero [..., in /
    group, out], weight = scale * values + zero (`quantize_weight_grouped`)."""

    values: jax.Array
    scale: jax.Array
    scheme: str = struct.field(pytree_node=False, default="w8a8")
    hadamard: int = struct.field(pytree_node=False, default=0)
    zero: jax.Array | None = None

    @property
    def group(self) -> int:
        """Input channels per scale (0: one scale per output channel)."""
        if self.zero is None:
            return 0
        return self.values.shape[-2] // self.scale.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def ndim(self) -> int:
        return self.values.ndim

    @property
    def size(self) -> int:
        return int(self.values.size)

    def __getitem__(self, index) -> QuantizedWeight:
        """Index the leading (layer or expert) axes: w[e] is expert e's weight."""
        zero = None if self.zero is None else self.zero[index]
        return self.replace(values=self.values[index], scale=self.scale[index], zero=zero)

    def astype(self, dtype) -> jax.Array:
        """The dequantized float weight: code that multiplies `w.astype(x.dtype)` itself
        (an einsum, `ragged_dot`) gets weight-only arithmetic, never a wrong product."""
        return self.dequantize(dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        if self.zero is not None:
            w = dequantize_weight_grouped(self.values, self.scale, self.zero)
        else:
            w = self.values.astype(jnp.float32) * self.scale[..., None, :]
        if self.hadamard:
            w = hadamard_rotate(w, self.hadamard, axis=-2)
        return w.astype(dtype)


@struct.dataclass
class QuantizedActivation:
    """A per-token int8 activation: values int8 [..., C], scale float32 [...]; `dtype`
    is the float dtype it came from (and the product's output dtype)."""

    values: jax.Array
    scale: jax.Array
    dtype: str = struct.field(pytree_node=False, default="float32")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape)

    def __getitem__(self, index) -> QuantizedActivation:
        return self.replace(values=self.values[index], scale=self.scale[index])

    def dequantize(self) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scale[..., None]).astype(self.dtype)


def quantize_activation(x: jax.Array) -> QuantizedActivation:
    """Per-token dynamic symmetric int8 (the reference quantizer)."""
    q, s = quantize_rows(x)
    return QuantizedActivation(q, s, jnp.dtype(x.dtype).name)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def wants_int8_input(w) -> bool:
    """True when `linear(x, w)` quantizes x per token itself, so a GSM site may hand
    it an already quantized activation (the fused smooth + quantize kernel)."""
    return (isinstance(w, QuantizedWeight) and w.scheme == "w8a8" and not w.hadamard
            and w.zero is None)


# ----------------------------------------------------------------------------- Hadamard


def hadamard_matrix(n: int) -> np.ndarray:
    """The normalised Sylvester Hadamard matrix of order n (a power of two): H @ H.T = I."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def hadamard_rotate(x: jax.Array, block: int, axis: int = -1) -> jax.Array:
    """x with `axis` cut into blocks of `block` channels, each multiplied by H_block
    (symmetric and orthogonal, so applying it twice is the identity)."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % block:
        raise ValueError(f"{n} channels are not a multiple of the Hadamard block {block}")
    h = jnp.asarray(hadamard_matrix(block), jnp.float32)
    xm = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    shape = xm.shape
    y = (xm.reshape(shape[:-1] + (n // block, block)) @ h).reshape(shape)
    return jnp.moveaxis(y, -1, axis).astype(x.dtype)


# ----------------------------------------------------------------------------- products


def _int8_digits(x: jax.Array, digits: int | None = None) -> tuple[jax.Array, jax.Array]:
    """x [..., K] as sum_k q_k * s_k per token with int8 q_k and power-of-two scales:
    absmax / 127 < s_0 <= 2 * absmax / 127, s_k = s_0 / 128**k. Returns
    (q [digits, ..., K], s [digits, ...]); a row holding NaN or inf gets NaN scales,
    so the product stays non-finite as the float one would be.

    Powers of two make every step exact: x / s_k only shifts exponents, and each
    residual r - q_k * s_k (at most s_k / 2) is representable, so no rounding happens
    anywhere and the digits do not depend on whether the compiler contracts the
    multiply-subtract into an FMA, which differs between fusions (a GSM site at
    strength 0 must leave the model bit-identical). The residual after the last digit
    is at most s_0 / 2 / 128**(digits-1) <= absmax / 127 / 128**(digits-1): 4.8e-7 *
    absmax for the default 3 digits (21 bits of the token's largest element: more than
    the 16 the scheme's name promises, a little under float32's 24; 4 digits give
    3.8e-9 but cost more per decode step: docs/performance_notes.md, "w8a16 digits")."""
    digits = W8A16_DIGITS if digits is None else digits
    r = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(r), axis=-1)
    _, exponent = jnp.frexp(absmax / 127.0)  # absmax / 127 = m * 2**e with m < 1
    # NaN or inf anywhere in the row: NaN scales (frexp alone would give a finite one)
    s = jnp.ldexp(jnp.ones_like(absmax), exponent) + absmax * 0.0
    qs, ss = [], []
    for _ in range(digits):
        q = quantize_with_scale(r, s[..., None])
        qs.append(q)
        ss.append(s)
        r = r - q.astype(jnp.float32) * s[..., None]
        s = s * (1.0 / DIGIT_RATIO)
    return jnp.stack(qs), jnp.stack(ss)


def _w8a16_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """(x @ values) * scale: the product with the dequantized weight, activations float.

    Generic form: the int8 values converted to x's dtype for the product (after x is
    computed, see `_after`), the per-channel scale applied after it. XLA:GPU fuses the
    convert into the GEMM.
    XLA:CPU cannot: it writes the converted f32 weight out and its dot reads it back,
    which costs more than reading an f32 weight in the first place.

    CPU, up to `W8A16_KERNEL_MAX_ROWS` rows (decode) of a 2-D weight: the int8
    matrix-vector kernel (`pallas_kernels/int8_matvec_cpu.py`, an XLA FFI custom call),
    which reads the int8 weight once as stored at about the float32 product's bytes per
    second, so a quarter of its time. x is rounded to int16 per row for it (error at most
    1/65534 of the row's largest element: 16-bit activations, as the scheme's name says).
    docs/performance_notes.md, "w8a16 on CPU: the int8 weight read once".

    A grouped weight (`w.zero` set) takes the kernel's grouped form there, and otherwise
    the product with its dequantized weight (no digit form).

    Without the kernel (no C++ compiler, GSM_JAX_CPU_KERNELS=0), up to
    `W8A16_DIGIT_MAX_ROWS` rows (also DeepSeek-V4's per-expert blocks of routed tokens
    when those are quantized): x is expanded into `W8A16_DIGITS` int8 digits with
    power-of-two scales (`_int8_digits`: exact, error below 4.8e-7 of the row's largest
    element) and multiplied by the int8 weight as stored, on XLA's int8 GEMM (the
    Ozaki-scheme idea: a wide product from exact narrow ones); the exact int32 results are
    recombined in float32. SmolLM2 decode steps with per-layer weights, ms, digits vs the
    converted-weight form (fp32 in the same runs): batch 1 ~29 vs ~42 (33-37), batch 4
    47.8 vs 67.1 (71-74), batch 16 ~101 vs ~130 (122-132). Prefill-sized products
    (hundreds of rows) keep the generic form.
    """
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if (0 < rows <= W8A16_KERNEL_MAX_ROWS and w.values.ndim == 2 and x.shape[-1] > 0
            and jax.default_backend() == "cpu" and int8_matvec_cpu.available()):
        x2 = x.reshape(rows, x.shape[-1])
        if w.zero is not None:
            y = int8_matvec_cpu.int8_matvec_grouped(x2, w.values, w.scale, w.zero)
        else:
            y = int8_matvec_cpu.int8_matvec(x2, w.values, w.scale)
        return y.reshape(x.shape[:-1] + (y.shape[-1],)).astype(x.dtype)
    if w.zero is not None:  # grouped: the dequantized weight, its convert tied to x
        return x @ dequantize_weight_grouped(_after(x, w.values), w.scale, w.zero, x.dtype)
    if rows <= W8A16_DIGIT_MAX_ROWS and jax.default_backend() == "cpu":
        q, s = _int8_digits(x.reshape(rows, x.shape[-1]))
        acc = int8_dot(q.reshape(-1, x.shape[-1]), w.values).astype(jnp.float32)
        acc = acc.reshape(q.shape[0], rows, -1) * s[..., None]  # [digits, rows, out]
        y = acc[-1]
        for k in range(q.shape[0] - 2, -1, -1):  # smallest digit first
            y = y + acc[k]
        y = y.reshape(x.shape[:-1] + (acc.shape[-1],))
        return (y * w.scale).astype(x.dtype)
    y = x @ _after(x, w.values).astype(x.dtype)
    return y * w.scale.astype(x.dtype)


def _after(x: jax.Array, values: jax.Array) -> jax.Array:
    """`values`, made to depend on x at run time, so its convert is scheduled after x.

    Per-layer weights (`models.llama.unstack_layers`) are separate parameters, so no
    convert of them depends on an activation; XLA:CPU's default scheduler then runs
    every layer's convert first and keeps all the f32 copies alive at once (~500 MB
    for SmolLM2; docs/performance_notes.md, "w8a16: tie each weight convert"). The
    select on a condition that is always true but computed from x (NaN included: x0
    == x0 or x0 != x0) costs one scalar test inside the convert loop.
    """
    if x.size == 0 or jax.default_backend() != "cpu":
        return values
    x0 = x.reshape(-1)[0]
    live = (x0 == x0) | (x0 != x0)
    return jnp.where(live, values, jnp.zeros((), values.dtype))


def _w8a8_matmul(xq: QuantizedActivation, w: QuantizedWeight) -> jax.Array:
    """int8 x int8 -> int32 (exact), rescaled by the token and channel scales in f32.

    XLA:CPU sends a one-row int8 product (decode at batch 1) down its matrix-vector
    path, which first converts the whole int8 weight to int32; from two rows on it
    runs the int8 GEMM library kernel on the int8 weight as stored. So on CPU a single
    row is multiplied as two identical rows (docs/performance_notes.md, "W8A8 on CPU: a
    one-row product runs as two rows"). The integer result is the same.
    """
    values, shape = xq.values, xq.values.shape
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    if rows == 1 and jax.default_backend() == "cpu":
        flat = values.reshape(1, shape[-1])
        acc = int8_dot(jnp.concatenate([flat, flat]), w.values)[:1]
        acc = acc.reshape(shape[:-1] + (acc.shape[-1],))
    else:
        acc = int8_dot(values, w.values)  # exact int32
    y = acc.astype(jnp.float32) * xq.scale[..., None] * w.scale
    return y.astype(xq.dtype)


def _block_quant_matmul(x: jax.Array, w: BlockQuantWeight) -> jax.Array:
    """x @ an FP8 / FP4 block-scaled weight kept as stored (models/block_quant.py).

    The weight is dequantized per block right before the product, contracting its
    stored [out, in] orientation directly (no transpose); with `act="e4m3"` x is first
    rounded to FP8 per token and 128-channel block, as V4's runtime does. The dequantize
    is tied to x (`_after`) so XLA:CPU does not run every layer's converts up front.
    """
    if w.act == "e4m3":
        x = quantize_activation_e4m3(x, w.act_block)
    # the select runs on bytes: on FP8 XLA:CPU emulates it (docs/performance_notes.md,
    # "FP8 products: the ordering select runs on bytes")
    raw = _after(x, jax.lax.bitcast_convert_type(w.values, jnp.uint8))
    values = jax.lax.bitcast_convert_type(raw, w.values.dtype)
    stored = w.replace(values=values).dequantize_stored(x.dtype)
    return jax.lax.dot_general(x, stored, (((x.ndim - 1,), (1,)), ((), ())))


def _float_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x @ w for a float weight, in x's dtype.

    A 16-bit product (bf16 / f16 weight and activation) of at least two rows accumulates
    in float32 through `preferred_element_type` and is rounded once at the end. On
    XLA:CPU that is the form its GEMM library (YNNPACK) runs on the 16-bit weight as
    stored; a 16-bit result makes XLA widen both operands to float32 instead, and the
    weights of a whole decode loop get float32 copies. One row keeps that widened form:
    the library's one-row 16-bit product is ~13x slower than the float32 matrix-vector
    product (docs/performance_notes.md, "16-bit products accumulate in float32")."""
    w = w.astype(x.dtype)
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    one_row_cpu = rows < 2 and jax.default_backend() == "cpu"
    if jnp.dtype(x.dtype).itemsize == 2 and not one_row_cpu:
        y = jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)
        return y.astype(x.dtype)
    return x @ w


def linear(x, w) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in x's dtype, whatever form w takes.

    `x` may be a `QuantizedActivation` only when w is a W8A8 `QuantizedWeight`.
    """
    if isinstance(x, QuantizedActivation):
        if not wants_int8_input(w):
            raise TypeError("an int8 activation can only multiply a W8A8 QuantizedWeight "
                            f"without rotation, got {type(w).__name__}")
        return _w8a8_matmul(x, w)
    if isinstance(w, BlockQuantWeight):
        return _block_quant_matmul(x, w)
    if not isinstance(w, QuantizedWeight):
        return _float_matmul(x, w)
    if w.scheme == "w8a16":
        if w.hadamard:
            x = hadamard_rotate(x, w.hadamard)
        return _w8a16_matmul(x, w)
    if w.scheme == "w8a8":
        if w.zero is not None:
            raise ValueError("a grouped QuantizedWeight (zero set) is w8a16 only; its "
                             "scheme says w8a8")
        if w.hadamard:
            x = hadamard_rotate(x, w.hadamard)
        return _w8a8_matmul(quantize_activation(x), w)
    raise ValueError(f"unknown quantization scheme {w.scheme!r}; expected one of {SCHEMES}")
