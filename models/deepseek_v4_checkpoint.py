"""DeepSeek-V4 checkpoints as DeepSeek ships them: FP8 block-scaled weights, packed FP4
routed experts, DeepSeek's own tensor names, sharded safetensors.

Reading (`checkpoint_tensors`): every tensor of a `SafetensorsStore` becomes a lazy
reference; a weight with a sibling scale (`<name>.scale` in DeepSeek's naming,
`<name>.weight_scale_inv` in transformers') becomes one `QuantRef`, its block shape
taken from the scale's shape (128 x 128 dense FP8, 1 x 32 FP4 experts, 32 x 32 for
V4.1). Nothing is read until `weights_from_hf` asks for it, one layer at a time.

Converting (`weights_from_hf`, `load_checkpoint`: the family's checkpoint hooks, which
`models/deepseek_v4.py` exposes): Hugging Face or DeepSeek names -> the model's weight
tree, FP8 / FP4 kept as stored or dequantized, placed on the devices layer by layer.

Writing (`write_checkpoint`): a model's float weights in the official layout
(the released names, dtypes and block shapes: the checkpoint's
`model.safetensors.index.json` and shard headers), split into shards with an index:
the tests' and benchmarks' stand-in for the real release.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gsm_jax.errors import ModelLoadError, UnsupportedModelError
from gsm_jax.models import block_quant as bq
from gsm_jax.models.block_quant import BlockQuantWeight
from gsm_jax.models.deepseek_common_checkpoint import QuantRef, StoredQuant, TensorRef, to_device
from gsm_jax.models.safetensors_io import INDEX_FILE, SafetensorsStore, write_safetensors

if TYPE_CHECKING:
    from gsm_jax.models.deepseek_v4 import DeepseekV4Config

QUANT_METHODS = ("fp8",)
WEIGHT_FMTS = ("e4m3",)
SCALE_FMTS = ("ue8m0", None)
ACTIVATION_SCHEMES = ("dynamic", None)
EXPERT_DTYPES = ("fp4", "fp8", None)
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


# ----------------------------------------------------------------------------- config


def check_quantization_config(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` (+ `expert_dtype`) validated, or None."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise UnsupportedModelError(f"config field quantization_config={qc!r} is not an object")
    checks = (("quant_method", qc.get("quant_method"), QUANT_METHODS),
              ("fmt", qc.get("fmt", "e4m3"), WEIGHT_FMTS),
              ("scale_fmt", qc.get("scale_fmt"), SCALE_FMTS),
              ("activation_scheme", qc.get("activation_scheme"), ACTIVATION_SCHEMES))
    for key, value, allowed in checks:
        if value not in allowed:
            raise UnsupportedModelError(
                f"config field quantization_config.{key}={value!r} is not supported "
                f"(supported: {[a for a in allowed if a is not None]})")
    expert = hf.get("expert_dtype", qc.get("expert_dtype"))
    if expert not in EXPERT_DTYPES:
        raise UnsupportedModelError(f"config field expert_dtype={expert!r} is not supported "
                                    "(supported: fp4, fp8)")
    block = qc.get("weight_block_size", [128, 128])
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedModelError(
            f"config field quantization_config.weight_block_size={block!r} is not two "
            "positive integers")
    return {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": qc.get("scale_fmt"),
            "weight_block_size": (int(block[0]), int(block[1])),
            "expert_dtype": expert or "fp8"}


# ----------------------------------------------------------------------------- reading


def checkpoint_tensors(store: SafetensorsStore, quant: dict[str, Any] | None) -> dict[str, Any]:
    """name -> TensorRef | QuantRef for every stored tensor (scales folded into their weight).

    A scale without its weight, or a low-precision weight without a scale, is an error
    naming the tensor: nothing is dequantized with a made-up scale.
    """
    names = set(store.tensors)
    scales = {}
    for name in names:
        for suffix in _SCALE_SUFFIXES:
            if name.endswith(suffix):
                weight = name.removesuffix(suffix) + ".weight"
                if weight in names:
                    scales[weight] = name
                elif suffix == ".weight_scale_inv" or store.info(name).dtype == "F8_E8M0":
                    raise ModelLoadError(f"scale tensor {name!r} has no weight {weight!r}")
    if scales and quant is None:
        raise ModelLoadError("the checkpoint holds block-scaled weights (e.g. "
                             f"{sorted(scales)[0]!r}) but config.json has no quantization_config")
    block = quant["weight_block_size"] if quant else (128, 128)
    expert = quant["expert_dtype"] if quant else "fp8"
    out: dict[str, Any] = {}
    used_scales = set(scales.values())
    for name in sorted(names - used_scales):
        if name in scales:
            out[name] = QuantRef(store, name, scales[name], block, expert)
            continue
        if store.info(name).dtype in ("F8_E4M3", "F8_E5M2"):
            raise ModelLoadError(f"FP8 tensor {name!r} has no scale tensor "
                                 f"({name.removesuffix('.weight')}.scale)")
        out[name] = TensorRef(store, name)
    return out


# ----------------------------------------------------------------------------- converting


# Checkpoint names `save_pretrained` writes (the upstream layout) -> the reference's
# module names (what `model.state_dict()` holds). Mirrors transformers' conversion
# mapping for deepseek_v4, applied in order.
_RENAMES = [
    (r"\.attn\.", ".self_attn."),
    (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^model\.embed\.weight$", "model.embed_tokens.weight"),
    (r"^model\.head\.weight$", "lm_head.weight"),
    (r"^head\.weight$", "lm_head.weight"),
    (r"\.hc_head_(fn|base|scale)$", r".hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn_sink$", ".sinks"),
    (r"\.self_attn\.indexer\.weights_proj\.", ".self_attn.compressor.indexer.scorer.weights_proj."),
    (r"\.self_attn\.indexer\.wq_b\.", ".self_attn.compressor.indexer.q_b_proj."),
    (r"\.(self_attn|compressor|indexer)\.norm\.", r".\1.kv_norm."),
    (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."),
    (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."),
    (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
]


_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.w([123])\.weight$")


MTP_PREFIX = "mtp."


def _canonical_name(name: str) -> str:
    if not name.startswith(("model.", "lm_head.", "head.")):
        name = "model." + name
    for pattern, repl in _RENAMES:
        name = re.sub(pattern, repl, name)
    return name


@dataclasses.dataclass(frozen=True)
class _MergedExperts:
    """The reference's merged expert tensor, built from per-expert checkpoint tensors when
    it is asked for (so loading holds one layer's experts at a time, not the model's)."""

    prefix: str
    kind: str  # "gate_up" (w1 | w3 along the output axis) or "down" (w2)
    per_expert: dict[int, dict[str, Any]]

    def load(self) -> Any:
        """[E, out, in] (or a StoredQuant of it), filled one expert at a time so only the
        result and one expert's tensors are held."""
        names = ("1", "3") if self.kind == "gate_up" else ("2",)
        experts = sorted(self.per_expert)
        out = None
        for j, e in enumerate(experts):
            try:
                parts = [_resolve(self.per_expert[e][n]) for n in names]
            except KeyError as exc:
                raise UnsupportedModelError(
                    f"expert weight w{exc.args[0]} of expert {e} missing under {self.prefix}"
                ) from exc
            one = _concat_out(parts)
            if out is None:
                quant = isinstance(one, StoredQuant)
                arrays = (one.values, one.scale) if quant else (one,)
                bufs = [np.empty((len(experts), *a.shape), a.dtype) for a in arrays]
                out = StoredQuant(*bufs, one.fmt, one.block) if quant else bufs[0]
            if isinstance(out, StoredQuant):
                if not (isinstance(one, StoredQuant) and (one.fmt, one.block) ==
                        (out.fmt, out.block) and one.values.shape == out.values.shape[1:]):
                    raise ModelLoadError(f"{self.prefix}: expert {e} is stored in another "
                                         "format or shape than expert "
                                         f"{experts[0]}")
                out.values[j], out.scale[j] = one.values, one.scale
            else:
                out[j] = one.dequantize() if isinstance(one, StoredQuant) else one
        return out


