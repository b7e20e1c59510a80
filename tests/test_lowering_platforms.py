"""Lowered for the platforms we claim, on every commit, without an accelerator.

No GPU or TPU is lent to this project's CI, so nothing else checks that the CUDA and TPU
paths even lower. Here, on the CPU host, `jax.export(..., platforms=[p])` lowers for
p = "cuda" and p = "tpu":

- every Pallas kernel (`pallas_kernels/`: the GSM prefill / decode filters and the fused
  smooth + int8 kernels) through the entry points the model calls, impl "pallas";
- every registered family's `prefill`, `decode_step` and `extend`, GSM on at every layer
  (a `GSMConfig(target_layers="all")` made into the model's sites as `generate` does, with
  the kernel impl set to "pallas" and the filter precision GPU / TPU resolve "auto" to);
- DeepSeek-V4 and V4.1 loaded with their FP8 / FP4 weights kept as stored;
- the W8A8 Llama (the fused smooth + int8 kernels inside a model);
- a Llama sharded on a 1 x 8 mesh: an `AbstractMesh`, so no devices are needed (the
  program is the one a real 8-device mesh gives, checked once by hand: only two scalar
  arguments' empty-mesh annotations differed).

Each artifact must serialize and deserialize to the same module, and the kernels must
really be in the program: every call site of Triton's custom call on CUDA (allowed with
`DisabledSafetyCheck.custom_call`: it is not on jax.export's list of stable custom calls)
or Mosaic's `tpu_custom_call` on TPU is counted, by kernel name and channel width, and
must be exactly the sites the model has. This is no substitute for running on a device
(`scripts/gpu_check*.sh` stay ready for one), but it catches every lowering error without
one. Lowering traces and emits StableHLO only, no XLA compilation; both platforms' exports
share one trace per program.

Caveats: the trace is the CPU host's, so a trace-time `jax.default_backend()` choice in
model code (a few CPU-only matmul forms in `models/linear.py`, the MoE dispatch choice in
`models/moe.py`) takes its CPU side; none is on the paths lowered here. One export for both
platforms at once (`platforms=["cuda", "tpu"]`) fails in JAX itself (`test_one_export_
for_both_platforms`, a strict xfail that flips when JAX lowers each `platform_dependent`
branch for its own platforms only).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections import Counter
from pathlib import Path
from unittest import mock

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
from gsm_jax.gsm_runtime import gsm_inputs_for_batch, kernel_impl
from gsm_jax.models.sites import SITES

PLATFORMS = ("cuda", "tpu")
TRITON = "__gpu$xla.gpu.triton"
CUSTOM_CALL = {"cuda": TRITON, "tpu": "tpu_custom_call"}
TINY = {"llama": tiny_gsm_llama, "gemma3": tiny_gemma3, "deepseek_v4": tiny_dsv4,
        "deepseek_v41": tiny_dsv41}
# Families whose layers run as one `lax.scan` body (`common.layer_weights(scan_ok=True)`):
# each site's kernel is called once in the program. The others unroll their layers.
SCANNED = {"llama"}
ENTRY_POINTS = ("prefill", "decode_step", "extend")
B, CACHE, P, C = 2, 32, 9, 4  # rows, cache length, prompt tokens, extend chunk
GSM = gsm_jax.GSMConfig(window_size=4, smooth_strength=0.3, target_layers="all",
                        precision="bf16")  # what "auto" resolves to on GPU / TPU
MESH = (1, 8)


# ----------------------------------------------------------------------------- helpers


# what jax.default_backend() says on a host of each platform
BACKEND = {"cuda": "gpu", "tpu": "tpu"}


class Program:
    """A function of flat arrays (the model's pytrees hold our own classes, whose
    serialization jax.export does not know) and its arguments, with its traces: one jitted
    function serves both platforms' exports (the trace is most of an export's cost) unless
    the trace asked which backend it runs on; then each platform traces its own."""

    def __init__(self, fn, args):
        leaves, tree = jax.tree.flatten(args)

        def flat(*values):
            return jax.tree.leaves(fn(*jax.tree.unflatten(tree, values)))

        self.flat, self.args = flat, leaves
        self.traces: dict[str | None, object] = {}  # backend it asked for, None: did not


def export_for(program: Program, platforms: tuple[str, ...], mesh=None) -> export.Exported:
    """The program exported for `platforms`, traced as on a host of the first: model code
    that picks a form by `jax.default_backend()` at trace time (the CPU-only products of
    `models/linear.py`, the MoE exchange of `models/moe.py`) takes the device's. Its
    serialization must round-trip (with the argument and result shardings on `mesh`, when
    the program is sharded)."""
    backend = BACKEND[platforms[0]]
    jitted = program.traces.get(None) or program.traces.get(backend) or jax.jit(
        lambda *a: program.flat(*a))  # a new function: jit's trace cache keys on it
    asked = []

    def default_backend() -> str:
        asked.append(backend)
        return backend

    allow = [export.DisabledSafetyCheck.custom_call(TRITON)] if "cuda" in platforms else []
    with mock.patch.object(jax, "default_backend", default_backend):
        exp = export.export(jitted, platforms=platforms, disabled_checks=allow)(*program.args)
    program.traces.setdefault(backend if asked else None, jitted)

    back = export.deserialize(exp.serialize())
    assert exp.platforms == back.platforms == tuple(platforms)

    def avals(e):  # (an aval's sharding is the mesh's at export: compared below)
        return [(a.shape, a.dtype) for a in (*e.in_avals, *e.out_avals)]

    assert avals(back) == avals(exp)
    if mesh is not None:
        assert back.in_shardings_jax(mesh) == exp.in_shardings_jax(mesh)
        assert back.out_shardings_jax(mesh) == exp.out_shardings_jax(mesh)
    assert back.nr_devices == exp.nr_devices
    assert back.mlir_module_serialized == exp.mlir_module_serialized
    return exp


_FUNC = re.compile(r"^  func\.func (?:public |private )?@([\w$.-]+)\(", re.M)
_CALL = re.compile(r"\bcall @([\w$.-]+)\(")
_NAME = re.compile(r'[{ ,](?:kernel_)?name = "([^"]+)"')
_FIRST_OPERAND = re.compile(r"\} : \(tensor<([0-9x]+)x[a-z0-9]+>")


def kernel_calls(text: str, platform: str) -> Counter:
    """The kernel calls the program makes, as (kernel name, channel width of its first
    operand), one per call site: a function's own custom calls plus, for every call of
    another function, that function's (a jitted helper is emitted once and called from
    each unrolled layer). A call inside a loop body counts once."""
    bounds = [(m.start(), m.group(1)) for m in _FUNC.finditer(text)]
    bodies = {name: text[start:end] for (start, name), (end, _) in
              zip(bounds, [*bounds[1:], (len(text), None)], strict=True)}
    target = f"custom_call @{CUSTOM_CALL[platform]}("

    @functools.cache
    def calls(name: str) -> Counter:
        found = Counter()
        for line in bodies[name].splitlines():
            if target in line:
                kernel, operand = _NAME.search(line), _FIRST_OPERAND.search(line)
                found[(kernel.group(1) if kernel else "?",
                       int(operand.group(1).split("x")[-1]) if operand else -1)] += 1
            for callee in _CALL.findall(line):
                found += calls(callee)
        return found

    return calls("main")


def names(calls: Counter) -> Counter:
    out = Counter()
    for (name, _), n in calls.items():
        out[name] += n
    return out


@pytest.fixture(scope="module")
def programs():
    """Traced programs by key, each built on first use, for the module's tests (both
    platforms' exports of one program share its trace)."""
    cache: dict = {}

    def get(key, build):
        if key not in cache:
            cache[key] = Program(*build())
        return cache[key]

    yield get
    cache.clear()


