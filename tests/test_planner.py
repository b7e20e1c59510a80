"""The planner's prefill activation estimate against how generate prefills (chunked)."""

from __future__ import annotations

import pytest

import gsm_jax
from gsm_jax.errors import InvalidInputError
from gsm_jax.generation import PREFILL_CHUNK


def _act(context: int, chunk):
    p = gsm_jax.plan("deepseek-v4-flash", (1, 8), "141GB", batch=1, context=context,
                     prefill_chunk=chunk)
    return p.lines["activations (estimate)"]


def test_chunked_prefill_activations_grow_linearly():
    """One call materialises [H, T, T + entries] scores (quadratic in the prompt); in
    chunks of PREFILL_CHUNK tokens, as generate prefills, [H, chunk, T + entries]: linear.
    V4-Flash at 32k tokens on 8 devices: ~49 GB in one call (the figure issue 25 quotes),
    under 2 GB chunked."""
    one = {t: _act(t, None) for t in (16384, 32768)}
    chunked = {t: _act(t, PREFILL_CHUNK) for t in (16384, 32768)}
    assert one[32768] / one[16384] > 3.4  # the scores term alone: 4
    assert 1.5 < chunked[32768] / chunked[16384] <= 2.0  # a chunk: constant stream + linear scores
    assert 45e9 < one[32768] < 55e9 and chunked[32768] < 2e9
    # a prompt no longer than the chunk is one call either way
    assert _act(PREFILL_CHUNK, PREFILL_CHUNK) == _act(PREFILL_CHUNK, None)
    with pytest.raises(InvalidInputError, match="prefill_chunk must be >= 1"):
        _act(4096, 0)