def _resolve(value: Any) -> Any:
    """A tensor as numpy (or a StoredQuant), reading it if it is a lazy reference."""
    if hasattr(value, "load"):
        value = value.load()
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().float().cpu().numpy() if value.is_floating_point() \
            else value.detach().cpu().numpy()
    return value


def _concat_out(parts: list[Any]) -> Any:
    """[w, ...] concatenated along the output axis (one expert's w1 | w3), staying
    block-quantized when the block grid allows."""
    if len(parts) == 1:
        return parts[0] if isinstance(parts[0], StoredQuant) else np.asarray(parts[0], np.float32)
    if all(isinstance(w, StoredQuant) for w in parts):
        f, blk = parts[0].fmt, parts[0].block
        if all(w.fmt == f and w.block == blk and w.values.shape[-2] % blk[0] == 0
               for w in parts):
            return StoredQuant(np.concatenate([w.values for w in parts]),
                               np.concatenate([w.scale for w in parts]), f, blk)
    return np.concatenate([w.dequantize() if isinstance(w, StoredQuant)
                           else np.asarray(w, np.float32) for w in parts])


def canonical_hf_names(tensors: dict[str, Any]) -> dict[str, Any]:
    """Accept both the module names and the checkpoint names; return module names.

    Per-expert w1/w3/w2 matrices become the reference's merged `experts.gate_up_proj`
    [E, 2I, D] and `experts.down_proj` [E, D, I] (built lazily, see `_MergedExperts`).
    Multi-token-prediction tensors (`mtp.*`) keep their checkpoint names.
    Values may be arrays, torch tensors or lazy references (`.load()`).
    """
    out: dict[str, Any] = {}
    experts: dict[str, dict[int, dict[str, Any]]] = {}
    for name, value in tensors.items():
        if name.startswith(MTP_PREFIX):
            out[name] = value
            continue
        name = _canonical_name(name)
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = value
        else:
            out[name] = value
    for prefix, per_expert in experts.items():
        out[prefix + ".gate_up_proj"] = _MergedExperts(prefix, "gate_up", per_expert)
        out[prefix + ".down_proj"] = _MergedExperts(prefix, "down", per_expert)
    return out


