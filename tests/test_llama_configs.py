"""The Llama family reads the configs its ecosystem writes: Llama 3.1 / 3.2 (`llama3` RoPE),
YaRN and linear RoPE on Llama / Qwen2 / Qwen3, Qwen3 (per-head q / k RMSNorm), Mistral, and
Llama's `attention_bias` (q, k, v and o biases). Each tiny model is built and saved by
transformers itself (`XConfig(...)`, `XForCausalLM(config)`, `save_pretrained`) and loaded
with `gsm_jax.load(dir)`; no config dict here is written by hand.

Tolerance: both sides run fp32 over 2 layers in a different order (fused q/k/v, XLA vs
oneDNN reductions); measured differences are ~1e-6 of the logit scale, and the issue's bound
is 1e-4 of it. Every parity test also shows that dropping the feature under test (the
scaled RoPE, q / k norms, o bias) moves the logits by far more than the bound, so it cannot
pass without the feature. Sequences are 100+ tokens with original_max_position_embeddings
32 and max_position_embeddings 128, so positions run well past the original context.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from decode_checks import decode_and_teacher_forced

import gsm_jax
from gsm_jax.errors import UnsupportedModelError
from gsm_jax.models.hf_config import UnknownConfigKeyWarning
from gsm_jax.models.rope import RopeSpec

REL_TOL = 1e-4  # max |Δlogit| / max |logit| (the bound; see the module docstring)
ABLATION_MIN = 1e-2  # the feature under test moves the logits by at least this much
SEQ = 110

VOCAB = 258  # 256 byte tokens + <s>, </s> (`_write_tokenizer`)
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}

# name -> (transformers config class, model class, config kwargs, what to ablate)
CASES = {
    "llama_llama3": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(rope_parameters=LLAMA3), "rope"),
    "llama_yarn": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(rope_parameters=YARN), "rope"),
    "llama_linear": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}), "rope"),
    "llama_bias_llama3": (tf.LlamaConfig, tf.LlamaForCausalLM,
                          dict(rope_parameters=LLAMA3, attention_bias=True), "o_bias"),
    # YaRN with every optional key: mscale / mscale_all_dim (attention factor), betas, no
    # truncation of the correction range
    # (theta 100 and these betas put the correction range at channels 1.62 .. 4.03, so not
    # rounding it to 1 .. 5 changes the frequencies)
    "qwen2_yarn_mscale": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(rope_parameters={
        **YARN, "rope_theta": 100.0, "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 2.0,
        "beta_slow": 0.5, "truncate": False}), "rope"),
    "qwen2_linear": (tf.Qwen2Config, tf.Qwen2ForCausalLM, dict(rope_parameters={
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}), "rope"),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(tie_word_embeddings=True), "qk_norm"),
    # an explicit attention factor; original_max_position_embeddings given at the top level
    # (transformers' standardize_rope_params lets it win over the rope dict's)
    "qwen3_yarn": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "attention_factor": 1.25},
        original_max_position_embeddings=32), "rope"),
    # a window as long as the context never binds (sequences are refused past it)
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=128), None),
}


def _write_tokenizer(root: Path) -> None:
    """Byte-level BPE without merges (one token per byte) plus <s> and </s>, as
    `tokenizer.json` + `tokenizer_config.json` (what `gsm_jax.load` reads in a directory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<s>"], vocab["</s>"] = 256, 257
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights far from transformers' N(0, 0.02) init, so attention is peaked and depends on
    positions (and every norm weight differs from one): the features under test matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * noise)
            elif p.ndim == 1:  # biases
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.25 * noise)


