"""`models.linear.linear` on float weights: 16-bit products accumulate in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gsm_jax.models.linear import linear


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("rows", [1, 2, 16])
def test_16bit_product_equals_float32_product_rounded_once(dtype, rows):
    """bf16 / f16 operands multiply exactly in float32; the result is the float32 product
    of the same 16-bit values, rounded once to the 16-bit dtype (a float32 accumulation of
    576 terms differs only in summation order: well under one 16-bit ulp)."""
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 576)), dtype)
    w = jnp.asarray(rng.standard_normal((576, 960)) * 0.05, dtype)
    y = jax.jit(linear)(x, w)
    assert y.dtype == dtype and y.shape == (rows, 960)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    ulp = np.abs(ref) * float(jnp.finfo(dtype).eps)
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= ulp + 1e-6)


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="reads the program XLA:CPU compiles; GPU and TPU pick their own dot")
def test_16bit_product_of_several_rows_reads_the_16bit_weight():
    """From two rows on, the compiled dot takes the bf16 weight as stored and returns
    float32; one row keeps XLA's widened float32 product (its fast matrix-vector path)."""
    w = jnp.zeros((576, 960), jnp.bfloat16)
    two = jax.jit(linear).lower(jnp.zeros((2, 576), jnp.bfloat16), w).compile().as_text()
    dots = [ln for ln in two.splitlines() if " dot(" in ln]
    assert dots and all(ln.split("=")[1].strip().startswith("f32[2,960]") for ln in dots)
    assert "bf16[576,960]" in two and "f32[576,960]" not in two
    one = jax.jit(linear).lower(jnp.zeros((1, 576), jnp.bfloat16), w).compile().as_text()
    assert "f32[576,960]" in one  # the weight widened for the one-row product
