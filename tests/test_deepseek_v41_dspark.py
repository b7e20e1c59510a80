"""DeepSeek-V4.1's DSpark drafter (models/deepseek_v41_dspark.py) and speculative decoding
with it (gsm_jax.speculative.dspark_generate).

Reference: NeMo AutoModel 0.7.0's `DeepseekV41DSparkBackbone` (dspark.py) and its target-feature
capture (`get_dspark_target_feature_modules`), on a tiny config whose draft targets layers
5-7 (as V4.1-Flash's 37-39 of 40), both sides loading the same released-layout checkpoint
(FP8 stage projections and main_proj, FP4 experts). Tolerance 1e-5 of the scale with float
caches on both sides (everything is fp32; ~1e-6 seen); with the FP8 cache rounding on, the
same top-1 and 1e-2 (a rounding midpoint may flip, see tests/test_deepseek_v41.py).
The index top-k keeps every visible entry (index_topk 64), so a near-tie in the indexer
cannot make the two backbones pick differently.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gsm_jax.errors import InvalidInputError, ModelLoadError
from gsm_jax.models import deepseek_v41 as dv
from gsm_jax.models import deepseek_v41_dspark as ds

REL_TOL = 1e-5
DRAFT = dict(num_nextn_predict_layers=3, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0],
             dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=8,
             dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, dspark_block_size=5,
             dspark_noise_token_id=127)


def _rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(checkpoint dir with the backbone and the mtp.* stages written as released, NeMo's
    target and draft loaded from it by NeMo's own adapters, gsm_jax.load of it)."""
    import v41_reference as ref

    import gsm_jax
    from gsm_jax.models.deepseek_v41_checkpoint import write_checkpoint

    hf = ref.dspark_config(engram_layer_ids=[1, 5], index_topk=64, candidate_topk_blocks=16)
    model = ref.nemo_model(hf, seed=1)
    draft = ref.nemo_dspark(model, seed=1)
    tensors = {**ref.released_state_dict(model), **ref.dspark_state_dict(draft)}
    path = write_checkpoint(tmp_path_factory.mktemp("dspark"), ref.saved_config(model), tensors,
                            ref.tiny_tokenizer_json(), shard_bytes=200_000, quantize_mtp=True)
    target = ref.nemo_from_checkpoint(model, path)
    return path, target, ref.nemo_dspark_from_checkpoint(draft, path, target), \
        gsm_jax.load(path, dtype="float32", keep_quantized=True)


def test_draft_weights_as_stored(released):
    """The mtp.* stages load as the backbone does: FP8 32x32 projections (main_proj too) and
    FP4 experts kept as stored, with the draft's own expert count."""
    from gsm_jax.models.block_quant import BlockQuantWeight

    _, _, _, params = released
    dw = ds.draft_weights(params.config, params.extra["mtp"])
    assert len(dw["stages"]) == 3
    st = dw["stages"][0]
    assert isinstance(dw["main_proj"], BlockQuantWeight) and dw["main_proj"].fmt == "e4m3"
    assert st["attn"]["q_b"].fmt == "e4m3" and st["moe"]["experts_gate_up"].fmt == "e2m1"
    assert st["moe"]["router"].shape == (64, 4)
    assert dw["markov_embed"].shape == (128, 8) and dw["confidence"].shape == (72, 1)
    floats = ds.draft_weights(params.config, params.extra["mtp"], keep_quantized=False)
    np.testing.assert_array_equal(np.asarray(dw["main_proj"].dequantize()),
                                  np.asarray(floats["main_proj"]))


