"""The CPU int8 matrix-vector kernel (pallas_kernels/int8_matvec_cpu.cc) against its
plain references, and the int8 LM head (`quantize(..., head=True)`) that uses it.

The kernel's arithmetic is integer: x rounded to int16 per row, times the int8 weight,
summed exactly in int32 (in chunks of 512 k, each added in float32), then scaled. So it
is compared with the same integer product done in int64 by numpy: the only differences
allowed are float32 roundings of the chunk sums and the final two multiplies
(relative 1e-6 of the row's largest output). The grouped form (a float16 scale and offset
per group of k) likewise, with the bound of float32 recursive summation over its groups."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import tiny_dsv4, tiny_gemma3, tiny_gsm_llama

import gsm_jax
from gsm_jax.errors import UnsupportedModelError
from gsm_jax.models.linear import QuantizedWeight
from gsm_jax.pallas_kernels import int8_matvec_cpu as kmod
from gsm_jax.params import ModelParams
from gsm_jax.quant import dequantize, quantize

needs_kernel = pytest.mark.skipif(
    jax.default_backend() != "cpu" or not kmod.available(),
    reason=f"the int8 CPU kernel is unavailable here: {kmod.unavailable_reason()}")


def _exact(x: np.ndarray, values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The kernel's product in int64 and float64: int16 rows (the module's own rounding)
    times the int8 weight, scaled."""
    xq, xs = (np.asarray(a) for a in kmod.quantize_rows_int16(jnp.asarray(x)))
    acc = xq.astype(np.int64) @ values.astype(np.int64)
    return acc.astype(np.float64) * xs.astype(np.float64)[:, None] * scale.astype(np.float64)


def _case(rng, rows: int, k: int, n: int):
    x = rng.standard_normal((rows, k)).astype(np.float32)
    values = rng.integers(-127, 128, (k, n)).astype(np.int8)
    scale = rng.uniform(0.5, 2.0, n).astype(np.float32)
    return x, values, scale


@needs_kernel
@pytest.mark.parametrize("rows,k,n", [
    (1, 1, 1), (1, 2, 63), (1, 33, 64), (1, 96, 65),       # tails of a 64-column block
    (1, 576, 2049), (2, 512, 300), (2, 513, 1),           # a span boundary; the int32 chunk
    (3, 1537, 100), (4, 64, 257), (5, 101, 77),           # odd K; 3-4 rows; a row group of 1
    (16, 576, 1536),                                      # SmolLM2's gate/up at batch 16
])
def test_kernel_equals_the_exact_integer_product(rows, k, n):
    rng = np.random.default_rng(rows * 1000 + k + n)
    x, values, scale = _case(rng, rows, k, n)
    y = np.asarray(jax.jit(kmod.int8_matvec)(jnp.asarray(x), jnp.asarray(values),
                                             jnp.asarray(scale)), np.float64)
    ref = _exact(x, values, scale)
    assert y.shape == (rows, n)
    tol = 1e-6 * np.abs(ref).max(axis=1, keepdims=True) + 1e-30
    assert np.all(np.abs(y - ref) <= tol)
    # and the jnp reference of the module agrees
    jref = np.asarray(kmod.int8_matvec_reference(*kmod.quantize_rows_int16(jnp.asarray(x)),
                                                 jnp.asarray(values), jnp.asarray(scale)))
    if k * 32767 * 127 < 2**31:  # the jnp reference sums in int32
        np.testing.assert_allclose(y, jref, rtol=0, atol=float(tol.max()))


@needs_kernel
def test_kernel_sums_past_int32_without_overflow():
    """Every product at its largest (|x| = 32767, |w| = 127) over K = 1537: an int32 sum
    over the row would overflow 5x; the kernel's chunks of 512 do not."""
    k, n = 1537, 70
    x = np.ones((2, k), np.float32)
    x[1] = -1.0
    values = np.full((k, n), 127, np.int8)
    values[:, 1::2] = -127
    scale = np.ones(n, np.float32)
    y = np.asarray(kmod.int8_matvec(jnp.asarray(x), jnp.asarray(values), jnp.asarray(scale)),
                   np.float64)
    ref = _exact(x, values, scale)
    assert np.abs(ref).max() > 2**31 / 32767  # the int32 bound is really crossed
    np.testing.assert_allclose(y, ref, rtol=1e-6)


@needs_kernel
def test_kernel_rows_zero_and_non_finite():
    rng = np.random.default_rng(3)
    x, values, scale = _case(rng, 4, 40, 90)
    x[1] = 0.0
    x[2, 7] = np.nan
    x[3, 0] = np.inf
    y = np.asarray(kmod.int8_matvec(jnp.asarray(x), jnp.asarray(values), jnp.asarray(scale)))
    np.testing.assert_allclose(y[0], _exact(x[:1], values, scale)[0], rtol=1e-6)
    np.testing.assert_array_equal(y[1], 0.0)
    assert np.isnan(y[2]).all() and np.isnan(y[3]).all()


