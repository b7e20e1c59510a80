"""Model families: the registry.

A family is one module (`models/<family>.py`) with the same entry points (`init_cache`,
`prefill`, `decode_step`, `forward`, `weights_from_hf`, ... and a `CONFIG_CLASS` with
`from_hf_config` and a `family` name) and, in its "family contract" section, what the
runtime needs to know about it: its name (`FAMILY`), the Hugging Face `model_type`s it
loads (`HF_MODEL_TYPES`), its weights' logical axes (`LOGICAL_AXES`) and optional hooks
(docs/adding_a_family.md lists them). Generation, sharding, quantization, the planner,
speculative decoding and the workflow tools talk to this interface only: registering a
family is one line in `FAMILY_MODULES`.

Modules are imported on first use, in registration order, and only as far as a lookup
needs (`import gsm_jax` imports none of them).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from gsm_jax.errors import UnsupportedModelError

# Every KV-cache format a user may name (`kv_cache_dtype=`, `--kv-cache-dtype`); which
# family takes which: `models.common.config_with_kv_cache_dtype`
KV_CACHE_KINDS = ("auto", "float", "int8", "fp8", "released")

FAMILY_MODULES = (
    "gsm_jax.models.llama",
    "gsm_jax.models.gemma3",
    "gsm_jax.models.deepseek_v4",
    "gsm_jax.models.deepseek_v41",
)


def _modules() -> Iterator[ModuleType]:
    for path in FAMILY_MODULES:
        yield importlib.import_module(path)


def names() -> tuple[str, ...]:
    """Every registered family's name, in registration order."""
    return tuple(m.FAMILY for m in _modules())


def hf_model_types() -> dict[str, str]:
    """Hugging Face `model_type` -> family name."""
    return {t: m.FAMILY for m in _modules() for t in m.HF_MODEL_TYPES}


@functools.cache
def family_module(family: str) -> ModuleType:
    """The module of the family named `family`."""
    for m in _modules():
        if m.FAMILY == family:
            return m
    raise UnsupportedModelError(f"unknown model family {family!r}; known: {sorted(names())}")


def family_for_model_type(model_type: str | None) -> str:
    """The family that loads a Hugging Face config of this `model_type`."""
    for m in _modules():
        if model_type in m.HF_MODEL_TYPES:
            return m.FAMILY
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not supported; supported: {sorted(hf_model_types())}"
    )


def hook(family: str, name: str, default: Any = None) -> Any:
    """The family's contract name `name` (an optional hook or constant), or `default`."""
    return getattr(family_module(family), name, default)


class FamiliesWith:
    """The families that provide contract name `name`, as a lazy read-only collection:
    `family in FamiliesWith("stack_dense")`, iteration in registration order."""

    def __init__(self, name: str):
        self.name = name

    def __contains__(self, family: object) -> bool:
        try:
            return hasattr(family_module(family), self.name)
        except (UnsupportedModelError, TypeError):  # TypeError: unhashable
            return False

    def __iter__(self) -> Iterator[str]:
        return (m.FAMILY for m in _modules() if hasattr(m, self.name))

    def __repr__(self) -> str:
        return f"FamiliesWith({self.name!r}): {tuple(self)}"
