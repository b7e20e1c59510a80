"""DeepSeek-V4.1 at the user's level: `gsm_jax.load` / `generate_tokens` on a tiny checkpoint
in the released layout (FP8 e4m3 32 x 32, FP4 experts, E8M0 scales), written by
`models.deepseek_v41_checkpoint.write_checkpoint` from the NeMo reference's own weights
(tests/v41_reference.py); the bad inputs a user can hand `gsm_jax.load`; text-only prompts;
and the release's FP8 activation rounding (`gsm_jax.quantize(params, "fp8")`).

The reference runs on the same file: NeMo's own state-dict adapter loads the checkpoint
(dequantizing it), so both sides compute with the same rounded weights, fp32, and differ by
summation order only. Tolerance: 1e-4 of the logit scale, as the family's teacher-forced
parity (tests/test_deepseek_v41.py, whose test_load_matches_nemo checks `gsm_jax.forward` on
this same config and seed, explains the margin: the cache QDQs and the two top-k selections
are discontinuous). Greedy tokens are compared exactly with NeMo's argmax continuation, read
from one teacher-forced NeMo pass over prompt + output (NeMo has no cache; it is causal), with
the reference's top-1 / top-2 margin checked so a near tie cannot decide the test.
"""

from __future__ import annotations

import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import v41_reference as ref

import gsm_jax
from gsm_jax.errors import InvalidInputError, ModelLoadError
from gsm_jax.models.block_quant import BlockQuantWeight, dequantize_np
from gsm_jax.models.deepseek_v41_checkpoint import read_checkpoint, write_checkpoint
from gsm_jax.models.safetensors_io import SafetensorsStore

REL_TOL = 1e-4
IMAGE_TOKEN = 125  # inside the tiny vocabulary (the release's 129264 is not), never generated here
# "must choose": the indexer's top-4 picks among up to 16 compressed entries, candidates bind;
# 8 index heads and model seed 1 avoid exact-zero score ties (tests/test_deepseek_v41.py)
TEXT = dict(engram_layer_ids=[], index_n_heads=8)
SEED = 1
N_NEW = 16
PROMPTS = ([5, 17, 99, 42, 8, 64, 23, 77, 31, 50, 12], [90, 3, 44, 61, 28, 7, 110])


def _write(path, config, tensors, tokenizer=True, **kw):
    return write_checkpoint(path, {**config, "image_token_id": IMAGE_TOKEN}, tensors,
                            ref.tiny_tokenizer_json() if tokenizer else None,
                            shard_bytes=kw.pop("shard_bytes", 200_000), **kw)


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(checkpoint dir, NeMo on that file) for the Engram-free must-choose config."""
    config = ref.tiny_config(**TEXT)
    model = ref.nemo_model(config, seed=SEED)
    path = _write(tmp_path_factory.mktemp("v41_load") / "ckpt", ref.saved_config(model),
                  ref.released_state_dict(model))
    yield path, ref.nemo_from_checkpoint(model, path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def params(released):
    return gsm_jax.load(released[0], dtype="float32", keep_quantized=True)


def _block_leaves(weights):
    is_block = lambda a: isinstance(a, BlockQuantWeight)  # noqa: E731
    return [a for a in jax.tree.leaves(weights, is_leaf=is_block) if is_block(a)]


# ----------------------------------------------------------------------------- load


def test_keep_quantized_keeps_the_stored_containers(released, params):
    path, _ = released
    layer = params.weights["layers"][2]  # a Full ratio-2 layer: compressor and indexer too
    for w in (layer["attn"]["q_a"], layer["attn"]["q_b"], layer["attn"]["kv"],
              layer["attn"]["o_b"], layer["attn"]["indexer"]["q_b"],
              layer["moe"]["shared_down"]):
        assert isinstance(w, BlockQuantWeight), type(w)
        assert (w.fmt, w.block, w.act) == ("e4m3", (32, 32), "none")
        assert w.values.dtype == jax.numpy.float8_e4m3fn and w.scale.dtype == np.uint8
    experts = layer["moe"]["experts_gate_up"]
    assert isinstance(experts, BlockQuantWeight)
    assert (experts.fmt, experts.block, experts.values.dtype) == ("e2m1", (1, 32), np.uint8)
    # the bytes are the file's: q_b dequantizes to the reader's decoding of the tensor
    _, ckpt = read_checkpoint(path)
    try:
        np.testing.assert_array_equal(np.asarray(layer["attn"]["q_b"].dequantize()),
                                      ckpt.dequantized("layers.2.attn.wq_b.weight").T)
    finally:
        ckpt.close()
    # Engram tables as stored: FP8 rows, E8M0 bytes per row per 32 columns
    for layer_id in params.config.engram_layer_ids:
        engram = params.weights["layers"][layer_id]["engram"]
        assert engram["table"].dtype == jax.numpy.float8_e4m3fn
        assert engram["table_scale"].dtype == np.uint8
        assert engram["table_scale"].shape == (engram["table"].shape[0],
                                               engram["table"].shape[1] // 32)
        assert isinstance(engram["wkv"], BlockQuantWeight)
    # everything else that is not block-quantized is float32 as asked
    is_block = lambda a: isinstance(a, BlockQuantWeight)  # noqa: E731
    floats = [a for a in jax.tree.leaves(params.weights, is_leaf=is_block)
              if not is_block(a) and jax.numpy.issubdtype(a.dtype, jax.numpy.floating)
              and a.dtype != jax.numpy.float8_e4m3fn]
    assert floats and all(a.dtype == jax.numpy.float32 for a in floats)
    n_lowp = sum(1 for a in _block_leaves(params.weights))
    assert n_lowp >= 7 * params.config.num_layers
    assert params.config.image_token_id == IMAGE_TOKEN


@pytest.fixture(scope="module")
def greedy_off(params):
    """generate_tokens' greedy continuations of PROMPTS (GSM off) and their logits."""
    return gsm_jax.generate_tokens(params, list(PROMPTS), max_new_tokens=N_NEW, eos_ids=[],
                                   return_logits=True)


