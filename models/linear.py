"""Every projection of the model families goes through `linear`.

Today a weight is a float array stored [in, out]. The quantization path swaps
in weight containers (int8 values + scales) and extends `linear` to dispatch
on them, so model files never change when a new scheme arrives.
"""

from __future__ import annotations

import jax


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] in x's dtype."""
    return x @ w.astype(x.dtype)
