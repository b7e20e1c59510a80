"""The family contract: what a model family's module provides, on one page.

A family (Llama, Gemma 3, DeepSeek-V4, V4.1) is one module under `models/`, registered by
one line in `gsm_jax/families.py`. The runtime (generation, the serving engine, sharding,
quantization, the planner, speculative decoding, the workflow tools) reads the names of
`FamilyModule` below from it and nothing else by name. `missing(module)` says what a module
lacks; tests/test_family_contract.py runs it on every registered family, beside the
numerical checks (prefill + decode = forward, chunked extend = prefill, ...).

Optional names (a family that has nothing to say there leaves them out; the runtime's
answer without them in brackets) are `OPTIONAL`. docs/adding_a_family.md explains each.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

__all__ = ["OPTIONAL", "Drafter", "FamilyModule", "missing", "required_names"]


@runtime_checkable
class Drafter(Protocol):
    """A family's own speculative drafter (DeepSeek-V4.1's DSpark): `DRAFTER` in its module,
    None for a family without one. `gsm_jax.speculative.dspark_generate` runs it."""

    def check_config(self, cfg: Any) -> None:
        """Refuse (InvalidInputError) a config the drafter cannot run."""

    def feature_window(self, cfg: Any) -> int:
        """Rows of the feature ring the draft reads (positions [anchor - window, anchor))."""

    def block_size(self, cfg: Any) -> int:
        """The most tokens one draft call proposes."""

    def prefill_with_features(self, weights: dict, cfg: Any, tokens: Any, lengths: Any,
                              cache: Any, sites: Any) -> tuple[Any, Any, Any]:
        """`prefill` that also returns the features [B, T, F] the draft reads."""

    def extend_with_features(self, weights: dict, cfg: Any, tokens: Any, n_new: Any,
                             cache: Any, sites: Any) -> tuple[Any, Any, Any]:
        """`extend(..., all_logits=True)` that also returns those positions' features."""

    def propose(self, weights: dict, draft: dict, cfg: Any, cur: Any, anchor: Any,
                ring: Any, ring_pos: Any) -> tuple[Any, Any]:
        """(proposals [1, block_size], their logits) after token `cur` at `anchor`."""

    def draft_weights(self, cfg: Any, tensors: Any, dtype: Any) -> dict:
        """The draft's weight tree from the checkpoint's drafter tensors."""


@runtime_checkable
class FamilyModule(Protocol):
    """Every name a family module must define (see docs/adding_a_family.md). `sites`: the
    model's hooks (`models.sites.Sites`: None, the GSM filter's `GSMInputs`, a tool's own)."""

    FAMILY: str  # the family's name (= CONFIG_CLASS.family), as saved checkpoints record it
    TITLE: str  # its name in messages ("Gemma 3")
    HF_MODEL_TYPES: tuple[str, ...]  # the Hugging Face model_type values it loads
    LOGICAL_AXES: Mapping[str, tuple]  # {weight leaf name: logical axes}, float layout
    CONFIG_CLASS: type  # frozen dataclass with from_hf_config(hf_dict) and `family`
    PLANNER: Any  # a models.family_planner.FamilyPlanner: the planner's hooks
    DRAFTER: Drafter | None  # its own speculative drafter, or None

    def init_cache(self, cfg: Any, batch_size: int, max_len: int, *, dtype: Any,
                   gsm_max_window: int | None) -> Any:
        """The decode cache; its slots hold positions 0 .. max_len - 1 of each row. A
        family with a `common.KVCache` may take `paged=(pages, page_size)` as well (the
        serving engine's pool of pages, `common.init_paged_kv_cache`)."""

    def prefill(self, weights: dict, cfg: Any, tokens: Any, lengths: Any, cache: Any,
                sites: Any) -> tuple[Any, Any]:
        """Right-padded prompts [B, T] into a fresh cache: (last-token logits, cache)."""

    def extend(self, weights: dict, cfg: Any, tokens: Any, n_new: Any, cache: Any,
               sites: Any, *, all_logits: bool, hidden: bool) -> tuple[Any, Any]:
        """A chunk [B, C] (first n_new [B] real) after each row's cached tokens (chunked
        prefill; with all_logits every position's logits: a one-call verifier)."""

    def decode_step(self, weights: dict, cfg: Any, tokens: Any, cache: Any, sites: Any,
                    active: Any) -> tuple[Any, Any]:
        """One token per row: (logits [B, V], cache)."""

    def forward(self, weights: dict, cfg: Any, tokens: Any, lengths: Any, sites: Any) -> Any:
        """Teacher-forced logits [B, T, V]."""

    def hidden_states(self, weights: dict, cfg: Any, tokens: Any, lengths: Any,
                      sites: Any) -> tuple[Any, dict]:
        """(final hidden states [B, T, D] before the final norm, what the hooks sowed)."""

    def logits(self, weights: dict, cfg: Any, x: Any) -> Any:
        """Final norm and LM head: logits(hidden_states(...)[0]) is forward."""

    def cache_insert(self, cache: Any, rows: Any, slots: Any) -> Any:
        """Rows of a prefilled cache into `slots` of a running one (continuous batching)."""

    def init_weights(self, cfg: Any, rng: Any, dtype: Any) -> dict:
        """Random weights (tests, benchmarks)."""

    def weight_shapes(self, cfg: Any, dtype: Any) -> dict:
        """The weight tree's shapes (jax.ShapeDtypeStruct leaves)."""

    def weights_from_hf(self, cfg: Any, tensors: Any, dtype: Any) -> dict:
        """The weight tree from a checkpoint's tensors (safetensors, GGUF)."""