def _block_weight(q: Any, on_device: bool = False) -> BlockQuantWeight:
    """A StoredQuant as a BlockQuantWeight: on the default device at once (its host copy
    freed), or still on the host for a mesh placement (each device takes its slices)."""
    if on_device:
        return BlockQuantWeight(jnp.asarray(q.values), jnp.asarray(q.scale), q.fmt, q.block)
    return BlockQuantWeight(q.values, q.scale, q.fmt, q.block)


def _cast_host(tree: Any, dtype: Any) -> Any:
    """`deepseek_v4`'s weight dtypes on the host: numpy leaves in their final dtypes."""
    from gsm_jax.models.deepseek_v4 import leaf_dtype

    return jax.tree_util.tree_map_with_path(
        lambda path, a: a if isinstance(a, BlockQuantWeight)
        else np.asarray(a).astype(leaf_dtype(path, dtype), copy=False),
        tree, is_leaf=lambda a: isinstance(a, BlockQuantWeight))


def _dense(w: Any) -> np.ndarray:
    """A float [..., in, out] numpy weight, whatever form `lin` gave."""
    return np.asarray(w.dequantize()) if isinstance(w, BlockQuantWeight) else w


def _cat_out(a: Any, b: Any) -> Any:
    """Two [in, out] weights side by side ([a | b] along the output axis)."""
    if (isinstance(a, BlockQuantWeight) and isinstance(b, BlockQuantWeight)
            and (a.fmt, a.block) == (b.fmt, b.block)
            and a.stored_shape[-2] % a.block[0] == 0):
        xp = jnp if isinstance(a.values, jax.Array) else np  # on the device already, or not
        return a.replace(values=xp.concatenate([a.values, b.values], axis=-2),
                         scale=xp.concatenate([a.scale, b.scale], axis=-2))
    return np.concatenate([_dense(a), _dense(b)], axis=-1)