@needs_kernel
def test_kernel_under_vmap_and_refused_shapes():
    rng = np.random.default_rng(4)
    x, values, scale = _case(rng, 6, 48, 80)
    xs = jnp.asarray(x.reshape(3, 2, 48))
    y = jax.vmap(lambda a: kmod.int8_matvec(a, jnp.asarray(values), jnp.asarray(scale)))(xs)
    one = kmod.int8_matvec(jnp.asarray(x), jnp.asarray(values), jnp.asarray(scale))
    np.testing.assert_array_equal(np.asarray(y).reshape(6, 80), np.asarray(one))
    empty = kmod.int8_matvec(jnp.zeros((0, 48)), jnp.asarray(values), jnp.asarray(scale))
    assert empty.shape == (0, 80)
    with pytest.raises(ValueError, match="do not form a product"):
        kmod.int8_matvec(jnp.asarray(x), jnp.asarray(values[:40]), jnp.asarray(scale))
    with pytest.raises(ValueError, match="do not form a product"):
        kmod.int8_matvec(jnp.asarray(x), jnp.asarray(values, jnp.int32), jnp.asarray(scale))
    with pytest.raises(ValueError, match=r"x \[rows, K\]"):
        kmod.int8_matvec(jnp.asarray(x[0]), jnp.asarray(values), jnp.asarray(scale))


# ----------------------------------------------------------------------------- grouped