def _build(root: Path, name: str) -> tuple[Path, torch.nn.Module]:
    config_cls, model_cls, kwargs, _ = CASES[name]
    path = root / name
    path.mkdir()
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **kwargs})).eval()
    _randomise(model, seed=len(name))
    model.save_pretrained(path)
    _write_tokenizer(path)
    return path, model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each case built and saved once: name -> (directory, transformers model)."""
    root = tmp_path_factory.mktemp("llama_configs")
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in cache:
            cache[name] = _build(root, name)
        return cache[name]

    return get


def _ids(n: int = SEQ, rows: int = 2) -> np.ndarray:
    return np.random.RandomState(1).randint(0, 256, (rows, n))


def _reference(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def _ablate(params, what: str | None):
    cfg = params.config
    changed = {"rope": dict(rope=None), "qk_norm": dict(qk_norm=False),
               "o_bias": dict(o_bias=False)}[what]
    return dataclasses.replace(params, config=dataclasses.replace(cfg, **changed))


@pytest.mark.parametrize("name", list(CASES))
def test_teacher_forced_logits_match_transformers(saved, name):
    path, model = saved(name)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeyWarning)  # every key accounted for
        params = gsm_jax.load(path)
    cfg = params.config
    assert cfg.model_type == model.config.model_type
    ids = _ids()
    ref = _reference(model, ids)
    got = np.asarray(gsm_jax.forward(params, ids))
    err = _rel(got, ref)
    print(f"{name}: max |Δlogit| / max |logit| = {err:.2e}")
    assert err <= REL_TOL, err
    what = CASES[name][3]
    if what is not None:
        ablated = np.asarray(gsm_jax.forward(_ablate(params, what), ids))
        assert _rel(ablated, ref) > ABLATION_MIN, (what, _rel(ablated, ref))


@pytest.mark.parametrize("name", ["llama_llama3", "qwen2_yarn_mscale", "qwen3_yarn"])
def test_greedy_decode_agrees_with_teacher_forced(saved, name):
    """prefill + decode_step (past the original context) against one forward pass."""
    params = gsm_jax.load(saved(name)[0])
    rows = [list(_ids(90, 1)[0]), list(_ids(40, 1)[0])]
    for toks, decode, forced in decode_and_teacher_forced(params, rows, max_new_tokens=24):
        assert len(toks) == 24
        assert _rel(decode, forced) <= REL_TOL, _rel(decode, forced)
        np.testing.assert_array_equal(toks, forced.argmax(-1))


def test_rope_specs_are_what_transformers_computes(saved):
    """Each case's inverse frequencies and attention factor against transformers' own
    rotary embedding of the same config (float32; the same formulas in the same order)."""
    for name in CASES:
        path, model = saved(name)
        spec = gsm_jax.load(path).config.rope
        rotary = model.model.rotary_emb
        ref = rotary.inv_freq.numpy()
        ours = (spec or RopeSpec(theta=model.config.rope_parameters["rope_theta"],
                                 dim=TINY["head_dim"])).inv_freq()
        np.testing.assert_allclose(ours, ref, rtol=2e-7, atol=0, err_msg=name)
        assert (spec.attention_factor if spec else 1.0) == pytest.approx(
            rotary.attention_scaling, rel=1e-12), name


def test_top_level_original_max_position_embeddings_wins(saved, tmp_path):
    """A config.json whose top-level original_max_position_embeddings (32) disagrees with
    the rope dict's (128): transformers' standardize_rope_params takes the top level."""
    path, _ = saved("qwen3_yarn")
    odd = Path(shutil.copytree(path, tmp_path / "odd"))
    hf = json.loads((odd / "config.json").read_text())
    assert hf["original_max_position_embeddings"] == 32
    hf["rope_parameters"]["original_max_position_embeddings"] = 128
    (odd / "config.json").write_text(json.dumps(hf))
    params = gsm_jax.load(odd)
    assert params.config.rope.original_max_position_embeddings == 32
    ref_model = tf.AutoModelForCausalLM.from_pretrained(odd, dtype=torch.float32).eval()
    np.testing.assert_allclose(params.config.rope.inv_freq(),
                               ref_model.model.rotary_emb.inv_freq.numpy(), rtol=2e-7)
    ids = _ids()
    assert _rel(np.asarray(gsm_jax.forward(params, ids)), _reference(ref_model, ids)) <= REL_TOL


def test_legacy_rope_scaling_form_reads_the_same(saved, tmp_path):
    """`rope_scaling` + top-level `rope_theta` (transformers < 5 and most Hub checkpoints):
    the same model, for transformers reading it and for us."""
    path, model = saved("llama_llama3")
    legacy = Path(shutil.copytree(path, tmp_path / "legacy"))
    hf = json.loads((legacy / "config.json").read_text())
    rope = hf.pop("rope_parameters")
    hf["rope_theta"] = rope.pop("rope_theta")
    hf["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (legacy / "config.json").write_text(json.dumps(hf))
    params = gsm_jax.load(legacy)
    assert params.config == gsm_jax.load(path).config
    ref_model = tf.AutoModelForCausalLM.from_pretrained(legacy, dtype=torch.float32).eval()
    ids = _ids()
    assert _rel(np.asarray(gsm_jax.forward(params, ids)), _reference(ref_model, ids)) <= REL_TOL


def test_saved_and_reloaded_config_keeps_the_rope(saved, tmp_path):
    params = gsm_jax.load(saved("qwen3_yarn")[0])
    again = gsm_jax.load(gsm_jax.save(params, tmp_path / "ckpt"))
    assert again.config == params.config and again.config.rope.rope_type == "yarn"
    assert again.config.qk_norm
    ids = _ids(40, 1)
    np.testing.assert_array_equal(np.asarray(gsm_jax.forward(again, ids)),
                                  np.asarray(gsm_jax.forward(params, ids)))


@pytest.mark.parametrize("cls", [tf.LlamaConfig, tf.Qwen2Config, tf.Qwen3Config,
                                 tf.MistralConfig])
def test_every_key_transformers_writes_is_accounted_for(cls, tmp_path):
    """The defaults of each config class, as save_pretrained writes them: read or listed
    (Mistral's default 4096-token window is refused by name: it binds below 131072)."""
    cls(**{**TINY, "max_position_embeddings": 4096}).save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownConfigKeyWarning)
        cfg = gsm_jax.models.llama.LlamaConfig.from_hf_config(hf)
    assert cfg.model_type == hf["model_type"]
    hf["a_new_knob"] = 3
    with pytest.warns(UnknownConfigKeyWarning, match="a_new_knob"):
        gsm_jax.models.llama.LlamaConfig.from_hf_config(hf)


