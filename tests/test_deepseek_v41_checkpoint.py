"""DeepSeek-V4.1 checkpoints in the released layout (models/deepseek_v41_checkpoint.py).

- Round trip: released-name float tensors -> write_checkpoint -> read_checkpoint ->
  dequantized equals the tensors rounded the way the format rounds, computed here
  independently (FP8 e4m3 and FP4 e2m1 by nearest-value search over grids built from
  the bit definitions, power-of-two block scales by exact search, BF16 by bit
  arithmetic), not with models/block_quant.py.
- The layout: dtypes, scale grids, shards + index total_size, nested config.json,
  tokenizer.json beside, Engram tables in their own shards.
- Each bad input raises the named gsm_jax error, naming the tensor or key.
- Cross-check (research note deepseek_v41.md section 11.1): NeMo AutoModel 0.7.0's own
  state-dict adapter (`from_hf`) loads a checkpoint we wrote from its model with 0
  missing and 0 unexpected keys, and every loaded tensor equals our dequantization.
"""

from __future__ import annotations

import json
import math
import shutil

import ml_dtypes
import numpy as np
import pytest

from gsm_jax.errors import ModelLoadError, UnsupportedModelError
from gsm_jax.models.deepseek_common_checkpoint import StoredQuant
from gsm_jax.models.deepseek_v41_checkpoint import (
    EngramTableRef,
    checkpoint_tensors,
    engram_primes,
    engram_rows,
    read_checkpoint,
    write_checkpoint,
)
from gsm_jax.models.safetensors_io import INDEX_FILE, SafetensorsStore, read_header

TOKENIZER_JSON = json.dumps({"version": "1.0", "model": {"type": "WordLevel", "vocab": {}}})

# ----------------------------------------------------------------------------- independent refs