@pytest.mark.parametrize("cache_qdq", [False, True], ids=["float_caches", "released_caches"])
def test_features_and_draft_match_nemo(released, cache_qdq):
    """Target features (prefill_with_features) equal NeMo's captured attn_hc inputs' stream
    means; draft logits (LM head + Markov bias) and confidence logits for anchors 3, 12, 19
    (context: the window before each anchor) equal NeMo's backbone given the same features."""
    import v41_reference as ref

    _, target, nemo_draft, params = released
    cfg = dataclasses.replace(params.config, cache_qdq=cache_qdq)
    dw = ds.draft_weights(cfg, params.extra["mtp"])
    ids = np.random.default_rng(0).integers(3, 127, size=(2, 24))
    feats_ref = ref.nemo_dspark_features(target, ids, cache_qdq=cache_qdq)
    cache = dv.init_cache(cfg, 2, 32)
    _, feats, _ = jax.jit(lambda w, t, c: dv.prefill_with_features(
        w, cfg, t, jnp.full((2,), 24, jnp.int32), c))(params.weights, jnp.asarray(ids), cache)
    tol = REL_TOL if not cache_qdq else 1e-2
    assert feats.shape == (2, 24, 3 * 64)
    assert _rel(feats, feats_ref) < tol
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    run = jax.jit(lambda w, d, b, a, f, p, prev: ds.draft_logits(w, d, cfg, b, a, f, p, prev))
    for anchor in (3, 12, 19):
        prev = ids[:, anchor:anchor + 5]  # teacher-forced previous tokens for the Markov bias
        want, want_conf = ref.nemo_draft_logits(nemo_draft, feats_ref, ids, anchor, prev,
                                                cache_qdq=cache_qdq)
        block = np.concatenate([ids[:, anchor:anchor + 1], np.full((2, 4), 127)], axis=1)
        got, conf = run(params.weights, dw, jnp.asarray(block), jnp.full((2,), anchor),
                        jnp.asarray(feats_ref), pos, jnp.asarray(prev))
        err = _rel(got, want)
        assert err < tol, f"anchor {anchor}: draft logits off by {err:.2e} of the scale"
        np.testing.assert_array_equal(np.asarray(got).argmax(-1), want.argmax(-1))
        assert np.abs(np.asarray(conf) - want_conf).max() < tol * max(1, np.abs(want_conf).max())


@pytest.fixture(scope="module")
def tiny():
    """A random tiny V4.1 with a random 3-stage draft; float caches (the oracle test compares
    features across chunkings, which a rounding midpoint could flip)."""
    from test_deepseek_v41 import ENGRAM, small_hf_config

    from gsm_jax.params import ModelParams

    cfg = dv.DeepseekV41Config.from_hf_config(small_hf_config(index_n_heads=8, **DRAFT,
                                                              **ENGRAM))
    cfg = dataclasses.replace(cfg, cache_qdq=False)
    return ModelParams(dv.init_weights(cfg, jax.random.key(3)), cfg), \
        ds.init_weights(cfg, jax.random.key(4))


PROMPT = np.random.default_rng(0).integers(3, 128, 13)


GSM = dict(target_layers="all", smooth_strength=0.3, window_size=8)


@pytest.fixture(scope="module")
def greedy(tiny):
    """Plain greedy continuation of PROMPT, {"off": GSM off}, 24 tokens. (GSM on, with
    proposals at chosen acceptance counts and the feature ring checked each round, is
    test_dspark_on_a_mesh_equals_one_device's, against one device's greedy tokens.)"""
    from gsm_jax.generation import generate_tokens

    params, _ = tiny
    return {"off": generate_tokens(params, [PROMPT], max_new_tokens=24, eos_ids=[])[0]}


def test_dspark_generate_equals_greedy(tiny, greedy):
    """The tokens of dspark_generate with the (random) draft are plain greedy decoding's.
    (Random weights: the draft is accepted ~never; the figure means nothing.)"""
    from gsm_jax.speculative import dspark_generate

    params, dw = tiny
    res = dspark_generate(params, PROMPT, max_new_tokens=24, eos_ids=[], draft=dw)
    np.testing.assert_array_equal(res.tokens, greedy["off"][:24])
    assert res.drafted == 5 * res.rounds and len(res.accepted_per_round) == res.rounds


# The acceptance counts 0..5 with GSM on (rings rolled back), the tokens equal to greedy
# decoding's and the feature ring the draft reads at every round (exactly the positions
# [anchor - window, anchor), holding the teacher-forced features) are checked in one run:
# test_dspark_on_a_mesh_equals_one_device below, sharded against one device (a one-device
# run of the same loop compiled its own programs for ~100 s more; the one-device verify /
# commit programs with GSM on are test_commit_leaves_the_plain_decoding_cache's).


