"""What a `GSMConfig` means for one model and one batch, on the host.

`resolve_mask`: which (layer, site) pairs a config targets in a model with
``num_layers`` layers (explicit layers, ``"all"``, or the profile's high-kurtosis
pairs); `describe`: the same as a readable table. `row_enabled`: which rows of a
batch are smoothed (``enable``, the short-request bypass, and the rollout by
request id, `rollout_value`). `gsm_jax.gsm_runtime` turns these into the
arrays of the jitted step.
"""

from __future__ import annotations

import hashlib
import json
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from gsm_jax.errors import GSMConfigError, InvalidInputError
from gsm_jax.gsm.profile_io import load_profile, select_high_kurtosis
from gsm_jax.gsm.schema import (
    ADAPTIVE,
    ADAPTIVE_DIVISOR,
    ADAPTIVE_MIN_WINDOW,
    SITES,
    GSMConfig,
    is_int,
    is_pairs,
)


def check_num_layers(num_layers: Any) -> int:
    if not is_int(num_layers) or num_layers < 1:
        raise GSMConfigError(f"num_layers={num_layers!r}: must be an integer >= 1")
    return int(num_layers)


def _check_layer(layer: int, num_layers: int, source: str) -> None:
    if layer >= num_layers:
        raise GSMConfigError(
            f"{source} names layer {layer}, but the model has {num_layers} layers "
            f"(0..{num_layers - 1})"
        )


def high_kurtosis_pairs(cfg: GSMConfig, num_layers: int) -> list[tuple[int, str]]:
    """The (layer, site) pairs that ``target_layers="high_kurtosis"`` selects from the profile."""
    if cfg.profile is None:
        raise GSMConfigError(
            "target_layers='high_kurtosis' needs a profile; run `gsm-jax profile` or "
            "pass profile=..."
        )
    prof = load_profile(cfg.profile)
    if prof["num_layers"] != num_layers:
        raise GSMConfigError(
            f"profile {cfg.profile} was made for a model with {prof['num_layers']} layers "
            f"(model {prof['model']!r}), but this model has {num_layers}; profile this model"
        )
    if cfg.kurtosis_threshold is not None:
        return select_high_kurtosis(prof["stats"], threshold=cfg.kurtosis_threshold)
    return [(int(layer), str(site)) for layer, site in prof["high_kurtosis"]]


def resolve_mask(cfg: GSMConfig, num_layers: int) -> np.ndarray:
    """bool[num_layers, len(SITES)]: which (layer, site) pairs are targeted.

    The result is the target (``target_layers``) restricted to ``cfg.sites``; it
    ignores ``enable`` (`GSMConfig.runtime` applies that).
    """
    num_layers = check_num_layers(num_layers)
    mask = np.zeros((num_layers, len(SITES)), dtype=bool)
    tl = cfg.target_layers
    if tl == "all":
        mask[:] = True
    elif tl == "high_kurtosis":
        for layer, site in high_kurtosis_pairs(cfg, num_layers):
            _check_layer(layer, num_layers, f"profile {cfg.profile}")
            mask[layer, SITES.index(site)] = True
    elif is_pairs(tl):
        for layer, sites in tl:
            _check_layer(layer, num_layers, "target_layers")
            for site in sites:
                mask[layer, SITES.index(site)] = True
    else:
        for layer in tl:
            _check_layer(layer, num_layers, "target_layers")
            mask[layer, :] = True
    allowed = np.array([s in cfg.sites for s in SITES], dtype=bool)
    return mask & allowed[None, :]


def describe(cfg: GSMConfig, num_layers: int) -> str:
    """A human-readable summary and per-layer table of the smoothed sites."""
    mask = resolve_mask(cfg, num_layers)
    window = (
        f"adaptive (clamp((p+1)//{ADAPTIVE_DIVISOR}, {ADAPTIVE_MIN_WINDOW}, {cfg.max_window}))"
        if cfg.window_size == ADAPTIVE
        else f"{cfg.window_size}"
    )
    target = cfg.target_layers
    if target == "high_kurtosis":
        how = (
            f"excess_kurtosis >= {cfg.kurtosis_threshold}"
            if cfg.kurtosis_threshold is not None
            else "stored selection"
        )
        target_s = f"high_kurtosis from {cfg.profile} ({how})"
    elif isinstance(target, str):
        target_s = target
    else:
        target_s = "explicit " + json.dumps(cfg.to_dict()["target_layers"])
    lines = [
        f"GSM {'enabled' if cfg.enable else 'DISABLED (nothing is smoothed)'}: "
        f"strength {cfg.smooth_strength} (guard {cfg.max_strength}), window {window}, "
        f"max_window {cfg.max_window}, protect_first {cfg.protect_first}, "
        f"precision {cfg.precision}",
        f"rollout {cfg.rollout_fraction * 100:g}% of requests; short-request bypass "
        + (f"below {cfg.short_request_tokens} tokens" if cfg.short_request_tokens else "off"),
        f"target_layers: {target_s}; sites allowed: {', '.join(cfg.sites) or 'none'}",
        f"{int(mask.sum())} of {mask.size} (layer, site) pairs smoothed",
    ]
    width = max(len(s) for s in SITES)
    lines.append(("layer  " + "  ".join(s.ljust(width) for s in SITES)).rstrip())
    for layer in range(num_layers):
        cells = [("yes" if mask[layer, j] else ".").ljust(width) for j in range(len(SITES))]
        lines.append(f"{layer:5d}  " + "  ".join(cells).rstrip())
    return "\n".join(lines)


def rollout_value(request_id: str | int) -> float:
    """Stable u in [0, 1) for a request id: top 53 bits of blake2b(str(id)).

    The same in every process and Python version (no ``hash()`` salt); ``3`` and
    ``"3"`` are the same id.
    """
    if isinstance(request_id, bool) or not isinstance(request_id, str | numbers.Integral):
        raise InvalidInputError(f"request id {request_id!r}: must be a str or int")
    digest = hashlib.blake2b(str(request_id).encode("utf-8"), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 11) / float(1 << 53)


def row_enabled(
    cfg: GSMConfig,
    request_ids: Sequence[str | int] | None,
    total_tokens: Sequence[int],
) -> np.ndarray:
    """bool[B]: which batch rows are smoothed.

    A row is smoothed iff ``cfg.enable``, its ``total_tokens`` (prompt + new tokens)
    is not below ``short_request_tokens``, and ``rollout_value(id) < rollout_fraction``.
    Raising the fraction never drops a request that was already selected. With
    ``request_ids=None`` the row index stands in for the id: every row is selected
    when ``rollout_fraction == 1`` (and none at 0), but in between the choice is
    per batch position, not per request, so pass real ids for a gradual release.
    """
    tokens = [_int_input("total_tokens", t) for t in total_tokens]
    b = len(tokens)
    if request_ids is not None and len(request_ids) != b:
        raise InvalidInputError(
            f"request_ids has {len(request_ids)} entries but total_tokens has {b}"
        )
    out = np.full(b, cfg.enable, dtype=bool)
    if cfg.short_request_tokens > 0:
        out &= np.asarray(tokens, dtype=np.int64).reshape(b) >= cfg.short_request_tokens
    if cfg.rollout_fraction < 1.0:
        ids: Sequence[str | int] = request_ids if request_ids is not None else range(b)
        out &= np.array([rollout_value(i) < cfg.rollout_fraction for i in ids], dtype=bool)
    return out


def _int_input(name: str, v: Any) -> int:
    if not is_int(v) or v < 0:
        raise InvalidInputError(f"{name} entry {v!r}: must be an integer >= 0")
    return int(v)
