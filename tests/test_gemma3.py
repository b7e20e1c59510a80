"""Gemma 3: parity with transformers (tiny random config and the real 270M GGUF), decode
consistency with GSM on, the GGUF tokenizer, loading and bad configs.

Tolerances: fp32 on both sides; a tiny random model agrees to float rounding (1e-5 of
the logit scale); the real model's 18 layers and 262k-way LM head over 700 tokens
accumulate more rounding in different orders (einsum vs torch matmul), hence 1e-3 of
the logit scale (measured: 3e-6) with identical top-1 tokens.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # test dependencies (pyproject [test]): the reference implementation
import transformers
from decode_checks import decode_and_teacher_forced
from reference_config import saved_config

import gsm_jax
from gsm_jax.errors import ModelNotFoundError, UnsupportedModelError
from gsm_jax.models import gemma3


def _tiny_hf(seed: int = 0):
    torch.manual_seed(seed)
    hc = transformers.Gemma3TextConfig(
        vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
        query_pre_attn_scalar=12,  # not head_dim: the score scale is its own parameter
        layer_types=["sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        max_position_embeddings=128, attn_implementation="eager")
    model = transformers.Gemma3ForCausalLM(hc).eval()
    with torch.no_grad():  # HF initialises norms at 0 (multiplier 1): make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    cfg = gemma3.Gemma3Config.from_hf_config(saved_config(hc))  # as save_pretrained writes
    weights = gemma3.weights_from_hf(cfg, {k: v.numpy() for k, v in model.state_dict().items()})
    return model, cfg, weights


@pytest.fixture(scope="module")
def tiny():
    return _tiny_hf()


def _hf_logits(model, rows) -> list[np.ndarray]:
    with torch.no_grad():
        return [model(torch.tensor(np.asarray([r]))).logits[0].numpy() for r in rows]


def test_tiny_forward_matches_transformers_ragged(tiny):
    model, cfg, w = tiny
    rng = np.random.default_rng(0)
    rows = [list(rng.integers(0, 80, n)) for n in (20, 13, 7)]  # past the window of 5
    toks = np.zeros((3, 20), np.int32)
    for i, r in enumerate(rows):
        toks[i, :len(r)] = r
    out = np.asarray(gemma3.forward(w, cfg, jnp.asarray(toks), jnp.asarray([20, 13, 7])))
    for i, ref in enumerate(_hf_logits(model, rows)):
        np.testing.assert_allclose(out[i, :len(rows[i])], ref, atol=1e-5 * np.abs(ref).max())


def test_tiny_prefill_decode_and_extend_match_transformers(tiny):
    model, cfg, w = tiny
    toks = np.random.default_rng(1).integers(0, 80, (2, 20)).astype(np.int32)
    ref = np.stack(_hf_logits(model, list(toks)))
    tol = 1e-5 * np.abs(ref).max()
    cache = gemma3.init_cache(cfg, 2, 32)
    logits, cache = gemma3.prefill(w, cfg, jnp.asarray(toks[:, :8]), jnp.asarray([8, 8]), cache)
    np.testing.assert_allclose(np.asarray(logits), ref[:, 7], atol=tol)
    for t in range(8, 20):  # decode crosses the sliding window (5) many times
        logits, cache = gemma3.decode_step(w, cfg, jnp.asarray(toks[:, t]), cache)
        np.testing.assert_allclose(np.asarray(logits), ref[:, t], atol=tol)
    cache = gemma3.init_cache(cfg, 2, 32)
    _, cache = gemma3.prefill(w, cfg, jnp.asarray(toks[:, :6]), jnp.asarray([6, 6]), cache)
    logits, cache = gemma3.extend(w, cfg, jnp.asarray(toks[:, 6:]), jnp.asarray([14, 14]), cache,
                                  all_logits=True)
    np.testing.assert_allclose(np.asarray(logits), ref[:, 6:], atol=tol)
    assert np.asarray(cache.lengths).tolist() == [20, 20]


def test_stacked_init_weights_run(tiny):
    _, cfg, _ = tiny
    w = gemma3.init_weights(cfg, jax.random.key(0))
    assert w["layers"]["qkv"].shape == (4, 32, cfg.q_size + 2 * cfg.kv_size)
    logits = gemma3.forward(w, cfg, jnp.zeros((1, 3), jnp.int32), jnp.asarray([3]))
    assert logits.shape == (1, 3, 80) and bool(jnp.isfinite(logits).all())
    shapes = gemma3.weight_shapes(cfg)
    assert shapes["embed"].shape == (80, 32)


def _tiny_params(tiny):
    from gsm_jax.params import ModelParams

    _, cfg, w = tiny
    return ModelParams(w, cfg, None, "tiny-gemma3")


def test_smoothquant_is_exact_in_float_and_int8_schemes_run(tiny):
    """SmoothQuant folds into Gemma's norms and the v / up columns exactly as for Llama
    (the q/k norms act after qkv, the post-norms after o and down); w8a16, w8a8 (with
    GSM: quantize, then smooth) and fp8 stay near the float model."""
    from gsm_jax.quant import smoothquant

    params = _tiny_params(tiny)
    toks = np.random.default_rng(2).integers(0, 80, (4, 16)).astype(np.int32)
    ref = np.asarray(gsm_jax.forward(params, toks))
    migrated = smoothquant(params, toks, alpha=0.5)
    np.testing.assert_allclose(np.asarray(gsm_jax.forward(migrated, toks)), ref,
                               atol=1e-4 * np.abs(ref).max())
    assert not np.allclose(np.asarray(migrated.weights["layers"][0]["qkv"]),
                           np.asarray(params.weights["layers"][0]["qkv"]))
    # w8a16 is the float model of its dequantized weights (to rounding); w8a8 and fp8 also
    # round activations (fp8: 3 mantissa bits), so only their direction is checked
    from gsm_jax.quant import dequantize

    gsm = gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.1, precision="f32")
    w8a16 = gsm_jax.quantize(params, "w8a16")
    np.testing.assert_allclose(np.asarray(gsm_jax.forward(w8a16, toks)),
                               np.asarray(gsm_jax.forward(dequantize(w8a16), toks)),
                               atol=1e-5 * np.abs(ref).max())
    for scheme in ("w8a8", "fp8"):
        q = gsm_jax.quantize(params, scheme)
        for cfg in (None, gsm):
            out = np.asarray(gsm_jax.forward(q, toks, gsm=cfg))
            base = np.asarray(gsm_jax.forward(params, toks, gsm=cfg))
            cosine = (out * base).sum() / np.linalg.norm(out) / np.linalg.norm(base)
            assert cosine > 0.95, (scheme, cfg, cosine)
        tokens = gsm_jax.generate_tokens(q, [list(toks[0, :5])], max_new_tokens=4, gsm=gsm,
                                         eos_ids=[])
        assert len(tokens[0]) == 4


def test_sharded_equals_one_device():
    """Tensor-parallel over 2 and 4 forced host devices: the same logits and tokens."""
    # the family contract's sharded check skips Gemma 3 for this one (SHARDED_ELSEWHERE in
    # tests/test_family_contract.py): keep GSM on and a mesh that splits the batch
    from test_sharding import _COMPARE, run_on_8_devices

    res = run_on_8_devices(_COMPARE + """
