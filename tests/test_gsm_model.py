"""GSM inside the model: exactness when off, prefill/decode consistency, batch invariance,
per-request decisions, and no recompilation when the config changes."""

from __future__ import annotations

import numpy as np
import pytest
from decode_checks import decode_and_teacher_forced
from tiny_models import tiny_gsm_llama

import gsm_jax
from gsm_jax import generation
from gsm_jax.config import rollout_value

ALL = dict(target_layers="all", smooth_strength=0.3, precision="f32")


@pytest.fixture(scope="module")
def tiny():
    return tiny_gsm_llama()


def _rows(n: int, lengths, seed: int = 0, vocab: int = 96):
    rng = np.random.RandomState(seed)
    return [list(rng.randint(4, vocab, size=ln)) for ln in lengths][:n]


def test_off_and_zero_strength_and_window_one_are_bit_identical(smollm2):
    rows = [smollm2.tokenizer.encode("The capital of France is Paris, and"),
            smollm2.tokenizer.encode("def fib(n):")]
    base = np.asarray(gsm_jax.forward(smollm2, rows))
    for cfg in (
        gsm_jax.GSMConfig(enable=False, **ALL),
        gsm_jax.GSMConfig(**{**ALL, "smooth_strength": 0.0}),
        gsm_jax.GSMConfig(**{**ALL, "window_size": 1}),
        gsm_jax.GSMConfig(**{**ALL, "precision": "bf16", "smooth_strength": 0.0}),
    ):
        np.testing.assert_array_equal(np.asarray(gsm_jax.forward(smollm2, rows, gsm=cfg)), base)
    gen_off = gsm_jax.generate_tokens(smollm2, rows, max_new_tokens=8)
    gen_zero = gsm_jax.generate_tokens(smollm2, rows, max_new_tokens=8,
                                       gsm=gsm_jax.GSMConfig(enable=False, **ALL))
    for a, b in zip(gen_off, gen_zero, strict=True):
        np.testing.assert_array_equal(a, b)
    # and GSM on really changes something
    on = np.asarray(gsm_jax.forward(smollm2, rows, gsm=gsm_jax.GSMConfig(**ALL)))
    assert np.abs(on - base).max() > 1e-2


CONSISTENCY = [
    dict(window_size=8, protect_first=0),
    dict(window_size=8, protect_first=1),
    dict(window_size="adaptive", protect_first=2),
    dict(window_size=3, protect_first=1, max_window=4),  # window wraps the ring many times
]


@pytest.mark.parametrize("overrides", CONSISTENCY)
def test_decode_equals_teacher_forced_with_gsm(tiny, overrides):
    """Incremental decode with GSM on == one forward pass over the same tokens (f32)."""
    cfg = gsm_jax.GSMConfig(**{**ALL, **overrides})
    rows = _rows(3, [5, 23, 40])  # ragged; the adaptive window grows past 4 in the long row
    for _, got, ref in decode_and_teacher_forced(tiny, rows, max_new_tokens=40, gsm=cfg):
        np.testing.assert_allclose(got, ref, atol=1e-4 * np.abs(ref).max(), rtol=0)


def test_decode_equals_teacher_forced_bf16_precision(smollm2):
    """bf16 filter arithmetic: prefill (band sums) and decode (row sums) add in a different
    order, so the bf16-rounded means may differ by an ulp (2^-8 relative); over 30 layers that
    stays well under 1% of the logit scale and never flips the greedy choice here."""
    cfg = gsm_jax.GSMConfig(target_layers="all", window_size="adaptive", protect_first=1)
    rows = [smollm2.tokenizer.encode("The capital of France is"),
            smollm2.tokenizer.encode("Once upon a time, there was")]
    for o, got, ref in decode_and_teacher_forced(smollm2, rows, max_new_tokens=12, gsm=cfg,
                                                 eos_ids=None):
        np.testing.assert_allclose(got, ref, atol=1e-2 * np.abs(ref).max(), rtol=0)
        np.testing.assert_array_equal(ref.argmax(-1), o)


def test_batch_invariance(tiny):
    """A row's logits do not depend on its neighbours or on how much padding the batch has."""
    cfg = gsm_jax.GSMConfig(**{**ALL, "window_size": "adaptive", "protect_first": 0})
    rows = _rows(4, [7, 30, 2, 18], seed=3)
    batched = np.asarray(gsm_jax.forward(tiny, rows, gsm=cfg))
    for i, r in enumerate(rows):
        alone = np.asarray(gsm_jax.forward(tiny, [r], gsm=cfg))[0]
        np.testing.assert_allclose(batched[i, : len(r)], alone, atol=1e-5, rtol=0)
    outs = gsm_jax.generate_tokens(tiny, rows, max_new_tokens=10, eos_ids=[], gsm=cfg)
    for i, r in enumerate(rows):
        alone = gsm_jax.generate_tokens(tiny, [r], max_new_tokens=10, eos_ids=[], gsm=cfg)[0]
        np.testing.assert_array_equal(outs[i], alone)


def test_protect_first_leaves_first_tokens_alone(tiny):
    """Logits at positions < protect_first equal the unsmoothed model's; later ones differ."""
    rows = _rows(1, [12], seed=5)
    base = np.asarray(gsm_jax.forward(tiny, rows))[0]
    on = np.asarray(gsm_jax.forward(tiny, rows, gsm=gsm_jax.GSMConfig(**ALL, protect_first=3)))[0]
    np.testing.assert_array_equal(on[:3], base[:3])
    # position 3 is the first smoothed token, but its window holds only itself -> unchanged too
    assert np.abs(on[4:] - base[4:]).max() > 1e-4


