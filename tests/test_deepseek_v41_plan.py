"""DeepSeek-V4.1-Flash at real size without its weights: the released layout computed from
the config alone (`deepseek_v41_checkpoint.released_layout`), the planner by part, and the
Engram tables row-sharded on a mesh.

The layout is checked against two independent sources: the release's own index and the
HF API's per-dtype counts (research note §9.1, §9.3, §9.5: 510,286,023,000 B, 96,085
tensors, 763,205,315,794 logical parameters), and NeMo AutoModel 0.7.0's state-dict
adapter, whose released names and shapes on a tiny config must be ours exactly. The
shipped real config (`gsm_jax/data/deepseek_v41_flash_config.json`) is checked against
NeMo's config defaults, which the note says are the released values.

On a mesh (8 forced host devices, in a subprocess): a tiny released-layout checkpoint
with two Engram layers, `load(dir, mesh=...)` (tables placed slice by slice, padded to the
mesh), equals one device on 1 x 8 (logits to 1e-5 of the scale, greedy tokens with GSM
on equal, FP8 / FP4 kept); device 0 holds 1/M of each table; and the
planner's per-device weight bytes equal the bytes of device 0's shards. The cache QDQ is
off in that comparison: a sharded sum differs from the unsharded one by ulps, which can
cross an FP8 rounding midpoint (tests/test_deepseek_v41_load.py) and would test the
rounding, not the sharding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import v41_reference as ref
from test_sharding import run_on_8_devices

import gsm_jax
from gsm_jax.models.deepseek_v41_checkpoint import (
    _logical_tensors,
    layout_totals,
    released_layout,
    write_checkpoint,
)
from gsm_jax.models.safetensors_io import SafetensorsStore

REAL_CONFIG = Path(gsm_jax.__file__).parent / "data" / "deepseek_v41_flash_config.json"
REAL = json.loads(REAL_CONFIG.read_text())


def test_released_layout_equals_the_release_index():
    t = layout_totals(released_layout(REAL))
    assert t["bytes"] == 510_286_023_000  # index total_size
    assert t["tensors"] == 96_085
    # the HF API's per-dtype parameter counts (I8 counted as FP4 values, two per byte)
    assert t["BF16"] == 1_976_441_856
    assert t["F32"] == 42_307_282
    assert t["F8_E4M3"] == 204_015_223_296
    assert 2 * t["I8"] == 557_171_343_360


def test_planner_counts_the_release_to_the_byte():
    with_vision = gsm_jax.plan("deepseek-v4.1-flash", device_memory="1TB", vision=True)
    assert with_vision.parameters == 763_205_315_794
    stored = [n for n in with_vision.notes if n.startswith("weights as stored")]
    assert stored == ["weights as stored in the release: 510,286,023,000 B per device"]
    text = gsm_jax.plan("deepseek-v4.1-flash", device_memory="1TB")
    vision = with_vision.lines["weights: vision tower + aligner (BF16)"]
    assert vision == 970_536_960
    assert sum(v for k, v in text.lines.items() if k.startswith("weights")
               and "held by gsm_jax" not in k) == 510_286_023_000 - vision
    assert "weights: vision tower + aligner (BF16)" not in text.lines


def test_planner_splits_by_part_on_8_devices():
    one = gsm_jax.plan("deepseek-v4.1-flash", device_memory="1TB")
    p = gsm_jax.plan("deepseek-v4.1-flash", (1, 8), "141GB", batch=8, context=8192)
    experts = "weights: routed experts (FP4 + E8M0)"
    tables = "weights: Engram tables (FP8 + E8M0)"
    assert p.lines[experts] * 8 == one.lines[experts]  # 384 experts, 48 per device
    # the tables' rows padded to a multiple of 8 (384016682 is not one): at most 7 rows
    assert 0 <= p.lines[tables] * 8 - one.lines[tables] <= 2 * 7 * 264
    assert p.fits, p.table()
    assert any("890 B per cached token" in n for n in p.notes)
    # the cache lines are the packed caches' bytes (batch 8 over 1 data shard: 8 rows of
    # 8192 tokens at 890 B, plus the windows); float caches (--kv-cache-dtype float) more
    entries = ("cache: sliding-window K=V", "cache: compressed KV (shared)",
               "cache: index keys (shared)")
    assert sum(p.lines[k] for k in entries) == 8 * (8192 * 890 + 40 * 128 * 528)
    f = gsm_jax.plan("deepseek-v4.1-flash", (1, 8), "141GB", batch=8, context=8192,
                     kv_cache_dtype="float")
    assert sum(f.lines[k] for k in entries) > 3 * sum(p.lines[k] for k in entries)
    # the tables in pinned host memory: the same bytes, listed apart, off the device total
    h = gsm_jax.plan("deepseek-v4.1-flash", (1, 8), "141GB", batch=8, context=8192,
                     engram_memory="host")
    assert h.host_lines == {tables: p.lines[tables]}
    assert tables not in h.lines and h.total == p.total - p.lines[tables]
    assert h.lines == {k: v for k, v in p.lines.items() if k != tables}
    assert any("6,336 B per token and Engram layer (2 layers)" in n for n in h.notes), h.notes
    assert "pinned host memory" in h.table() and h.to_dict()["host_lines"]
    with pytest.raises(gsm_jax.InvalidInputError, match="no Engram tables"):
        gsm_jax.plan("deepseek-v4-flash", engram_memory="host")


def test_shipped_config_is_nemos_default():
    from nemo_automodel.components.models.deepseek_v41.config import (
        DeepseekV41TextConfig,
        DeepseekV41VisionConfig,
    )

    for ours, theirs, least in ((REAL["text_config"], DeepseekV41TextConfig(), 40),
                                (REAL["vision_config"], DeepseekV41VisionConfig(), 8)):
        checked = 0
        for key, value in ours.items():
            got = getattr(theirs, key, None)
            if key in ("model_type", "torch_dtype", "rope_scaling") or got is None:
                continue
            assert got == value, key
            checked += 1
        assert checked >= least
    assert ref.tiny_config()["text_config"]["num_hidden_layers"] < 40  # tiny stays tiny


@pytest.fixture(scope="module")
def tiny_nemo():
    # hash primes from 54: tables of 410 and 580 rows, which 8 devices do not divide; 8
    # heads in 8 output groups and 8 experts, so that a model axis of 8 splits them
    config = ref.tiny_config(index_n_heads=8, engram_vocab_size=54, num_attention_heads=8,
                             o_groups=8)
    model = ref.nemo_model(config, seed=1)
    return ref.saved_config(model), model  # the config as NeMo's save_pretrained writes it


def test_layout_names_and_shapes_are_nemos(tiny_nemo, tmp_path):
    """Our layout of the tiny config == the names and shapes NeMo's adapter writes (text
    model: no DSpark, no vision), and the stored form == what the writer puts on disk."""
    config, model = tiny_nemo
    theirs = ref.released_state_dict(model)
    assert {k: tuple(v.shape) for k, v in theirs.items()} == _logical_tensors(
        config, vision=False, mtp=False)
    path = write_checkpoint(tmp_path / "ck", config, theirs, ref.tiny_tokenizer_json(),
                            shard_bytes=200_000)
    store = SafetensorsStore(path)
    on_disk = {k: (tuple(i.shape), i.dtype) for k, i in store.tensors.items()}
    assert on_disk == released_layout(config, vision=False, mtp=False)


def test_vision_layout_is_nemos():
    """The vision tower's names and shapes (counted by the planner when asked) against
    NeMo's vision encoder and aligner at a small width."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.vision import (
        DeepseekV41VisionAligner,
        DeepseekV41VisionTransformer,
    )

    vision = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                  intermediate_size=48, patch_size=4, downsample_ratio=2)
    config = ref.tiny_config(vision_config=vision)
    nemo_cfg = DeepseekV41Config(text_config=dict(config["text_config"]), vision_config=vision)
    theirs = {f"vision.{k}": tuple(v.shape) for k, v in
              DeepseekV41VisionTransformer(nemo_cfg).state_dict().items()}
    theirs.update({f"aligner.{k}": tuple(v.shape) for k, v in
                   DeepseekV41VisionAligner(nemo_cfg).state_dict().items()})
    d = config["text_config"]["hidden_size"]
    theirs.update({n: (d,) for n in ("image_start", "image_end", "image_newline")})
    ours = {k: v for k, v in _logical_tensors(config, vision=True, mtp=False).items()
            if k.startswith(("vision.", "aligner.", "image_"))}
    assert ours == theirs