def _config_only(tmp_path: Path, cls, **kwargs) -> Path:
    """A directory with a transformers-written config.json and no weights: a refusal that
    names the key proves the config was refused before any weight was read."""
    cls(**{**TINY, **kwargs}).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("rope,message", [
    ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
     r"rope_type='dynamic' is not supported \(supported: default, linear, llama3, yarn\)"),
    ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
      "long_factor": [2.0] * 8, "original_max_position_embeddings": 32},
     r"rope_type='longrope' is not supported \(supported: default, linear, llama3, yarn\)"),
    ({"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
     r"\['mrope_section'\] are not supported \(supported rope types: default, linear"),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5},
     r"partial_rotary_factor=0.5 is not supported"),
])
def test_unsupported_rope_is_refused_before_weights(tmp_path, rope, message):
    path = _config_only(tmp_path, tf.LlamaConfig)
    hf = json.loads((path / "config.json").read_text())
    hf["rope_parameters"] = rope
    (path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(UnsupportedModelError, match=message):
        gsm_jax.load(path)


@pytest.mark.parametrize("cls,kwargs,message", [
    (tf.Qwen2Config, dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     r"sliding_window=16 applies to layers \[1\]"),
    (tf.Qwen3Config, dict(use_sliding_window=True, sliding_window=16, max_window_layers=0),
     r"sliding_window=16 applies to layers \[0, 1\]"),
    (tf.MistralConfig, dict(sliding_window=64), r"sliding_window=64 applies to layers \[0, 1\]"),
    (tf.LlamaConfig, dict(mlp_bias=True), r"mlp_bias=True is not supported"),
    (tf.LlamaConfig, dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
])
def test_unsupported_settings_are_refused_before_weights(tmp_path, cls, kwargs, message):
    with pytest.raises(UnsupportedModelError, match=message):
        gsm_jax.load(_config_only(tmp_path, cls, **kwargs))


def test_qwen2_window_that_is_off_loads(tmp_path):
    """Qwen2.5's configs: a window with use_sliding_window false is no window."""
    hf = json.loads((_config_only(tmp_path, tf.Qwen2Config, use_sliding_window=False,
                                  sliding_window=16) / "config.json").read_text())
    assert gsm_jax.models.llama.LlamaConfig.from_hf_config(hf).attention_bias


@pytest.mark.parametrize("name", ["qwen3", "llama_llama3"])
def test_cli_generate_on_a_saved_directory(saved, name, capsys):
    from gsm_jax.cli import main

    path = saved(name)[0]
    assert main(["generate", "--model", str(path), "--max-new-tokens", "6",
                 "The capital of France is"], compile_cache=False) == 0
    out = capsys.readouterr().out
    expected = gsm_jax.generate(gsm_jax.load(path), ["The capital of France is"],
                                max_new_tokens=6)[0]
    assert f">>> The capital of France is\n{expected}\n" in out, out


def test_cli_generate_quantized_with_int8_head(saved, capsys):
    """`gsm-jax generate --quantize w8a16 --quantize-head --quantize-group-size 16`: the
    text of gsm_jax.generate on quantize(params, "w8a16", head=True, group_size=16)."""
    from gsm_jax.cli import main
    from gsm_jax.quant import quantize

    path = saved("llama_llama3")[0]
    assert main(["generate", "--model", str(path), "--max-new-tokens", "6", "--quantize",
                 "w8a16", "--quantize-head", "--quantize-group-size", "16",
                 "The capital of France is"], compile_cache=False) == 0
    out = capsys.readouterr().out
    q = quantize(gsm_jax.load(path), "w8a16", head=True, group_size=16)
    expected = gsm_jax.generate(q, ["The capital of France is"], max_new_tokens=6)[0]
    assert "[gsm-jax] quantized: w8a16, groups of 16 (LM head too)" in out
    assert f">>> The capital of France is\n{expected}\n" in out, out


def test_planner_counts_qwen3_parameters(saved):
    """The planner reads a Qwen3 config.json: its parameter count is transformers' (the
    q / k norms and tied embeddings included)."""
    path, model = saved("qwen3")
    plan = gsm_jax.plan(str(path / "config.json"), batch=1, context=64, device_memory="1GB")
    assert plan.parameters == model.num_parameters()


def test_a_key_the_rope_type_does_not_read_is_named():
    """transformers ignores (with a warning) a key that another RoPE type reads: so do we."""
    from gsm_jax.models.rope import RopeKeyWarning

    with pytest.warns(RopeKeyWarning, match=r"'linear' does not read \['low_freq_factor'\]"):
        spec = RopeSpec.from_hf({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0,
                                 "low_freq_factor": 1.0}, 16, 128, where="rope_parameters")
    assert spec == RopeSpec(theta=1e4, dim=16, rope_type="linear", factor=2.0)