from test_gemma3 import _tiny_hf
from gsm_jax.params import ModelParams
_, cfg, w = _tiny_hf()
params = ModelParams(w, cfg, None, "tiny-gemma3")
rows = [[5, 6, 7, 8, 9, 10, 11], [3, 4]]
result = compare(params, rows, [(1, 2), (2, 4)],
                 gsm=gsm_jax.GSMConfig(target_layers="all", precision="f32"))
""")
    for mesh, r in res.items():
        assert r["rel"] < 1e-5 and r["tokens_equal"] and r["n_sharded"] > 0, (mesh, r)


@pytest.mark.parametrize("change, message", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                          "sliding_attention": {"rope_type": "default"}}}, "RoPE scaling"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
    ({"model_type": "llama"}, "not Gemma 3"),
])
def test_unsupported_configs_are_refused(change, message):
    hf = {"model_type": "gemma3_text", "vocab_size": 8, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 4, **change}
    with pytest.raises(UnsupportedModelError, match=message):
        gemma3.Gemma3Config.from_hf_config(hf)


def test_layer_types_default_to_every_sixth_global():
    hf = {"model_type": "gemma3_text", "vocab_size": 8, "hidden_size": 8,
          "intermediate_size": 8, "num_hidden_layers": 12, "num_attention_heads": 2,
          "head_dim": 4}
    cfg = gemma3.Gemma3Config.from_hf_config(hf)
    assert [i for i, s in enumerate(cfg.sliding_layers) if not s] == [5, 11]


def test_unknown_registered_name_and_missing_package(monkeypatch):
    from gsm_jax.models import gguf_reader

    with pytest.raises(ModelNotFoundError, match="gemma3-270m"):
        gguf_reader.default_gguf_path("gemma3-9000")
    monkeypatch.setitem(gguf_reader._ASSEMBLED_MODELS, "gemma3-270m",
                        ("no_such_gemma_package_xyz", "no-such-gemma-package"))
    with pytest.raises(ModelNotFoundError, match="pip install no-such-gemma-package"):
        gsm_jax.load("gemma3-270m")


# ----------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def gemma_path() -> str:
    from gsm_jax.models.gguf_reader import default_gguf_path

    # scripts/env.sh installs the package; a missing one fails here with the pip command
    return default_gguf_path("gemma3-270m")


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return gsm_jax.load("gemma3-270m")


@pytest.fixture(scope="module")
def hf_gemma(gemma_path):
    directory, name = os.path.split(gemma_path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_gemma_tokenizer(gemma_path):
    directory, name = os.path.split(gemma_path)
    return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)


def _wikitext(shared_data_dir) -> str:
    return (shared_data_dir / "wikitext2_test.txt").read_text()


def test_real_config_and_gguf_types(gemma, gemma_path):
    import gguf

    cfg = gemma.config
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (
        "gemma3", 18, 640, 262144)
    assert [i for i, s in enumerate(cfg.sliding_layers) if not s] == [5, 11, 17]
    assert (cfg.sliding_window, cfg.rope_local_theta, cfg.rope_theta) == (512, 1e4, 1e6)
    types = {t.tensor_type.name for t in gguf.GGUFReader(gemma_path).tensors}
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= types  # every one dequantized by the loader


def test_real_teacher_forced_logits_match_transformers(gemma, hf_gemma, shared_data_dir):
    """Two WikiText-2 passages of 700 and 560 tokens in one ragged batch: both cross the
    512-token sliding window, so the local layers' masking is exercised."""
    text = _wikitext(shared_data_dir)
    rows = [gemma.tokenizer.encode(text[5000:9000])[:700],
            gemma.tokenizer.encode(text[20000:24000])[:560]]
    assert min(len(r) for r in rows) > gemma.config.sliding_window
    out = np.asarray(gsm_jax.forward(gemma, rows))
    for i, ref in enumerate(_hf_logits(hf_gemma, rows)):
        got = out[i, :len(rows[i])]
        np.testing.assert_allclose(got, ref, atol=1e-3 * np.abs(ref).max(), rtol=0)
        np.testing.assert_array_equal(got.argmax(-1), ref.argmax(-1))


