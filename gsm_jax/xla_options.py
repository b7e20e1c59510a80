"""`model_jit`: `jax.jit` with the compiler options every program that runs a model uses.

XLA:CPU's default scheduler orders independent work for concurrency. A model whose
layers are separate arrays (`models.llama.unstack_layers`, what `gsm_jax.load`
returns) has weight-only work that depends on no activation, the int8 -> float
converts of w8a16; that scheduler runs all of them first, so every converted layer
is alive at once (500 MB of temporaries for SmolLM2: decode at batch 16 229 ms
instead of 131 ms per step). The memory-optimizing scheduler runs each convert
next to its product. Other backends ignore the option (it is an XLA:CPU field of
XLA's DebugOptions, which every backend parses).
"""

from __future__ import annotations

import functools
from typing import Any

import jax

MODEL_COMPILER_OPTIONS: dict[str, Any] = {
    "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
}


def model_jit(fun=None, **kwargs):
    """`jax.jit(fun, **kwargs)` plus `MODEL_COMPILER_OPTIONS`; also usable as
    `functools.partial(model_jit, static_argnames=...)` or a bare decorator."""
    if fun is None:
        return functools.partial(model_jit, **kwargs)
    options = {**MODEL_COMPILER_OPTIONS, **(kwargs.pop("compiler_options", None) or {})}
    return jax.jit(fun, compiler_options=options, **kwargs)
