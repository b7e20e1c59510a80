"""DeepSeek-V4 checkpoints in the official layout: DeepSeek's names, FP8 e4m3 blocks with
E8M0 scales, packed FP4 experts, several shards with an index, an MTP block.

The reference is transformers' `from_pretrained` on the very directory we load (on CPU
it renames DeepSeek's names and dequantizes FP8/FP4 itself, `Fp8Dequantize`). Both sides
see the same stored bytes and run fp32, so logits agree to rounding noise (~1e-6 of the
logit scale); we assert 1e-4 of the scale as the issue asks, and equal greedy tokens.
Every dimension above 128 is a multiple of 128 (transformers' dequantizer requires
whole blocks), and 256-wide tensors hold 2 x 2 blocks.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gsm_jax
from gsm_jax.errors import ModelLoadError, UnsupportedModelError
from gsm_jax.models import deepseek_v4 as dv
from gsm_jax.models import deepseek_v4_checkpoint as ck
from gsm_jax.models.block_quant import BlockQuantWeight
from gsm_jax.models.deepseek_v4_checkpoint import official_config, write_checkpoint
from gsm_jax.models.safetensors_io import INDEX_FILE, SafetensorsStore, write_safetensors

REL_TOL = 1e-4
VOCAB = 256
# The official config.json keys (compress_ratios, num_hash_layers, qk_rope_head_dim,
# compress_rope_theta, rope_scaling); compress_rate_hca 8 so short sequences reach HCA entries.
OFFICIAL = dict(
    model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=VOCAB,
    hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
    head_dim=128, qk_rope_head_dim=64, q_lora_rank=256, o_groups=2, o_lora_rank=128,
    n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=128,
    index_n_heads=4, index_head_dim=128, index_topk=3, sliding_window=8,
    compress_ratios=[0, 4, 128, 4], compress_rate_hca=8, num_hash_layers=1, hc_mult=2,
    swiglu_limit=2.0, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
    max_position_embeddings=256, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 32,
                  "beta_fast": 32, "beta_slow": 1},
    bos_token_id=0, eos_token_id=1,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no DeepSeek-V4", allow_module_level=True)


@pytest.fixture(scope="module")
def float_model():
    """Our config and float weights from a randomised transformers model."""
    from tiny_models import randomise_hf_dsv4

    hf_cfg = transformers.DeepseekV4Config(**{k: v for k, v in OFFICIAL.items()
                                              if k not in ("model_type", "architectures")})
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(hf_cfg).eval()
    randomise_hf_dsv4(model, hf_cfg, 1)
    cfg = dv.DeepseekV4Config.from_hf_config(OFFICIAL)
    assert cfg == dv.DeepseekV4Config.from_hf_config(hf_cfg.to_dict())
    weights = dv.weights_from_hf(cfg, {k: v.numpy() for k, v in model.state_dict().items()})
    return cfg, weights


@pytest.fixture(scope="module", params=["fp4", "fp8"])
def checkpoint(request, float_model, tmp_path_factory):
    """(directory, transformers' model from it) for FP4 experts (Flash) and FP8 (Flash-Base)."""
    cfg, weights = float_model
    path = write_checkpoint(cfg, weights, tmp_path_factory.mktemp(f"dsv4_{request.param}"),
                            shards=3, expert_dtype=request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, ref


def _ref_logits(ref, ids) -> np.ndarray:
    with torch.no_grad():
        return ref(torch.tensor(np.asarray(ids))[None]).logits[0].numpy()


def _assert_close(ours, want, what, tol=REL_TOL):
    scale = float(np.abs(want).max())
    err = float(np.abs(np.asarray(ours) - want).max())
    assert err <= tol * scale, f"{what}: max |diff| {err:.3g} > {tol} * {scale:.3g}"


# ----------------------------------------------------------------------------- the layout


def test_written_checkpoint_is_the_official_layout(checkpoint):
    path, _ = checkpoint
    index = json.loads((path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) == 3
    store = SafetensorsStore(path)
    dtype = {n: t.dtype for n, t in store.tensors.items()}
    fp4 = "fp4" in path.name
    assert dtype["layers.0.attn.wq_a.weight"] == "F8_E4M3"
    assert store.info("layers.0.attn.wq_a.scale").shape == (2, 2)  # [256, 256] in 128 blocks
    assert dtype["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    assert dtype["layers.1.ffn.experts.3.w1.weight"] == ("I8" if fp4 else "F8_E4M3")
    assert store.info("layers.1.ffn.experts.3.w1.weight").shape == ((128, 128) if fp4
                                                                   else (128, 256))
    assert store.info("layers.1.ffn.experts.3.w2.scale").shape == ((256, 4) if fp4 else (2, 1))
    assert dtype["embed.weight"] == dtype["head.weight"] == "BF16"
    assert dtype["layers.0.ffn.gate.tid2eid"] == "I64" and dtype["layers.1.ffn.gate.bias"] == "F32"
    assert dtype["layers.1.attn.indexer.compressor.ape"] == "F32"
    assert any(n.startswith("mtp.0.") for n in store.tensors)
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert config["compress_ratios"] == [0, 4, 128, 4, 0]  # the trailing 0 is the MTP block
    store.close()


def test_kept_as_stored_in_memory(checkpoint):
    path, _ = checkpoint
    params = gsm_jax.load(path, dtype="float32", keep_quantized=True)
    layer = params.weights["layers"][1]
    q_a, experts = layer["attn"]["q_a"], layer["moe"]["experts_gate_up"]
    assert isinstance(q_a, BlockQuantWeight) and q_a.values.dtype == jnp.float8_e4m3fn
    assert q_a.scale.dtype == jnp.uint8 and q_a.shape == (256, 256)
    assert isinstance(experts, BlockQuantWeight) and experts.shape == (4, 256, 256)
    if "fp4" in path.name:
        assert experts.fmt == "e2m1" and experts.values.dtype == jnp.uint8
        assert experts.nbytes == 4 * 256 * 256 // 2 + 4 * 256 * 256 // 32  # half a byte + scales
    assert isinstance(params.weights["layers"][0]["attn"]["o_a"], BlockQuantWeight)
    assert params.weights["embed"].dtype == jnp.float32  # the rest in the dtype asked for
    # the MTP block survives, as stored
    mtp = params.weights["mtp"]["0"]
    assert isinstance(mtp["e_proj"]["weight"], BlockQuantWeight)
    assert "attn" in mtp and "ffn" in mtp
    assert "unused_tensors" not in params.extra
    with pytest.raises(gsm_jax.errors.InvalidInputError, match="FP8/FP4"):
        gsm_jax.save(params, path.parent / "saved")
    as_stored = gsm_jax.load(path)  # no dtype: low precision kept, the rest bf16 as stored
    assert isinstance(as_stored.weights["layers"][1]["attn"]["q_a"], BlockQuantWeight)
    assert as_stored.weights["embed"].dtype == jnp.bfloat16


# ----------------------------------------------------------------------------- parity


def test_logits_match_transformers_from_pretrained(checkpoint):
    path, ref = checkpoint
    kept = gsm_jax.load(path, dtype="float32", keep_quantized=True)
    dequantized = gsm_jax.load(path, dtype="float32")
    assert not any(isinstance(a, BlockQuantWeight) for a in jax.tree.leaves(
        dequantized.weights, is_leaf=lambda a: isinstance(a, BlockQuantWeight)))
    rng = np.random.default_rng(7)
    rows = [rng.integers(0, VOCAB, n).tolist() for n in (37, 11, 4)]  # ragged, crosses windows
    ours_kept = np.asarray(gsm_jax.forward(kept, rows))
    ours_deq = np.asarray(gsm_jax.forward(dequantized, rows))
    for i, r in enumerate(rows):
        want = _ref_logits(ref, r)
        _assert_close(ours_kept[i, : len(r)], want, f"row {i}, FP8/FP4 in memory")
        _assert_close(ours_deq[i, : len(r)], want, f"row {i}, dequantized at load")
        assert (ours_kept[i, : len(r)].argmax(-1) == want.argmax(-1)).all()
    _assert_close(ours_kept, ours_deq, "kept vs dequantized", tol=1e-5)


def test_greedy_tokens_match_transformers_generate(checkpoint):
    path, ref = checkpoint
    params = gsm_jax.load(path, dtype="float32", keep_quantized=True)
    prompt = np.random.default_rng(3).integers(2, VOCAB, 9).tolist()
    ours = gsm_jax.generate_tokens(params, [prompt], max_new_tokens=12, eos_ids=[])[0]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert np.asarray(ours).tolist() == out[0, len(prompt):].tolist()


def test_bfloat16_dequantized_load_runs_close(checkpoint):
    path, ref = checkpoint
    params = gsm_jax.load(path, dtype="bfloat16")
    f32 = gsm_jax.load(path, dtype="float32")
    # e4m3 / e2m1 values times power-of-two scales are exact in bf16: the same weights
    for a, b in zip(jax.tree.leaves(params.weights["layers"][1]),
                    jax.tree.leaves(f32.weights["layers"][1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b))
    row = np.random.default_rng(5).integers(0, VOCAB, 16).tolist()
    got = np.asarray(gsm_jax.forward(params, [row]))[0]
    # bf16 activations through 4 random layers (weights ~N(0, 0.1)): ~15% of the logit
    # scale, not 1e-4; a wrong weight would be off by far more
    assert np.isfinite(got).all()
    _assert_close(got, _ref_logits(ref, row), "bf16", tol=0.3)


# FP4 experts (the released Flash) only: FP8 experts load and run at parity with
# transformers above; the smoothing and activation rounding do not look at the expert dtype
@pytest.mark.parametrize("checkpoint", ["fp4"], indirect=True)
def test_gsm_decode_equals_teacher_forcing_with_fp8_weights(checkpoint):
    """GSM sites on the real layout: attn_out feeds the FP8 grouped output projection,
    ffn_mid the FP8 shared expert; incremental decode equals the teacher-forced forward."""
    from decode_checks import decode_and_teacher_forced

    path, _ = checkpoint
    params = gsm_jax.load(path, dtype="float32", keep_quantized=True)
    # f32 filter arithmetic: the default bf16 filter rounds prefill and decode differently
    cfg = gsm_jax.GSMConfig(window_size=4, smooth_strength=0.3, target_layers="all",
                            max_window=8, short_request_tokens=0, precision="f32")
    rows = [np.random.default_rng(9).integers(2, VOCAB, n).tolist() for n in (10, 5)]
    plain = gsm_jax.forward(params, rows[:1])
    smoothed = gsm_jax.forward(params, rows[:1], gsm=cfg)
    assert float(np.abs(np.asarray(smoothed) - np.asarray(plain)).max()) > 1e-3  # GSM acts
    for toks, dec, tf in decode_and_teacher_forced(params, rows, max_new_tokens=6, gsm=cfg):
        assert len(toks) == 6
        _assert_close(dec, tf, "GSM decode vs teacher forcing")


# FP4 experts (the released Flash) only: FP8 experts load and run at parity with
# transformers above; the smoothing and activation rounding do not look at the expert dtype
@pytest.mark.parametrize("checkpoint", ["fp4"], indirect=True)
def test_fp8_activations_smooth_then_quantize(checkpoint):
    """`quantize(params, "fp8")` on FP8 weights: activations rounded per token and 128-block
    to e4m3 inside `linear`, after the GSM site smoothed them."""
    path, _ = checkpoint
    params = gsm_jax.load(path, dtype="float32", keep_quantized=True)
    fp8 = gsm_jax.quantize(params, "fp8")
    assert fp8.weights["layers"][1]["attn"]["q_a"].act == "e4m3"
    assert fp8.weights["layers"][1]["moe"]["experts_gate_up"].act == "e4m3"
    rows = [np.random.default_rng(4).integers(2, VOCAB, 12).tolist()]
    base = np.asarray(gsm_jax.forward(params, rows))
    act = np.asarray(gsm_jax.forward(fp8, rows))
    diff = float(np.abs(act - base).max()) / float(np.abs(base).max())
    # e4m3 keeps 3 mantissa bits (~3% per value); through 4 random layers the logits move
    # by tens of percent of their scale here, but stay finite and bounded
    assert np.isfinite(act).all() and 1e-5 < diff < 1.0
    gsm = gsm_jax.GSMConfig(window_size=4, smooth_strength=0.0, target_layers="all",
                            max_window=8, short_request_tokens=0)
    np.testing.assert_array_equal(np.asarray(gsm_jax.forward(fp8, rows, gsm=gsm)), act)


# ----------------------------------------------------------------------------- names


def _rewritten(src, dst, rename=None, drop=(), add=None, patch=None):
    """Copy a checkpoint into one shard with tensors renamed / dropped / added / patched."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.unlink()
    (dst / INDEX_FILE).unlink()
    store = SafetensorsStore(src)
    tensors = {}
    for name in store:
        if name in drop:
            continue
        arr = store.read(name)
        if patch and name in patch:
            arr = patch[name](arr)
        tensors[(rename or (lambda n: n))(name)] = (arr, store.info(name).dtype)
    tensors.update(add or {})
    store.close()
    write_safetensors(dst / "model.safetensors", tensors)
    return dst


def test_hugging_face_names_load_the_same(checkpoint, tmp_path):
    """transformers' module names with `.weight_scale_inv` scales load to the same tree."""
    path, _ = checkpoint

    def hf_name(name: str) -> str:
        if name.startswith("mtp."):
            return name
        name = name.replace(".scale", ".weight_scale_inv") if name.endswith(".scale") else name
        if ".ffn.experts." in name:  # per-expert tensors keep their index
            return "model." + name.replace(".ffn.", ".mlp.")
        stem, suffix = (name[: -len(".weight_scale_inv")], ".weight_scale_inv") \
            if name.endswith(".weight_scale_inv") else (name, "")
        if suffix:
            return ck._canonical_name(stem + ".weight").removesuffix(".weight") + suffix
        return ck._canonical_name(name)

    other = _rewritten(path, tmp_path / "hf_names", rename=hf_name)
    assert "model.layers.0.self_attn.q_a_proj.weight_scale_inv" in SafetensorsStore(other)
    a = gsm_jax.load(path, dtype="float32", keep_quantized=True)
    b = gsm_jax.load(other, dtype="float32", keep_quantized=True)
    la, lb = (jax.tree.leaves(p.weights["layers"]) for p in (a, b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_unused_tensors_are_reported(checkpoint, tmp_path, caplog):
    path, _ = checkpoint
    extra = {"layers.0.attn.mystery.weight": (np.zeros((4, 4), np.float32), "F32")}
    other = _rewritten(path, tmp_path / "extra", add=extra)
    with caplog.at_level("WARNING"):
        params = gsm_jax.load(other, dtype="float32")
    assert any("mystery" in n for n in params.extra["unused_tensors"])
    assert "not used by the model" in caplog.text and "mystery" in caplog.text


# ----------------------------------------------------------------------------- bad input


def test_missing_shard_is_named(checkpoint, tmp_path):
    path, _ = checkpoint
    broken = shutil.copytree(path, tmp_path / "no_shard")
    (broken / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00003.safetensors"):
        gsm_jax.load(broken)


def test_truncated_shard_is_named(checkpoint, tmp_path):
    path, _ = checkpoint
    broken = shutil.copytree(path, tmp_path / "truncated")
    shard = broken / "model-00003-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model-00003-of-00003.*truncated"):
        gsm_jax.load(broken)


def test_missing_tensor_and_missing_scale_are_named(checkpoint, tmp_path):
    path, _ = checkpoint
    gone = _rewritten(path, tmp_path / "no_tensor", drop={"layers.2.attn.wo_b.weight",
                                                          "layers.2.attn.wo_b.scale"})
    with pytest.raises(UnsupportedModelError, match="layers.2.self_attn.o_b_proj.weight"):
        gsm_jax.load(gone)
    no_scale = _rewritten(path, tmp_path / "no_scale", drop={"layers.1.attn.wq_b.scale"})
    with pytest.raises(ModelLoadError, match="layers.1.attn.wq_b.weight.*no scale"):
        gsm_jax.load(no_scale)


def test_scale_shape_that_does_not_fit_is_named(checkpoint, tmp_path):
    path, _ = checkpoint
    bad = _rewritten(path, tmp_path / "bad_scale",
                     patch={"layers.1.attn.wq_a.scale": lambda s: s[:1]})
    with pytest.raises(ModelLoadError, match="layers.1.attn.wq_a.scale.*does not fit"):
        gsm_jax.load(bad)


def test_e8m0_nan_byte_is_refused(checkpoint, tmp_path):
    path, _ = checkpoint

    def nan_byte(s):
        s = s.copy()
        s.flat[0] = 0xFF
        return s

    bad = _rewritten(path, tmp_path / "nan", patch={"layers.3.ffn.experts.1.w2.scale": nan_byte})
    with pytest.raises(ModelLoadError, match="layers.3.ffn.experts.1.w2.scale.*NaN"):
        gsm_jax.load(bad)


def test_expert_size_that_does_not_match_the_config_is_named(checkpoint, tmp_path):
    path, _ = checkpoint
    bad = shutil.copytree(path, tmp_path / "expert_size")
    config = json.loads((bad / "config.json").read_text())
    config["moe_intermediate_size"] = 256  # the stored experts are 128 wide
    (bad / "config.json").write_text(json.dumps(config))
    packed = r".*packed FP4" if "fp4" in path.name else ""
    with pytest.raises(ModelLoadError, match=r"experts_(gate_up|down) \(ffn.experts" + packed):
        gsm_jax.load(bad)


@pytest.mark.parametrize("key,value", [("quant_method", "awq"), ("fmt", "e5m2"),
                                       ("scale_fmt", "e4m3"), ("weight_block_size", [128])])
def test_unknown_quantization_config_is_named(key, value):
    hf = {**OFFICIAL, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                              "scale_fmt": "ue8m0", key: value}}
    with pytest.raises(UnsupportedModelError, match=f"quantization_config.{key}"):
        dv.DeepseekV4Config.from_hf_config(hf)
    with pytest.raises(UnsupportedModelError, match="expert_dtype"):
        dv.DeepseekV4Config.from_hf_config({**OFFICIAL, "expert_dtype": "int4",
                                            "quantization_config": {"quant_method": "fp8"}})


# ----------------------------------------------------------------------------- memory


def test_loading_holds_about_one_shard_beyond_the_loaded_weights(tmp_path):
    """Peak RSS while loading a ~300 MB, 4-shard checkpoint (random stored values), in a fresh
    process: what loading adds beyond the resident set before it and the loaded weights
    themselves (on a CPU device they live in host memory) stays under 1.5x the largest shard.

    The peak is VmHWM, reset after a warm-up load of a tiny checkpoint (imports, small
    compilations); `ru_maxrss` would not do: Linux carries it over from the forking
    (pytest) process.
    """
    wide = {**OFFICIAL, "hidden_size": 1024, "moe_intermediate_size": 1024, "q_lora_rank": 512,
            "n_routed_experts": 32, "num_attention_heads": 8, "index_n_heads": 8,
            "vocab_size": 4096}
    path = write_checkpoint(dv.DeepseekV4Config.from_hf_config(wide), None, tmp_path / "big",
                            shards=4, seed=0)
    warm = write_checkpoint(dv.DeepseekV4Config.from_hf_config(OFFICIAL), None,
                            tmp_path / "warm", shards=2, seed=1)
    script = textwrap.dedent(f"""
        import json
        import gsm_jax
        from gsm_jax.models.safetensors_io import SafetensorsStore
        def status(key):
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))
        gsm_jax.load({str(warm)!r})
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak (VmHWM) to the current resident set
        before = status("VmRSS")
        params = gsm_jax.load({str(path)!r})
        peak = status("VmHWM")
        store = SafetensorsStore({str(path)!r})
        print(json.dumps(dict(before=before, peak=peak, params=params.nbytes(),
                              shard=store.largest_shard_bytes(),
                              total=sum(t.nbytes for t in store.tensors.values()))))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=600, check=True).stdout
    m = json.loads(out.strip().splitlines()[-1])
    assert m["total"] > 250e6
    assert abs(m["params"] - m["total"]) < 0.05 * m["total"]  # kept as stored: same bytes
    overhead = m["peak"] - m["before"] - m["params"]
    assert overhead < 1.5 * m["shard"], (
        f"loading added {overhead / 1e6:.0f} MB beyond the weights; largest shard "
        f"{m['shard'] / 1e6:.0f} MB")


def test_official_config_round_trips(float_model):
    cfg, _ = float_model
    assert dv.DeepseekV4Config.from_hf_config(official_config(cfg)) == cfg