@pytest.fixture(scope="module")
def nemo_pass(released, greedy_off):
    """(rows prompt + output, NeMo's logits over them [B, T, V]): one teacher-forced pass,
    right-padded as NeMo requires."""
    _, nemo = released
    rows = [np.concatenate([p, o]) for p, o in zip(PROMPTS, greedy_off[0], strict=True)]
    ids = np.full((len(rows), max(r.size for r in rows)), 2, np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : r.size], mask[i, : r.size] = r, 1
    return rows, ref.nemo_logits(nemo, ids, attention_mask=mask)


def _rel_err(got, want):
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.heavy  # a generate_tokens compile (prefill + decode loop), ~40 s idle
def test_greedy_tokens_equal_the_reference_continuation(greedy_off, nemo_pass):
    """NeMo's argmax continuation of each prompt is generate_tokens' greedy output. NeMo is
    causal, so its logits at position p of prompt + output are those of the prefix up to p:
    one teacher-forced pass checks every step (step k's argmax is new token k given the
    tokens before it, which by induction are NeMo's own picks). The logits each token was
    picked from (prefill, then 15 cached decode steps) match NeMo's too."""
    out, step_logits = greedy_off
    _, logits = nemo_pass
    for i, (prompt, got) in enumerate(zip(PROMPTS, out, strict=True)):
        assert got.shape == (N_NEW,)
        steps = logits[i, len(prompt) - 1: len(prompt) - 1 + N_NEW]  # predicts each new token
        np.testing.assert_array_equal(got, steps.argmax(-1), err_msg=f"prompt {i}")
        top2 = np.sort(steps, axis=-1)[:, -2:]
        margin = ((top2[:, 1] - top2[:, 0]) / np.abs(steps).max()).min()
        assert margin > 10 * REL_TOL, f"prompt {i}: reference near tie ({margin:.1e})"
        err = _rel_err(step_logits[i], steps)
        assert err < REL_TOL, f"prompt {i}: decode logits off by {err:.2e} of the scale"


