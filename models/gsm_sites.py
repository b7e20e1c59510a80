"""Where a model hands a site's activations to the GSM filter.

Both model families call `smooth_site_prefill` / `smooth_site_decode` at their two
sites (`attn_out`: the input of the output projection; `ffn_mid`: the input of the
down projection). Everything numeric is a runtime array, so a new GSM config
takes effect without recompiling; only `max_window`, `precision` and `impl` are
static.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

SITES = ("attn_out", "ffn_mid")
ATTN_OUT, FFN_MID = 0, 1


@struct.dataclass
class GSMInputs:
    """Runtime GSM arrays for one batch (a pytree: changing values never recompiles)."""

    strength: jax.Array  # f32 [layers, 2]: per (layer, site) strength, 0 where not smoothed
    row_enabled: jax.Array  # f32 [B]: 1 for rows smoothed, 0 for bypassed/rolled-out rows
    window: jax.Array  # i32 []: fixed window, or 0 for adaptive
    protect_first: jax.Array  # i32 []
    max_window: int = struct.field(pytree_node=False, default=64)
    precision: str = struct.field(pytree_node=False, default="bf16")
    impl: str = struct.field(pytree_node=False, default="auto")

    def row_args(self, layer: jax.Array, site: int) -> tuple[jax.Array, jax.Array]:
        """Per-row window [B] and strength [B] for one (layer, site)."""
        batch = self.row_enabled.shape[0]
        strength = self.strength[layer, site] * self.row_enabled
        window = jnp.broadcast_to(self.window, (batch,)).astype(jnp.int32)
        return window, strength.astype(jnp.float32)


def smooth_site_prefill(
    gsm: GSMInputs | None,
    layer: jax.Array,
    site: int,
    x: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array | None]:
    """Smooth a site over a whole prompt; also return the ring buffer decode continues from."""
    if gsm is None:
        return x, None
    from gsm_jax.smoothing import ring_from_prefill, smooth_prefill

    window, strength = gsm.row_args(layer, site)
    with jax.named_scope(f"gsm_{SITES[site]}"):
        y = smooth_prefill(
            x, positions, window, strength, gsm.protect_first,
            max_window=gsm.max_window, precision=gsm.precision, impl=gsm.impl,
        )
        ring = ring_from_prefill(x, positions, gsm.max_window)
    return y, ring


def smooth_site_decode(
    gsm: GSMInputs | None,
    layer: jax.Array,
    site: int,
    x: jax.Array,
    rings: jax.Array | None,
    position: jax.Array,
    active: jax.Array,
) -> tuple[jax.Array, jax.Array | None]:
    """Smooth one new token per row ([B, C]) against the ring of its recent inputs.

    `rings` holds every layer's ring for this site, [layers, B, max_window, C]
    (part of the decode cache); only layer `layer` is read and written.
    `position` [B] is each row's new position (its cache length); rows with
    active=False return x unchanged (see `smooth_decode_stacked`).
    """
    if gsm is None:
        return x, rings
    from gsm_jax.smoothing import smooth_decode_stacked

    window, strength = gsm.row_args(layer, site)
    with jax.named_scope(f"gsm_{SITES[site]}"):
        return smooth_decode_stacked(
            x, rings, layer, position, active, window, strength, gsm.protect_first,
            precision=gsm.precision, impl=gsm.impl,
        )