def test_short_request_bypass(tiny):
    rows = _rows(2, [4, 20], seed=6)
    cfg = gsm_jax.GSMConfig(**ALL, short_request_tokens=20)  # row 0: 4 + 8 = 12 < 20
    outs_off, lo = gsm_jax.generate_tokens(tiny, rows, max_new_tokens=8, eos_ids=[],
                                           return_logits=True)
    outs_on, ln = gsm_jax.generate_tokens(tiny, rows, max_new_tokens=8, eos_ids=[], gsm=cfg,
                                          return_logits=True)
    np.testing.assert_array_equal(ln[0], lo[0])  # bypassed: bit-identical to no GSM
    assert np.abs(ln[1] - lo[1]).max() > 1e-4


def test_rollout_by_request_id(tiny):
    ids = [f"req-{i}" for i in range(12)]
    cfg = gsm_jax.GSMConfig(**ALL, rollout_fraction=0.5)
    selected = [rollout_value(i) < 0.5 for i in ids]
    assert 0 < sum(selected) < len(ids)
    rows = _rows(12, [6] * 12, seed=8)
    base = np.asarray(gsm_jax.forward(tiny, rows))
    on = np.asarray(gsm_jax.forward(tiny, rows, gsm=cfg, request_ids=ids))
    for i, sel in enumerate(selected):
        same = np.array_equal(on[i], base[i])
        assert same != sel, f"row {i}: selected={sel} but unchanged={same}"
    # the same id gets the same decision in another batch position
    again = np.asarray(gsm_jax.forward(tiny, rows[::-1], gsm=cfg, request_ids=ids[::-1]))
    np.testing.assert_allclose(again[::-1], on, atol=1e-5, rtol=0)


def test_config_changes_do_not_recompile(tiny):
    rows = _rows(2, [9, 14], seed=9)
    cfg = gsm_jax.GSMConfig(**ALL)
    gsm_jax.generate_tokens(tiny, rows, max_new_tokens=6, gsm=cfg)
    gsm_jax.forward(tiny, rows, gsm=cfg)
    n_gen = generation._generate_loop._cache_size()
    n_fwd = generation._forward_jit._cache_size()
    variants = [
        cfg.replace(smooth_strength=0.05),
        cfg.replace(window_size=3),
        cfg.replace(window_size="adaptive"),
        cfg.replace(target_layers=[0, 2]),
        cfg.replace(target_layers={1: ["ffn_mid"]}),
        cfg.replace(protect_first=0),
        cfg.replace(short_request_tokens=12),
        cfg.replace(rollout_fraction=0.5),
        cfg.replace(enable=False),
    ]
    for v in variants:
        gsm_jax.generate_tokens(tiny, rows, max_new_tokens=6, gsm=v, request_ids=["a", "b"])
        gsm_jax.forward(tiny, rows, gsm=v, request_ids=["a", "b"])
    assert generation._generate_loop._cache_size() == n_gen
    assert generation._forward_jit._cache_size() == n_fwd


def test_model_through_pallas_kernels_in_interpret_mode(tiny):
    """The forced Pallas path (interpret mode on CPU) gives the XLA path's logits."""
    cfg = gsm_jax.GSMConfig(**{**ALL, "window_size": "adaptive", "protect_first": 1})
    rows = _rows(2, [6, 19], seed=10)
    xla_out, xla_logits = gsm_jax.generate_tokens(tiny, rows, max_new_tokens=5, eos_ids=[],
                                                  gsm=cfg, return_logits=True)
    with gsm_jax.kernel_impl("pallas_interpret"):
        pl_out, pl_logits = gsm_jax.generate_tokens(tiny, rows, max_new_tokens=5, eos_ids=[],
                                                    gsm=cfg, return_logits=True)
    for a, b, la, lb in zip(xla_out, pl_out, xla_logits, pl_logits, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(la, lb, atol=1e-5 * np.abs(la).max(), rtol=0)


def test_watcher_drives_generation(tiny, tmp_path):
    path = tmp_path / "gsm.yaml"
    gsm_jax.GSMConfig(**ALL).to_file(path)
    watcher = gsm_jax.ConfigWatcher(path)
    rows = _rows(1, [10], seed=11)
    first = np.asarray(gsm_jax.forward(tiny, rows, gsm=watcher))
    path.write_text("smooth_strength: 0.9\ntarget_layers: all\n")  # above the guard
    assert watcher.poll() is False and "0.9" in str(watcher.last_error)
    np.testing.assert_array_equal(np.asarray(gsm_jax.forward(tiny, rows, gsm=watcher)), first)
    gsm_jax.GSMConfig(**{**ALL, "enable": False}).to_file(path)
    assert watcher.poll() is True
    np.testing.assert_array_equal(np.asarray(gsm_jax.forward(tiny, rows, gsm=watcher)),
                                  np.asarray(gsm_jax.forward(tiny, rows)))
    watcher.rollback()
    np.testing.assert_array_equal(np.asarray(gsm_jax.forward(tiny, rows, gsm=watcher)), first)
