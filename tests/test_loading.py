"""Loaders other than the default GGUF: HF directories, orbax round trip, bad sources."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import gsm_jax
from gsm_jax.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError

TINY = dict(vocab_size=101, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rope_theta=5000.0)


def _save_hf(model_cls, config, path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.save_pretrained(path)
    return model


def _compare(params, model, seq_len: int = 20) -> None:
    ids = np.random.RandomState(1).randint(0, params.config.vocab_size, (2, seq_len))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    got = np.asarray(gsm_jax.forward(params, ids))
    np.testing.assert_allclose(got, ref, atol=1e-5 * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_hf_llama_directory_matches_transformers(tmp_path, tied):
    model = _save_hf(LlamaForCausalLM, LlamaConfig(**TINY, tie_word_embeddings=tied), tmp_path)
    params = gsm_jax.load(tmp_path)
    assert params.config.tie_word_embeddings == tied
    assert ("lm_head" in params.weights) == (not tied)
    _compare(params, model)


def test_hf_qwen2_directory_matches_transformers(tmp_path):
    model = _save_hf(Qwen2ForCausalLM, Qwen2Config(**TINY, tie_word_embeddings=False), tmp_path)
    params = gsm_jax.load(tmp_path)
    assert params.config.attention_bias
    _compare(params, model)


def test_orbax_round_trip_is_exact(tmp_path, smollm2):
    path = gsm_jax.save(smollm2, tmp_path / "ckpt")
    again = gsm_jax.load(path)
    assert again.config == smollm2.config
    for a, b in zip(jax.tree.leaves(smollm2.weights), jax.tree.leaves(again.weights),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    text = "The capital of France is"
    assert again.tokenizer.encode(text) == smollm2.tokenizer.encode(text)
    assert again.tokenizer.eos_ids == smollm2.tokenizer.eos_ids
    assert (again.tokenizer.apply_chat_template("hi")
            == smollm2.tokenizer.apply_chat_template("hi"))


def test_save_refuses_to_overwrite(tmp_path, smollm2):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(gsm_jax.InvalidInputError, match="not empty"):
        gsm_jax.save(smollm2, tmp_path)


def test_bfloat16_load(tmp_path):
    _save_hf(LlamaForCausalLM, LlamaConfig(**TINY), tmp_path)
    params = gsm_jax.load(tmp_path, dtype="bfloat16")
    assert params.dtype == jax.numpy.bfloat16
    out = gsm_jax.generate_tokens(params, [[1, 2, 3]], max_new_tokens=4)
    assert len(out[0]) == 4


def test_unknown_model_name():
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        gsm_jax.load("no-such-model")


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFoundError, match="missing.gguf"):
        gsm_jax.load(tmp_path / "missing.gguf")


def test_corrupt_gguf(tmp_path, smollm2_gguf_path):
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf_path, "rb") as f:
        cut.write_bytes(f.read(5_000_000))
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        gsm_jax.load(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        gsm_jax.load(junk)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(UnsupportedModelError, match="bert"):
        gsm_jax.load(tmp_path)


def test_unsupported_llama_option(tmp_path):
    _save_hf(LlamaForCausalLM, LlamaConfig(**TINY), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_act"] = "gelu"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        gsm_jax.load(tmp_path)


def test_directory_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="safetensors"):
        gsm_jax.load(tmp_path)


def test_unknown_dtype():
    with pytest.raises(gsm_jax.InvalidInputError, match="float64"):
        gsm_jax.load("smollm2-135m", dtype="float64")


def test_save_names_the_extra_entries_it_cannot_write(tmp_path, tiny_llama):
    """JSON entries of `params.extra` are saved; others (V4.1's DSpark tensors) are named."""
    import dataclasses

    params = dataclasses.replace(tiny_llama, extra={"note": [1, 2], "mtp": object()})
    path = gsm_jax.save(params, tmp_path / "ckpt")
    meta = json.loads((path / "gsm_jax.json").read_text())
    assert meta["extra"] == {"note": [1, 2]} and meta["extra_not_saved"] == ["mtp"]


def test_keep_quantized_on_a_source_without_block_quantized_weights(tmp_path, monkeypatch):
    """keep_quantized=True (the CLI's --keep-quantized) on a model with nothing stored in
    FP8 / FP4 is refused before any weight is read, naming the option."""
    from gsm_jax import loading

    LlamaConfig(**TINY).save_pretrained(tmp_path)  # config.json only: no weights to read
    monkeypatch.setattr(loading, "_load_hf_dir", lambda *a, **k: pytest.fail("read weights"))
    with pytest.raises(gsm_jax.InvalidInputError, match="keep-quantized.*no block-quantized"):
        gsm_jax.load(tmp_path, dtype="float32", keep_quantized=True)
    monkeypatch.setattr(loading, "_load_gguf", lambda *a, **k: pytest.fail("read the GGUF"))
    with pytest.raises(gsm_jax.InvalidInputError, match="keep-quantized"):
        gsm_jax.load("smollm2-135m", keep_quantized=True)
    with pytest.raises(ModelNotFoundError):  # a missing path is still reported as missing
        gsm_jax.load(tmp_path / "nowhere", keep_quantized=True)