def _exact_grouped(x, values, scale, zero):
    """The grouped product in int64 / float64, and a bound on the kernel's float32 error:
    it adds G group terms (each an exact integer sum times a float16 factor), so its
    recursive float32 sum is within (G + 2) * 2**-24 * sum |terms| of the exact one."""
    xq, xs = (np.asarray(a) for a in kmod.quantize_rows_int16(jnp.asarray(x)))
    rows, k = xq.shape
    groups, n = scale.shape
    xg = xq.astype(np.int64).reshape(rows, groups, k // groups)
    acc = np.einsum("rgk,gkn->rgn", xg, values.astype(np.int64).reshape(groups, -1, n))
    terms = (acc * scale.astype(np.float64)
             + xg.sum(-1)[..., None] * zero.astype(np.float64)) * xs[:, None, None]
    bound = (groups + 2) * 2.0**-24 * (np.abs(acc * scale.astype(np.float64))
                                       + np.abs(xg.sum(-1)[..., None] * zero.astype(np.float64))
                                       ).sum(1) * xs[:, None]
    return terms.sum(1), bound


def _grouped_case(rng, rows, k, n, group):
    x = rng.standard_normal((rows, k)).astype(np.float32)
    values = rng.integers(-128, 128, (k, n)).astype(np.int8)
    scale = rng.uniform(0.01, 2.0, (k // group, n)).astype(np.float16)
    zero = rng.uniform(-3.0, 3.0, (k // group, n)).astype(np.float16)
    return x, values, scale, zero


@needs_kernel
@pytest.mark.parametrize("rows,k,n,group", [
    (1, 2, 1, 2), (1, 64, 63, 32), (1, 96, 65, 32),         # tails of a 64-column block
    (1, 576, 2049, 32), (2, 1024, 300, 512),                # a span boundary; the largest group
    (3, 1536, 100, 64), (4, 64, 257, 2), (5, 96, 77, 32),   # 3-5 rows; the smallest group
    (16, 576, 1536, 32),                                    # SmolLM2's gate/up at batch 16
])
def test_grouped_kernel_equals_the_exact_product(rows, k, n, group):
    rng = np.random.default_rng(rows * 1000 + k + n + group)
    x, values, scale, zero = _grouped_case(rng, rows, k, n, group)
    args = [jnp.asarray(a) for a in (x, values, scale, zero)]
    y = np.asarray(jax.jit(kmod.int8_matvec_grouped)(*args), np.float64)
    ref, bound = _exact_grouped(x, values, scale, zero)
    assert y.shape == (rows, n)
    assert np.all(np.abs(y - ref) <= bound + 1e-30)
    jref = np.asarray(kmod.int8_matvec_grouped_reference(
        *kmod.quantize_rows_int16(args[0]), *args[1:]), np.float64)
    assert np.all(np.abs(jref - ref) <= bound + 1e-30)


@needs_kernel
def test_grouped_kernel_largest_group_sums_do_not_overflow():
    """|x| = 32767 and q = -128 over a group of 512: 512 * 32767 * 128 < 2**31, the bound
    the kernel's per-group int32 sums rely on."""
    k, n = 1024, 40
    x = np.ones((1, k), np.float32)
    values = np.full((k, n), -128, np.int8)
    scale = np.ones((2, n), np.float16)
    zero = np.zeros((2, n), np.float16)
    y = np.asarray(kmod.int8_matvec_grouped(*(jnp.asarray(a) for a in (x, values, scale,
                                                                       zero))), np.float64)
    ref, _ = _exact_grouped(x, values, scale, zero)
    np.testing.assert_allclose(y, ref, rtol=1e-6)
    assert abs(ref[0, 0]) / 2 / (1 / 32767) > 2**30  # each group's sum is near 2**31


@needs_kernel
def test_grouped_kernel_refused_shapes():
    rng = np.random.default_rng(5)
    x, values, scale, zero = (jnp.asarray(a) for a in _grouped_case(rng, 2, 96, 40, 32))
    with pytest.raises(ValueError, match="must be even"):  # groups of 3
        kmod.int8_matvec_grouped(x, values, jnp.ones((32, 40)), jnp.ones((32, 40)))
    with pytest.raises(ValueError, match="must be even"):  # a group of 1024 > 512
        kmod.int8_matvec_grouped(jnp.ones((1, 1024)), jnp.ones((1024, 4), jnp.int8),
                                 jnp.ones((1, 4)), jnp.ones((1, 4)))
    with pytest.raises(ValueError, match="scale and zero"):
        kmod.int8_matvec_grouped(x, values, scale, zero[:, :39])
    empty = kmod.int8_matvec_grouped(jnp.zeros((0, 96)), values, scale, zero)
    assert empty.shape == (0, 40)


def test_switch_and_missing_compiler_leave_the_xla_form(monkeypatch, tmp_path):
    """GSM_JAX_CPU_KERNELS=0, or no C++ compiler: `available()` is False and says why;
    `linear` then keeps its XLA form (the digit products), with the same result bound."""
    monkeypatch.setenv(kmod.ENV_SWITCH, "0")
    assert not kmod.available() and kmod.unavailable_reason() == f"{kmod.ENV_SWITCH}=0"
    monkeypatch.delenv(kmod.ENV_SWITCH)
    monkeypatch.setattr(kmod, "_state", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.warns(RuntimeWarning, match="int8 kernel is unavailable"):
        assert not kmod.available()
    assert "no C++ compiler" in kmod.unavailable_reason()
    assert not kmod.possible()  # a saved program's key says so too
    # a CPU without AVX-512: named before any compiler runs
    monkeypatch.setattr(kmod, "_state", {})
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(kmod, "_cpu_id", lambda: "model name : old flags : fpu sse2 avx2")
    with pytest.warns(RuntimeWarning):
        assert not kmod.available()
    assert "lacks avx512f, avx512bw" in kmod.unavailable_reason() and not kmod.possible()
    from gsm_jax.models.linear import linear
    from gsm_jax.pallas_kernels.quant_reference import quantize_weight

    rng = np.random.default_rng(9)
    w = QuantizedWeight(*quantize_weight(jnp.asarray(rng.standard_normal((32, 24)),
                                                     jnp.float32)), "w8a16")
    x = jnp.asarray(rng.standard_normal((1, 32)), jnp.float32)
    fresh = jax.jit(lambda a, b: linear(a, b))  # jit caches per function: trace anew
    y = fresh(x, w)
    ref = np.asarray(x, np.float64) @ np.asarray(w.dequantize(), np.float64)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5)
    hlo = fresh.lower(x, w).as_text()
    assert kmod.TARGET not in hlo
    # a grouped weight: the product with its dequantized weight
    from gsm_jax.pallas_kernels.quant_reference import quantize_weight_grouped

    values, scale, zero = quantize_weight_grouped(
        jnp.asarray(rng.standard_normal((32, 24)), jnp.float32), 8)
    wg = QuantizedWeight(values, scale, "w8a16", zero=zero)
    fresh = jax.jit(lambda a, b: linear(a, b))
    ref = np.asarray(x, np.float64) @ np.asarray(wg.dequantize(), np.float64)
    np.testing.assert_allclose(np.asarray(fresh(x, wg)), ref, rtol=1e-5, atol=1e-5)
    assert kmod.TARGET not in fresh.lower(x, wg).as_text()


@needs_kernel
def test_w8a16_decode_product_is_the_custom_call():
    """Decode-sized w8a16 products on CPU lower to the kernel; prefill-sized ones do not."""
    from gsm_jax.models.linear import W8A16_KERNEL_MAX_ROWS, linear
    from gsm_jax.pallas_kernels.quant_reference import quantize_weight, quantize_weight_grouped

    w = QuantizedWeight(*quantize_weight(jnp.ones((32, 24), jnp.float32)), "w8a16")
    fresh = jax.jit(lambda a, b: linear(a, b))
    small = fresh.lower(jnp.ones((W8A16_KERNEL_MAX_ROWS, 32)), w).as_text()
    large = fresh.lower(jnp.ones((W8A16_KERNEL_MAX_ROWS + 1, 32)), w).as_text()
    assert kmod.TARGET in small and kmod.TARGET not in large
    assert kmod.TARGET_GROUPED not in small
    values, scale, zero = quantize_weight_grouped(jnp.ones((32, 24), jnp.float32), 16)
    wg = QuantizedWeight(values, scale, "w8a16", zero=zero)
    small = fresh.lower(jnp.ones((1, 32)), wg).as_text()
    large = fresh.lower(jnp.ones((W8A16_KERNEL_MAX_ROWS + 1, 32)), wg).as_text()
    assert kmod.TARGET_GROUPED in small and kmod.TARGET not in large


# ----------------------------------------------------------------------------- int8 head


def _untied(p: ModelParams, seed: int = 11) -> ModelParams:
    cfg = dataclasses.replace(p.config, tie_word_embeddings=False)
    rng = np.random.default_rng(seed)
    head = jnp.asarray(rng.normal(0, 0.05, (cfg.hidden_size, cfg.vocab_size)), jnp.float32)
    return dataclasses.replace(p, config=cfg, weights={**p.weights, "lm_head": head})


@pytest.mark.parametrize("make", ["llama_tied", "llama_untied", "gemma3"])
def test_int8_head(make):
    """head=True: "lm_head" becomes an int8 weight-only QuantizedWeight [D, V] with one
    scale per vocabulary entry; a tied model's lookup table is rounded to the same grid, so
    embedding and head stay one matrix. Prefill and decode logits equal those of the
    dequantized float model (the int16 rounding of decode rows aside), and the head
    alone moves the logits by no more than its quantization bound."""
    base = {"llama_tied": lambda: tiny_gsm_llama(),
            "llama_untied": lambda: _untied(tiny_gsm_llama()),
            "gemma3": tiny_gemma3}[make]()
    tied = "lm_head" not in base.weights
    q = quantize(base, "w8a16", head=True)
    head = q.weights["lm_head"]
    cfg = base.config
    assert isinstance(head, QuantizedWeight) and head.scheme == "w8a16"
    assert head.values.dtype == jnp.int8
    assert head.values.shape == (cfg.hidden_size, cfg.vocab_size)
    assert head.scale.shape == (cfg.vocab_size,)
    assert q.extra.get("quantized_head") is True
    table = base.weights["embed"] if tied else base.weights["lm_head"].T
    if tied:  # one matrix: the lookup rows are the head's columns
        np.testing.assert_array_equal(np.asarray(q.weights["embed"]),
                                      np.asarray(head.dequantize().T))
    else:
        np.testing.assert_array_equal(np.asarray(q.weights["embed"]),
                                      np.asarray(base.weights["embed"]))
    # the head's rounding is bounded per vocabulary entry: |dw| <= scale / 2
    err = np.abs(np.asarray(head.dequantize().T) - np.asarray(table, np.float32))
    assert np.all(err <= np.asarray(head.scale)[:, None] / 2 * (1 + 1e-6))
    rows = [[5, 9, 17, 4, 22], [7, 8]]
    deq = dequantize(q)
    np.testing.assert_allclose(np.asarray(gsm_jax.forward(q, rows)),
                               np.asarray(gsm_jax.forward(deq, rows)), rtol=1e-4, atol=1e-4)
    toks, logits = gsm_jax.generate_tokens(q, rows, max_new_tokens=5, eos_ids=[],
                                           return_logits=True)
    ref_toks, ref_logits = gsm_jax.generate_tokens(deq, rows, max_new_tokens=5, eos_ids=[],
                                                   return_logits=True)
    for a, b in zip(logits, ref_logits, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-3)
    for a, b in zip(toks, ref_toks, strict=True):
        np.testing.assert_array_equal(a, b)


def test_int8_head_refused_where_not_implemented():
    with pytest.raises(UnsupportedModelError, match="head=True"):
        quantize(tiny_dsv4(), "w8a16", head=True)



def test_int8_head_saves_and_loads(tmp_path):
    """gsm_jax.save / load keep the int8 head (a QuantizedWeight) and its logits."""
    q = quantize(tiny_gsm_llama(), "w8a16", head=True)
    gsm_jax.save(q, tmp_path / "m")
    back = gsm_jax.load(tmp_path / "m")
    assert isinstance(back.weights["lm_head"], QuantizedWeight)
    assert back.extra.get("quantized_head") is True
    rows = [[5, 6, 7, 8]]
    np.testing.assert_array_equal(np.asarray(gsm_jax.forward(back, rows)),
                                  np.asarray(gsm_jax.forward(q, rows)))
