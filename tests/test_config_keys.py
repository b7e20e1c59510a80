"""The config contract: every family reads the config.json its reference library writes.

Each config here is built by the reference library and written by its own serializer
(transformers' `save_pretrained`; NeMo AutoModel's for DeepSeek-V4.1), never a dict written
to suit our reader. Every key in the file must be read by the family's `from_hf_config`,
listed in its `HARMLESS` table (with a one-word reason), or refused by name: a key that is
none of these raises `UnknownConfigKeyWarning`, which this module turns into an error. So
when a new reference release adds a key, this test fails until the key is accounted for.
"""

from __future__ import annotations

import importlib
import json
import warnings

import pytest
from reference_config import saved_config

from gsm_jax import families
from gsm_jax.errors import UnsupportedModelError
from gsm_jax.models.hf_config import UnknownConfigKeyWarning

pytestmark = pytest.mark.filterwarnings("error::gsm_jax.models.hf_config.UnknownConfigKeyWarning")


def _saved(config, tmp_path) -> dict:
    hf = saved_config(config)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return hf


def _transformers(name: str, **kw):
    import transformers

    return getattr(transformers, name)(**kw)


def _nemo_v41(**text):
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    return DeepseekV41Config(text_config=text or None, vision_config={"num_hidden_layers": 0})


