"""How DeepSeek-V4 and V4.1 checkpoints store a tensor, read lazily: shared by both readers.

Both releases store sharded safetensors whose low-precision weights come as a pair, the
weight and its block scale: `QuantRef` checks such a pair when it is read and returns a
`StoredQuant` (the bytes and scales as stored, numpy); every other tensor is a `TensorRef`.
`models/deepseek_v4_checkpoint.py` and `models/deepseek_v41_checkpoint.py` build their
tensor maps from these, so neither family's reader imports the other's; `to_device` is
where both put a converted part when no mesh placement is given.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import ModelLoadError
from gsm_jax.models import block_quant as bq
from gsm_jax.models.block_quant import BlockQuantWeight
from gsm_jax.models.safetensors_io import SafetensorsStore


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """One stored tensor, read on demand."""

    store: SafetensorsStore
    name: str

    def load(self) -> np.ndarray:
        return self.store.read(self.name)


@dataclasses.dataclass(frozen=True)
class StoredQuant:
    """A low-precision weight as read: values [..., out, in(/2)] and scales, numpy."""

    values: np.ndarray
    scale: np.ndarray
    fmt: str
    block: tuple[int, int]

    def dequantize(self) -> np.ndarray:
        """float32 [..., out, in], the stored orientation."""
        return bq.dequantize_np(self.values, self.scale, self.fmt, self.block)


@dataclasses.dataclass(frozen=True)
class QuantRef:
    """A stored weight + its scale; `load` checks the pair and returns a StoredQuant."""

    store: SafetensorsStore
    name: str
    scale_name: str
    config_block: tuple[int, int]
    expert_dtype: str

    def _fmt(self) -> str:
        dtype = self.store.info(self.name).dtype
        if dtype == "F8_E4M3":
            return "e4m3"
        if dtype in ("I8", "U8"):  # packed FP4 e2m1, two per byte along the input axis
            return "e2m1"
        raise ModelLoadError(f"tensor {self.name!r} has a scale but dtype {dtype} "
                             "(expected F8_E4M3, or I8 holding packed FP4)")

    def _block(self, fmt: str, shape: tuple[int, ...], grid: tuple[int, ...]) -> tuple[int, int]:
        out, inp = shape[-2], shape[-1] * (2 if fmt == "e2m1" else 1)
        block = self.config_block if fmt == "e4m3" else (1, 32)  # MXFP4: 1 x 32 always
        if bq.scale_grid((out, inp), block) == tuple(grid[-2:]):
            return block
        raise ModelLoadError(
            f"scale {self.scale_name!r} has shape {list(grid)}, which does not fit its weight "
            f"{self.name!r} of logical shape {[out, inp]} (blocks of {list(block)} "
            f"would need {list(bq.scale_grid((out, inp), block))})")

    def load(self) -> StoredQuant:
        info, sinfo = self.store.info(self.name), self.store.info(self.scale_name)
        fmt = self._fmt()
        if len(info.shape) < 2 or len(sinfo.shape) != len(info.shape) \
                or sinfo.shape[:-2] != info.shape[:-2]:
            raise ModelLoadError(f"scale {self.scale_name!r} {list(sinfo.shape)} does not fit "
                                 f"weight {self.name!r} {list(info.shape)}")
        if fmt == "e2m1" and self.expert_dtype != "fp4":
            raise ModelLoadError(f"tensor {self.name!r} holds packed FP4, but the config's "
                                 f"expert_dtype is {self.expert_dtype!r}")
        block = self._block(fmt, info.shape, sinfo.shape)
        if sinfo.dtype not in ("F8_E8M0", "U8", "F32", "BF16", "F16"):
            raise ModelLoadError(f"scale {self.scale_name!r} has dtype {sinfo.dtype}; "
                                 "expected F8_E8M0 bytes or a float")
        scale = self.store.read(self.scale_name)
        if sinfo.dtype in ("F8_E8M0", "U8"):
            bad = int(np.count_nonzero(scale == bq.E8M0_NAN))
            if bad:
                raise ModelLoadError(f"scale {self.scale_name!r} holds {bad} E8M0 NaN byte(s) "
                                     "(0xFF)")
        else:
            scale = scale.astype(np.float32)
            if not np.all(np.isfinite(scale)):
                raise ModelLoadError(f"scale {self.scale_name!r} holds non-finite values")
        values = self.store.read(self.name)
        if fmt == "e2m1":
            values = values.view(np.uint8)
        return StoredQuant(values, scale, fmt, block)


def to_device(tree: Any, _prefix: tuple = ()) -> Any:
    """A converted host tree on the default device (block-quantized leaves as stored): the
    placement of a checkpoint's parts when no mesh placement is given."""
    def put(a):
        if isinstance(a, BlockQuantWeight):
            return a.replace(values=jnp.asarray(a.values), scale=jnp.asarray(a.scale))
        return jnp.asarray(a)

    return jax.tree.map(put, tree, is_leaf=lambda a: isinstance(a, BlockQuantWeight))