def _e4m3_positive() -> np.ndarray:
    """Finite non-negative float8_e4m3fn values by code 0..126 (bias 7, 3 mantissa bits;
    code 127 is NaN)."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.asarray(vals, np.float64)


E4M3 = _e4m3_positive()
E2M1 = np.asarray([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)


def _nearest(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """|x| rounded to the nearest grid value (ties to the even code), sign kept."""
    a = np.abs(x)
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = a - grid[lo], grid[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.copysign(grid[pick], x)


def _pow2_scale(amax: float, top: float) -> float:
    """The smallest power of two s with amax / s <= top (exact, by search)."""
    if amax == 0:
        return 2.0 ** -108  # any scale gives zeros
    k = math.frexp(amax)[1] - math.frexp(top)[1]
    while amax > top * 2.0 ** k:
        k += 1
    while amax <= top * 2.0 ** (k - 1):
        k -= 1
    return 2.0 ** k


def _ref_blocks(w: np.ndarray, block: tuple[int, int], grid: np.ndarray) -> np.ndarray:
    w = np.asarray(w, np.float64)
    out = np.empty_like(w)
    for i in range(0, w.shape[0], block[0]):
        for j in range(0, w.shape[1], block[1]):
            b = w[i:i + block[0], j:j + block[1]]
            s = _pow2_scale(float(np.abs(b).max()), float(grid[-1]))
            out[i:i + block[0], j:j + block[1]] = _nearest(b / s, grid) * s
    return out


def ref_fp8(w, block=(32, 32)):
    return _ref_blocks(w, block, E4M3)


def ref_fp4(w):
    return _ref_blocks(w, (1, 32), E2M1)


def ref_bf16(w):
    u = np.asarray(w, np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


# ----------------------------------------------------------------------------- a tiny model

D, INTER, N_EXP, ENGRAM_D = 64, 48, 3, 64


def tiny_text(**overrides) -> dict:
    """The keys the checkpoint needs: 3 layers, Engram on layer 1 (2 heads x n = 2..4,
    primes from 50: 53 .. 73), a layer 2 that compresses and indexes."""
    text = dict(vocab_size=96, hidden_size=D, num_hidden_layers=3, moe_intermediate_size=INTER,
                n_routed_experts=N_EXP, engram_layer_ids=[1], engram_vocab_size=50,
                engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=ENGRAM_D,
                engram_num_embeddings=[384], compress_ratios=[0, 0, 2])
    text.update(overrides)
    return text


def tiny_tensors(seed: int = 0, rows: int = 384) -> dict[str, np.ndarray]:
    """Released-name float tensors; magnitudes vary by row (different block scales), and
    FP8 shapes that are not multiples of 32 (partial edge blocks)."""
    rng = np.random.default_rng(seed)

    def w(*shape):
        mag = 10.0 ** rng.uniform(-3, 1, size=(shape[0],) + (1,) * (len(shape) - 1))
        return (rng.standard_normal(shape) * mag).astype(np.float32)

    t = {"embed.weight": w(96, D), "head.weight": w(96, D), "norm.weight": w(D)}
    for i in range(3):
        p = f"layers.{i}."
        t.update({
            p + "attn_norm.weight": w(D), p + "ffn_norm.weight": w(D),
            p + "hc_attn_fn": w(24, 4 * D), p + "hc_attn_base": w(24), p + "hc_attn_scale": w(3),
            p + "hc_ffn_fn": w(24, 4 * D), p + "hc_ffn_base": w(24), p + "hc_ffn_scale": w(3),
            p + "attn.attn_sink": w(4), p + "attn.wq_a.weight": w(40, D),
            p + "attn.q_norm.weight": w(40), p + "attn.wq_b.weight": w(136, 40),
            p + "attn.wkv.weight": w(72, D), p + "attn.kv_norm.weight": w(72),
            p + "attn.wo_a.weight": w(48, 72), p + "attn.wo_b.weight": w(D, 48),
            p + "ffn.gate.weight": w(N_EXP, D), p + "ffn.gate.bias": w(N_EXP),
            p + "ffn.gate.bias_vl": w(N_EXP),
            p + "ffn.shared_experts.w1.weight": w(INTER, D),
            p + "ffn.shared_experts.w3.weight": w(INTER, D),
            p + "ffn.shared_experts.w2.weight": w(D, INTER),
        })
        for e in range(N_EXP):
            t[p + f"ffn.experts.{e}.w1.weight"] = w(INTER, D)
            t[p + f"ffn.experts.{e}.w3.weight"] = w(INTER, D)
            t[p + f"ffn.experts.{e}.w2.weight"] = w(D, INTER)
    t.update({"layers.1.engram.embed.weight": w(rows, ENGRAM_D),
              "layers.1.engram.wkv.weight": w(5 * D, 3 * 2 * ENGRAM_D),
              "layers.1.engram.q_weight": w(4, D), "layers.1.engram.k_weight": w(4, D),
              "layers.2.attn.compressor.wkv.weight": w(72, D),
              "layers.2.attn.compressor.wgate.weight": w(72, D),
              "layers.2.attn.compressor.norm.weight": w(72),
              "layers.2.attn.indexer.wq_b.weight": w(64, 40),
              "layers.2.attn.indexer.weights_proj.weight": w(4, D),
              "layers.2.attn.indexer.wk.weight": w(16, 72),
              "layers.2.attn.indexer.k_norm.weight": w(16),
              # the draft and the vision tower: written as given
              "mtp.0.main_proj.weight": w(D, 3 * D).astype(ml_dtypes.bfloat16),
              "mtp.0.attn_norm.weight": w(D),
              "vision.blocks.0.attn.wqkv.weight": w(96, 32).astype(ml_dtypes.bfloat16),
              "aligner.w1.weight": w(D, 32).astype(ml_dtypes.bfloat16),
              "image_newline": w(D).astype(ml_dtypes.bfloat16)})
    return t


FP8 = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
       "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "engram.wkv")
F32 = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
       "hc_ffn_scale", "attn.attn_sink", "ffn.gate.bias", "ffn.gate.bias_vl")


def expected(name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """(stored dtype, the float the reader must give back) for one written tensor."""
    stem = name.split(".", 2)[-1] if name.startswith("layers.") else ""
    if name.startswith(("mtp.", "vision.", "aligner.", "image_")):
        return {np.dtype(ml_dtypes.bfloat16): "BF16", np.dtype(np.float32): "F32"}[
            value.dtype], value.astype(np.float32)
    if ".ffn.experts." in name:
        return "I8", ref_fp4(value)
    if name.endswith(".engram.embed.weight"):
        return "F8_E4M3", ref_fp8(value, (1, 32))
    if stem.removesuffix(".weight") in FP8:
        return "F8_E4M3", ref_fp8(value)
    if stem in F32:
        return "F32", value
    return "BF16", ref_bf16(value)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tensors = tiny_tensors()
    path = write_checkpoint(tmp_path_factory.mktemp("v41"), {"text_config": tiny_text()},
                            tensors, TOKENIZER_JSON, shard_bytes=64_000)
    hf, ckpt = read_checkpoint(path)
    yield path, tensors, hf, ckpt
    ckpt.close()


def _write_bad(tmp_path, tensors=None, text=None, tokenizer=True, **kw):
    tensors = tiny_tensors() if tensors is None else tensors
    return write_checkpoint(tmp_path / "bad", {"text_config": text or tiny_text(), **kw},
                            tensors, TOKENIZER_JSON if tokenizer else None, shard_bytes=64_000)


# ----------------------------------------------------------------------------- round trip


def test_round_trip_equals_the_formats_rounding(written):
    path, tensors, _, ckpt = written
    store = SafetensorsStore(path)
    for name, value in tensors.items():
        dtype, want = expected(name, np.asarray(value))
        assert store.info(name).dtype == dtype, name
        got = ckpt.dequantized(name)
        assert got.dtype == np.float32 and got.shape == value.shape, name
        np.testing.assert_array_equal(got, want.astype(np.float32), err_msg=name)
    store.close()


def test_every_stored_tensor_is_read(written):
    path, tensors, _, ckpt = written
    assert set(ckpt.tensors) == set(tensors)  # scales folded into their weights
    assert ckpt.unused == ("aligner.w1.weight", "image_newline",
                           "vision.blocks.0.attn.wqkv.weight")
    assert ckpt.engram_primes == {1: (53, 59, 61, 67, 71, 73)}
    assert ckpt.tokenizer_file == path / "tokenizer.json"


def test_stored_containers(written):
    _, tensors, _, ckpt = written
    fp8 = ckpt["layers.0.attn.wq_b.weight"]  # [136, 40]: partial edge blocks both ways
    assert isinstance(fp8, StoredQuant) and (fp8.fmt, fp8.block) == ("e4m3", (32, 32))
    assert fp8.values.dtype == ml_dtypes.float8_e4m3fn and fp8.values.shape == (136, 40)
    assert fp8.scale.dtype == np.uint8 and fp8.scale.shape == (5, 2)
    fp4 = ckpt["layers.2.ffn.experts.1.w2.weight"]  # [64, 48]
    assert (fp4.fmt, fp4.block) == ("e2m1", (1, 32))
    assert fp4.values.dtype == np.uint8 and fp4.values.shape == (64, 24)
    assert fp4.scale.shape == (64, 2)
    bf16 = ckpt["layers.0.attn_norm.weight"]
    assert bf16.dtype == ml_dtypes.bfloat16


@pytest.mark.parametrize("name", ["layers.0.attn.wq_b.weight", "layers.2.ffn.experts.1.w2.weight",
                                  "layers.1.engram.embed.weight"])
def test_block_quant_weights_decode_like_the_reader(written, name):
    """The model's container (models/block_quant.BlockQuantWeight, jnp decode) gives the
    reader's numbers."""
    _, _, _, ckpt = written
    w = ckpt.block_quant(name)
    assert w.block == ((32, 32) if ".attn." in name else (1, 32))
    np.testing.assert_array_equal(np.asarray(w.dequantize_stored()), ckpt.dequantized(name))
    with pytest.raises(TypeError, match="not block-quantized"):
        ckpt.block_quant("layers.0.attn_norm.weight")


