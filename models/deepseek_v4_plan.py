"""DeepSeek-V4 for the planner (`gsm_jax.plan`): its `PLANNER`, which `models/deepseek_v4.py`
exposes.

A checkpoint with a quantization_config stores the dense projections as FP8 e4m3 in
128 x 128 blocks and the routed experts as FP4 (or FP8), and `gsm_jax.load` keeps them
so: the planner counts those leaves at their stored bytes and compiles against them as
stored. The model axis splits experts, heads and head groups whole; MTP blocks count as
layers; a prefill's keys are the raw tokens plus the compressed entries.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from gsm_jax.models.block_quant import BlockQuantWeight
from gsm_jax.models.family_planner import FamilyPlanner

if TYPE_CHECKING:
    from gsm_jax.models.deepseek_v4 import DeepseekV4Config

# labels of the cache leaves (`init_cache`), by leaf name
CACHE_KINDS = {"window": "sliding-window K=V", "comp": "compressed entries",
               "index": "indexer entries", "comp_ring": "compressor rings",
               "index_ring": "compressor rings"}
# weights a checkpoint with a quantization_config stores as FP8 e4m3 in 128 x 128
# blocks (the indexer's q_b too; compressors stay bf16), and the routed experts (FP4 or FP8)
FP8_WEIGHTS = frozenset({"q_a", "q_b", "kv", "o_a", "o_b", "shared_gate_up", "shared_down"})
EXPERT_WEIGHTS = frozenset({"experts_gate_up", "experts_down"})


class DeepseekV4Planner(FamilyPlanner):
    """DeepSeek-V4's answers to the planner (`FamilyPlanner`)."""

    def model_axis_sizes(self, cfg: DeepseekV4Config) -> dict[str, int]:
        """What the mesh's model axis splits whole, besides the vocabulary (checked up front)."""
        return {"experts": cfg.n_routed_experts, "heads": cfg.num_heads,
                "output_groups": cfg.o_groups}

    def stored_weight_bytes(self, name: str, shape: tuple[int, ...], quant: dict | None,
                            expert_dtype: str, dtype: str) -> tuple[str, float]:
        """(dtype label, bytes) of one weight as `gsm_jax.load` keeps it."""
        n = math.prod(shape)
        if quant and name in EXPERT_WEIGHTS and expert_dtype == "fp4":
            return "fp4 (+e8m0 scales)", n * (0.5 + 1 / 32)
        if quant and (name in FP8_WEIGHTS or name in EXPERT_WEIGHTS):
            bo, bi = quant.get("weight_block_size", [128, 128])
            blocks = math.prod(shape[:-2]) * math.ceil(shape[-1] / bo) * math.ceil(shape[-2] / bi)
            return "fp8 e4m3 (+e8m0 scales)", n + blocks
        return super().stored_weight_bytes(name, shape, quant, expert_dtype, dtype)

    def abstract_stored_weights(self, shapes: Any, quant: dict, expert_dtype: str) -> Any:
        """`weight_shapes`' tree with the leaves a checkpoint with `quant` (its
        quantization_config) stores block-quantized as stored (FP8 dense projections, FP4
        or FP8 routed experts)."""
        bo, bi = quant.get("weight_block_size", [128, 128])

        def stored(path, leaf):
            name = str(getattr(path[-1], "key", path[-1]))
            if any(str(getattr(p, "key", "")) in ("indexer", "compressor") for p in path[:-1]):
                fp8 = name == "q_b"  # the indexer's wq_b is FP8 too; compressors stay bf16
            else:
                fp8 = name in FP8_WEIGHTS
            if not (fp8 or name in EXPERT_WEIGHTS):
                return leaf
            *lead, inp, out = leaf.shape
            if name in EXPERT_WEIGHTS and expert_dtype == "fp4":
                return BlockQuantWeight(
                    jax.ShapeDtypeStruct((*lead, out, inp // 2), jnp.uint8),
                    jax.ShapeDtypeStruct((*lead, out, math.ceil(inp / 32)), jnp.uint8),
                    "e2m1", (1, 32))
            return BlockQuantWeight(
                jax.ShapeDtypeStruct((*lead, out, inp), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((*lead, math.ceil(out / bo), math.ceil(inp / bi)),
                                     jnp.uint8),
                "e4m3", (bo, bi))

        return jax.tree_util.tree_map_with_path(stored, shapes)

    def mtp_layers(self, cfg: DeepseekV4Config, quant: dict | None) -> int:
        """MTP blocks counted as one more layer each (a release checkpoint has one)."""
        return super().mtp_layers(cfg, quant) or (1 if quant else 0)

    def activation_widths(self, cfg: DeepseekV4Config, tokens: int) -> tuple[int, int]:
        """(intermediate width per token, attention keys per query) of a prefill of
        `tokens`: the routed experts' or the heads' width; raw plus compressed entries."""
        inter = max(cfg.num_experts_per_tok * cfg.moe_intermediate_size * 2,
                    cfg.num_heads * cfg.head_dim)
        rate = max(min(cfg.compress_rate_csa, cfg.compress_rate_hca), 1)
        return inter, tokens + tokens // rate


PLANNER = DeepseekV4Planner(cache_kinds=CACHE_KINDS)