@pytest.mark.heavy  # a second generate_tokens compile (GSM on)
def test_gsm_strength_zero_equals_gsm_off(params, greedy_off):
    from gsm_jax.config import GSMConfig

    out, logits = gsm_jax.generate_tokens(
        params, list(PROMPTS), max_new_tokens=N_NEW, eos_ids=[], return_logits=True,
        gsm=GSMConfig(smooth_strength=0.0, window_size=8, target_layers="all"))
    for a, b, la, lb in zip(out, greedy_off[0], logits, greedy_off[1], strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(la, lb, rtol=0, atol=2e-5 * np.abs(lb).max())


@pytest.mark.heavy  # NeMo's model + the checkpoint + a third generate_tokens compile
def test_greedy_tokens_with_engram_equal_the_reference(tmp_path):
    """The same check with the Engram layers (1 and 5 of the tiny config), with float caches
    on both sides (`cache_qdq=False`; NeMo's cache quantize/dequantize patched to the
    identity): the greedy tokens are NeMo's argmax continuation, the logits each was picked
    from (prefill, then cached decode steps carrying the n-gram history) equal NeMo's and our
    own teacher-forced forward over prompt + output, all to 1e-4 of the logit scale.

    Why float caches here: with the roundings on, the Engram streams differ from NeMo's (and
    the decode program's from the forward's) by ulps of XLA's fusion order, which on some
    inputs cross an FP8 / FP4 rounding midpoint of the window or compressed KV; one flipped
    FP4 level then moves everything after it (measured: 9.4e-2 of the scale between our own
    decode and forward in one CI run, under 1e-4 in the runs before it on another CPU). Where
    it flips is not a property of the model, so a 1e-4 check there cannot be stable. The
    roundings themselves are checked where they are continuous enough to hold: bit for bit
    against NeMo's quantizers (tests/test_deepseek_v41.py) and, on the Engram-free config,
    decode logits against NeMo's at 1e-4 with the roundings on (the test above). The Engram
    pieces alone (hash ids, table rows, wkv, q/k weights, the update given the same input)
    equal NeMo's exactly or to 4e-9 (tests/test_deepseek_v41.py)."""
    import dataclasses

    config = ref.tiny_config(index_n_heads=8)
    assert config["text_config"]["engram_layer_ids"] == [1, 5]
    model = ref.nemo_model(config, seed=SEED)
    path = _write(tmp_path / "ckpt", ref.saved_config(model), ref.released_state_dict(model))
    nemo = ref.nemo_from_checkpoint(model, path)
    params = gsm_jax.load(path, dtype="float32", keep_quantized=True)
    assert params.config.active_engram_layers == (1, 5) and params.config.cache_qdq
    params = dataclasses.replace(params, config=dataclasses.replace(params.config,
                                                                    cache_qdq=False))
    out, step_logits = gsm_jax.generate_tokens(params, list(PROMPTS), max_new_tokens=N_NEW,
                                               eos_ids=[], return_logits=True)
    rows = [np.concatenate([p, o]) for p, o in zip(PROMPTS, out, strict=True)]
    ids = np.full((len(rows), max(r.size for r in rows)), 2, np.int64)
    mask = np.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : r.size], mask[i, : r.size] = r, 1
    logits = ref.nemo_logits(nemo, ids, attention_mask=mask, cache_qdq=False)
    ours = np.asarray(gsm_jax.forward(params, [list(map(int, r)) for r in rows]))
    for i, (prompt, got) in enumerate(zip(PROMPTS, out, strict=True)):
        window = slice(len(prompt) - 1, len(prompt) - 1 + N_NEW)
        steps = logits[i, window]
        np.testing.assert_array_equal(got, steps.argmax(-1), err_msg=f"prompt {i}")
        err = _rel_err(step_logits[i], ours[i, window])
        assert err < REL_TOL, f"prompt {i}: decode vs forward off by {err:.2e} of the scale"
        err = _rel_err(step_logits[i], steps)
        assert err < REL_TOL, f"prompt {i}: decode vs NeMo off by {err:.2e} of the scale"
        # the closest top-1 / top-2 call (6.6e-5 of the scale on prompt 0) against the two
        # sides' measured gap (~5e-7): the equal tokens are not a coin toss at a near tie
        top2 = np.sort(steps, axis=-1)[:, -2:]
        margin = ((top2[:, 1] - top2[:, 0]) / np.abs(steps).max()).min()
        assert margin > 10 * err, f"prompt {i}: reference near tie ({margin:.1e} vs {err:.1e})"


# ----------------------------------------------------------------------------- text only


def test_image_token_is_refused_before_compiling(params, monkeypatch):
    from gsm_jax import generation

    def no_compile(*a, **k):
        raise AssertionError("compiled before refusing the prompt")

    monkeypatch.setattr(generation, "_generate_loop", no_compile)
    monkeypatch.setattr(generation, "_forward_jit", no_compile)
    bad = [[5, 6], [7, IMAGE_TOKEN, 8]]
    msg = rf"prompt 1 holds token id {IMAGE_TOKEN} at position 1.*image_token_id.*text only"
    with pytest.raises(InvalidInputError, match=msg):
        gsm_jax.generate_tokens(params, bad, max_new_tokens=4)
    with pytest.raises(InvalidInputError, match=msg):
        gsm_jax.forward(params, np.asarray([[5, 6, 9], [7, IMAGE_TOKEN, 8]]))
    word = params.tokenizer.decode([IMAGE_TOKEN]).strip()
    assert params.tokenizer.encode(word) == [IMAGE_TOKEN]
    with pytest.raises(InvalidInputError, match=rf"token id {IMAGE_TOKEN}.*image_token_id"):
        gsm_jax.generate(params, ["hello " + word])
    from gsm_jax.serving.engine import Engine, Request  # the server's path too

    engine = Engine(params, max_batch=1, max_len=64)
    with pytest.raises(InvalidInputError, match=rf"token id {IMAGE_TOKEN}.*image_token_id"):
        engine.check_request(Request([7, IMAGE_TOKEN, 8], max_new_tokens=2))


