"""A few float32 rows times an int8 weight on CPU, as one XLA custom call (jax.ffi).

    y[r, n] = scale[n] * sum_k x[r, k] * values[k, n]
or, for a grouped weight (groups of g consecutive k with a float16 scale and offset per
column, `int8_matvec_grouped`),
    y[r, n] = sum_k x[r, k] * (scale[k // g, n] * values[k, n] + zero[k // g, n])

This is w8a16's decode product on CPU (`models/linear.py`). XLA:CPU has no fast form
of it: its one-row product with an int8 (or bf16) weight widens the whole weight first,
and its int8 GEMM reads int8 no faster than its matrix-vector product reads float32
(docs/performance_notes.md, "16-bit products accumulate in float32" and "w8a16 on CPU:
the int8 weight read once"). `int8_matvec_cpu.cc` reads the int8 weight once, as stored,
widens it in registers and splits the columns across XLA's intra-op thread pool.

It needs AVX-512 (F, BW and VL; VNNI when present). The C++ source is compiled at first use
with the host's C++ compiler (`$CXX`, else `g++`, `-O3 -march=native`: it runs on the
machine that built it) into ``$XDG_CACHE_HOME/gsm-jax/kernels`` (``~/.cache/...``),
keyed by the source, the compiler, the CPU and jaxlib, and registered as the CPU FFI
targets ``gsm_int8_matvec`` and ``gsm_int8_matvec_grouped``. On a CPU without AVX-512,
without a compiler, or with ``GSM_JAX_CPU_KERNELS=0``, `available()` is False and callers
keep their XLA form (a failed build says so once, as a RuntimeWarning).
`int8_matvec_reference` and `int8_matvec_grouped_reference` are the plain jnp definitions
the kernel is tested against (tests/test_int8_matvec_cpu.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp

TARGET = "gsm_int8_matvec"
TARGET_GROUPED = "gsm_int8_matvec_grouped"  # begins with TARGET (ensure_registered's test)
MAX_GROUP = 512  # the kernel's integer sums run per group: exact in int32 up to 512 k
SOURCE = Path(__file__).with_name("int8_matvec_cpu.cc")
ENV_SWITCH = "GSM_JAX_CPU_KERNELS"
# /proc/cpuinfo names; VNNI is used if present
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl")

_lock = threading.Lock()
_state: dict = {}  # "ok": bool, "error": str, "library": path


QMAX16 = 32767


def quantize_rows_int16(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-row symmetric int16: (q int16 [rows, K], scale float32 [rows]) with
    x ~= q * scale, scale = absmax / 32767 (1 for an all-zero row), |x - q * scale| <=
    scale / 2. A row holding NaN or inf gets a NaN scale, so its products stay
    non-finite as float ones would."""
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(absmax > 0, absmax / QMAX16, 1.0)
    q = jnp.clip(jnp.round(x / scale[:, None]), -QMAX16, QMAX16)
    q = jnp.where(jnp.isfinite(q), q, 0.0).astype(jnp.int16)
    return q, jnp.where(jnp.isfinite(absmax), scale, jnp.nan)


