"""DeepSeek-V4 checkpoints as DeepSeek ships them: FP8 block-scaled weights, packed FP4
routed experts, DeepSeek's own tensor names, sharded safetensors.

Reading (`checkpoint_tensors`): every tensor of a `SafetensorsStore` becomes a lazy
reference; a weight with a sibling scale (`<name>.scale` in DeepSeek's naming,
`<name>.weight_scale_inv` in transformers') becomes one `QuantRef`, its block shape
taken from the scale's shape (128 x 128 dense FP8, 1 x 32 FP4 experts, 32 x 32 for
V4.1). Nothing is read until `models/deepseek_v4.weights_from_hf` asks for it, one
layer at a time.

Writing (`write_checkpoint`): a model's float weights in the official layout
(the released names, dtypes and block shapes: the checkpoint's
`model.safetensors.index.json` and shard headers), split into shards with an index:
the tests' and benchmarks' stand-in for the real release.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np

from gsm_jax.errors import ModelLoadError, UnsupportedModelError
from gsm_jax.models import block_quant as bq
from gsm_jax.models.deepseek_common_checkpoint import QuantRef, TensorRef
from gsm_jax.models.safetensors_io import INDEX_FILE, SafetensorsStore, write_safetensors

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