def test_real_greedy_ragged_batch_equals_transformers_generate(gemma, hf_gemma):
    prompts = ["The capital of France is", "def fibonacci(n):\n",
               "In 1969, the first human to walk on the Moon was"]
    rows = [gemma.tokenizer.encode(p) for p in prompts]
    outs = gsm_jax.generate_tokens(gemma, rows, max_new_tokens=32, eos_ids=[])
    for row, out in zip(rows, outs, strict=True):
        with torch.no_grad():
            ref = hf_gemma.generate(torch.tensor([row]), max_new_tokens=32, do_sample=False,
                                    min_new_tokens=32)[0, len(row):].numpy()
        np.testing.assert_array_equal(np.asarray(out), ref)


def test_real_decode_equals_teacher_forcing_with_gsm(gemma):
    """With GSM on every layer and site (f32 filter), incremental decode (rings) gives the
    logits of one forward pass over the same tokens, and smoothing changes them."""
    cfg = gsm_jax.GSMConfig(target_layers="all", smooth_strength=0.1, window_size=8,
                            precision="f32")
    rows = [gemma.tokenizer.encode("The history of the Roman Empire"),
            gemma.tokenizer.encode("Water boils at")]
    for out, got, ref in decode_and_teacher_forced(gemma, rows, max_new_tokens=16, gsm=cfg):
        np.testing.assert_allclose(got, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)
        np.testing.assert_array_equal(ref.argmax(-1), out)
    plain = np.asarray(gsm_jax.forward(gemma, rows[:1]))
    smoothed = np.asarray(gsm_jax.forward(gemma, rows[:1], gsm=cfg))
    assert np.abs(plain - smoothed).max() > 1e-2


def test_real_tokenizer_ids_equal_transformers(gemma, hf_gemma_tokenizer, shared_data_dir):
    text = _wikitext(shared_data_dir)
    samples = ["  two spaces", "tabs\t\tand\n\n\nnewlines", "naïve café 日本語 😀🤖",
               " leading space", "<start_of_turn>user\nhi<end_of_turn>\n", "x<pad>y",
               "a    b", "3.14159 1234567", ""]
    samples += [text[i: i + 2000] for i in range(0, 200_000, 20_000)]
    tok = gemma.tokenizer
    for s in samples:
        ids = tok.encode(s)
        assert ids == hf_gemma_tokenizer(s).input_ids, s[:60]
        assert tok.decode(ids, skip_special_tokens=False) == hf_gemma_tokenizer.decode(ids)
    assert tok.encode(text[:300_000]) == hf_gemma_tokenizer(text[:300_000]).input_ids


def test_real_chat_template_and_chat_generate(gemma):
    text = gemma.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "}])
    assert text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\n")
    ids = gemma.tokenizer.encode(text)
    assert ids[0] == gemma.tokenizer.bos_id and ids.count(gemma.tokenizer.bos_id) == 1
    assert gemma.tokenizer.id_to_token(ids[1]) == "<start_of_turn>"  # matched whole
    with pytest.raises(Exception, match="alternate"):
        gemma.tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])
    out = gsm_jax.generate(gemma, ["What is 2 + 2?"], max_new_tokens=8, chat=True)
    assert isinstance(out[0], str) and out[0]