@pytest.mark.parametrize("m", [0, 2, 5])
def test_commit_leaves_the_plain_decoding_cache(tiny, m):
    """After a verify of [cur, 5 proposals] and a commit of m accepted, every cache leaf
    (window rings, compressed KV, index keys, compressor state, Engram history, GSM rings,
    lengths) equals the cache of m + 1 plain decode steps from the same state, GSM on."""
    import gsm_jax
    import gsm_jax.speculative as spec

    params, _ = tiny
    cfg = params.config
    # the shapes dspark_generate uses for PROMPT and 24 new tokens (13 + 24 tokens: cache 64,
    # prompt bucket 16): the one-device prefill / verify / commit programs with GSM on
    g = spec._gsm_inputs(gsm_jax.GSMConfig(**GSM), cfg.num_layers, cfg.num_layers, 37)
    tokens = np.zeros((1, 16), np.int32)
    tokens[0, :13] = PROMPT
    cur, saved, ring, ring_pos = spec._dspark_prefill(
        params.weights, tokens, np.asarray([13], np.int32), g, config=cfg, cache_len=64)
    drafts = jnp.asarray(np.random.default_rng(m).integers(3, 128, (1, 5)), jnp.int32)
    _, _, feats, grown = spec._dspark_verify(params.weights, cur, drafts, saved, g, config=cfg)
    got, _, _ = spec._dspark_commit(params.weights, saved, grown, cur, drafts,
                                    jnp.asarray([m], jnp.int32), g, ring, ring_pos, feats,
                                    jnp.asarray([13], jnp.int32), config=cfg)
    want = saved
    step = jax.jit(lambda w, t, c, g: dv.decode_step(w, cfg, t, c, g)[1])
    for t in np.concatenate([np.asarray(cur), np.asarray(drafts[0, :m])]):
        want = step(params.weights, jnp.asarray([t], jnp.int32), want, g)
    leaves = jax.tree_util.tree_leaves_with_path(want)
    assert len(leaves) == len(jax.tree.leaves(got)) > 10
    for (path, a), b in zip(leaves, jax.tree.leaves(got), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind in "iub":
            np.testing.assert_array_equal(b, a, err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6,
                                       err_msg=jax.tree_util.keystr(path))


def test_errors(tiny):
    """Each refusal names the problem before any compilation."""
    from gsm_jax.params import ModelParams
    from gsm_jax.speculative import dspark_generate

    params, dw = tiny
    with pytest.raises(InvalidInputError, match="no DSpark tensors"):
        dspark_generate(params, PROMPT, max_new_tokens=4)
    with pytest.raises(InvalidInputError, match="draft_len"):
        dspark_generate(params, PROMPT, max_new_tokens=4, draft=dw, draft_len=6)
    cut = dataclasses.replace(params.config, num_layers=6, compress_ratios=(0, 0, 2, 2, 2, 1),
                              kv_source_layer_ids=(2, 5), index_source_layer_ids=(2, 5))
    with pytest.raises(InvalidInputError, match="dspark_target_layer_ids"):
        dspark_generate(ModelParams(params.weights, cut), PROMPT, max_new_tokens=4, draft=dw)
    none = dataclasses.replace(params.config, num_nextn_predict_layers=0)
    with pytest.raises(InvalidInputError, match="no DSpark stages"):
        ds.draft_weights(none, {})
    mtp = {f"mtp.{s}.{k}": v for s in range(3)
           for k, v in {"attn_norm.weight": np.ones(64, np.float32)}.items()}
    with pytest.raises(ModelLoadError, match="mtp.0.main_proj.weight"):
        ds.draft_weights(params.config, mtp)
    with pytest.raises(ModelLoadError, match="mtp.3.norm.weight"):
        ds.draft_weights(params.config, {**mtp, "mtp.3.norm.weight": np.ones(64)})


@pytest.mark.heavy
def test_dspark_on_a_mesh_equals_one_device():
    """On 1 x 8 forced host devices (backbone and draft sharded by the same rules: heads,
    the shared expert and the stages' experts split): with GSM on, proposals that make every
    acceptance count 0..5 occur give one device's plain greedy tokens (the rings rolled back
    on every rejection); at every round the feature ring the draft reads holds exactly the
    positions [anchor - window, anchor) with one device's teacher-forced features of the
    sequence, and the sharded draft proposes what the one-device draft proposes from the
    same inputs."""
    from test_sharding import run_on_8_devices

    res = run_on_8_devices("""
import dataclasses
import jax, jax.numpy as jnp, numpy as np
import gsm_jax
import gsm_jax.speculative as spec
from gsm_jax.generation import generate_tokens
from gsm_jax.models import deepseek_v41 as dv
from gsm_jax.models import deepseek_v41_dspark as ds
from gsm_jax.params import ModelParams
from gsm_jax.sharding import one_device_mesh
from test_deepseek_v41 import ENGRAM, small_hf_config
from test_deepseek_v41_dspark import DRAFT, GSM, PROMPT

# 8 heads, output groups, experts and draft experts: a model axis of 8 splits them all
cfg = dv.DeepseekV41Config.from_hf_config(small_hf_config(
    index_n_heads=8, num_attention_heads=8, o_groups=8,
    **dict(DRAFT, dspark_n_routed_experts=8), **ENGRAM))
cfg = dataclasses.replace(cfg, cache_qdq=False)
params = ModelParams(dv.init_weights(cfg, jax.random.key(3)), cfg)
dw = ds.init_weights(cfg, jax.random.key(4))
gsm = gsm_jax.GSMConfig(**GSM)
greedy = np.asarray(generate_tokens(params, [PROMPT], max_new_tokens=25, eos_ids=[],
                                    gsm=gsm)[0])
seq = np.concatenate([PROMPT, greedy]).astype(np.int32)
# teacher-forced features of the whole sequence on one device (13 + 25 tokens)
g = spec._gsm_inputs(gsm, cfg.num_layers, cfg.num_layers, seq.size)
want_feats = np.asarray(jax.jit(lambda w, t, n, c, g: dv.prefill_with_features(
    w, cfg, t, n, c, g)[1])(params.weights, jnp.asarray(seq[None]),
                            jnp.asarray([seq.size], jnp.int32),
                            dv.init_cache(cfg, 1, 48, gsm_max_window=g.max_window), g)[0])
on = gsm_jax.shard(params, jax.make_mesh((1, 8), ("data", "model")))
real_draft, one = spec._dspark_draft, jax.devices()[0]
plan = iter([5, 0, 3, 1, 4, 2] + [5] * 8)
same, seen, ring_ok, ring_err = [], [], [], 0.0

def checked_oracle(weights, dw_, cur, anchor, ring, ring_pos, *, config, draft_len):
    global ring_err
    mine = real_draft(weights, dw_, cur, anchor, ring, ring_pos, config=config,
                      draft_len=draft_len)
    host = [jax.device_put(np.asarray(a), one) for a in (cur, anchor, ring, ring_pos)]
    with jax.set_mesh(one_device_mesh()):  # inside dspark_generate's mesh context
        theirs = real_draft(params.weights, dw, *host, config=config, draft_len=draft_len)
    same.append(bool(np.array_equal(np.asarray(mine), np.asarray(theirs))))
    a, right = int(anchor[0]), next(plan)
    seen.append(right)
    pos = np.asarray(ring_pos[0])
    ring_ok.append(int(cur[0]) == seq[a] and sorted(pos[pos >= 0])
                   == list(range(max(0, a - cfg.sliding_window), a)))
    got, want = np.asarray(ring[0])[pos >= 0], want_feats[pos[pos >= 0]]
    ring_err = max(ring_err, float(np.abs(got - want).max() / np.abs(want).max()))
    prop = seq[a + 1:a + 1 + draft_len].copy()
    if right < draft_len:
        prop[right] = (prop[right] + 1) % config.vocab_size  # wrong from here on
    return jnp.asarray(prop[None])

spec._dspark_draft = checked_oracle
res = spec.dspark_generate(on, PROMPT, max_new_tokens=20, eos_ids=[], draft=dw, gsm=gsm)
from gsm_jax.sharding import mesh_of
result = dict(equal=bool(np.array_equal(res.tokens, greedy[:20])),
              accepted=list(res.accepted_per_round), same=same, seen=seen[:res.rounds],
              ring_ok=ring_ok, ring_err=ring_err,
              draft_specs=sorted({str(leaf.sharding.spec) for leaf in jax.tree.leaves(
                  spec._draft_on_mesh(cfg, dw, mesh_of(on.weights)))}))
""")
    assert res["equal"], res
    assert set(res["accepted"]) >= {0, 1, 2, 3, 4, 5}, res
    assert res["accepted"] == res["seen"], res
    assert res["ring_ok"] and all(res["ring_ok"]), res
    assert res["ring_err"] < 1e-5, res
    assert res["same"] and all(res["same"]), res
    # the draft is split, not replicated whole on every device
    assert any("model" in s for s in res["draft_specs"]), res