def test_engram_table_rows_are_read_lazily(written):
    _, tensors, _, ckpt = written
    table = ckpt["layers.1.engram.embed.weight"]
    assert isinstance(table, EngramTableRef) and table.shape == (384, ENGRAM_D)
    ids = np.array([[7, 5, 6], [383, 0, 6]])
    rows = table.rows(ids)
    assert rows.values.dtype == ml_dtypes.float8_e4m3fn and rows.values.shape == (6, ENGRAM_D)
    assert rows.scale.dtype == np.uint8 and rows.scale.shape == (6, ENGRAM_D // 32)
    whole = table.load()
    assert (whole.fmt, whole.block) == ("e4m3", (1, 32))
    np.testing.assert_array_equal(rows.values.view(np.uint8),
                                  whole.values[ids.reshape(-1)].view(np.uint8))
    np.testing.assert_array_equal(rows.scale, whole.scale[ids.reshape(-1)])
    want = ref_fp8(tensors["layers.1.engram.embed.weight"], (1, 32))[ids.reshape(-1)]
    np.testing.assert_array_equal(table.dequantize_rows(ids), want.astype(np.float32))
    with pytest.raises(IndexError):
        table.rows([384])


def test_written_layout(written):
    path, tensors, hf, _ = written
    assert hf["model_type"] == "deepseek_v41"
    assert hf["architectures"] == ["DeepseekV41ForCausalLM"]
    assert hf["text_config"]["model_type"] == "deepseek_v41_text"
    assert hf["text_config"]["engram_num_embeddings"] == [384]
    assert hf["vision_config"]["model_type"] == "deepseek_v41_vision"
    assert hf["quantization_config"] == {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
        "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
    assert (path / "tokenizer.json").read_text() == TOKENIZER_JSON
    index = json.loads((path / INDEX_FILE).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3
    headers = {s: read_header(path / s) for s in shards}
    data = sum(t.nbytes for h in headers.values() for t in h.values())
    assert index["metadata"]["total_size"] == data
    assert {n for h in headers.values() for n in h} == set(index["weight_map"])
    for shard, h in headers.items():  # whole tensors, each shard within the size
        assert sum(t.nbytes for t in h.values()) <= 64_000 or len(h) == 1 or \
            any(".engram.embed." in n for n in h), shard
    table = index["weight_map"]["layers.1.engram.embed.weight"]
    assert set(headers[table]) == {"layers.1.engram.embed.weight", "layers.1.engram.embed.scale"}
    store = SafetensorsStore(path)
    for name, shape in {"layers.1.engram.embed.scale": (384, 2),
                        "layers.1.engram.wkv.scale": (10, 12),
                        "layers.0.attn.wkv.scale": (3, 2),
                        "layers.0.ffn.experts.2.w1.scale": (INTER, 2),
                        "layers.0.ffn.experts.2.w1.weight": (INTER, D // 2)}.items():
        assert store.info(name).shape == shape, name
        assert store.info(name).dtype == ("I8" if name.endswith("weight") else "F8_E8M0")
    store.close()


def test_engram_primes_follow_the_release():
    """Section 6.2: consecutive primes from engram_vocab_size, 24 per layer, never reused;
    the row counts are the released engram_num_embeddings."""
    text = dict(engram_layer_ids=[1, 14], engram_vocab_size=16000000, engram_max_ngram_size=4,
                engram_n_heads=8)
    primes = engram_primes(text)
    assert primes[1][:8] == (16000057, 16000079, 16000081, 16000097, 16000121, 16000129,
                             16000133, 16000183)
    assert primes[1][-1] == 16000463 and primes[14][0] == 16000477
    assert primes[14][-8:] == (16000781, 16000799, 16000813, 16000819, 16000841, 16000877,
                               16000879, 16000889)
    assert engram_rows(text) == {1: 384006168, 14: 384016682}


def test_engram_primes_agree_with_models_engram():
    """models/engram.py (the hash, another implementation of the same rule) takes the
    same primes, for the released and the tiny configs."""
    from gsm_jax.models import engram
    released = dict(engram_layer_ids=[1, 14], engram_vocab_size=16000000,
                    engram_max_ngram_size=4, engram_n_heads=8,
                    engram_compressed_vocab_size=99092,
                    engram_num_embeddings=[384006168, 384016682])
    tiny = {**tiny_text(), "engram_compressed_vocab_size": 52}
    for text in (released, tiny):
        specs = engram.engram_specs(text)
        assert {s.layer_id: s.primes for s in specs} == engram_primes(text)
        assert [s.num_embeddings for s in specs] == list(engram_rows(text).values())


def test_scale_grids_of_the_released_shapes():
    """Section 9.2's stored shapes give its scale shapes."""
    from gsm_jax.models.deepseek_v41_checkpoint import _expected_scale

    released = [("fp8", (32768, 1280), (1024, 40)),  # attn.wq_b
                ("fp8", (8192, 4096), (256, 128)),  # attn.wo_a
                ("fp8", (4096, 1280), (128, 40)),  # attn.indexer.wq_b
                ("fp8", (25600, 6144), (800, 192)),  # engram.wkv
                ("fp4", (2304, 2560), (2304, 160)),  # experts.w1 (I8: 5120 logical)
                ("fp4", (5120, 1152), (5120, 72)),  # experts.w2
                ("engram", (384006168, 256), (384006168, 8))]  # engram.embed
    for kind, shape, scale in released:
        assert _expected_scale(kind, shape) == scale, (kind, shape)


@pytest.mark.parametrize("overrides,key", [({"engram_layer_ids": [1, 1]}, "engram_layer_ids"),
                                           ({"engram_n_heads": None}, "engram_n_heads"),
                                           ({"engram_vocab_size": "50"}, "engram_vocab_size")])
def test_engram_config_errors_name_the_key(overrides, key):
    with pytest.raises(UnsupportedModelError, match=rf"text_config\.{key}"):
        engram_primes(tiny_text(**overrides))


def test_engram_rows_agree_with_the_reference_harness():
    import v41_reference as v41
    text = v41.tiny_config()["text_config"]
    assert list(engram_rows(text).values()) == text["engram_num_embeddings"]


def test_open_store_entry_point(written):
    """What a family's load_checkpoint(cfg, hf_config, store, ...) hook calls."""
    path, tensors, hf, ckpt = written
    store = SafetensorsStore(path)
    other = checkpoint_tensors(hf, store)
    assert set(other.tensors) == set(ckpt.tensors) and other.unused == ckpt.unused
    np.testing.assert_array_equal(other.dequantized("layers.2.attn.indexer.wq_b.weight"),
                                  ckpt.dequantized("layers.2.attn.indexer.wq_b.weight"))
    store.close()


def test_engram_table_memmap(written):
    _, _, _, ckpt = written
    table = ckpt["layers.1.engram.embed.weight"]
    values, scale = table.memmap()
    whole = table.load()
    assert values.dtype == ml_dtypes.float8_e4m3fn and values.shape == (384, ENGRAM_D)
    np.testing.assert_array_equal(np.asarray(values).view(np.uint8),
                                  whole.values.view(np.uint8))
    np.testing.assert_array_equal(np.asarray(scale), whole.scale)


@pytest.mark.parametrize("n_layers", [2, 1])
def test_truncated_config_reports_the_layers_it_drops(tmp_path, n_layers):
    # 2: Engram layer 1 is still loaded; 1: it is not, so no tokenizer is needed
    path = _write_bad(tmp_path, text=tiny_text(num_hidden_layers=n_layers),
                      tokenizer=n_layers > 1)
    _, ckpt = read_checkpoint(path)
    dropped = sorted(n for n in ckpt.tensors
                     if n.startswith("layers.") and int(n.split(".")[1]) >= n_layers)
    assert dropped and set(dropped) <= set(ckpt.unused)
    assert not any(n.startswith("layers.0.") for n in ckpt.unused)
    ckpt.close()


def test_quantize_mtp_follows_the_layer_rules(tmp_path):
    t = {k: v for k, v in tiny_tensors().items() if not k.startswith("mtp.")}
    layer0 = {k: v for k, v in t.items() if k.startswith("layers.0.")}
    mtp = {"mtp.0." + k.removeprefix("layers.0."): v for k, v in layer0.items()}
    mtp["mtp.0.main_proj.weight"] = tiny_tensors(seed=1)["mtp.0.main_proj.weight"].astype(
        np.float32)
    path = write_checkpoint(tmp_path / "mtp", {"text_config": tiny_text()}, {**t, **mtp},
                            TOKENIZER_JSON, quantize_mtp=True)
    _, ckpt = read_checkpoint(path)
    store = SafetensorsStore(path)
    for name, value in mtp.items():
        dtype, want = expected("layers.0." + name.removeprefix("mtp.0."), value)
        if name == "mtp.0.main_proj.weight":
            dtype, want = "F8_E4M3", ref_fp8(value)
        assert store.info(name).dtype == dtype, name
        np.testing.assert_array_equal(ckpt.dequantized(name), want.astype(np.float32),
                                      err_msg=name)
    store.close()
    ckpt.close()


# ----------------------------------------------------------------------------- bad inputs


def _raw(value, block):
    """(values, scale) tuples written verbatim (bypassing the writer's quantizer)."""
    from gsm_jax.models import block_quant as bq

    v, s = bq.quantize_np(value, "e4m3", block)
    return (v, "F8_E4M3"), (s, "F8_E8M0")


def test_missing_engram_table(tmp_path):
    t = tiny_tensors()
    _, scale = _raw(t.pop("layers.1.engram.embed.weight"), (1, 32))
    t["layers.1.engram.embed.scale"] = scale
    with pytest.raises(ModelLoadError, match=r"Engram table 'layers\.1\.engram\.embed\.weight'"):
        read_checkpoint(_write_bad(tmp_path, t))


def test_missing_engram_scale(tmp_path):
    t = tiny_tensors()
    t["layers.1.engram.embed.weight"], _ = _raw(t["layers.1.engram.embed.weight"], (1, 32))
    with pytest.raises(ModelLoadError, match=r"'layers\.1\.engram\.embed\.scale'.*missing"):
        read_checkpoint(_write_bad(tmp_path, t))


def test_missing_engram_wkv(tmp_path):
    t = tiny_tensors()
    del t["layers.1.engram.wkv.weight"]
    with pytest.raises(ModelLoadError, match=r"'layers\.1\.engram\.wkv\.weight'.*missing"):
        read_checkpoint(_write_bad(tmp_path, t))


def test_engram_rows_must_be_the_sum_of_the_primes(tmp_path):
    # 385 rows declared and stored: one more than primes 53 .. 73 sum to
    t = tiny_tensors(rows=385)
    with pytest.raises(ModelLoadError,
                       match=r"'layers\.1\.engram\.embed\.weight' has 385 rows.*sum to 384"):
        read_checkpoint(_write_bad(tmp_path, t, tiny_text(engram_num_embeddings=[385])))


def test_engram_rows_must_match_the_config(tmp_path):
    with pytest.raises(ModelLoadError, match=r"text_config\.engram_num_embeddings\[0\]=400"):
        read_checkpoint(_write_bad(tmp_path, text=tiny_text(engram_num_embeddings=[400])))


def test_engram_rows_follow_the_vocab_size(tmp_path):
    # engram_vocab_size 60: primes 61, 67, 71, 73, 79, 83; the 384-row table no longer fits
    with pytest.raises(ModelLoadError, match=r"primes \(61 \.\. 83.*sum to 434"):
        read_checkpoint(_write_bad(tmp_path, text=tiny_text(engram_vocab_size=60)))


def test_engram_tensor_of_an_unconfigured_layer(tmp_path):
    t = tiny_tensors()
    t["layers.0.engram.q_weight"] = t["layers.1.engram.q_weight"]
    with pytest.raises(ModelLoadError, match=r"'layers\.0\.engram\.q_weight'.*engram_layer_ids"):
        read_checkpoint(_write_bad(tmp_path, t))


def test_128_block_scale_grid_in_a_32_block_checkpoint(tmp_path):
    t = tiny_tensors()
    t["layers.0.attn.wq_b.weight"], t["layers.0.attn.wq_b.scale"] = _raw(
        t["layers.0.attn.wq_b.weight"], (128, 128))
    with pytest.raises(ModelLoadError,
                       match=r"scale 'layers\.0\.attn\.wq_b\.scale' has shape \[2, 1\].*"
                             r"needs \[5, 2\].*128 x 128"):
        read_checkpoint(_write_bad(tmp_path, t))


@pytest.mark.parametrize("name,block", [("layers.2.ffn.experts.0.w1.weight", (32, 32)),
                                        ("layers.1.engram.embed.weight", (32, 32))])
def test_row_scales_of_the_wrong_grid(tmp_path, name, block):
    from gsm_jax.models import block_quant as bq

    t = tiny_tensors()
    if ".experts." in name:
        v, s = bq.quantize_np(t[name], "e2m1", block)
        t[name] = (v.view(np.int8), "I8")
    else:
        v, s = bq.quantize_np(t[name], "e4m3", block)
        t[name] = (v, "F8_E4M3")
    t[name.removesuffix(".weight") + ".scale"] = (s, "F8_E8M0")
    scale = name.removesuffix(".weight") + ".scale"
    with pytest.raises(ModelLoadError, match=rf"'{scale.replace('.', '[.]')}'"):
        read_checkpoint(_write_bad(tmp_path, t))


def test_fp8_weight_without_scale(tmp_path):
    t = tiny_tensors()
    t["layers.0.attn.wo_a.weight"], _ = _raw(t["layers.0.attn.wo_a.weight"], (32, 32))
    with pytest.raises(ModelLoadError, match=r"'layers\.0\.attn\.wo_a\.weight'.*no scale"):
        read_checkpoint(_write_bad(tmp_path, t))


def test_scale_without_weight(tmp_path):
    t = tiny_tensors()
    _, t["layers.0.attn.wo_b.scale"] = _raw(t.pop("layers.0.attn.wo_b.weight"), (32, 32))
    with pytest.raises(ModelLoadError, match=r"'layers\.0\.attn\.wo_b\.scale' has no weight"):
        read_checkpoint(_write_bad(tmp_path, t))


def test_engram_nan_scale_is_refused_when_read(tmp_path):
    from gsm_jax.models import block_quant as bq

    t = tiny_tensors()
    v, s = bq.quantize_np(t.pop("layers.1.engram.embed.weight"), "e4m3", (1, 32))
    s[10, 1] = 0xFF
    t["layers.1.engram.embed.weight"] = (v, "F8_E4M3")
    t["layers.1.engram.embed.scale"] = (s, "F8_E8M0")
    _, ckpt = read_checkpoint(_write_bad(tmp_path, t))
    table = ckpt["layers.1.engram.embed.weight"]
    table.rows([9, 11])
    for read in (lambda: table.rows([3, 10]), table.load, table.dequantize):
        with pytest.raises(ModelLoadError, match=r"'layers\.1\.engram\.embed\.scale'.*NaN"):
            read()
    ckpt.close()


def test_engram_layers_need_a_tokenizer(tmp_path):
    with pytest.raises(ModelLoadError, match=r"engram_layer_ids \[1\] needs tokenizer\.json"):
        read_checkpoint(_write_bad(tmp_path, tokenizer=False))


def test_no_engram_needs_no_tokenizer(tmp_path):
    t = {k: v for k, v in tiny_tensors().items() if ".engram." not in k}
    hf, ckpt = read_checkpoint(_write_bad(tmp_path, t, tiny_text(engram_layer_ids=[],
                                                                  engram_num_embeddings=[]),
                                          tokenizer=False))
    assert ckpt.engram_primes == {} and ckpt.tokenizer_file is None
    ckpt.close()


def test_other_quantization_configs_are_refused(tmp_path):
    path = _write_bad(tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["weight_block_size"] = [128, 128]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"quantization_config\.weight_block_size"):
        read_checkpoint(path)
    config["quantization_config"]["weight_block_size"] = [32, 32]
    config["quantization_config"]["expert_dtype"] = "fp8"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"quantization_config\.expert_dtype"):
        read_checkpoint(path)
    del config["text_config"]
    config["quantization_config"]["expert_dtype"] = "fp4"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"text_config"):
        read_checkpoint(path)


def test_writer_refuses_other_quantization_and_unknown_names(tmp_path):
    with pytest.raises(ValueError, match="quantization_config"):
        write_checkpoint(tmp_path / "a", {"text_config": tiny_text(), "quantization_config": {
            "weight_block_size": [128, 128]}}, {}, None)
    with pytest.raises(ValueError, match="'model.embed_tokens.weight'"):
        write_checkpoint(tmp_path / "b", tiny_text(),
                         {"model.embed_tokens.weight": np.zeros((2, 2), np.float32)}, None)


# ----------------------------------------------------------------------------- NeMo cross-check


def test_nemo_from_hf_loads_our_checkpoint(tmp_path):
    """NeMo's adapter loads what we wrote from its own model's weights: 0 missing and 0
    unexpected keys, and each loaded tensor equals our reader's dequantization bitwise."""
    import copy

    import torch
    import v41_reference as v41
    from safetensors.torch import load_file

    config = v41.tiny_config()
    model = v41.nemo_model(config, v41.tiny_tokenizer(), seed=0)
    released = v41.released_state_dict(model)
    path = write_checkpoint(tmp_path / "nemo", v41.saved_config(model), released,
                            v41.tiny_tokenizer_json(),
                            shard_bytes=100_000)
    _, ckpt = read_checkpoint(path)
    assert set(ckpt.tensors) == set(released) and ckpt.unused == ()
    hf_state = {}
    for shard in sorted(set(json.loads((path / INDEX_FILE).read_text())["weight_map"].values())):
        hf_state.update(load_file(path / shard))
    assert hf_state["layers.1.engram.embed.scale"].dtype == torch.float8_e8m0fnu
    assert hf_state["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    target = copy.deepcopy(model)  # the cached model stays as it is
    native = target.state_dict_adapter.from_hf(dict(hf_state))
    result = target.load_state_dict(native, strict=False)
    assert result.missing_keys == [] and result.unexpected_keys == []
    loaded = v41.released_state_dict(target)
    assert set(loaded) == set(released)
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, ckpt.dequantized(name), err_msg=name)
    ckpt.close()
    shutil.rmtree(path)
