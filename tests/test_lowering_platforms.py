"""Lowered for the platforms we claim, on every commit, without an accelerator.

No GPU or TPU is lent to this project's CI, so nothing else checks that the CUDA and TPU
paths even lower. Here, on the CPU host, `jax.export(..., platforms=[...])` lowers for
"cuda" and "tpu":

- every Pallas kernel (`pallas_kernels/`: the GSM prefill / decode filters and the fused
  smooth + int8 kernels), through the public entry points with impl "pallas";
- every family's `prefill`, `decode_step` and `extend` with GSM on, impl "pallas";
- DeepSeek-V4 and V4.1 with their FP8 / FP4 weights kept as stored;
- the W8A8 Llama (the fused smooth + quantize kernels inside a model);
- one model sharded on a 1 x 8 mesh (a subprocess with 8 forced host devices).

Each export must serialize and deserialize, and the kernels must really be in the program:
Triton's custom call on CUDA (allowed with `DisabledSafetyCheck.custom_call`, as it is not
on jax.export's list of stable custom calls), Mosaic's `tpu_custom_call` on TPU. This is no
substitute for running on a device (`scripts/gpu_check*.sh` stay ready for one), but it
catches every lowering error without one. Lowering traces and emits StableHLO only: no
XLA compilation, so the module costs seconds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from tiny_models import tiny_dsv4, tiny_dsv41, tiny_gemma3, tiny_gsm_llama

import gsm_jax
from gsm_jax import smoothing
from gsm_jax.families import family_module
from gsm_jax.families import names as registered_families
from gsm_jax.gsm_runtime import gsm_inputs_for_batch

PLATFORMS = ("cuda", "tpu")
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
TINY = {"llama": tiny_gsm_llama, "gemma3": tiny_gemma3, "deepseek_v4": tiny_dsv4,
        "deepseek_v41": tiny_dsv41}
B, CACHE, P, C = 2, 32, 9, 4  # rows, cache length, prompt tokens, extend chunk


def lower(fn, args, platform: str) -> str:
    """Export fn(*args) for `platform` over its flattened arguments (the model's pytrees
    hold our own classes, which jax.export's pytree serialization does not know); check
    the artifact round-trips; return the StableHLO text."""
    leaves, tree = jax.tree.flatten(args)

    def flat(*values):
        return jax.tree.leaves(fn(*jax.tree.unflatten(tree, values)))

    exp = export.export(jax.jit(flat), platforms=[platform], disabled_checks=[
        export.DisabledSafetyCheck.custom_call(KERNEL_CALL["cuda"])])(*leaves)
    back = export.deserialize(exp.serialize())
    assert back.platforms == (platform,)
    assert len(back.in_avals) == len(leaves)
    return exp.mlir_module()


def kernel_calls(text: str, platform: str) -> int:
    return text.count(KERNEL_CALL[platform])


def test_every_registered_family_is_lowered():
    assert set(registered_families()) == set(TINY)


# ----------------------------------------------------------------------------- kernels


def _kernel_cases():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, 16, 64)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), (B, 16))
    win, strength, lo = jnp.zeros(B, jnp.int32), jnp.full(B, 0.3, jnp.float32), jnp.int32(1)
    ring = jnp.zeros((B, 8, 64), jnp.float32)
    rings = jnp.zeros((3, B, 8, 64), jnp.float32)
    step = jnp.full(B, 5, jnp.int32)
    kw = dict(precision="f32", impl="pallas")
    return {
        "smooth_prefill": (lambda *a: smoothing.smooth_prefill(*a, max_window=8, **kw),
                           (x, pos, win, strength, lo)),
        "smooth_decode": (lambda *a: smoothing.smooth_decode(*a, **kw),
                          (x[:, 0], ring, step, win, strength, lo)),
        "smooth_quantize_prefill": (
            lambda *a: smoothing.smooth_quantize_prefill(*a, max_window=8, **kw),
            (x, pos, win, strength, lo)),
        "smooth_quantize_decode": (
            lambda *a: smoothing.smooth_quantize_decode_stacked(*a, **kw),
            (x[:, 0], rings, jnp.int32(1), step, jnp.ones(B, bool), win, strength, lo)),
    }


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", sorted(_kernel_cases()))
def test_kernels_lower(name, platform):
    fn, args = _kernel_cases()[name]
    text = lower(fn, args, platform)
    assert kernel_calls(text, platform) >= 1, f"{name}: no kernel in the {platform} program"


# ----------------------------------------------------------------------------- families


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request):
    return TINY[request.param]()


def _entry_points(params):
    """(name, fn, args) of prefill, decode_step and extend with GSM on, impl "pallas"."""
    cfg, w = params.config, params.weights
    fam = family_module(cfg.family)
    gsm = gsm_inputs_for_batch(gsm_jax.GSMConfig(window_size=4, smooth_strength=0.3,
                                                 target_layers="all"),
                               cfg.num_layers, B, [P, P], fit_ring=True).replace(impl="pallas")
    cache = fam.init_cache(cfg, B, CACHE, gsm_max_window=gsm.max_window)
    toks = jnp.ones((B, P), jnp.int32)
    return [
        ("prefill", lambda w, t, n, c, g: fam.prefill(w, cfg, t, n, c, g),
         (w, toks, jnp.full(B, P, jnp.int32), cache, gsm)),
        ("decode_step", lambda w, t, c, g: fam.decode_step(w, cfg, t, c, g),
         (w, toks[:, 0], cache, gsm)),
        ("extend", lambda w, t, n, c, g: fam.extend(w, cfg, t, n, c, g),
         (w, toks[:, :C], jnp.full(B, C, jnp.int32), cache, gsm)),
    ]


def _check_model(params, platform, label):
    for name, fn, args in _entry_points(params):
        text = lower(fn, args, platform)
        # two GSM sites a layer: every one goes through a kernel
        n = kernel_calls(text, platform)
        assert n >= 2, f"{label} {name}: {n} kernel calls in the {platform} program"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_family_entry_points_lower(tiny, platform):
    _check_model(tiny, platform, tiny.config.family)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_w8a8_llama_lowers_with_the_fused_kernels(platform):
    from gsm_jax.quant import quantize

    _check_model(quantize(tiny_gsm_llama(), "w8a8"), platform, "llama w8a8")


# ----------------------------------------------------------------------------- FP8 / FP4


@pytest.fixture(scope="module")
def stored_formats(tmp_path_factory):
    """V4 and V4.1 loaded with their FP8 (32 x 32 / 128 x 128) and FP4 weights kept."""
    import v41_reference as ref

    from gsm_jax.models.deepseek_v4_checkpoint import write_checkpoint as write_v4
    from gsm_jax.models.deepseek_v41_checkpoint import random_tensors
    from gsm_jax.models.deepseek_v41_checkpoint import write_checkpoint as write_v41
    from gsm_jax.workflow.evidence.random_models import hf_config

    root = tmp_path_factory.mktemp("stored")
    v4 = tiny_dsv4()
    v4_path = write_v4(v4.config, v4.weights, root / "v4", expert_dtype="fp4")
    hf = hf_config("deepseek-v4.1-tiny", 128, 0, 1, 2)
    v41_path = write_v41(root / "v41", hf, random_tensors(hf, 0), ref.tiny_tokenizer_json())
    return {name: gsm_jax.load(path, dtype="float32", keep_quantized=True)
            for name, path in (("deepseek_v4", v4_path), ("deepseek_v41", v41_path))}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41"])
def test_stored_fp8_fp4_weights_lower(stored_formats, family, platform):
    from gsm_jax.models.block_quant import BlockQuantWeight

    params = stored_formats[family]
    kept = [a for a in jax.tree.leaves(params.weights,
                                       is_leaf=lambda a: isinstance(a, BlockQuantWeight))
            if isinstance(a, BlockQuantWeight)]
    assert {a.fmt for a in kept} >= {"e4m3", "e2m1"}, {a.fmt for a in kept}
    _check_model(params, platform, f"{family} stored")


# ----------------------------------------------------------------------------- sharded


@pytest.mark.heavy
def test_sharded_on_a_1x8_mesh_lowers():
    """A tiny Llama sharded on a 1 x 8 mesh (8 forced host devices, a subprocess): its
    decode step lowers for both platforms with the mesh's shardings in the program. (The
    first run of this test found that Mosaic kernels cannot be partitioned automatically:
    the GSM sites now run the filter under `shard_map`, `gsm_sites._per_shard`.)"""
    from test_sharding import run_on_8_devices

    result = run_on_8_devices("""
import jax, jax.numpy as jnp
import gsm_jax
from tiny_models import tiny_gsm_llama
from test_lowering_platforms import lower, kernel_calls, _entry_points
from gsm_jax.sharding import mesh_of
params = gsm_jax.shard(tiny_gsm_llama(), jax.make_mesh((1, 8), ("data", "model")))
mesh = mesh_of(params.weights)  # the mesh generate sets around its tracing
name, fn, args = _entry_points(params)[1]
result = {}
for platform in ("cuda", "tpu"):
    with jax.set_mesh(mesh):  # as generate traces a sharded model
        text = lower(fn, args, platform)
    # Shardy's annotations; the kernels inside shard_map's manual computations
    result[platform] = [kernel_calls(text, platform), text.count("sdy.sharding"),
                        text.count("manual_computation"), "mhlo.num_partitions = 8" in text]
""")
    for platform in ("cuda", "tpu"):
        calls, shardings, manual, eight = result[platform]
        assert calls >= 2 and shardings > 0 and manual >= calls and eight, (
            platform, result[platform])
