"""GSM smoothing as a `Sites` implementation: where a model hands a site's activations
to the GSM filter.

`GSMInputs` is the `models.sites.Sites` hook that smooths: every family's layer calls
`step.site(...)` at its two sites (`attn_out`: the input of the output projection;
`ffn_mid`: the input of the down projection). Everything numeric is a runtime array,
so a new GSM config takes effect without recompiling; only `max_window`, `precision` and `impl` are
static.

"Quantize, then smooth" (INT8 W8A8, `gsm_jax.quant`): a caller may pass the weight
the site feeds (`next_weight`). When it is a W8A8 `QuantizedWeight`, the site
returns the activation already smoothed *and* quantized per token, as a
`QuantizedActivation` that `linear` multiplies as is: the filter sees the float
activation, the per-token scale is taken after it. On GPU that is one fused
Pallas kernel (`pallas_kernels/smooth_quant.py`); on CPU the XLA filter followed
by the reference quantizer (the same arithmetic `linear` would apply). Without
GSM (gsm=None) a site returns x and `linear` quantizes it, so a strength-0 config
gives the quantized model without GSM bit for bit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from gsm_jax.models.linear import QuantizedActivation, wants_int8_input
from gsm_jax.models.partitioning import map_rows_and_channels
from gsm_jax.models.sites import ATTN_OUT, FFN_MID, SITES, Sites

__all__ = ["ATTN_OUT", "FFN_MID", "SITES", "GSMInputs", "smooth_site_decode",
           "smooth_site_extend", "smooth_site_prefill"]


@struct.dataclass
class GSMInputs(Sites):
    """Runtime GSM arrays for one batch (a pytree: changing values never recompiles), and
    the `Sites` hook that smooths with them (`site` below: one entry for every mode)."""

    # f32 [layers, 2]: per (layer, site) strength, 0 where not smoothed; or [B, layers, 2]:
    # per row (a server whose running requests hold different config versions)
    strength: jax.Array
    row_enabled: jax.Array  # f32 [B]: 1 for rows smoothed, 0 for bypassed/rolled-out rows
    window: jax.Array  # i32 [] or [B]: fixed window, or 0 for adaptive
    protect_first: jax.Array  # i32 []
    max_window: int = struct.field(pytree_node=False, default=64)
    precision: str = struct.field(pytree_node=False, default="bf16")
    impl: str = struct.field(pytree_node=False, default="auto")

    def row_args(self, layer: jax.Array, site: int) -> tuple[jax.Array, jax.Array]:
        """Per-row window [B] and strength [B] for one (layer, site)."""
        batch = self.row_enabled.shape[0]
        per_row = self.strength[:, layer, site] if self.strength.ndim == 3 else (
            self.strength[layer, site])
        strength = per_row * self.row_enabled
        window = jnp.broadcast_to(self.window, (batch,)).astype(jnp.int32)
        return window, strength.astype(jnp.float32)

    @property
    def uses_rings(self) -> bool:
        return True

    def site(self, step, layer, index, x, next_weight=None):
        """Smooth x [B, T, C] at site `index` of `layer`, as the step's mode needs:
        teacher-forced (no state), a fresh prefill (the rings start here), a chunk that
        continues the rows' rings, or one decode token per row against them."""
        if step.mode == "forward":
            return smooth_site_prefill(self, layer, index, x, step.positions, next_weight)[0]
        if step.mode == "prefill":
            y, ring = smooth_site_prefill(self, layer, index, x, step.positions, next_weight)
            rings = step.rings[index]
            step.rings[index] = rings.at[layer].set(ring.astype(rings.dtype))
            return y
        if step.mode == "extend":
            y, step.rings[index] = smooth_site_extend(self, layer, index, x, step.rings[index],
                                                      step.start, step.positions)
            return y
        y, step.rings[index] = smooth_site_decode(self, layer, index, x[:, 0], step.rings[index],
                                                  step.positions[:, 0], step.active,
                                                  next_weight)
        return y[:, None]  # also a QuantizedActivation: [B, C] -> [B, 1, C]


# The axes of the filter's arguments (`partitioning.map_rows_and_channels`): x [B, T, C],
# positions [B, T], window and strength [B], protect_first []; for decode x [B, C], the
# rings [L, B, W, C], layer [], position and active [B].
_PREFILL_KINDS = ("btc", "bt", "b", "b", "")
_DECODE_KINDS = ("bc", "lbwc", "", "b", "b", "b", "b", "")


def _per_shard(fn, args, kinds, out_kinds, *, per_token_scale: bool = False):
    """The GSM filter on each device's own rows and channels when a mesh is set (exact: the
    filter is independent across both): the Pallas kernels need it (Mosaic cannot be
    partitioned automatically; a Triton call's operands would be gathered). With
    `per_token_scale` (smooth, then int8) the channels stay whole: the scale is a max over
    all of a token's channels."""
    x = args[0]
    return map_rows_and_channels(fn, args, kinds, out_kinds, x.shape[0],
                                 None if per_token_scale else x.shape[-1])


