"""gsm-jax: GSM inference-time activation smoothing for LLMs, in JAX/Flax with Pallas kernels.

    import gsm_jax
    params = gsm_jax.load("smollm2-135m")
    gsm_jax.generate(params, ["The capital of France is"], max_new_tokens=32)
    gsm_jax.generate(params, prompts, gsm=gsm_jax.GSMConfig(target_layers="all"))

Where a token's activations get smoothed: `models/gsm_sites.py` (called at the
`attn_out` and `ffn_mid` sites of each model family's layer), running the filter
of `gsm_jax/smoothing.py` or its Pallas kernels in `pallas_kernels/`.

Compilation: ``gsm_jax.enable_compilation_cache()`` turns JAX's persistent compilation cache on
(``~/.cache/gsm-jax/jax/<cpu>``; the `gsm-jax` command does it itself). Importing the package does
not: the setting is process-wide (`gsm_jax/compile_cache.py`).
"""

from typing import TYPE_CHECKING

from gsm_jax.errors import (
    GSMConfigError,
    GSMJaxError,
    InvalidInputError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)

# The public API, imported on first use: `import gsm_jax` loads no jax (4 ms instead of
# ~2 s); `gsm_jax.generate` and `from gsm_jax import generate` import their module then.
_LAZY = {
    "enable_compilation_cache": ("gsm_jax.compile_cache", "enable_compilation_cache"),
    "ConfigWatcher": ("gsm_jax.config", "ConfigWatcher"),
    "GSMConfig": ("gsm_jax.config", "GSMConfig"),
    "describe": ("gsm_jax.config", "describe"),
    "forward": ("gsm_jax.generation", "forward"),
    "generate": ("gsm_jax.generation", "generate"),
    "generate_tokens": ("gsm_jax.generation", "generate_tokens"),
    "with_kv_cache_dtype": ("gsm_jax.generation", "with_kv_cache_dtype"),
    "kernel_impl": ("gsm_jax.gsm_runtime", "kernel_impl"),
    "set_kernel_impl": ("gsm_jax.gsm_runtime", "set_kernel_impl"),
    "DEFAULT_MODEL": ("gsm_jax.loading", "DEFAULT_MODEL"),
    "REGISTERED_MODELS": ("gsm_jax.loading", "REGISTERED_MODELS"),
    "load": ("gsm_jax.loading", "load"),
    "save": ("gsm_jax.loading", "save"),
    "ModelParams": ("gsm_jax.params", "ModelParams"),
    "smooth": ("gsm_jax.smoothing", "smooth"),
    "profile": ("gsm_jax.workflow.profile", "profile"),
    "calibrate": ("gsm_jax.workflow.calibrate", "calibrate"),
    "evaluate": ("gsm_jax.workflow.evaluate", "evaluate"),
    "bench": ("gsm_jax.workflow.bench", "bench"),
    "quantize": ("gsm_jax.quant", "quantize"),
    "shard": ("gsm_jax.sharding", "shard"),
    "plan": ("gsm_jax.planner", "plan"),
    "speculative_generate": ("gsm_jax.speculative", "speculative_generate"),
    "dspark_generate": ("gsm_jax.speculative", "dspark_generate"),
}

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from gsm_jax.compile_cache import enable_compilation_cache
    from gsm_jax.config import ConfigWatcher, GSMConfig, describe
    from gsm_jax.generation import forward, generate, generate_tokens, with_kv_cache_dtype
    from gsm_jax.gsm_runtime import kernel_impl, set_kernel_impl
    from gsm_jax.loading import DEFAULT_MODEL, REGISTERED_MODELS, load, save
    from gsm_jax.params import ModelParams


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gsm_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "DEFAULT_MODEL",
    "REGISTERED_MODELS",
    "bench",
    "calibrate",
    "evaluate",
    "profile",
    "quantize",
    "plan",
    "shard",
    "speculative_generate",
    "dspark_generate",
    "ConfigWatcher",
    "GSMConfig",
    "GSMConfigError",
    "GSMJaxError",
    "InvalidInputError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelParams",
    "UnsupportedModelError",
    "describe",
    "enable_compilation_cache",
    "forward",
    "generate",
    "generate_tokens",
    "with_kv_cache_dtype",
    "kernel_impl",
    "load",
    "save",
    "set_kernel_impl",
    "smooth",
]
__version__ = "0.1.0"
