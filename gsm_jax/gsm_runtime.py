"""From a user's GSM config to the arrays the jitted model step takes (`GSMInputs`).

Host-side decisions (which layers and sites, short-request bypass, rollout by
request id) become arrays here, so none of them recompiles the model. The
kernel implementation is the one static choice: "auto" (Pallas on GPU/TPU,
fused XLA on CPU), "xla", "pallas", or "pallas_interpret" (Pallas kernels in
interpret mode, so CPU tests run the model through them). Set it with
`set_kernel_impl` or the environment variable GSM_JAX_KERNEL.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import GSMConfigError
from gsm_jax.gsm.resolve import resolve_mask, row_enabled
from gsm_jax.gsm.schema import GSMConfig
from gsm_jax.gsm.watcher import ConfigWatcher
from gsm_jax.models.gsm_sites import GSMInputs

KERNEL_IMPLS = ("auto", "xla", "pallas", "pallas_interpret")
_kernel_impl = os.environ.get("GSM_JAX_KERNEL", "auto")


def set_kernel_impl(impl: str) -> None:
    """Choose how the GSM filter runs inside the model (see the module docstring)."""
    global _kernel_impl
    if impl not in KERNEL_IMPLS:
        raise GSMConfigError(f"kernel impl {impl!r} is unknown; choose from {KERNEL_IMPLS}")
    _kernel_impl = impl


@contextlib.contextmanager
def kernel_impl(impl: str) -> Iterator[None]:
    """Temporarily choose the GSM kernel implementation."""
    previous = _kernel_impl
    set_kernel_impl(impl)
    try:
        yield
    finally:
        set_kernel_impl(previous)


def as_gsm_config(gsm: Any) -> GSMConfig:
    """Accept a GSMConfig, a ConfigWatcher (its current config), a dict or a config file path."""
    if isinstance(gsm, GSMConfig):
        return gsm
    if isinstance(gsm, ConfigWatcher):
        return gsm.config
    if isinstance(gsm, Mapping):
        return GSMConfig.from_dict(gsm)
    if isinstance(gsm, str | os.PathLike):
        return GSMConfig.from_file(Path(gsm))
    raise GSMConfigError(
        f"gsm must be a GSMConfig, ConfigWatcher, dict or config path, not {type(gsm).__name__}"
    )


def ring_rows(cfg: Any, total_tokens: Sequence[int]) -> int:
    """The ring size a call whose rows end at `total_tokens` needs: the largest window
    any of its positions can use (a fixed window, or the adaptive clamp((p+1)//16, 4,
    max_window) at the longest row), rounded up to a power of two >= 8 (few compiled
    sizes) and at most `max_window`. With it the filter reads and keeps exactly what it
    would with the full `max_window` rows: every window fits, nothing else is read."""
    if cfg.window_size == "adaptive":
        need = min(max(max(total_tokens, default=1) // 16, 4), cfg.max_window)
    else:
        need = min(int(cfg.window_size), cfg.max_window)
    return min(cfg.max_window, max(8, 1 << (max(need, 1) - 1).bit_length()))


def gsm_inputs_for_batch(gsm: Any, num_layers: int, batch_size: int,
                         total_tokens: Sequence[int],
                         request_ids: Sequence[Any] | None = None,
                         fit_ring: bool = False) -> GSMInputs:
    """GSMInputs for a batch whose first len(total_tokens) rows are real requests.

    Padding rows (bucketed batch) are never smoothed. `fit_ring`: size the ring buffers
    for this call's windows (`ring_rows`) instead of `max_window` - for one-shot calls
    (generate, forward) whose lengths are known; the serving engine sizes its ring once,
    for its max_len (`ring_rows(cfg, [max_len])`), so a live config change never
    needs another compiled size.
    """
    cfg = as_gsm_config(gsm)
    mask = resolve_mask(cfg, num_layers)
    strength = np.where(mask & cfg.enable, cfg.smooth_strength, 0.0).astype(np.float32)
    rows = np.zeros((batch_size,), np.float32)
    rows[: len(total_tokens)] = row_enabled(cfg, request_ids, list(total_tokens))
    window = 0 if cfg.window_size == "adaptive" else int(cfg.window_size)
    return GSMInputs(
        strength=jnp.asarray(strength),
        row_enabled=jnp.asarray(rows),
        window=jnp.asarray(window, jnp.int32),
        protect_first=jnp.asarray(cfg.protect_first, jnp.int32),
        max_window=ring_rows(cfg, total_tokens) if fit_ring else cfg.max_window,
        precision=resolved_precision(cfg.precision),
        impl=resolved_kernel_impl(),
    )


def resolved_precision(precision: str) -> str:
    """"auto" -> the filter arithmetic measured fastest on the default backend."""
    if precision != "auto":
        return precision
    return "f32" if jax.default_backend() == "cpu" else "bf16"


def resolved_kernel_impl() -> str:
    """"auto" resolved for the default backend when the model is traced.

    Resolving here, rather than with `lax.platform_dependent` inside the step,
    keeps the other platform's branch out of the CPU program: XLA:CPU turned
    the small per-layer conditionals into selects that evaluated both branches
    and copied the GSM ring stack every layer. To lower for another platform
    (e.g. `jax.export` for CUDA from a CPU host) choose "pallas" explicitly.
    """
    if _kernel_impl != "auto":
        return _kernel_impl
    return "xla" if jax.default_backend() == "cpu" else "pallas"