def test_every_registered_family_is_lowered():
    assert set(registered_families()) == set(TINY)


# ----------------------------------------------------------------------------- kernels

# entry point -> the kernel it runs on each platform (on TPU, smooth + int8 is the Mosaic
# GSM kernel followed by XLA's quantizer)
KERNELS = {
    "smooth_prefill": {"cuda": "gsm_smooth_prefill", "tpu": "gsm_smooth_prefill"},
    "smooth_decode": {"cuda": "gsm_smooth_decode", "tpu": "gsm_smooth_decode"},
    "smooth_quantize_prefill": {"cuda": "gsm_smooth_quantize_prefill",
                                "tpu": "gsm_smooth_prefill"},
    "smooth_quantize_decode": {"cuda": "gsm_smooth_quantize_decode",
                               "tpu": "gsm_smooth_decode"},
}
KERNEL_DTYPES = {"f32": (jnp.float32, "f32"), "bf16": (jnp.bfloat16, "bf16")}  # x, precision
WIDTH = 72  # channels: not a multiple of any block


def kernel_case(entry: str, dtype: str):
    x_dtype, precision = KERNEL_DTYPES[dtype]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, 13, WIDTH)), x_dtype)
    pos = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (B, 13))
    win, strength, lo = jnp.zeros(B, jnp.int32), jnp.full(B, 0.3, jnp.float32), jnp.int32(1)
    rings = jnp.zeros((3, B, 8, WIDTH), x_dtype)
    step, active = jnp.full(B, 5, jnp.int32), jnp.ones(B, bool)
    kw = dict(precision=precision, impl="pallas")
    return {
        "smooth_prefill": (functools.partial(smoothing.smooth_prefill, max_window=8, **kw),
                           (x, pos, win, strength, lo)),
        "smooth_decode": (functools.partial(smoothing.smooth_decode, **kw),
                          (x[:, 0], rings[0], step, win, strength, lo)),
        "smooth_quantize_prefill": (
            functools.partial(smoothing.smooth_quantize_prefill, max_window=8, **kw),
            (x, pos, win, strength, lo)),
        "smooth_quantize_decode": (
            functools.partial(smoothing.smooth_quantize_decode_stacked, **kw),
            (x[:, 0], rings, jnp.int32(1), step, active, win, strength, lo)),
    }[entry]


