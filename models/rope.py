"""Rotary position embeddings: one `RopeSpec` per RoPE variant, its inverse frequencies and
attention factor, built from a config's `rope_parameters` / `rope_scaling` dict.

Shared by every family: DeepSeek-V4 / V4.1 (interleaved pairs, partial rotation) and the
Llama family (rotate-half). How the channels are paired is the family's; the frequencies are
here. The formulas follow transformers' `modeling_rope_utils` (the reference): `default`,
`linear` (position interpolation: every inverse frequency divided by `factor`), `llama3`
(Llama 3.1 / 3.2: low frequencies divided by `factor`, high ones kept, a smooth ramp between)
and `yarn` (NTK-by-parts interpolation plus an attention factor on cos and sin).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import numpy as np

from gsm_jax.errors import UnsupportedModelError

ROPE_TYPES = ("default", "linear", "llama3", "yarn")

# Keys of a rope dict every type reads, and those each type reads beside them (transformers'
# `_validate_<type>_rope_parameters` lists). "type" is the older spelling of "rope_type".
_COMMON_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")
_TYPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}
_KNOWN_KEYS = sorted({*_COMMON_KEYS, *(k for ks in _TYPE_KEYS.values() for k in ks)})


class RopeKeyWarning(UserWarning):
    """A rope key that another RoPE type reads but this one does not (transformers ignores
    it too, with a warning): it changes nothing here either."""


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One RoPE variant: plain, linear (position interpolation by `factor`), Llama 3's
    frequency-dependent scaling, or YaRN (frequency interpolation by `factor`)."""

    theta: float
    dim: int  # rotated channels (the trailing `dim` of a head), even
    rope_type: str = "default"  # "default" | "linear" | "llama3" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # multiplies cos and sin
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    truncate: bool = True  # yarn: correction range rounded to whole channels

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope_type {self.rope_type!r} is not supported "
                                        f"(supported: {', '.join(ROPE_TYPES)})")

    @classmethod
    def from_hf(cls, p: dict[str, Any], head_dim: int, max_pos: int, label: str = "", *,
                where: str | None = None) -> RopeSpec:
        """From one flat rope dict as transformers reads it. `max_pos` is the config's
        max_position_embeddings: the default of `original_max_position_embeddings` (as
        transformers' `standardize_rope_params` sets it) and YaRN's factor source when the
        dict has no factor. `where` names the dict in errors (default
        `rope_parameters[label]`). A key no supported type reads is refused by name; a key
        another type reads but this one does not is warned about (`RopeKeyWarning`)."""
        where = where or f"rope_parameters[{label!r}]"
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(
                f"{where}: rope_type={rope_type!r} is not supported "
                f"(supported: {', '.join(ROPE_TYPES)})")
        unknown = sorted(k for k in p if k not in _KNOWN_KEYS)
        if unknown:
            raise UnsupportedModelError(
                f"{where}: key(s) {unknown} are not supported (supported rope types: "
                f"{', '.join(ROPE_TYPES)}; keys they read: {', '.join(_KNOWN_KEYS)})")
        unused = sorted(k for k in p if k not in _COMMON_KEYS + _TYPE_KEYS[rope_type]
                        and p[k] is not None)
        if unused:
            warnings.warn(RopeKeyWarning(
                f"{where}: rope_type {rope_type!r} does not read {unused} (transformers "
                "ignores them too)"), stacklevel=2)
        dim = int(head_dim * float(p.get("partial_rotary_factor", 1.0)))
        theta = float(p["rope_theta"])
        if rope_type == "default":
            return cls(theta=theta, dim=dim)

        def need(key: str) -> Any:
            if p.get(key) is None:
                raise UnsupportedModelError(f"{where}: rope_type {rope_type!r} needs {key!r}")
            return p[key]

        original = int(p.get("original_max_position_embeddings") or max_pos)
        if rope_type == "linear":
            return cls(theta=theta, dim=dim, rope_type="linear", factor=float(need("factor")))
        if rope_type == "llama3":
            low, high = float(need("low_freq_factor")), float(need("high_freq_factor"))
            if low == high:
                raise UnsupportedModelError(
                    f"{where}: low_freq_factor == high_freq_factor == {low} (the ramp between "
                    "them is a division by zero)")
            return cls(theta=theta, dim=dim, rope_type="llama3", factor=float(need("factor")),
                       original_max_position_embeddings=original,
                       low_freq_factor=low, high_freq_factor=high)
        factor = p.get("factor")
        factor = float(max_pos / original if factor is None else factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
            attention_factor = (mscale(factor, ms) / mscale(factor, ms_all)
                                if ms and ms_all else mscale(factor))
        truncate = p.get("truncate", True)
        if truncate not in (True, False):
            raise UnsupportedModelError(f"{where}: truncate={truncate!r} is not a boolean")
        return cls(
            theta=theta, dim=dim, rope_type="yarn", factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
            attention_factor=float(attention_factor), truncate=bool(truncate),
        )

    def inv_freq(self) -> np.ndarray:
        """[dim // 2] float32 inverse frequencies (one per rotated channel pair)."""
        dim = self.dim
        exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        pos_freqs = np.float32(self.theta) ** exponents
        if self.rope_type == "default":
            return (np.float32(1.0) / pos_freqs).astype(np.float32)
        if self.rope_type == "linear":
            return ((np.float32(1.0) / pos_freqs) / np.float32(self.factor)).astype(np.float32)
        if self.rope_type == "llama3":
            return self._llama3_inv_freq(np.float32(1.0) / pos_freqs)

        # YaRN: interpolate the low frequencies, keep the high ones, ramp in between.
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation = (1 - ramp).astype(np.float32)
        inv_extra = np.float32(1.0) / pos_freqs
        inv_inter = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)
        return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)

    def _llama3_inv_freq(self, inv: np.ndarray) -> np.ndarray:
        """Llama 3.1's scaling, in transformers' float32 order: wavelengths above
        original / low_freq_factor divided by `factor`, below original / high_freq_factor
        kept, a linear blend in 1 / wavelength between."""
        factor = np.float32(self.factor)
        old = float(self.original_max_position_embeddings)
        low_ff, high_ff = self.low_freq_factor, self.high_freq_factor
        low_wavelen, high_wavelen = old / low_ff, old / high_ff
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(np.float32)
        smooth = ((np.float32(old) / wavelen - np.float32(low_ff))
                  / np.float32(high_ff - low_ff)).astype(np.float32)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
