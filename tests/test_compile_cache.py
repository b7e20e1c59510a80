"""`compile_cache.cached_call`: traced programs saved with jax.export beside the persistent
compilation cache, loaded by a later process instead of tracing again (issue 24, item 2).

A "later process" is simulated by clearing the in-memory table (`_programs`); the CLI test
in tests/test_clone_and_cli.py runs two real processes."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import tiny_gsm_llama

import gsm_jax
from gsm_jax import compile_cache as cc


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    """The persistent cache 'on' in tmp_path for cached_call (JAX's own compilation cache
    setting is the suite's; only the exported programs go to tmp_path)."""
    monkeypatch.setattr(cc, "_enabled", tmp_path)
    monkeypatch.setattr(cc, "_programs", {})
    monkeypatch.setattr(cc, "_warned", set())
    return tmp_path


@functools.partial(jax.jit, static_argnames=("scale", "square"))
def _fn(tree, key, *, scale: float, square: bool):
    x = tree["x"] * scale + jax.random.uniform(key, tree["x"].shape)
    y = x * x if square else x
    return y.sum(axis=-1), {"n": tree["n"] + 1, "none": None}


def _args(shape=(3, 4)):
    return ({"x": jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape),
             "n": jnp.int32(5)}, jax.random.key(3))


def _saved(folder):
    return sorted((folder / cc.EXPORT_SUBDIR).glob("*.jaxexport"))


def _no_tracing(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("traced again: the saved program was not used")

    monkeypatch.setattr(jax.export, "export", refuse)


def test_saved_program_is_loaded_and_equal(cache_on, monkeypatch):
    static = dict(scale=2.0, square=True)
    want = _fn(*_args(), **static)
    first = cc.cached_call("fn", _fn, _args(), static)
    assert len(_saved(cache_on)) == 1 and _saved(cache_on)[0].name.startswith("fn-")
    monkeypatch.setattr(cc, "_programs", {})  # a new process
    _no_tracing(monkeypatch)
    second = cc.cached_call("fn", _fn, _args(), static)
    for got in (first, second):  # pytree outputs (None included) and the PRNG key input
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_one_program_per_static_arguments_shapes_and_source(cache_on, monkeypatch):
    cc.cached_call("fn", _fn, _args(), dict(scale=2.0, square=True))
    cc.cached_call("fn", _fn, _args(), dict(scale=2.0, square=False))
    cc.cached_call("fn", _fn, _args((2, 4)), dict(scale=2.0, square=False))
    assert len(_saved(cache_on)) == 3
    # the same call after a change of gsm_jax's source (or of jax): traced and saved anew
    monkeypatch.setattr(cc, "_programs", {})
    monkeypatch.setattr(cc, "source_fingerprint", lambda: "edited")
    cc.cached_call("fn", _fn, _args(), dict(scale=2.0, square=True))
    assert len(_saved(cache_on)) == 4


def test_source_fingerprint_covers_the_model_files():
    import gsm_jax.models.llama as llama_module

    assert len(cc.source_fingerprint()) == 64
    assert llama_module.__file__.endswith("llama.py")  # models/ is gsm_jax.models


def test_unreadable_saved_program_is_traced_again(cache_on, monkeypatch, capsys):
    static = dict(scale=1.0, square=True)
    cc.cached_call("fn", _fn, _args(), static)
    (path,) = _saved(cache_on)
    path.write_bytes(b"not a program")
    monkeypatch.setattr(cc, "_programs", {})
    got = cc.cached_call("fn", _fn, _args(), static)
    assert "unreadable saved program" in capsys.readouterr().err
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(_fn(*_args(), **static)[0]))
    assert path.read_bytes() != b"not a program"  # rewritten


def test_direct_call_when_the_cache_is_off(tmp_path, monkeypatch):
    monkeypatch.setattr(cc, "_enabled", None)
    monkeypatch.setattr(cc, "_programs", {})
    _no_tracing(monkeypatch)
    got = cc.cached_call("fn", _fn, _args(), dict(scale=1.0, square=False))
    np.testing.assert_array_equal(np.asarray(got[0]),
                                  np.asarray(_fn(*_args(), scale=1.0, square=False)[0]))
    assert not (tmp_path / cc.EXPORT_SUBDIR).exists()


def test_a_program_that_cannot_be_exported_is_said_and_called_directly(cache_on, capsys):
    @functools.partial(jax.jit, static_argnames=("k",))
    def with_callback(x, *, k):
        jax.debug.callback(lambda v: None, x)
        return x * k

    for _ in range(2):
        got = cc.cached_call("cb", with_callback, (jnp.ones(3),), dict(k=2))
        np.testing.assert_array_equal(np.asarray(got), 2 * np.ones(3))
    err = capsys.readouterr().err
    assert err.count("cb: traced on every run, not saved") == 1, err
    assert not _saved(cache_on)


