"""DeepSeek-V4.1 for the planner (`gsm_jax.plan`): its `PLANNER`, which
`models/deepseek_v41.py` exposes.

`gsm_jax.plan` / `gsm-jax plan --model deepseek-v4.1-flash`: the weights counted from the
released layout itself (`deepseek_v41_checkpoint.released_layout`: every tensor's stored
shape and dtype, whose total is the release's 510,286,023,000 B), each divided by how the
sharding rules split it; what gsm_jax holds beyond the stored bytes (f32 copies of
small bf16 tensors, the Engram token map) on a line of its own (`held_weight_bytes`). The
caches are counted from `init_cache` (held packed in the released formats, whose bytes
per token `released_cache_bytes` gives).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.models.block_quant import BlockQuantWeight
from gsm_jax.models.deepseek_v41_checkpoint import (
    LAYER_NAMES,
    STORED_BYTES,
    check_quantization_config,
    is_vision,
    released_layout,
    released_part,
)
from gsm_jax.models.family_planner import FamilyPlanner

if TYPE_CHECKING:
    from gsm_jax.models.deepseek_v41 import DeepseekV41Config

# labels of the cache leaves (`init_cache`), by leaf name
CACHE_KINDS = {"window": "sliding-window K=V", "comp": "compressed KV (shared)",
               "index_keys": "index keys (shared)", "comp_ring": "compressor rings",
               "engram_history": "Engram n-gram history"}

# released cache formats (§9.6): window K=V FP8 + E8M0 per 32; compressed KV FP4 + E4M3 per
# 16; index keys MXFP4 (E8M0 per 32)
_RELEASED_ENTRY_BYTES = {"window": lambda c: c.head_dim + c.head_dim // 32,
                         "comp": lambda c: c.head_dim // 2 + c.head_dim // 16,
                         "index_keys": lambda c: c.index_head_dim // 2 + c.index_head_dim // 32}


def released_cache_bytes(cfg: DeepseekV41Config) -> tuple[float, int]:
    """(bytes per cached token, bytes per sequence for the windows) in the release's own
    cache formats: 890 B/token + 40 x 128 window entries for V4.1-Flash."""
    from gsm_jax.models.deepseek_v41 import FULL

    per_token, windows = 0.0, 0
    for li in range(cfg.num_layers):
        plan = cfg.plan(li)
        windows += cfg.sliding_window * _RELEASED_ENTRY_BYTES["window"](cfg)
        if plan.role == FULL:
            per_token += (_RELEASED_ENTRY_BYTES["comp"](cfg)
                          + _RELEASED_ENTRY_BYTES["index_keys"](cfg)) / plan.ratio
    return per_token, windows


def released_axes(name: str, ndim: int) -> tuple[str | None, ...]:
    """Logical axes of a released tensor (stored [out, in] order; a `.scale` as its
    weight), from the same rules as the weight tree (`logical_axes`): routed experts split
    whole per device, Engram tables by rows, the DSpark stages as layers, the rest of the
    draft and the vision tower replicated."""
    from gsm_jax.models.deepseek_v41 import logical_axes

    base = re.sub(r"\.scale$", ".weight", name)
    if base in ("embed.weight", "head.weight"):
        return ("vocab", None)
    m = re.match(r"^(?:layers|mtp)\.\d+\.(.+)$", base)
    if not m:
        return (None,) * ndim
    rest = m.group(1)
    if re.fullmatch(r"ffn\.experts\.\d+\.w[123]\.weight", rest):
        return ("experts",) + (None,) * (ndim - 1)  # whole tensors per device
    if rest == "engram.embed.weight":
        return ("engram_rows", None)
    if rest == "attn.wo_a.weight":
        return ("heads", None)  # rows = head groups x o_lora_rank
    if rest in ("ffn.shared_experts.w1.weight", "ffn.shared_experts.w3.weight"):
        return ("mlp", None)
    if rest == "ffn.shared_experts.w2.weight":
        return (None, "mlp")
    if rest not in LAYER_NAMES:
        return (None,) * ndim
    path, is_proj = LAYER_NAMES[rest]
    axes = logical_axes(["layers", "0", *path], ndim)
    return tuple(reversed(axes)) if is_proj and ndim == 2 else axes


def _split(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: dict[str, int],
           blocks: tuple[int, ...] | None = None) -> tuple[float, tuple[int, ...]]:
    """(devices the tensor is split over, per-device shape): an axis splits when its mesh
    axis divides it (and its block grid); an "engram_rows" axis always, padded."""
    from gsm_jax.models.partitioning import PADDED_AXES, RULES, padded_size

    factor, local = 1, []
    for i, (axis, size) in enumerate(zip(axes, shape, strict=True)):
        n = mesh.get(RULES.get(axis) or "", 1) if axis else 1
        if n > 1 and axis in PADDED_AXES:
            factor *= n
            local.append(padded_size(size, n) // n)
        elif n > 1 and size % n == 0 and (blocks is None or blocks[i] % n == 0):
            factor *= n
            local.append(size // n)
        else:
            local.append(size)
    return factor, tuple(local)


def held_weight_bytes(cfg: DeepseekV41Config, quant: dict, mesh: dict[str, int],
                      weights_dtype: str) -> float:
    """Bytes per device of the weight tree `gsm_jax.load(dir, keep_quantized=True)`
    holds (`abstract_stored_weights`), split by the sharding rules."""
    from gsm_jax.models.deepseek_v41 import logical_axes, weight_shapes

    def family_axes(path, ndim):
        return logical_axes([str(getattr(p, "key", getattr(p, "idx", p))) for p in path], ndim)

    tree = PLANNER.abstract_stored_weights(weight_shapes(cfg, jnp.dtype(weights_dtype)), quant,
                                           "fp4")
    total = 0.0

    def one(path, leaf):
        nonlocal total
        if isinstance(leaf, BlockQuantWeight):
            axes = family_axes(path, len(leaf.shape))
            axes = (*axes[:-2], axes[-1], axes[-2])  # stored [.., out, in]
            blocks = (*leaf.scale.shape[:-2], leaf.scale.shape[-2], leaf.scale.shape[-1])
            for a in (leaf.values, leaf.scale):
                _, local = _split(axes, a.shape, mesh, blocks)
                total += float(np.prod(local)) * jnp.dtype(a.dtype).itemsize
            return
        _, local = _split(family_axes(path, len(leaf.shape)), leaf.shape, mesh)
        total += float(np.prod(local)) * jnp.dtype(leaf.dtype).itemsize

    jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda a: isinstance(a, BlockQuantWeight))
    return total


class DeepseekV41Planner(FamilyPlanner):
    """DeepSeek-V4.1's answers to the planner (`FamilyPlanner`)."""

    def model_axis_sizes(self, cfg: DeepseekV41Config) -> dict[str, int]:
        """What the mesh's model axis splits whole, besides the vocabulary (checked up front)."""
        return {"experts": cfg.n_routed_experts, "heads": cfg.num_heads,
                "output_groups": cfg.o_groups}

    def plan_weights(self, hf: dict, mesh: dict[str, int], weights_dtype: str, *,
                           vision: bool = False) -> tuple[dict[str, float], int, list[str]]:
        """(bytes per device by part, logical parameters, notes). The parts are the
        released tensors (`released_layout`, vision only when `vision`); one more line is what
        gsm_jax holds beyond them (`held_weight_bytes` minus the loaded parts)."""
        from gsm_jax.models.deepseek_v41 import DeepseekV41Config

        layout = released_layout(hf, vision=vision)
        lines: dict[str, float] = {}
        params, loaded = 0, 0.0
        for name, (shape, dtype) in layout.items():
            axes = released_axes(name, len(shape))
            _, local = _split(axes, shape, mesh)
            b = float(np.prod(local)) * STORED_BYTES[dtype]
            part = "weights: " + released_part(name)
            lines[part] = lines.get(part, 0.0) + b
            if not name.endswith(".scale"):
                params += int(np.prod(shape)) * (2 if dtype == "I8" else 1)
            if not name.startswith("mtp.") and not is_vision(name):
                loaded += b
        cfg = DeepseekV41Config.from_hf_config(hf)
        held = held_weight_bytes(cfg, check_quantization_config(hf), mesh, weights_dtype)
        lines["weights: held by gsm_jax beyond the stored bytes (f32 copies, token map)"] = \
            held - loaded
        stored = sum(v for k, v in lines.items() if not k.startswith("weights: held"))
        notes = [f"weights as stored in the release{'' if vision else ' (less vision)'}: "
                 f"{stored:,.0f} B per device"]
        notes += ["the DSpark draft is counted on the devices as a layer each (experts split "
                 "like the backbone's); gsm_jax.load keeps it in host memory until speculative "
                 "decoding runs it"]
        if not vision:
            skipped = sum(STORED_BYTES[d] * int(np.prod(s)) for n, (s, d) in
                          released_layout(hf).items() if is_vision(n))
            notes.append(f"vision tower + aligner skipped (text only): {skipped:,} B not loaded")
        per_token, windows = released_cache_bytes(cfg)
        notes.append(f"released cache formats: {per_token:.0f} B per cached token + "
                     f"{windows / 1e6:.2f} MB of windows per sequence; the cache lines above are "
                     "what gsm_jax allocates (held packed in those formats; with "
                     "--kv-cache-dtype float, as float in the weights dtype)")
        return lines, params, notes

    def mtp_layers(self, cfg: DeepseekV41Config, quant: dict | None) -> int:
        """0: the DSpark draft's stages are no layers of the weight tree; `plan_weights`
        counts them from the released layout (given a quantization_config)."""
        return 0

    def abstract_stored_weights(self, shapes: Any, quant: dict, expert_dtype: str = "fp4") -> Any:
        """`weight_shapes`' tree with the leaves `gsm_jax.load(dir, keep_quantized=True)` keeps
        as stored (the same rules as `weights_from_hf`): FP8 32 x 32 containers for the
        attention projections, the indexer's q_b, the shared expert (when its w1 | w3 rows stay
        block-aligned) and Engram's wkv; o_a per head group (when o_lora_rank is); FP4 routed
        experts; Engram tables FP8 + E8M0 bytes."""
        bo, bi = quant.get("weight_block_size", (32, 32))
        sds = jax.ShapeDtypeStruct

        def fp8(lead, out, inp):
            return BlockQuantWeight(
                sds((*lead, out, inp), jnp.float8_e4m3fn),
                sds((*lead, math.ceil(out / bo), math.ceil(inp / bi)), jnp.uint8), "e4m3", (bo, bi))

        def fp4(lead, out, inp):
            return BlockQuantWeight(sds((*lead, out, inp // 2), jnp.uint8),
                                    sds((*lead, out, math.ceil(inp / 32)), jnp.uint8), "e2m1",
                                    (1, 32))

        def stored(path, leaf):
            names = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
            name = names[-1]
            *lead, inp, out = leaf.shape if leaf.ndim >= 2 else (None, None)
            if name in ("q_a", "q_b", "kv", "o_b", "shared_down") or (
                    name == "wkv" and "engram" in names):
                return fp8(lead, out, inp)
            if name == "o_a":  # [G, in, O]: a container [G, O, in] when O is block-aligned
                return fp8(lead, out, inp) if out % bo == 0 else leaf
            if name == "shared_gate_up":  # w1 | w3 concatenated along out
                return fp8(lead, out, inp) if (out // 2) % bo == 0 else leaf
            if name in ("experts_gate_up", "experts_down"):
                return fp4(lead, out, inp)
            if name == "table":
                return sds(leaf.shape, jnp.float8_e4m3fn)
            if name == "table_scale":
                return sds(leaf.shape, jnp.uint8)
            return leaf

        return jax.tree_util.tree_map_with_path(stored, shapes)

    def activation_widths(self, cfg: DeepseekV41Config, tokens: int) -> tuple[int, int]:
        """(intermediate width per token, attention keys per query) of a prefill of
        `tokens`: the routed experts' or the heads' width; the window ring, the chunk and a
        ratio-1 Full layer's compressed entries (one per token)."""
        inter = max(cfg.num_experts_per_tok * cfg.moe_intermediate_size * 2,
                    cfg.num_heads * cfg.head_dim)
        return inter, cfg.sliding_window + 2 * tokens


PLANNER = DeepseekV41Planner(cache_kinds=CACHE_KINDS)
