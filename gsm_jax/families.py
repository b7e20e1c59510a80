"""Model families: each is a module with the same entry points.

`init_cache`, `prefill`, `decode_step`, `forward` and `weights_from_hf`, plus a
config class with `from_hf_config` and a `family` name. Generation and the
workflow tools only talk to this interface.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from gsm_jax.errors import UnsupportedModelError

_FAMILY_MODULES = {
    "llama": "gsm_jax.models.llama",
    "deepseek_v4": "gsm_jax.models.deepseek_v4",
    "gemma3": "gsm_jax.models.gemma3",
}
# Hugging Face `model_type` -> family
HF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "llama",
    "mistral": "llama",
    "deepseek_v4": "deepseek_v4",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}


def family_module(family: str) -> ModuleType:
    if family not in _FAMILY_MODULES:
        raise UnsupportedModelError(
            f"unknown model family {family!r}; known: {sorted(_FAMILY_MODULES)}"
        )
    return importlib.import_module(_FAMILY_MODULES[family])


def family_for_model_type(model_type: str | None) -> str:
    if model_type not in HF_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {sorted(HF_MODEL_TYPES)}"
        )
    return HF_MODEL_TYPES[model_type]