def smooth_site_prefill(
    gsm: GSMInputs | None,
    layer: jax.Array,
    site: int,
    x: jax.Array,
    positions: jax.Array,
    next_weight=None,
) -> tuple[jax.Array | QuantizedActivation, jax.Array | None]:
    """Smooth a site over a whole prompt; also return the ring buffer decode continues from.

    With a W8A8 `next_weight` the smoothed activation comes back quantized per token.
    """
    if gsm is None:
        return x, None
    from gsm_jax.smoothing import ring_from_prefill, smooth_prefill

    window, strength = gsm.row_args(layer, site)
    kw = dict(max_window=gsm.max_window, precision=gsm.precision, impl=gsm.impl)
    with jax.named_scope(f"gsm_{SITES[site]}"):
        args = (x, positions, window, strength, gsm.protect_first)
        if wants_int8_input(next_weight):
            from gsm_jax.smoothing import smooth_quantize_prefill

            q, s = _per_shard(functools.partial(smooth_quantize_prefill, **kw), args,
                              _PREFILL_KINDS, ("btc", "bt"), per_token_scale=True)
            y = QuantizedActivation(q, s, jnp.dtype(x.dtype).name)
        else:
            y = _per_shard(functools.partial(smooth_prefill, **kw), args, _PREFILL_KINDS,
                           "btc")
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
    next_weight=None,
) -> tuple[jax.Array | QuantizedActivation, jax.Array | None]:
    """Smooth one new token per row ([B, C]) against the ring of its recent inputs.

    `rings` holds every layer's ring for this site, [layers, B, max_window, C]
    (part of the decode cache); only layer `layer` is read and written.
    `position` [B] is each row's new position (its cache length); rows with
    active=False return x unchanged (see `smooth_decode_stacked`). With a W8A8
    `next_weight` the smoothed token comes back quantized per token.
    """
    if gsm is None:
        return x, rings
    from gsm_jax.smoothing import smooth_decode_stacked

    window, strength = gsm.row_args(layer, site)
    args = (x, rings, layer, position, active, window, strength, gsm.protect_first)
    if wants_int8_input(next_weight):
        from gsm_jax.smoothing import smooth_quantize_decode_stacked

        with jax.named_scope(f"gsm_{SITES[site]}"):
            q, s, rings = _per_shard(
                functools.partial(smooth_quantize_decode_stacked, precision=gsm.precision,
                                  impl=gsm.impl), args, _DECODE_KINDS, ("bc", "b", "lbwc"),
                per_token_scale=True)
        return QuantizedActivation(q, s, jnp.dtype(x.dtype).name), rings
    with jax.named_scope(f"gsm_{SITES[site]}"):
        return _per_shard(functools.partial(smooth_decode_stacked, precision=gsm.precision,
                                            impl=gsm.impl), args, _DECODE_KINDS,
                          ("bc", "lbwc"))


def smooth_site_extend(
    gsm: GSMInputs | None,
    layer: jax.Array,
    site: int,
    x: jax.Array,
    rings: jax.Array | None,
    start: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array | None]:
    """Smooth the next chunk of a prompt ([B, T, C], positions [B, T], -1 = padding) that
    continues rows already holding `start` [B] tokens: the filter runs over the ring's
    last max_window raw inputs followed by the chunk, so every window reaches back across
    the chunk boundary exactly as in one prefill over the whole prompt. Returns the chunk
    smoothed (float: a W8A8 `linear` quantizes it per token itself) and the rings with
    layer `layer` holding the row's last max_window inputs.
    """
    if gsm is None:
        return x, rings
    from gsm_jax.smoothing import ring_from_prefill, smooth_prefill

    window, strength = gsm.row_args(layer, site)
    ring = rings[layer]  # [B, W, C]: position q at slot q % W
    b, w = ring.shape[:2]
    hist_pos = start[:, None] - w + jnp.arange(w)[None, :]
    hist = ring[jnp.arange(b)[:, None], jnp.mod(hist_pos, w)].astype(x.dtype)
    xs = jnp.concatenate([hist, x], axis=1)
    ps = jnp.concatenate([jnp.where(hist_pos >= 0, hist_pos, -1), positions], axis=1)
    with jax.named_scope(f"gsm_{SITES[site]}"):
        y = _per_shard(functools.partial(smooth_prefill, max_window=gsm.max_window,
                                         precision=gsm.precision, impl=gsm.impl),
                       (xs, ps, window, strength, gsm.protect_first), _PREFILL_KINDS, "btc")
        new_ring = ring_from_prefill(xs, ps, w)
    return y[:, w:], rings.at[layer].set(new_ring.astype(rings.dtype))