def int8_matvec_reference(xq: jax.Array, x_scale: jax.Array, values: jax.Array,
                          scale: jax.Array) -> jax.Array:
    """(xq @ values) * x_scale * scale: the integer product exact (int32; int64 where the
    int32 sum could overflow), then scaled in float32."""
    acc = jax.lax.dot_general(xq.astype(jnp.int32), values.astype(jnp.int32),
                              (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * x_scale[:, None] * scale.astype(jnp.float32)


def int8_matvec_grouped_reference(xq: jax.Array, x_scale: jax.Array, values: jax.Array,
                                  scale: jax.Array, zero: jax.Array) -> jax.Array:
    """The grouped product: per group g, (xq_g @ values_g) * scale_g + sum(xq_g) * zero_g
    (integer sums exact in int32), summed over groups in float32, times x_scale."""
    rows, k = xq.shape
    groups, n = scale.shape
    xg = xq.astype(jnp.int32).reshape(rows, groups, k // groups)
    wg = values.astype(jnp.int32).reshape(groups, k // groups, n)
    acc = jnp.einsum("rgk,gkn->rgn", xg, wg, preferred_element_type=jnp.int32)
    y = (acc.astype(jnp.float32) * scale.astype(jnp.float32)
         + xg.sum(-1).astype(jnp.float32)[..., None] * zero.astype(jnp.float32)).sum(1)
    return y * x_scale[:, None]


@functools.lru_cache(maxsize=1)
def _cpu_id() -> str:
    """The CPU's model name and flags (read once: saved programs' keys ask on every call)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line
                if line.startswith("flags"):
                    break
    except OSError:
        flags = platform.processor()
    return flags


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gsm-jax" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def _build() -> Path:
    """The shared library for this source, compiler, CPU and jaxlib, built if absent."""
    import jaxlib

    missing = [f for f in REQUIRED_CPU_FLAGS if f not in _cpu_id().split()]
    if missing:
        raise RuntimeError(f"this CPU lacks {', '.join(missing)}, which the kernel needs")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (set CXX or install g++)")
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
    key = hashlib.sha256("\0".join([
        SOURCE.read_text(), cxx, " ".join(flags), _cpu_id(), jaxlib.__version__,
    ]).encode()).hexdigest()[:20]
    out = cache_dir() / f"int8_matvec_{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(tmp_out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp_out, out)  # atomic: a concurrent builder finds a whole file
    return out


def available() -> bool:
    """True when the kernel is built and registered (building it on the first call);
    False on a CPU without AVX-512 (F, BW, VL), without a C++ compiler, or with
    GSM_JAX_CPU_KERNELS=0."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    with _lock:
        if "ok" not in _state:
            try:
                path = _build()
                lib = ctypes.cdll.LoadLibrary(str(path))
                jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.GsmInt8Matvec),
                                            platform="cpu")
                jax.ffi.register_ffi_target(TARGET_GROUPED,
                                            jax.ffi.pycapsule(lib.GsmInt8MatvecGrouped),
                                            platform="cpu")
                _state.update(ok=True, library=str(path))
            except (OSError, RuntimeError, AttributeError) as e:
                _state.update(ok=False, error=str(e))
                # said once per process: w8a16 decode then runs XLA's slower form
                warnings.warn(f"gsm_jax: the CPU int8 kernel is unavailable ({e}); w8a16 "
                              f"products keep their XLA form (slower at decode). Set "
                              f"{ENV_SWITCH}=0 to silence this.", RuntimeWarning, stacklevel=2)
        return _state["ok"]


def possible() -> bool:
    """Whether `available()` can be True here, without building: the switch is on, the CPU
    has AVX-512 (F, BW, VL) and a C++ compiler is on the PATH (or the kernel is already
    registered). Part of a saved program's key (`gsm_jax.compile_cache`): a program traced
    with the kernel and one traced without are different programs."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    cpu = _cpu_id().split()
    return bool(_state.get("ok")) or (all(f in cpu for f in REQUIRED_CPU_FLAGS)
                                      and _compiler() is not None)


def ensure_registered(blob: bytes) -> None:
    """Before a saved program or executable runs: if it calls the kernel, build and register
    it; RuntimeError, naming why, when it calls the kernel and the kernel cannot be had."""
    if TARGET.encode() in blob and not available():
        raise RuntimeError(f"it calls the int8 kernel, which is unavailable here "
                           f"({unavailable_reason()})")


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True or was not asked yet)."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    return _state.get("error")


def int8_matvec(x: jax.Array, values: jax.Array, scale: jax.Array) -> jax.Array:
    """x [rows, K] float @ values [K, N] int8, times scale [N] -> [rows, N] float32 on the
    custom call (check `available()` first). x is rounded to int16 per row first
    (`quantize_rows_int16`: error at most 1/65534 of the row's largest element)."""
    if x.ndim != 2 or values.ndim != 2 or scale.ndim != 1:
        raise ValueError(f"int8_matvec: x [rows, K], values [K, N], scale [N]; got "
                         f"{x.shape}, {values.shape}, {scale.shape}")
    if values.dtype != jnp.int8 or x.shape[1] != values.shape[0] \
            or scale.shape[0] != values.shape[1]:
        raise ValueError(f"int8_matvec: shapes {x.shape} @ {values.shape} ({values.dtype}) "
                         f"* {scale.shape} do not form a product")
    xq, x_scale = quantize_rows_int16(x)
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], values.shape[1]),
                                                         jnp.float32),
                            vmap_method="sequential")
    return call(xq, x_scale, values, scale.astype(jnp.float32))


def int8_matvec_grouped(x: jax.Array, values: jax.Array, scale: jax.Array,
                        zero: jax.Array) -> jax.Array:
    """x [rows, K] float @ the grouped weight scale[k // g] * values[k] + zero[k // g]
    (values int8 [K, N]; scale, zero float16 [G, N], g = K / G even and at most 512)
    -> [rows, N] float32 on the custom call (check `available()` first). x is rounded to
    int16 per row first, as in `int8_matvec`."""
    if x.ndim != 2 or values.ndim != 2 or scale.ndim != 2 or zero.shape != scale.shape:
        raise ValueError(f"int8_matvec_grouped: x [rows, K], values [K, N], scale and zero "
                         f"[G, N]; got {x.shape}, {values.shape}, {scale.shape}, {zero.shape}")
    k, n = values.shape
    groups = scale.shape[0]
    if (values.dtype != jnp.int8 or x.shape[1] != k or scale.shape[1] != n or groups < 1
            or k % groups or (k // groups) % 2 or k // groups > MAX_GROUP):
        raise ValueError(f"int8_matvec_grouped: shapes {x.shape} @ {values.shape} "
                         f"({values.dtype}) with scales {scale.shape} do not form a product "
                         f"(the group K / G must be even, at most {MAX_GROUP}, and divide K)")
    xq, x_scale = quantize_rows_int16(x)
    call = jax.ffi.ffi_call(TARGET_GROUPED, jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(xq, x_scale, values, scale.astype(jnp.float16), zero.astype(jnp.float16))
