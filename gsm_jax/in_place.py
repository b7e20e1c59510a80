"""Writes into donated buffers that stay in place: the caches' and the GSM rings' updates.

`scatter_set(buf, index, values, mode=)` is ``buf.at[index].set(values, mode=mode)``, with
one difference: a write of a single update is made twice. XLA turns a scatter of one
update into a dynamic-update-slice, and XLA:CPU runs a dynamic-update-slice of a buffer
that the same program also reads on two to four copies of the whole buffer: at batch 1
every decode step copied every KV cache array (a mid Llama's step at 16k tokens took 8.5x
as long) and the whole GSM ring stack per layer. A scatter of two identical updates stays
a scatter and updates the donated buffer in place (docs/performance_notes.md, "GSM decode
ring write at batch 1: keep it a scatter" and "KV-cache writes at batch 1: keep them
scatters"; tests/test_decode_in_place.py checks the compiled decode steps).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["scatter_set"]


def scatter_set(buf: jax.Array, index: tuple[Any, ...], values: jax.Array, *,
                mode: str) -> jax.Array:
    """``buf.at[index].set(values, mode=mode)``, kept a scatter when it writes one update.

    index: index arrays (they broadcast together to the update shape U) and slices, an
    array first, so the update dims lead the result as numpy places them; values:
    U + the sliced dims. A single update (U of size 1) is written twice (the same slot,
    the same value: "drop" drops both, "promise_in_bounds" keeps its promise)."""
    if isinstance(index[0], slice):
        raise ValueError("scatter_set: the index must start with an index array")
    arrays = [jnp.asarray(i) for i in index if not isinstance(i, slice)]
    u = jnp.broadcast_shapes(*(a.shape for a in arrays))
    if math.prod(u) == 1:
        index = tuple(i if isinstance(i, slice)
                      else jnp.tile(jnp.broadcast_to(jnp.asarray(i), u).reshape(1), 2)
                      for i in index)
        one = values.reshape((1,) + values.shape[len(u):])
        values = jnp.concatenate([one, one])
    return buf.at[index].set(values, mode=mode)
