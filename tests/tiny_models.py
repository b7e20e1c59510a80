"""Small random models shared by several test modules (built in well under a second)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.params import ModelParams


def tiny_dsv4(seed: int = 0) -> ModelParams:
    """DeepSeek-V4 with one layer of each attention type, hash + top-k MoE, hc_mult 2."""
    from gsm_jax.models import deepseek_v4 as dv

    cfg = dv.DeepseekV4Config(
        vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, head_dim=16, q_lora_rank=24,
        o_groups=2, o_lora_rank=8, layer_types=(dv.SLIDING, dv.CSA, dv.HCA),
        mlp_layer_types=("hash_moe", "moe", "moe"), n_routed_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=16, main_rope=dv.RopeSpec(theta=10000.0, dim=8),
        compress_rope=dv.RopeSpec(theta=50000.0, dim=8), sliding_window=4,
        compress_rate_csa=2, compress_rate_hca=4, index_n_heads=4, index_head_dim=16,
        index_topk=2, hc_mult=2, swiglu_limit=2.0, max_position_embeddings=128)
    return ModelParams(dv.init_weights(cfg, jax.random.key(seed)), cfg, None, source="tiny-dsv4")


def tiny_workflow_llama(seed: int = 1) -> ModelParams:
    """The workflow tests' Llama (3 layers, d=48): one config and shapes for all of
    them, so its programs compile once per session; weights x20 so that smoothing
    visibly changes the logits."""
    from gsm_jax.models import llama

    cfg = llama.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_layers=3,
                            num_heads=4, num_kv_heads=2, head_dim=12,
                            max_position_embeddings=256)
    w = jax.tree.map(lambda a: a * 20 if a.ndim > 1 else a,
                     llama.init_weights(cfg, jax.random.key(seed)))
    return ModelParams(w, cfg, None, "tiny")


def saved_workflow_setup(root: Path) -> tuple[Path, str, str]:
    """The workflow Llama (seed 5) saved with orbax under root/model, and 8 x 24 token
    ids in root/tokens.npy: (root, model dir, tokens path) for the CLI tests."""
    import gsm_jax

    p = tiny_workflow_llama(seed=5)
    model = gsm_jax.save(dataclasses.replace(p, source="tiny-cli"), root / "model")
    tokens = np.random.default_rng(0).integers(0, 96, (8, 24)).astype(np.int32)
    np.save(root / "tokens.npy", tokens)
    return root, str(model), str(root / "tokens.npy")


def tiny_gsm_llama(seed: int = 7) -> ModelParams:
    """The GSM and INT8 model tests' Llama (3 layers, d=48, EOS 3), default init scale."""
    from gsm_jax.models import llama

    cfg = llama.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=3,
                            num_heads=4, num_kv_heads=2, head_dim=12,
                            max_position_embeddings=512, eos_token_ids=(3,))
    return ModelParams(llama.init_weights(cfg, jax.random.key(seed)), cfg, None, "tiny")


def randomise_hf_dsv4(model, cfg, seed: int) -> None:
    """Randomise every parameter and buffer of a transformers DeepseekV4ForCausalLM (sinks,
    position biases, hc biases/scales, correction biases, norms, hash tables), so no
    feature hides behind an identity initialisation."""
    import torch

    g = torch.Generator().manual_seed(seed)

    def rnd(shape, scale, center=0.0):
        return center + scale * torch.randn(shape, generator=g)

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(rnd(p.shape, 0.1, 1.0))
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(rnd(p.shape, 0.5))
            elif name.endswith(("scale",)):
                p.copy_(rnd(p.shape, 0.2, 1.0))
            else:
                p.copy_(rnd(p.shape, 0.1))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok]
                        for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(rnd(b.shape, 0.5))


def write_tiny_hf_llama(root: Path, max_positions: int = 256) -> Path:
    """A 2-layer random Llama as a Hugging Face directory (config, safetensors, byte tokenizer)
    that both gsm_jax.load and transformers' from_pretrained read. The tokenizer is byte-level
    BPE without merges (one token per byte), so it reads any text file."""
    import json

    from safetensors.numpy import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<s>"], vocab["</s>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    root.mkdir(parents=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))

    v, d, ff, layers, heads, kv, hd = len(vocab), 32, 64, 2, 4, 2, 8
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": v,
        "hidden_size": d, "intermediate_size": ff, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": v - 2,
        "eos_token_id": v - 1, "torch_dtype": "float32",
    }))
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tensors = {"model.embed_tokens.weight": w(v, d), "model.norm.weight": np.ones(d, np.float32),
               "lm_head.weight": w(v, d)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": np.ones(d, np.float32),
            p + "post_attention_layernorm.weight": np.ones(d, np.float32),
            p + "self_attn.q_proj.weight": w(heads * hd, d),
            p + "self_attn.k_proj.weight": w(kv * hd, d),
            p + "self_attn.v_proj.weight": w(kv * hd, d),
            p + "self_attn.o_proj.weight": w(d, heads * hd),
            p + "mlp.gate_proj.weight": w(ff, d),
            p + "mlp.up_proj.weight": w(ff, d),
            p + "mlp.down_proj.weight": w(d, ff),
        }
    save_file(tensors, str(root / "model.safetensors"))
    return root


def tiny_gemma3(seed: int = 0) -> ModelParams:
    """Gemma 3 with sliding (window 5) and global layers, norms randomised."""
    from gsm_jax.models import gemma3

    cfg = gemma3.Gemma3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=16, sliding_layers=(True, False, True, False),
        sliding_window=5, query_pre_attn_scalar=12.0, max_position_embeddings=256)
    w = gemma3.init_weights(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    layers = {k: (v + jnp.asarray(rng.normal(0, 0.3, v.shape), v.dtype) if "norm" in k else v)
              for k, v in w["layers"].items()}
    return ModelParams({**w, "layers": layers}, cfg, None, "tiny-gemma3")


def tiny_dsv41(seed: int = 0) -> ModelParams:
    """DeepSeek-V4.1 with every CSA2 role (SWA, Full r2, Reuse r2, Full r1 + candidates,
    Reuse r1, Reindex), window 4, top-k choosing."""
    from gsm_jax.models import deepseek_v41 as dv

    cfg = dv.DeepseekV41Config(
        vocab_size=96, hidden_size=32, num_layers=6, num_heads=4, head_dim=16, rope_dim=8,
        q_lora_rank=24, o_groups=2, o_lora_rank=8, n_routed_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=16, compress_ratios=(0, 2, 2, 1, 1, 1),
        kv_source_layer_ids=(1, 3), index_source_layer_ids=(1, 3, 5), index_n_heads=4,
        index_head_dim=16, index_topk=3, candidate_source_layer_id=3,
        candidate_topk_blocks=2, candidate_block_size=2, sliding_window=4, hc_mult=2,
        swiglu_limit=2.0, max_position_embeddings=128)
    return ModelParams(dv.init_weights(cfg, jax.random.key(seed)), cfg, None,
                       source="tiny-dsv41")