def weights_from_hf(cfg: DeepseekV4Config, tensors: dict[str, Any],
                    dtype: Any = jnp.float32, *, keep_quantized: bool = False,
                    unused: list[str] | None = None, place: Any = None) -> dict:
    """Hugging Face or DeepSeek names ([out, in] linears) -> this module's tree ([in, out],
    per layer), converted to device arrays one layer at a time.

    `tensors` maps names to arrays, torch tensors or lazy references (the loader's
    `deepseek_v4_checkpoint.checkpoint_tensors`). Block-scaled FP8 / FP4 weights become
    `BlockQuantWeight`s kept as stored when `keep_quantized`, otherwise they are
    dequantized (to float32, then `dtype`). `mtp.*` tensors are kept under
    `weights["mtp"]` as stored. Names nothing asked for are appended to `unused`.
    `place(host_tree, path_prefix)` puts each finished part on its devices (default:
    the default device; `gsm_jax.sharding.place_tree` for a mesh).
    Raises UnsupportedModelError naming a missing tensor.
    """
    direct = place is None  # one device: every tensor goes there as soon as it is built
    place = place or to_device
    from gsm_jax.models import deepseek_v4 as dv

    tensors = canonical_hf_names(tensors)
    used: set[str] = set()

    def get(name: str) -> Any:
        if name not in tensors:
            raise UnsupportedModelError(f"weight {name!r} is missing from the checkpoint")
        used.add(name)
        value = _resolve(tensors[name])
        if isinstance(value, StoredQuant):
            return value if keep_quantized else value.dequantize()
        value = np.asarray(value)
        return value if value.dtype.kind in "iu" else value.astype(np.float32)

    def lin(name: str) -> Any:
        value = get(name)
        return _block_weight(value, direct) if isinstance(value, StoredQuant) else value.T

    def kv_gate(p: str) -> Any:
        return _cat_out(lin(p + "kv_proj.weight"), lin(p + "gate_proj.weight"))

    def compressor(p: str) -> dict:
        return {"kv_gate": kv_gate(p), "position_bias": get(p + "position_bias"),
                "norm": get(p + "kv_norm.weight")}

    def hc(p: str) -> dict:
        return {"fn": lin(p + "fn"), "base": get(p + "base"), "scale": get(p + "scale")}

    def experts(name: str) -> Any:  # [E, out, in] -> [E, in, out]
        value = get(name)
        return _block_weight(value, direct) if isinstance(value, StoredQuant) \
            else value.transpose(0, 2, 1)

    def o_a_weight(name: str) -> Any:  # [G * O, I] -> [G, I, O]
        value = get(name)
        if isinstance(value, StoredQuant):
            if o_rank % value.block[0] == 0:
                return _block_weight(StoredQuant(
                    value.values.reshape(g, o_rank, -1),
                    value.scale.reshape(g, o_rank // value.block[0], -1), value.fmt,
                    value.block), direct)
            value = value.dequantize()
        return value.reshape(g, o_rank, -1).transpose(0, 2, 1)

    g, o_rank = cfg.o_groups, cfg.o_lora_rank
    expected = dv.weight_shapes(cfg)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        attn = {
            "q_a": lin(a + "q_a_proj.weight"), "q_a_norm": get(a + "q_a_norm.weight"),
            "q_b": lin(a + "q_b_proj.weight"), "kv": lin(a + "kv_proj.weight"),
            "kv_norm": get(a + "kv_norm.weight"), "o_a": o_a_weight(a + "o_a_proj.weight"),
            "o_b": lin(a + "o_b_proj.weight"), "sinks": get(a + "sinks"),
        }
        if cfg.layer_types[i] != dv.SLIDING:
            attn["compressor"] = compressor(a + "compressor.")
        if cfg.layer_types[i] == dv.CSA:
            x = a + "compressor.indexer."
            attn["indexer"] = {"compressor": compressor(x), "q_b": lin(x + "q_b_proj.weight"),
                               "weights_proj": lin(x + "scorer.weights_proj.weight")}
        m = p + "mlp."
        moe = {
            "router": lin(m + "gate.weight"),
            "experts_gate_up": experts(m + "experts.gate_up_proj"),
            "experts_down": experts(m + "experts.down_proj"),
            "shared_gate_up": _cat_out(lin(m + "shared_experts.gate_proj.weight"),
                                       lin(m + "shared_experts.up_proj.weight")),
            "shared_down": lin(m + "shared_experts.down_proj.weight"),
        }
        if cfg.mlp_layer_types[i] == "hash_moe":
            moe["tid2eid"] = get(m + "gate.tid2eid")
        else:
            moe["score_bias"] = get(m + "gate.e_score_correction_bias")
        layer = {
            "attn_hc": hc(p + "attn_hc."), "attn_norm": get(p + "input_layernorm.weight"),
            "attn": attn,
            "ffn_hc": hc(p + "ffn_hc."), "ffn_norm": get(p + "post_attention_layernorm.weight"),
            "moe": moe,
        }
        _check_shapes(layer, expected["layers"][i], f"layer {i}")
        # on the device(s) now: host memory holds one layer at a time
        layers.append(place(_cast_host(layer, dtype), ("layers", i)))
        del layer, attn, moe
        _release_host_memory()
    weights = {
        "embed": get("model.embed_tokens.weight"),
        "layers": tuple(layers),
        "hc_head_fn": lin("model.hc_head.hc_fn"),
        "hc_head_base": get("model.hc_head.hc_base"),
        "hc_head_scale": get("model.hc_head.hc_scale"),
        "final_norm": get("model.norm.weight"),
    }
    if not cfg.tie_word_embeddings:
        weights["lm_head"] = lin("lm_head.weight")
    top = {k: v for k, v in weights.items() if k != "layers"}
    _check_shapes(top, expected, "model")
    weights.update(place(_cast_host(top, dtype), ()))
    # the MTP block tensor by tensor (it holds a whole layer's experts, unmerged)
    mtp = {}
    for n in (n for n in tensors if n.startswith(MTP_PREFIX)):
        value = get(n)
        if isinstance(value, StoredQuant):
            value = _block_weight(value)
        mtp[n] = place(_cast_host({n: value}, dtype), ("mtp",))[n]
    if mtp:
        weights["mtp"] = _mtp_weights(mtp)
        _release_host_memory()
    if unused is not None:
        unused.extend(sorted(n for n in tensors if n not in used))
    return weights


# where a mismatching leaf comes from in DeepSeek's own names
_CHECKPOINT_HINTS = {"experts_gate_up": "ffn.experts.*.w1/w3", "experts_down": "ffn.experts.*.w2",
                     "shared_gate_up": "ffn.shared_experts.w1/w3",
                     "shared_down": "ffn.shared_experts.w2", "router": "ffn.gate.weight",
                     "q_a": "attn.wq_a", "q_b": "attn.wq_b / attn.indexer.wq_b", "kv": "attn.wkv",
                     "o_a": "attn.wo_a", "o_b": "attn.wo_b", "kv_gate": "compressor.wkv/wgate"}


def _release_host_memory() -> None:
    """Hand freed host memory back to the OS between layers (glibc keeps freed blocks of
    the sizes it has seen: loading layer after layer otherwise ratchets the resident set
    up by about a layer)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _check_shapes(tree: dict, want: dict, where: str) -> None:
    """Every leaf's (logical) shape against the config's; the error names the tensor."""
    for key, spec in want.items():
        if key not in tree:
            continue  # absent entries were refused by `get` already
        if isinstance(spec, dict):
            _check_shapes(tree[key], spec, f"{where} {key}")
            continue
        got = tuple(tree[key].shape) if isinstance(tree[key], BlockQuantWeight) \
            else tuple(np.shape(tree[key]))
        if got != tuple(spec.shape):
            hint = _CHECKPOINT_HINTS.get(key)
            packed = " (logical shape: packed FP4 holds two values per byte)" \
                if isinstance(tree[key], BlockQuantWeight) and tree[key].fmt == "e2m1" else ""
            raise ModelLoadError(
                f"{where} {key}{f' ({hint})' if hint else ''}: the checkpoint gives shape "
                f"{list(got)}{packed}, the config needs {list(spec.shape)}")


def _mtp_weights(flat: dict[str, Any]) -> dict:
    """The multi-token-prediction block, nested by its checkpoint name ("mtp.0.e_proj.weight"
    -> ["0"]["e_proj"]["weight"]), as stored (torch [out, in]; FP8/FP4 kept when loaded so).
    Loaded and kept for speculative decoding; no entry point runs it yet."""
    tree: dict = {}
    for name, value in flat.items():
        *path, leaf = name.removeprefix(MTP_PREFIX).split(".")
        node = tree
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def load_checkpoint(cfg: DeepseekV4Config, hf_config: dict, store: Any, dtype: Any,
                    keep_quantized: bool, placer: Any, progress: Any) -> tuple[dict, dict]:
    """`gsm_jax.load` of a safetensors directory (`store`): (weights, what params.extra
    records). dtype None: as stored (low precision kept, the other tensors bf16).
    `placer()` gives the function that places a subtree on the mesh, or None."""
    quant = check_quantization_config(hf_config)
    keep = keep_quantized and quant is not None
    if dtype is None:
        dtype = jnp.bfloat16 if quant is not None else jnp.float32
    unused: list[str] = []
    progress(f"converting {len(store.tensors)} tensors "
             f"({'FP8/FP4 kept as stored' if keep else jnp.dtype(dtype).name})")
    weights = weights_from_hf(cfg, checkpoint_tensors(store, quant), dtype,
                              keep_quantized=keep, unused=unused, place=placer())
    extra: dict[str, Any] = {}
    if quant is not None:
        extra["checkpoint_quantization"] = "fp8-e4m3+" + quant["expert_dtype"] + (
            " (kept)" if keep else " (dequantized)")
    if unused:
        extra["unused_tensors"] = tuple(unused)
    return weights, extra


# ----------------------------------------------------------------------------- writing

# which stored format each official tensor takes (section 2a of the research notes)
_FP8 = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight",
        "attn.wo_b.weight", "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight",
        "ffn.shared_experts.w2.weight", "ffn.shared_experts.w3.weight", "e_proj.weight",
        "h_proj.weight")
_F32 = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
        "hc_ffn_scale", "hc_head_fn", "hc_head_base", "hc_head_scale", "attn.attn_sink",
        "compressor.ape", "ffn.gate.bias")


def official_tensors(cfg: Any, weights: dict) -> dict[str, np.ndarray]:
    """The model's float weights under DeepSeek's names, torch [out, in] layout (float32;
    `write_checkpoint` decides each one's stored dtype). Inverse of `weights_from_hf`."""
    w = _to_numpy(weights)
    t: dict[str, np.ndarray] = {"embed.weight": w["embed"], "norm.weight": w["final_norm"],
                                "hc_head_fn": w["hc_head_fn"].T,
                                "hc_head_base": w["hc_head_base"],
                                "hc_head_scale": w["hc_head_scale"]}
    t["head.weight"] = w["embed"] if cfg.tie_word_embeddings else w["lm_head"].T
    inter = cfg.moe_intermediate_size
    for i, lw in enumerate(w["layers"]):
        p = f"layers.{i}."
        for block, hc in (("attn", "attn_hc"), ("ffn", "ffn_hc")):
            t[p + f"hc_{block}_fn"] = lw[hc]["fn"].T
            t[p + f"hc_{block}_base"] = lw[hc]["base"]
            t[p + f"hc_{block}_scale"] = lw[hc]["scale"]
        t[p + "attn_norm.weight"] = lw["attn_norm"]
        t[p + "ffn_norm.weight"] = lw["ffn_norm"]
        a = lw["attn"]
        g = a["o_a"].shape[0]
        t.update({
            p + "attn.wq_a.weight": a["q_a"].T, p + "attn.q_norm.weight": a["q_a_norm"],
            p + "attn.wq_b.weight": a["q_b"].T, p + "attn.wkv.weight": a["kv"].T,
            p + "attn.kv_norm.weight": a["kv_norm"],
            p + "attn.wo_a.weight": a["o_a"].transpose(0, 2, 1).reshape(g * cfg.o_lora_rank, -1),
            p + "attn.wo_b.weight": a["o_b"].T, p + "attn.attn_sink": a["sinks"],
        })

        def compressor(prefix: str, c: dict) -> None:
            kv, gate = np.split(c["kv_gate"], 2, axis=1)
            t.update({prefix + "wkv.weight": kv.T, prefix + "wgate.weight": gate.T,
                      prefix + "ape": c["position_bias"], prefix + "norm.weight": c["norm"]})

        if "compressor" in a:
            compressor(p + "attn.compressor.", a["compressor"])
        if "indexer" in a:
            compressor(p + "attn.indexer.compressor.", a["indexer"]["compressor"])
            t[p + "attn.indexer.wq_b.weight"] = a["indexer"]["q_b"].T
            t[p + "attn.indexer.weights_proj.weight"] = a["indexer"]["weights_proj"].T
        m = lw["moe"]
        t[p + "ffn.gate.weight"] = m["router"].T
        if "tid2eid" in m:
            t[p + "ffn.gate.tid2eid"] = m["tid2eid"].astype(np.int64)
        else:
            t[p + "ffn.gate.bias"] = m["score_bias"]
        for e in range(cfg.n_routed_experts):
            gu = m["experts_gate_up"][e]
            t[p + f"ffn.experts.{e}.w1.weight"] = gu[:, :inter].T
            t[p + f"ffn.experts.{e}.w3.weight"] = gu[:, inter:].T
            t[p + f"ffn.experts.{e}.w2.weight"] = m["experts_down"][e].T
        t[p + "ffn.shared_experts.w1.weight"] = m["shared_gate_up"][:, :inter].T
        t[p + "ffn.shared_experts.w3.weight"] = m["shared_gate_up"][:, inter:].T
        t[p + "ffn.shared_experts.w2.weight"] = m["shared_down"].T
    return t


def _to_numpy(tree: Any) -> Any:
    """Weights as float32 numpy (block-quantized ones dequantized), ints kept."""
    def one(a):
        arr = np.asarray(a.dequantize() if isinstance(a, bq.BlockQuantWeight) else a)
        return arr if arr.dtype.kind in "iu" else arr.astype(np.float32, copy=False)

    return jax.tree.map(one, tree, is_leaf=lambda a: isinstance(a, bq.BlockQuantWeight))


def _mtp_tensors(cfg: Any, t: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """A stand-in MTP block (`mtp.0.*`, as V4-Flash ships one): the projections and norms
    of the real one plus a copy of layer 0's block. Nothing runs it; it must survive loading."""
    rng = np.random.default_rng(seed)
    d, n = cfg.hidden_size, cfg.hc_mult
    out = {"mtp.0.e_proj.weight": 0.02 * rng.standard_normal((d, d)),
           "mtp.0.h_proj.weight": 0.02 * rng.standard_normal((d, d)),
           "mtp.0.enorm.weight": np.ones(d), "mtp.0.hnorm.weight": np.ones(d),
           "mtp.0.norm.weight": np.ones(d),
           "mtp.0.hc_head_fn": 0.02 * rng.standard_normal((n, n * d)),
           "mtp.0.hc_head_base": np.zeros(n), "mtp.0.hc_head_scale": np.ones(1)}
    for name, value in t.items():
        if name.startswith("layers.0.") and ".compressor." not in name and ".indexer." not in name:
            out["mtp.0." + name.removeprefix("layers.0.")] = value
    return {k: np.asarray(v, np.float32) if np.asarray(v).dtype.kind == "f" else v
            for k, v in out.items()}


def _random_like(value: np.ndarray, fmt: str | None, rng: np.random.Generator) -> np.ndarray:
    """Random stored values of `value`'s shape (FP8/FP4 as valid bytes, floats ~N(0, 0.02))."""
    if fmt == "e2m1":
        return rng.integers(0, 256, value.shape[:-1] + (value.shape[-1] // 2,), np.uint8)
    normal = (0.02 * rng.standard_normal(value.shape, np.float32))
    if fmt == "e4m3":
        return (normal * 100).astype(ml_dtypes.float8_e4m3fn)
    return normal


def _stored(name: str, value: np.ndarray, block: tuple[int, int], expert_fp4: bool,
            rng: np.random.Generator | None = None) -> dict[str, tuple[np.ndarray, str]]:
    """One official tensor in its stored dtype (+ its scale tensor). With `rng`, random
    stored values of the right shapes instead of `value` (which may then be a zero-stride
    placeholder): a large checkpoint written without ever holding its float weights."""
    base = name.rsplit("layers.", 1)[-1]
    if value.dtype.kind in "iu":
        if rng is not None:
            value = rng.integers(0, int(value.max()) + 1 if value.size else 1, value.shape)
        return {name: (value.astype(np.int64), "I64")}
    if ".ffn.experts." in name and name.endswith(".weight"):
        fmt, blk = ("e2m1", (1, 32)) if expert_fp4 else ("e4m3", block)
    elif base.endswith(_FP8):
        fmt, blk = "e4m3", block
    else:
        if rng is not None:
            value = _random_like(value, None, rng)
        if base.endswith(_F32) or name.startswith(("hc_head", "mtp.0.hc_head")):
            return {name: (value.astype(np.float32), "F32")}
        return {name: (value.astype(ml_dtypes.bfloat16), "BF16")}
    if rng is not None:
        values = _random_like(value, fmt, rng)
        scale = rng.integers(118, 123, bq.scale_grid(value.shape, blk), np.uint8)
    else:
        values, scale = bq.quantize_np(value, fmt, blk)
    stem = name.removesuffix(".weight")
    return {name: (values.view(np.int8), "I8") if fmt == "e2m1" else (values, "F8_E4M3"),
            stem + ".scale": (scale, "F8_E8M0")}


def official_config(cfg: Any, *, expert_dtype: str = "fp4",
                    block: tuple[int, int] = (128, 128), mtp: bool = True) -> dict[str, Any]:
    """config.json in the official form (legacy keys: compress_ratios, num_hash_layers,
    qk_rope_head_dim, compress_rope_theta, rope_scaling; quantization_config)."""
    from gsm_jax.models import deepseek_v4 as dv

    ratios = [{dv.SLIDING: 0, dv.CSA: 4, dv.HCA: 128}[t] for t in cfg.layer_types]
    n_hash = sum(1 for t in cfg.mlp_layer_types if t == "hash_moe")
    if cfg.mlp_layer_types != ("hash_moe",) * n_hash + ("moe",) * (cfg.num_layers - n_hash):
        raise ValueError("the official config can only say that the first layers hash-route")
    if cfg.main_rope.dim != cfg.compress_rope.dim or cfg.main_rope.rope_type != "default":
        raise ValueError("the official config has one qk_rope_head_dim and a plain main RoPE")
    c = cfg.compress_rope
    hf = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": 1, "head_dim": cfg.head_dim, "qk_rope_head_dim": cfg.main_rope.dim,
        "q_lora_rank": cfg.q_lora_rank, "o_groups": cfg.o_groups, "o_lora_rank": cfg.o_lora_rank,
        "n_routed_experts": cfg.n_routed_experts, "n_shared_experts": 1,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size, "scoring_func": cfg.scoring_func,
        "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit,
        "num_hash_layers": n_hash, "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids[0],
        "compress_ratios": ratios + ([0] if mtp else []),
        "sliding_window": cfg.sliding_window, "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
        "hc_mult": cfg.hc_mult, "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.main_rope.theta,
        "compress_rope_theta": c.theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_nextn_predict_layers": 1 if mtp else 0, "expert_dtype": expert_dtype,
        "torch_dtype": "bfloat16",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                                "quant_method": "fp8", "scale_fmt": "ue8m0",
                                "weight_block_size": list(block)},
    }
    if c.rope_type == "yarn":
        hf["rope_scaling"] = {"type": "yarn", "factor": c.factor,
                              "original_max_position_embeddings":
                                  c.original_max_position_embeddings,
                              "beta_fast": c.beta_fast, "beta_slow": c.beta_slow}
    # rates other than the release's 4 / 128 (small test models) in the legacy scalar keys,
    # which transformers reads too
    if cfg.compress_rate_csa != 4:
        hf["compress_rate_csa"] = cfg.compress_rate_csa
    if cfg.compress_rate_hca != 128:
        hf["compress_rate_hca"] = cfg.compress_rate_hca
    return hf


def write_checkpoint(cfg: Any, weights: dict | None, path: str | os.PathLike, *,
                     shards: int = 2, expert_dtype: str = "fp4",
                     block: tuple[int, int] = (128, 128), mtp: bool = True,
                     seed: int = 0) -> Path:
    """Write `weights` as an official-layout checkpoint: config.json, `shards` safetensors
    files (whole layers per shard, split by bytes) and model.safetensors.index.json.

    weights=None writes random stored values (valid FP8 / FP4 bytes, E8M0 scales near 1)
    without materialising float weights: a large checkpoint for loading and memory tests.
    """
    if expert_dtype not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype {expert_dtype!r}: fp4 or fp8")
    rng = None
    if weights is None:
        from gsm_jax.models import deepseek_v4 as dv

        rng = np.random.default_rng(seed)
        # zero-stride placeholders: the shapes without the memory
        weights = jax.tree.map(
            lambda a: np.broadcast_to((np.int64 if np.dtype(a.dtype).kind in "iu"
                                       else np.float32)(0), a.shape), dv.weight_shapes(cfg))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = official_config(cfg, expert_dtype=expert_dtype, block=block, mtp=mtp)
    (path / "config.json").write_text(json.dumps(hf, indent=1))
    float_tensors = official_tensors(cfg, weights)
    if mtp:
        float_tensors.update(_mtp_tensors(cfg, float_tensors, seed))
    stored: dict[str, tuple[np.ndarray, str]] = {}
    for name, value in float_tensors.items():
        stored.update(_stored(name, value, block, expert_dtype == "fp4", rng))

    def group(name: str) -> str:  # tensors of one layer stay in one shard
        parts = name.split(".")
        return ".".join(parts[:2]) if parts[0] in ("layers", "mtp") else "top"

    groups: dict[str, list[str]] = {}
    for name in stored:
        groups.setdefault(group(name), []).append(name)
    total = sum(a.nbytes for a, _ in stored.values())
    per_shard = total / max(shards, 1)
    files: list[list[str]] = [[]]
    size = 0  # of the shard being filled
    for names in groups.values():
        nbytes = sum(stored[n][0].nbytes for n in names)
        if files[-1] and size + nbytes / 2 > per_shard and len(files) < shards:
            files.append([])
            size = 0
        files[-1].extend(names)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(files):
        fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        write_safetensors(path / fname, {n: stored[n] for n in names})
        weight_map.update({n: fname for n in names})
    (path / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": int(total)}, "weight_map": weight_map}, indent=1))
    return path