def test_every_pallas_kernel_is_lowered():
    """Every kernel `pallas_kernels/` names is one that the cases below expect."""
    root = Path(gsm_jax.__file__).resolve().parents[1] / "pallas_kernels"
    defined = {m for f in root.glob("*.py")
               for m in re.findall(r'\bname="(gsm_\w+)"', f.read_text())}
    expected = {k for per_platform in KERNELS.values() for k in per_platform.values()}
    assert defined == expected


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dtype", sorted(KERNEL_DTYPES))
@pytest.mark.parametrize("entry", sorted(KERNELS))
def test_kernel_lowers(programs, entry, dtype, platform):
    exp = export_for(programs(("kernel", entry, dtype), lambda: kernel_case(entry, dtype)),
                     (platform,))
    got = kernel_calls(exp.mlir_module(), platform)
    assert got == Counter({(KERNELS[entry][platform], WIDTH): 1}), got


# ----------------------------------------------------------------------------- models


def entry_point(params, entry: str):
    """(fn, args) of one entry point at batch B with GSM on at every layer and site,
    impl "pallas", its arguments as `generate` / the serving engine pass them."""
    cfg, w = params.config, params.weights
    fam = family_module(cfg.family)
    with kernel_impl("pallas"):
        gsm = gsm_inputs_for_batch(GSM, cfg.num_layers, B, [P, P], fit_ring=True)
    assert gsm.impl == "pallas" and gsm.precision == "bf16"
    cache = fam.init_cache(cfg, B, CACHE, dtype=jax.tree.leaves(w)[0].dtype,
                           gsm_max_window=gsm.max_window)
    toks = jnp.ones((B, P), jnp.int32)
    if entry == "prefill":
        return (lambda w, t, n, c, g: fam.prefill(w, cfg, t, n, c, g),
                (w, toks, jnp.full(B, P, jnp.int32), cache, gsm))
    if entry == "decode_step":
        return (lambda w, t, c, g, a: fam.decode_step(w, cfg, t, c, g, a),
                (w, toks[:, 0], cache, gsm, jnp.ones(B, bool)))
    return (lambda w, t, n, c, g: fam.extend(w, cfg, t, n, c, g),
            (w, toks[:, :C], jnp.full(B, C, jnp.int32), cache, gsm))


