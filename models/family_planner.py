"""What the planner reads of a family beyond its entry points: the family's `PLANNER`.

`gsm_jax.planner` counts a model's memory per device from its family's `weight_shapes`
and `init_cache`; where a family's weights or caches are counted otherwise, it asks the
family's planner object (`PLANNER` in the family's module, a `FamilyPlanner`), and
`gsm_jax.sharding.check_model` asks it what the mesh's model axis must divide. Every hook
of the base class is what a family needs when the checkpoint holds its weight tree as is
(Llama, Gemma 3: `FamilyPlanner(cache_kinds=...)`); a family whose checkpoints store
weights otherwise (DeepSeek-V4's FP8 / FP4, V4.1's released layout) subclasses it in
`models/<family>_plan.py`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, eq=False)
class FamilyPlanner:
    """The planner's questions to a family, with the answers of a family whose checkpoint
    holds its weight tree as is.

    cache_kinds: {cache leaf name: label} of the plan's cache lines (`init_cache`'s leaves;
    a leaf not named is its own label).
    """

    cache_kinds: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def model_axis_sizes(self, cfg: Any) -> dict[str, int]:
        """{what: size} the mesh's model axis must divide, besides the vocabulary (checked
        up front by `sharding.check_model`): none."""
        return {}

    def stored_weight_bytes(self, name: str, shape: tuple[int, ...], quant: dict | None,
                            expert_dtype: str, dtype: str) -> tuple[str, float]:
        """(dtype label, bytes) of one float weight leaf as `gsm_jax.load` keeps it: `dtype`."""
        return dtype, math.prod(shape) * jnp.dtype(dtype).itemsize

    def abstract_stored_weights(self, shapes: Any, quant: dict, expert_dtype: str) -> Any:
        """`weight_shapes`' tree with the leaves a checkpoint with `quant` (its
        quantization_config) stores block-quantized as stored: the tree as it is."""
        return shapes

    def plan_weights(self, hf: dict, mesh: dict[str, int], weights_dtype: str, *,
                     vision: bool = False) -> tuple[dict[str, float], int, list[str]] | None:
        """(bytes per device by part, parameters, notes) counted from the family's released
        layout, given a config.json with a quantization_config; None: count the weight tree."""
        return None

    def mtp_layers(self, cfg: Any, quant: dict | None) -> int:
        """Multi-token-prediction blocks, counted as one more layer each."""
        return int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)

    def activation_widths(self, cfg: Any, tokens: int) -> tuple[int, int]:
        """(intermediate width per token, attention keys per query) of a prefill of
        `tokens`: the gated MLP's two halves, every token."""
        return 2 * cfg.intermediate_size, tokens