def test_engram_tables_row_sharded_on_a_mesh(tiny_nemo, tmp_path):
    """The tables in pinned host memory (`engram_memory="host"`), row-sharded on 1 x 8 and
    on one device. One 1 x 8 load carries both claims (the row split and the memory
    kind): the same rule places a device-memory table, which the DSpark mesh test
    (tests/test_deepseek_v41_dspark.py, Engram layers, 1 x 8) runs sharded."""
    config, model = tiny_nemo
    path = write_checkpoint(tmp_path / "ck", config, ref.released_state_dict(model),
                            ref.tiny_tokenizer_json(), shard_bytes=200_000)
    rows = list(config["text_config"]["engram_num_embeddings"])
    assert any(r % 8 for r in rows)  # the padding is exercised
    res = run_on_8_devices(f"""
import dataclasses
import jax, numpy as np
import gsm_jax
from gsm_jax.models.deepseek_v41_plan import held_weight_bytes
from gsm_jax.models.deepseek_v41_checkpoint import check_quantization_config

def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-9))

def no_qdq(p):
    return dataclasses.replace(p, config=dataclasses.replace(p.config, cache_qdq=False))

def kinds(params):
    out = {{}}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params.weights):
        key = jax.tree_util.keystr(path)
        name = "engram" if key.endswith(("['table']", "['table_scale']")) else "rest"
        out.setdefault(name, set()).add(leaf.sharding.memory_kind)
    return {{k: sorted(v) for k, v in out.items()}}

def device0_by_kind(params):
    out = {{}}
    for leaf in jax.tree.leaves(params.weights):
        s = next(s for s in leaf.addressable_shards if s.device.id == 0)
        out[leaf.sharding.memory_kind] = out.get(leaf.sharding.memory_kind, 0) + s.data.nbytes
    return out

path = {str(path)!r}
hf = json.load(open(path + "/config.json"))
one = no_qdq(gsm_jax.load(path, dtype="float32", keep_quantized=True))
prompts = [[5, 17, 99, 42, 8, 64, 23, 77, 31, 50, 12], [90, 3, 44, 61, 28, 7, 110]]
gsm = gsm_jax.GSMConfig(window_size=4, smooth_strength=0.2, target_layers="all",
                        precision="f32")
ref_logits = gsm_jax.forward(one, prompts)
ref_tokens = gsm_jax.generate_tokens(one, prompts, max_new_tokens=6, eos_ids=[], gsm=gsm)
result = {{}}
mesh = jax.make_mesh((1, 8), ("data", "model"))
for name, m in (("1x8 host", mesh), ("1 device host", None)):
    on = no_qdq(gsm_jax.load(path, dtype="float32", keep_quantized=True, mesh=m,
                             engram_memory="host"))
    tables = [lw["engram"]["table"] for lw in on.weights["layers"] if "engram" in lw]
    result[name] = dict(
        rel=rel(gsm_jax.forward(on, prompts), ref_logits),
        tokens_equal=m is None or np.array_equal(np.asarray(gsm_jax.generate_tokens(
            on, prompts, max_new_tokens=6, eos_ids=[], gsm=gsm)), np.asarray(ref_tokens)),
        kinds=kinds(on), by_kind=device0_by_kind(on),
        table_rows=[int(t.shape[0]) for t in tables],
        fractions=[next(s for s in t.addressable_shards if s.device.id == 0).data.shape[0]
                   / t.shape[0] for t in tables],
        specs=[str(t.sharding.spec) for t in tables],
        mesh_shape=list(on.weights["embed"].sharding.mesh.devices.shape),
        planned=held_weight_bytes(on.config, check_quantization_config(hf),
                                  {{"data": 1, "model": 8 if m is not None else 1}},
                                  "float32"))
""")
    for name, r in res.items():
        m = 8 if "1x8" in name else 1
        assert r["rel"] < 1e-5 and r["tokens_equal"], (name, r)
        # the Engram tables (and their row scales) in pinned host memory, nothing else
        assert r["kinds"] == {"engram": ["pinned_host"], "rest": ["device"]}, (name, r)
        assert r["mesh_shape"] == [1, m], (name, r)
        # row-sharded over the model axis, padded to a multiple of it: 1/M rows per device
        assert r["table_rows"] == [-(-n // m) * m for n in rows], (name, r)
        assert all(f == 1 / m for f in r["fractions"]), (name, r)
        if m > 1:
            assert all("model" in s for s in r["specs"]), (name, r)
        # device 0 holds what the planner says, the tables' part in host memory
        assert sum(r["by_kind"].values()) == r["planned"], (name, r)
        assert 0 < r["by_kind"]["pinned_host"] < r["planned"], (name, r)


def _real_width(layers: int = 6) -> dict:
    """The released config at real width with a short schedule covering every layer role
    and one real-size Engram table (layer 1: 384,006,168 rows): SWA 0, SWA + Engram 1,
    Full ratio 2 at 2, Full ratio 1 + candidate source at 3, Reindex 4, Reuse 5."""
    hf = json.loads(json.dumps(REAL))
    hf["text_config"].update(
        num_hidden_layers=layers, compress_ratios=[0, 0, 2, 1, 1, 1], kv_source_layer_ids=[2, 3],
        index_source_layer_ids=[2, 3, 4], candidate_source_layer_id=3, engram_layer_ids=[1],
        engram_num_embeddings=[384_006_168], num_nextn_predict_layers=0)
    return hf


@pytest.mark.heavy
def test_real_width_v41_compiles_sharded_and_fits():
    """Six real-width layers (every role, a 101 GB Engram table, 384 FP4 experts), lowered
    and compiled with abstract arrays for a 1 x 8 mesh: XLA's per-device arguments equal the
    planner's weights + caches within 1%, the Engram gather sends what its cost model says
    (`engram.gather_bytes`) and nothing gathers a table or an expert whole. The full
    40-layer program: `gsm-jax plan --model deepseek-v4.1-flash --devices 8 --compile`."""
    from gsm_jax.models.engram import gather_bytes

    batch = 8
    res = run_on_8_devices(f"""
from gsm_jax.planner import compile_check, compile_report
result = compile_check({_real_width()!r}, (1, 8), batch={batch}, context=4096,
                       prompt_tokens=64)
print(compile_report(result))
""", timeout=1200)
    planned = res["plan"]["weights"] + res["plan"]["caches"]
    for step in ("prefill", "decode"):
        m = res[step]
        assert abs(m["argument_size_in_bytes"] - planned) < 0.01 * planned, (step, m, planned)
        assert m["temp_size_in_bytes"] < 5e9, (step, m)  # a gathered table would be 101 GB
    scopes = res["decode_collectives"]["by_scope"]
    engram = sum(v for k, v in scopes.items() if "engram" in k)
    # XLA:CPU promotes a bf16 all-reduce to f32 (its HLO reduces in "region_promoted"):
    # 4 bytes per value here, 2 on GPU / TPU
    assert engram == pytest.approx(gather_bytes(batch, 24, 256, 8, itemsize=4)), scopes
    assert res["decode_collectives"]["bytes_per_device"] < 50e6, res["decode_collectives"]