# the kernel each entry point runs at a site; W8A8 on CUDA: the fused smooth + int8 kernels
SITE_KERNEL = {"prefill": "gsm_smooth_prefill", "decode_step": "gsm_smooth_decode",
               "extend": "gsm_smooth_prefill"}
FUSED = {"prefill": "gsm_smooth_quantize_prefill", "decode_step": "gsm_smooth_quantize_decode"}


def expected_calls(params, entry: str, platform: str, *, w8a8: bool = False,
                   split: int = 1) -> Counter:
    """One kernel call per GSM site (attn_out, ffn_mid: `cfg.site_sizes` channels, split
    `split` ways on a mesh) of every layer body: one body for a scanned family, one per
    layer otherwise."""
    cfg = params.config
    kernel = FUSED.get(entry, SITE_KERNEL[entry]) if w8a8 and platform == "cuda" else (
        SITE_KERNEL[entry])
    bodies = 1 if cfg.family in SCANNED else cfg.num_layers
    assert len(cfg.site_sizes) == len(SITES)
    out = Counter()
    for width in cfg.site_sizes:
        out[(kernel, width // split)] += bodies
    return out


def check_model(programs, key, params, entry: str, platform: str, **kw) -> export.Exported:
    exp = export_for(programs((key, entry), lambda: entry_point(params, entry)), (platform,))
    got = kernel_calls(exp.mlir_module(), platform)
    want = expected_calls(params, entry, platform, **kw)
    assert got == want, f"{key} {entry} on {platform}: kernel calls {got}, expected {want}"
    return exp


def _w8a8_llama():
    """The tiny Llama's weights as `quantize(..., "w8a8")` makes them, quantized in one
    jitted program (eagerly, each op compiles on its own: 4 s instead of 0.5)."""
    from gsm_jax.quant import quantize

    p = tiny_gsm_llama()
    weights = jax.jit(lambda w: quantize(dataclasses.replace(p, weights=w), "w8a8").weights)(
        p.weights)
    return dataclasses.replace(p, weights=weights)


@pytest.fixture(scope="module")
def tiny():
    """The tiny models by name, each built on first use."""
    return functools.cache(lambda name: {**TINY, "llama-w8a8": _w8a8_llama}[name]())


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("family", sorted(TINY))
def test_family_entry_point_lowers(programs, tiny, family, entry, platform):
    check_model(programs, family, tiny(family), entry, platform)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("entry", sorted(FUSED))  # extend: the unfused kernel, as above
def test_w8a8_llama_lowers_with_the_fused_kernels(programs, tiny, entry, platform):
    check_model(programs, "llama-w8a8", tiny("llama-w8a8"), entry, platform, w8a8=True)


# ----------------------------------------------------------------------------- FP8 / FP4


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """V4 and V4.1 checkpoints written in their stored formats and loaded with the FP8
    (V4: 128 x 128 blocks, V4.1: 32 x 32) and FP4 (1 x 32, routed experts) weights kept.
    V4.1: the tiny preset's widths in 3 layers (SWA with an Engram table; CSA2 ratio 2;
    ratio 1 with candidate blocks), fewer than its 8 to keep the traces short."""
    import v41_reference as ref

    from gsm_jax.models.deepseek_v4_checkpoint import write_checkpoint as write_v4
    from gsm_jax.models.deepseek_v41_checkpoint import random_tensors
    from gsm_jax.models.deepseek_v41_checkpoint import write_checkpoint as write_v41
    from gsm_jax.workflow.evidence.random_models import hf_config

    root = tmp_path_factory.mktemp("stored")
    v4 = tiny_dsv4()
    v4_path = write_v4(v4.config, v4.weights, root / "v4", expert_dtype="fp4")
    hf = hf_config("deepseek-v4.1-tiny", 128, 0, 1, 2)
    hf["text_config"].update(
        num_hidden_layers=3, compress_ratios=[0, 2, 1], kv_source_layer_ids=[1, 2],
        index_source_layer_ids=[1, 2], candidate_source_layer_id=2, engram_layer_ids=[1],
        engram_vocab_size=50, engram_max_ngram_size=3, engram_n_heads=2, engram_head_dim=32,
        engram_num_embeddings=[240], engram_compressed_vocab_size=ref.TINY_ENGRAM_CLASSES)
    v41_path = write_v41(root / "v41", hf, random_tensors(hf, 0), ref.tiny_tokenizer_json())
    return {name: gsm_jax.load(path, dtype="float32", keep_quantized=True)
            for name, path in (("deepseek_v4", v4_path), ("deepseek_v41", v41_path))}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("entry", ["prefill", "decode_step"])  # (extend: prefill's products)
@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41"])
def test_stored_fp8_fp4_weights_lower(programs, stored, family, entry, platform):
    from gsm_jax.models.block_quant import BlockQuantWeight

    params = stored[family]
    kept = [a for a in jax.tree.leaves(params.weights,
                                       is_leaf=lambda a: isinstance(a, BlockQuantWeight))
            if isinstance(a, BlockQuantWeight)]
    assert {a.fmt for a in kept} == {"e4m3", "e2m1"}, {a.fmt for a in kept}
    exp = check_model(programs, f"{family}-stored", params, entry, platform)
    # the FP8 bytes enter the program as they are stored (FP4: packed in uint8)
    assert jnp.dtype(jnp.float8_e4m3fn) in {a.dtype for a in exp.in_avals}


# ----------------------------------------------------------------------------- sharded


def sharded_llama(params, entry: str):
    """The entry point with the weights sharded by the library's rules on an abstract
    1 x 8 ("data", "model") mesh and the tokens split like the batch, as `generate` places
    them."""
    from jax.sharding import AbstractMesh, AxisType

    from gsm_jax.sharding import batch_sharding, weight_shardings
    from gsm_jax.sharding import check_model as check_fits

    mesh = AbstractMesh(MESH, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    check_fits(params.config, mesh)  # what gsm_jax.shard refuses up front
    fn, (w, toks, *rest) = entry_point(params, entry)
    shardings = weight_shardings(params.config.family, w, mesh)
    w = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                     w, shardings)
    toks = jax.ShapeDtypeStruct(toks.shape, toks.dtype,
                                sharding=batch_sharding(mesh, toks.ndim))
    return mesh, fn, (w, toks, *rest)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_sharded_on_a_1x8_mesh_lowers(programs, tiny, entry, platform):
    """Every GSM kernel runs on its device's own channels (`map_rows_and_channels`: Mosaic
    kernels cannot be partitioned automatically, and XLA would gather a Triton call's
    operands), inside the shard_map's manual computation."""
    params = tiny("llama")
    mesh, fn, args = sharded_llama(params, entry)
    with jax.sharding.use_abstract_mesh(mesh):  # the mesh `generate` sets around tracing
        exp = export_for(programs(("llama-1x8", entry), lambda: (fn, args)), (platform,),
                         mesh)
    text = exp.mlir_module()
    assert exp.nr_devices == 8 and "mhlo.num_partitions = 8" in text
    embed = exp.in_shardings_jax(mesh)[0]  # the first leaf: the embedding, its rows split
    assert exp.in_avals[0].shape == (params.config.vocab_size, params.config.hidden_size)
    assert embed.spec == jax.sharding.PartitionSpec("model", None), embed
    got = kernel_calls(text, platform)
    assert got == expected_calls(params, entry, platform, split=MESH[1]), got
    assert text.count("sdy.manual_computation(") == sum(got.values())


# ----------------------------------------------------------------------------- one export


@pytest.mark.xfail(strict=True, raises=ValueError, reason=(
    "jax 0.10.2: a multi-platform export lowers every kept branch of lax.platform_dependent "
    "for all its platforms, so the CUDA branch's Triton pallas_call is lowered for TPU too: "
    "ValueError: Compiler params for platform gpu cannot be used for tpu lowering."))
def test_one_export_for_both_platforms(programs):
    program = programs(("kernel", "smooth_prefill", "f32"),
                       lambda: kernel_case("smooth_prefill", "f32"))
    try:
        exp = export_for(program, PLATFORMS)
    except ValueError as e:
        if "Compiler params for platform gpu cannot be used for tpu lowering" not in str(e):
            pytest.fail(f"not the known JAX limitation: {e}")
        raise
    text = exp.mlir_module()
    for platform in PLATFORMS:
        assert names(kernel_calls(text, platform)) == Counter({"gsm_smooth_prefill": 1})