# Optional names: {name: (who reads it, what the runtime does without it)}
OPTIONAL = {
    "stack_layers": ("loading", "weights saved as held"),
    "unstack_layers": ("loading", "weights restored as saved"),
    "logical_axes": ("sharding, planner", "LOGICAL_AXES by leaf name"),
    "stack_dense": ("quant", "not a dense family: no SmoothQuant / Hadamard baselines"),
    "unstack_dense": ("quant", "as stack_dense"),
    "quantize_weights": ("quant", "a non-dense family without it is not quantizable"),
    "first_layers_config": ("speculative", "per-layer tuple fields cut to the first k"),
    "load_checkpoint": ("loading", "weights_from_hf on every tensor"),
}


def required_names() -> tuple[str, ...]:
    """The names `FamilyModule` declares, constants first."""
    consts = tuple(FamilyModule.__annotations__)
    fns = tuple(n for n, v in vars(FamilyModule).items()
                if inspect.isfunction(v) and not n.startswith("_"))
    return consts + fns


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _lacks(want: Any, got: Any) -> list[str]:
    """What function `got` cannot take of `want`'s call (bar `self`): as many positional
    arguments (the runtime passes those by position: names are free), and every keyword-only
    one by its name. Its own extra parameters, with defaults, are fine."""
    w = list(inspect.signature(want).parameters.values())[1:]
    g = list(inspect.signature(got).parameters.values())
    out = []
    n_pos = sum(p.kind in _POSITIONAL for p in w)
    if not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in g) and \
            sum(p.kind in _POSITIONAL for p in g) < n_pos:
        out.append(f"{n_pos} positional parameters")
    names = {p.name for p in g if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in g):
        out += [p.name for p in w if p.kind is inspect.Parameter.KEYWORD_ONLY
                and p.name not in names]
    return out


def missing(module: Any) -> list[str]:
    """What `module` lacks of the contract: a required name absent, or a function that
    cannot take the runtime's call (`_lacks`). Empty when the module provides everything."""
    out = []
    for name in required_names():
        if not hasattr(module, name):
            out.append(f"{name}: missing")
            continue
        want = getattr(FamilyModule, name, None)
        if inspect.isfunction(want):
            got = getattr(module, name)
            if not callable(got):
                out.append(f"{name}: not callable")
                continue
            lacks = _lacks(want, got)
            if lacks:
                out.append(f"{name}: no parameter {', '.join(lacks)}")
    drafter = getattr(module, "DRAFTER", None)
    if drafter is not None and not isinstance(drafter, Drafter):
        out.append(f"DRAFTER: {type(drafter).__name__} is not a Drafter")
    return out