# ----------------------------------------------------------------------------- FP8 activations


def _round_e4m3_blocks(x, block):
    """numpy: x rounded per token and `block` channels to FP8 e4m3 with a power-of-two
    scale 2**ceil(log2(max(absmax, 1e-4) / 448)) (the release's act_quant, ue8m0)."""
    x = np.asarray(x, np.float32)
    c = x.shape[-1]
    n = -(-c // block)
    pad = np.zeros(x.shape[:-1] + (n * block - c,), np.float32)
    blocks = np.concatenate([x, pad], -1).reshape(x.shape[:-1] + (n, block))
    amax = np.maximum(np.abs(blocks).max(-1, keepdims=True), 1e-4)
    scale = np.exp2(np.ceil(np.log2(amax / 448.0))).astype(np.float32)
    q = (blocks / scale).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (q * scale).reshape(blocks.shape[:-2] + (n * block,))[..., :c]


def _stored_float(w):
    return dequantize_np(np.asarray(w.values), np.asarray(w.scale), w.fmt, w.block)


def test_fp8_activation_rounding_is_an_option(params):
    from gsm_jax.models.linear import linear
    from gsm_jax.quant import with_fp8_activations

    assert all(w.act == "none" for w in _block_leaves(params.weights))  # off by default
    q = gsm_jax.quantize(params, "fp8")
    leaves = _block_leaves(q.weights)
    assert len(leaves) == len(_block_leaves(params.weights))
    assert all((w.act, w.act_block) == ("e4m3", 32) for w in leaves)
    layer = q.weights["layers"][5]
    rng = np.random.default_rng(0)
    # the rounding itself, bitwise: through an identity FP8 weight each output is one input
    d = 96
    eye = BlockQuantWeight(jax.numpy.eye(d, dtype=jax.numpy.float8_e4m3fn),
                           jax.numpy.full((3, 3), 127, jax.numpy.uint8), "e4m3", (32, 32))
    x = (rng.standard_normal((2, 5, d)) * 10.0 ** rng.uniform(
        -6, 3, size=(2, 5, d // 8)).repeat(8, -1)).astype(np.float32)
    x[0, 0, :40] = 1e-30  # below every scale's range: flushed, as the release does
    got = np.asarray(linear(jax.numpy.asarray(x), with_fp8_activations(eye, 32)))
    np.testing.assert_array_equal(got, _round_e4m3_blocks(x, 32))
    assert not np.array_equal(got, _round_e4m3_blocks(x, 128))  # 32-wide, not V4's 128
    # the products of the model's own FP8 and FP4 weights: the float product of the rounded x
    for w in (layer["attn"]["q_a"], layer["attn"]["q_b"], layer["moe"]["shared_gate_up"],
              layer["moe"]["shared_down"], layer["moe"]["experts_gate_up"][3]):
        stored = _stored_float(w)  # [out, in]
        x = (rng.standard_normal((2, 3, stored.shape[1]))
             * 10.0 ** rng.uniform(-3, 2, size=(2, 3, stored.shape[1] // 8)).repeat(8, -1)
             ).astype(np.float32)
        got = np.asarray(linear(jax.numpy.asarray(x), w))
        want = _round_e4m3_blocks(x, 32).astype(np.float64) @ stored.T.astype(np.float64)
        plain = x.astype(np.float64) @ stored.T.astype(np.float64)
        scale = np.abs(want).max()
        assert np.abs(got - want).max() < 1e-5 * scale  # fp32 summation order only
        assert np.abs(got - plain).max() > 1e-4 * scale  # the rounding did happen


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def engram_tensors():
    """(config, released-name float tensors) of the default tiny config: Engram on 1 and 5."""
    config = ref.tiny_config()
    return config, ref.released_state_dict(ref.nemo_model(config, seed=0))


@pytest.fixture
def no_reads(monkeypatch):
    """A tensor's bytes read during a refused load would be slow work on the release."""
    def read(self, name, index=None):
        raise AssertionError(f"tensor {name!r} read before the input was refused")

    monkeypatch.setattr(SafetensorsStore, "read", read)


def _raw_fp8(value, block):
    from gsm_jax.models import block_quant as bq

    v, s = bq.quantize_np(value, "e4m3", block)
    return (v, "F8_E4M3"), (s, "F8_E8M0")


def _load_bad(tmp_path, config, tensors, **kw):
    path = _write(tmp_path / "bad", config, tensors, **kw)
    return gsm_jax.load(path, dtype="float32", keep_quantized=True)


def test_missing_engram_table(tmp_path, engram_tensors, no_reads):
    config, t = engram_tensors
    t = dict(t)
    _, scale = _raw_fp8(t.pop("layers.5.engram.embed.weight"), (1, 32))
    t["layers.5.engram.embed.scale"] = scale
    with pytest.raises(ModelLoadError, match=r"'layers\.5\.engram\.embed\.weight'"):
        _load_bad(tmp_path, config, t)


def test_missing_engram_scale(tmp_path, engram_tensors, no_reads):
    config, t = engram_tensors
    t = dict(t)
    t["layers.1.engram.embed.weight"], _ = _raw_fp8(t["layers.1.engram.embed.weight"], (1, 32))
    with pytest.raises(ModelLoadError, match=r"'layers\.1\.engram\.embed\.scale'.*missing"):
        _load_bad(tmp_path, config, t)


def test_engram_rows_must_match_the_primes(tmp_path, engram_tensors, no_reads):
    # engram_vocab_size 60 moves every hash prime (and the config's row counts with them):
    # the stored tables no longer fit them
    config, t = engram_tensors
    with pytest.raises(ModelLoadError, match=r"'layers\.1\.engram\.embed\.weight' has \d+ rows"
                                             r".*primes.*sum to \d+"):
        _load_bad(tmp_path, ref.tiny_config(engram_vocab_size=60), t)


def test_engram_row_counts_must_match_the_primes(tmp_path, engram_tensors, no_reads):
    config, t = engram_tensors
    rows = list(config["text_config"]["engram_num_embeddings"])
    with pytest.raises(ModelLoadError, match=r"engram_num_embeddings"):
        _load_bad(tmp_path, ref.tiny_config(engram_num_embeddings=[rows[0] + 1, rows[1]]), t)


def test_128_block_scales_in_a_32_block_checkpoint(tmp_path, engram_tensors, no_reads):
    config, t = engram_tensors
    t = dict(t)
    t["layers.3.attn.wq_b.weight"], t["layers.3.attn.wq_b.scale"] = _raw_fp8(
        t["layers.3.attn.wq_b.weight"], (128, 128))
    with pytest.raises(ModelLoadError, match=r"scale 'layers\.3\.attn\.wq_b\.scale' has shape "
                                             r"\[2, 1\].*needs \[8, 1\].*128 x 128"):
        _load_bad(tmp_path, config, t)


def test_engram_layers_without_tokenizer(tmp_path, engram_tensors, no_reads):
    config, t = engram_tensors
    with pytest.raises(ModelLoadError, match=r"engram_layer_ids \[1, 5\] needs tokenizer\.json"):
        _load_bad(tmp_path, config, t, tokenizer=False)


def test_reuse_layer_without_an_earlier_full_layer(tmp_path, engram_tensors, no_reads):
    # layer 2 (ratio 2) is no longer a KV source: layers 2-4 would reuse a compressed KV
    # nobody wrote
    config, t = engram_tensors
    bad = ref.tiny_config(kv_source_layer_ids=[5], index_source_layer_ids=[5, 7])
    with pytest.raises(ModelLoadError, match=r"compress_ratios.*Reuse layer 2 \(ratio 2\) has "
                                             r"no earlier Full layer"):
        _load_bad(tmp_path, bad, t)


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_damaged_shard(tmp_path, engram_tensors, no_reads, damage):
    config, t = engram_tensors
    path = _write(tmp_path / "bad", config, t)
    shard = sorted(path.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    if damage == "truncated":
        shard.write_bytes(data[: len(data) - 1000])
        match = rf"{shard.name}: tensor '[^']+' .*truncated"
    else:
        shard.write_bytes(data[:8] + b"#" + data[9:])
        match = rf"{shard.name}: cannot read the safetensors header"
    with pytest.raises(ModelLoadError, match=match):
        gsm_jax.load(path)