def test_generate_through_a_saved_program_equals_generate(cache_on, monkeypatch):
    """The whole generation loop (prefill + decode, GSM on, sampled, logits returned):
    outputs of the exported program equal the plain jit's, in the process that saved it
    and in one that loads it."""
    params = tiny_gsm_llama()
    gsm = gsm_jax.GSMConfig(window_size=4, smooth_strength=0.3, target_layers="all")
    rows = [[5, 6, 7, 8, 9], [10, 11, 12]]
    kw = dict(max_new_tokens=6, temperature=0.8, top_k=20, seed=4, gsm=gsm, return_logits=True)
    monkeypatch.setattr(cc, "_enabled", None)
    want = gsm_jax.generate_tokens(params, rows, **kw)
    monkeypatch.setattr(cc, "_enabled", cache_on)
    saved = gsm_jax.generate_tokens(params, rows, **kw)
    assert [p.name.split("-")[0] for p in _saved(cache_on)] == ["generate_loop"]
    monkeypatch.setattr(cc, "_programs", {})
    _no_tracing(monkeypatch)
    loaded = gsm_jax.generate_tokens(params, rows, **kw)
    for got in (saved, loaded):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        for a, b in zip(got[0], want[0], strict=True):
            np.testing.assert_array_equal(a, b)


def test_engine_programs_saved_as_executables_load_without_lowering(cache_on, monkeypatch,
                                                                     capsys):
    """The serving engine's programs are saved compiled (`save_executable`) and a later
    process loads them without tracing, lowering or compiling; the requests' tokens (GSM on,
    greedy and sampled) equal those of the engine that compiled them. A corrupt file is
    said once and built again."""
    from gsm_jax.serving import programs
    from gsm_jax.serving.engine import Engine, Request

    params = tiny_gsm_llama()
    gsm = gsm_jax.GSMConfig(window_size=4, smooth_strength=0.3, target_layers="all")
    reqs = [Request([5, 6, 7, 8, 9], 5, request_id="a"),
            Request([10, 11, 12], 4, request_id="b", temperature=0.9, seed=3)]

    def run():
        eng = Engine(params, max_batch=2, max_len=32, gsm=gsm, compile_gsm=True, eos_ids=[],
                     prefill_chunk=16)
        eng.warmup((4,))
        return eng, [r.tokens for r in eng.run(reqs)]

    monkeypatch.setattr(programs, "_EXECUTABLES", {})
    first, want = run()
    saved = sorted((cache_on / cc.EXECUTABLE_SUBDIR).glob("*.jaxexec"))
    assert len(saved) == len(first.programs) > 0

    monkeypatch.setattr(programs, "_EXECUTABLES", {})  # a new process
    monkeypatch.setattr(cc, "_programs", {})

    def refuse(*a, **k):
        raise AssertionError("lowered again: the saved executable was not used")

    with monkeypatch.context() as m:
        m.setattr(programs.ProgramSet, "_lower", refuse)
        second, got = run()
    assert got == want and second.programs.compiled == len(second.programs)

    saved[0].write_bytes(b"not an executable")
    monkeypatch.setattr(programs, "_EXECUTABLES", {})
    _, again = run()
    assert again == want
    assert "ignoring the unreadable saved executable" in capsys.readouterr().err
    assert saved[0].stat().st_size > 100  # rewritten


def test_int8_model_through_a_saved_program(cache_on, monkeypatch, capsys):
    """A w8a16 model with an int8 head: its program (which calls gsm_jax's CPU int8 kernel
    where it builds) is exported, not refused as an unstable custom call, and a later
    process that loads it registers the kernel first; where the kernel cannot be had, the
    saved program is refused by name and traced again."""
    from gsm_jax.pallas_kernels import int8_matvec_cpu
    from gsm_jax.quant import quantize

    params = quantize(tiny_gsm_llama(), "w8a16", head=True)
    rows = [[5, 6, 7, 8, 9], [10, 11, 12]]
    kw = dict(max_new_tokens=5, eos_ids=[], return_logits=True)
    monkeypatch.setattr(cc, "_enabled", None)
    want = gsm_jax.generate_tokens(params, rows, **kw)
    monkeypatch.setattr(cc, "_enabled", cache_on)
    gsm_jax.generate_tokens(params, rows, **kw)
    (path,) = _saved(cache_on)
    uses_kernel = int8_matvec_cpu.TARGET.encode() in path.read_bytes()
    assert uses_kernel == (jax.default_backend() == "cpu" and int8_matvec_cpu.available())
    assert "traced on every run" not in capsys.readouterr().err
    asked = []
    real = int8_matvec_cpu.available
    monkeypatch.setattr(int8_matvec_cpu, "available", lambda: asked.append(1) or real())
    monkeypatch.setattr(cc, "_programs", {})
    loaded = gsm_jax.generate_tokens(params, rows, **kw)
    assert bool(asked) == uses_kernel
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if uses_kernel:  # the kernel gone: the saved program is not run, and it says why
        monkeypatch.setattr(int8_matvec_cpu, "available", lambda: False)
        monkeypatch.setattr(cc, "_programs", {})
        again = gsm_jax.generate_tokens(params, rows, **kw)
        assert "calls the int8 kernel, which is unavailable" in capsys.readouterr().err
        assert len(again[0]) == 2
