"""Llama-family checkpoints (Hugging Face state-dict names, safetensors or GGUF tensors
already renamed by `models/gguf_reader.py`) into `models/llama.py`'s weight tree; the
reading helpers Gemma 3's converter shares (`models/gemma3_checkpoint.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import UnsupportedModelError

__all__ = ["dense_weights", "getter", "weights_from_hf"]


def getter(tensors: dict[str, Any]) -> Callable[[str], np.ndarray]:
    """name -> the tensor as float32 numpy; UnsupportedModelError naming a missing one."""
    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise UnsupportedModelError(f"weight {name!r} is missing from the checkpoint")
        return np.asarray(tensors[name], dtype=np.float32)

    return get


def fused(get: Callable[[str], np.ndarray], names: list[str]) -> np.ndarray:
    """[out, in] tensors concatenated on out and transposed to [in, out]."""
    return np.concatenate([get(n) for n in names]).T


def dense_weights(cfg: Any, get: Callable[[str], np.ndarray], layer: Callable[[str], dict],
                  final_norm: np.ndarray, dtype: Any) -> dict:
    """The dense families' tree: embedding, "layers" a tuple of one dict per layer (the
    layout `unstack_layers` gives, built directly so loading never holds the weights
    twice), final norm, and the LM head unless tied ([in, out])."""
    def cast(lw: dict) -> dict:
        return {k: jnp.asarray(v, dtype=dtype) for k, v in lw.items()}

    weights = {
        "embed": jnp.asarray(get("model.embed_tokens.weight"), dtype=dtype),
        "layers": tuple(cast(layer(f"model.layers.{i}.")) for i in range(cfg.num_layers)),
        "final_norm": jnp.asarray(final_norm, dtype=dtype),
    }
    if not cfg.tie_word_embeddings:
        weights["lm_head"] = jnp.asarray(get("lm_head.weight").T, dtype=dtype)
    return weights


def weights_from_hf(cfg: Any, tensors: dict[str, Any], dtype: Any = jnp.float32) -> dict:
    """Hugging Face state-dict names and [out, in] shapes -> `models/llama.py`'s per-layer
    tree (`cfg`: its `LlamaConfig`).

    Fuses q/k/v and gate/up and transposes to [in, out]. Raises UnsupportedModelError
    naming any missing tensor.
    """
    get = getter(tensors)

    def layer(p: str) -> dict:
        lw = {
            "attn_norm": get(p + "input_layernorm.weight"),
            "qkv": fused(get, [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
            "o": get(p + "self_attn.o_proj.weight").T,
            "ffn_norm": get(p + "post_attention_layernorm.weight"),
            "gate_up": fused(get, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            "down": get(p + "mlp.down_proj.weight").T,
        }
        if cfg.attention_bias:
            lw["qkv_bias"] = np.concatenate([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        if cfg.o_bias:
            lw["o_bias"] = get(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            lw["q_norm"] = get(p + "self_attn.q_norm.weight")
            lw["k_norm"] = get(p + "self_attn.k_norm.weight")
        return lw

    return dense_weights(cfg, get, layer, get("model.norm.weight"), dtype)
