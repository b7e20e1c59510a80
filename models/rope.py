"""Rotary position embeddings: one `RopeSpec` per RoPE variant, its inverse frequencies and
attention factor, built from a config's `rope_parameters` / `rope_scaling` dict.

Shared by every family: DeepSeek-V4 / V4.1 (interleaved pairs, partial rotation) and the
Llama family (rotate-half). How the channels are paired is the family's; the frequencies are
here. The formulas follow transformers' `modeling_rope_utils` (the reference).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from gsm_jax.errors import UnsupportedModelError


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One RoPE variant: plain, or YaRN (frequency interpolation by `factor`)."""

    theta: float
    dim: int  # rotated channels (the trailing `dim` of a head), even
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0  # multiplies cos and sin

    @classmethod
    def from_hf(cls, p: dict[str, Any], head_dim: int, max_pos: int, label: str) -> RopeSpec:
        rope_type = p.get("rope_type", p.get("type", "default"))
        dim = int(head_dim * float(p.get("partial_rotary_factor", 1.0)))
        theta = float(p["rope_theta"])
        if rope_type == "default":
            return cls(theta=theta, dim=dim)
        if rope_type != "yarn":
            raise UnsupportedModelError(
                f"rope_parameters[{label!r}] rope_type {rope_type!r} is not supported "
                "(supported: default, yarn)"
            )
        if p.get("truncate", True) is False:
            raise UnsupportedModelError(
                f"rope_parameters[{label!r}] truncate=False is not supported")
        original = int(p["original_max_position_embeddings"])
        factor = p.get("factor")
        factor = float(max_pos / original if factor is None else factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = p.get("attention_factor")
        if attention_factor is None:
            ms, ms_all = p.get("mscale"), p.get("mscale_all_dim")
            attention_factor = (mscale(factor, ms) / mscale(factor, ms_all)
                                if ms and ms_all else mscale(factor))
        return cls(
            theta=theta, dim=dim, rope_type="yarn", factor=factor,
            original_max_position_embeddings=original,
            beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
            attention_factor=float(attention_factor),
        )

    def inv_freq(self) -> np.ndarray:
        """[dim // 2] float32 inverse frequencies (one per interleaved channel pair)."""
        dim = self.dim
        exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
        pos_freqs = np.float32(self.theta) ** exponents
        if self.rope_type == "default":
            return (np.float32(1.0) / pos_freqs).astype(np.float32)

        # YaRN: interpolate the low frequencies, keep the high ones, ramp in between.
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings
                                   / (rotations * 2 * math.pi))) / (2 * math.log(self.theta))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        extrapolation = (1 - ramp).astype(np.float32)
        inv_extra = np.float32(1.0) / pos_freqs
        inv_inter = np.float32(1.0) / (np.float32(self.factor) * pos_freqs)
        return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)
