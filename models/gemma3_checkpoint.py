"""Gemma 3 checkpoints (Hugging Face Gemma3ForCausalLM names, safetensors or GGUF tensors
already renamed by `models/gguf_reader.py`) into `models/gemma3.py`'s weight tree."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from gsm_jax.models.llama_checkpoint import dense_weights, fused, getter

__all__ = ["weights_from_hf"]


def weights_from_hf(cfg: Any, tensors: dict[str, Any], dtype: Any = jnp.float32) -> dict:
    """Hugging Face Gemma3ForCausalLM names and [out, in] shapes -> `models/gemma3.py`'s
    tree (`cfg`: its `Gemma3Config`).

    Fuses q/k/v and gate/up, transposes to [in, out], turns every norm weight w into
    the multiplier 1 + w. Raises UnsupportedModelError naming a missing tensor.
    """
    get = getter(tensors)

    def norm(name: str) -> np.ndarray:
        return 1.0 + get(name)

    def layer(p: str) -> dict:
        return {
            "attn_norm": norm(p + "input_layernorm.weight"),
            "qkv": fused(get, [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
            "q_norm": norm(p + "self_attn.q_norm.weight"),
            "k_norm": norm(p + "self_attn.k_norm.weight"),
            "o": get(p + "self_attn.o_proj.weight").T,
            "post_attn_norm": norm(p + "post_attention_layernorm.weight"),
            "ffn_norm": norm(p + "pre_feedforward_layernorm.weight"),
            "gate_up": fused(get, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            "down": get(p + "mlp.down_proj.weight").T,
            "post_ffn_norm": norm(p + "post_feedforward_layernorm.weight"),
        }

    return dense_weights(cfg, get, layer, norm("model.norm.weight"), dtype)