# (family, the reference's config object). Defaults are the reference's; Mistral's window
# is turned off (gsm_jax refuses a window that binds, by name: tested below).
REFERENCE_CONFIGS = {
    "llama": lambda: _transformers("LlamaConfig"),
    "llama3": lambda: _transformers("LlamaConfig", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, max_position_embeddings=131072),
    "qwen2": lambda: _transformers("Qwen2Config"),
    "qwen2_yarn": lambda: _transformers("Qwen2Config", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
    "qwen3": lambda: _transformers("Qwen3Config"),
    "mistral": lambda: _transformers("MistralConfig", sliding_window=None),
    "gemma3_text": lambda: _transformers("Gemma3TextConfig"),
    "gemma3": lambda: _transformers("Gemma3Config"),
    "deepseek_v4": lambda: _transformers("DeepseekV4Config"),
    "deepseek_v41": lambda: _nemo_v41(),
}


def _read(hf: dict):
    family = families.family_for_model_type(hf.get("model_type"))
    return family, families.family_module(family).CONFIG_CLASS.from_hf_config(hf)


@pytest.mark.parametrize("name", sorted(REFERENCE_CONFIGS))
def test_every_key_the_reference_writes_is_accounted_for(name, tmp_path):
    hf = _saved(REFERENCE_CONFIGS[name](), tmp_path)
    family, cfg = _read(hf)  # an unaccounted key is an error here (pytestmark)
    assert cfg.family == family


@pytest.mark.parametrize("name", sorted(REFERENCE_CONFIGS))
def test_an_unknown_key_is_named_once(name, tmp_path):
    """A key nobody reads and no table lists is reported, by name, in one warning."""
    hf = _saved(REFERENCE_CONFIGS[name](), tmp_path)
    target = hf["text_config"] if "text_config" in hf else hf
    target["attention_temperature_scale"] = 0.7  # a made-up, math-changing-sounding key
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _read(hf)
    ours = [w for w in seen if issubclass(w.category, UnknownConfigKeyWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "attention_temperature_scale" in str(ours[0].message)


@pytest.mark.parametrize("name, key, value", [
    ("llama", "hidden_act", "relu"),
    ("qwen3", "hidden_act", "gelu"),
    ("gemma3_text", "hidden_activation", "silu"),
    ("deepseek_v4", "hidden_act", "gelu"),
    ("deepseek_v41", "scoring_func", "sigmoid"),
    ("deepseek_v41", "norm_topk_prob", False),
    ("deepseek_v41", "topk_method", "group_limited_greedy"),
])
def test_a_math_changing_value_is_refused_by_name(name, key, value, tmp_path):
    hf = _saved(REFERENCE_CONFIGS[name](), tmp_path)
    (hf["text_config"] if "text_config" in hf else hf)[key] = value
    with pytest.raises(UnsupportedModelError, match=key) as e:
        _read(hf)
    assert repr(value) in str(e.value) or str(value) in str(e.value)


@pytest.mark.parametrize("name", ["llama", "qwen2", "deepseek_v4", "deepseek_v41"])
def test_an_unknown_rope_type_is_refused_naming_it(name, tmp_path):
    hf = _saved(REFERENCE_CONFIGS[name](), tmp_path)
    target = hf["text_config"] if "text_config" in hf else hf
    rope = target.get("rope_parameters")
    if isinstance(rope, dict) and "compress" in rope:  # V4's per-kind form
        rope["compress"]["rope_type"] = "longrope"
    else:
        target["rope_parameters"] = {**(rope or {}), "rope_type": "longrope"}
    with pytest.raises(UnsupportedModelError, match="longrope"):
        _read(hf)


def test_refused_before_any_weight_is_read(tmp_path):
    """gsm_jax.load of a directory whose config refuses: the config's error, not the
    weights' (the safetensors file here is not even valid)."""
    import gsm_jax

    hf = _saved(REFERENCE_CONFIGS["llama"](), tmp_path)
    hf["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        gsm_jax.load(tmp_path)


def test_harmless_tables_give_one_word_reasons():
    for path in families.FAMILY_MODULES:
        table = importlib.import_module(path).HARMLESS
        assert table, path
        for key, why in table.items():
            assert isinstance(why, str) and why.isidentifier() and why == why.lower(), \
                (path, key, why)


# ----------------------------------------------------------------------------- V4.1 rotary


def test_v41_yarn_is_read_from_what_nemo_writes(tmp_path):
    """The bug this contract was written for: NeMo (transformers 5) writes YaRN under
    `rope_parameters`; it used to be read only under `rope_scaling`, so the compressed layers
    ran without YaRN. Both names now give the same config."""
    from gsm_jax.models.deepseek_v41 import DeepseekV41Config

    scaling = {"rope_type": "yarn", "factor": 4, "beta_fast": 32, "beta_slow": 1,
               "original_max_position_embeddings": 4096}
    hf = _saved(_nemo_v41(rope_scaling=scaling), tmp_path)
    text = hf["text_config"]
    assert "rope_scaling" not in text and text["rope_parameters"]["rope_type"] == "yarn"
    cfg = DeepseekV41Config.from_hf_config(hf)
    spec = cfg.compress_rope
    assert (spec.rope_type, spec.factor, spec.original_max_position_embeddings) == (
        "yarn", 4.0, 4096)
    assert cfg.rope(0).rope_type == "default"  # the SWA-only layers: no YaRN, theta 1e4
    legacy = json.loads(json.dumps(hf))
    legacy["text_config"]["rope_scaling"] = legacy["text_config"].pop("rope_parameters")
    assert DeepseekV41Config.from_hf_config(legacy) == cfg
    # neither given: NeMo's default (YaRN x16 over 65,536 positions), not "no YaRN"
    del legacy["text_config"]["rope_scaling"]
    assert DeepseekV41Config.from_hf_config(legacy).compress_rope.factor == 16.0


def test_v41_rope_names_that_disagree_are_refused(tmp_path):
    from gsm_jax.models.deepseek_v41 import DeepseekV41Config

    hf = _saved(_nemo_v41(), tmp_path)
    text = hf["text_config"]
    text["rope_scaling"] = {**text["rope_parameters"], "factor": 8}
    with pytest.raises(UnsupportedModelError, match="rope_parameters.*rope_scaling"):
        DeepseekV41Config.from_hf_config(hf)
    text["rope_scaling"] = dict(text["rope_parameters"])  # the same: accepted
    DeepseekV41Config.from_hf_config(hf)
    text["rope_parameters"]["rope_theta"] = 5000.0  # inside vs the top-level rope_theta
    del text["rope_scaling"]
    with pytest.raises(UnsupportedModelError, match="rope_theta"):
        DeepseekV41Config.from_hf_config(hf)


# ----------------------------------------------------------------------------- defaults


def test_an_absent_key_means_the_references_default(tmp_path):
    """Where a config leaves a key out, the reference's class default applies: Qwen3's
    head_dim 128 (not hidden / heads), Mistral's 4096-token window (refused: it binds below
    max_position_embeddings; an explicit null is no window)."""
    hf = _saved(_transformers("Qwen3Config", hidden_size=1024, num_attention_heads=16),
                tmp_path)
    del hf["head_dim"]
    assert hf["hidden_size"] // hf["num_attention_heads"] != 128
    assert _read(hf)[1].head_dim == 128
    hf = _saved(REFERENCE_CONFIGS["mistral"](), tmp_path)
    assert hf["sliding_window"] is None and _read(hf)[1].family == "llama"
    del hf["sliding_window"]
    with pytest.raises(UnsupportedModelError, match="sliding_window=4096"):
        _read(hf)


def test_qwen2_biases_whatever_attention_bias_says(tmp_path):
    """transformers' Qwen2 always has q / k / v biases (Qwen2Config has no such field);
    an exporter's attention_bias=false is read and ignored as the reference ignores it."""
    hf = _saved(REFERENCE_CONFIGS["qwen2"](), tmp_path)
    hf["attention_bias"] = False
    cfg = _read(hf)[1]
    assert cfg.attention_bias and not cfg.o_bias
