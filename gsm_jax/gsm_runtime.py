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

from gsm_jax.config import ConfigWatcher, GSMConfig, resolve_mask, row_enabled
from gsm_jax.errors import GSMConfigError
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


def gsm_inputs_for_batch(gsm: Any, num_layers: int, batch_size: int,
                         total_tokens: Sequence[int],
                         request_ids: Sequence[Any] | None = None) -> GSMInputs:
    """GSMInputs for a batch whose first len(total_tokens) rows are real requests.

    Padding rows (bucketed batch) are never smoothed.
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
        max_window=cfg.max_window,
        precision=cfg.precision,
        impl=resolved_kernel_impl(),
    )


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
