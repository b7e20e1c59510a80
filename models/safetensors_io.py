"""Safetensors read tensor by tensor through memory maps, and written, with every dtype
DeepSeek-V4 checkpoints use (F8_E4M3, F8_E8M0, I8-packed FP4, BF16, F32, I64).

The format: an 8-byte little-endian header length, a JSON header (name -> dtype,
shape, [begin, end) byte offsets into the data that follows), the raw bytes. The
header is parsed here rather than through `safetensors.numpy`, which neither knows
the FP8 dtypes nor reads one tensor without the whole file.

`SafetensorsStore(dir)` indexes a directory (sharded with `model.safetensors.index.json`
or not) and reads one tensor at a time: the bytes are copied out of a read-only
memory map, then the mapped pages are released (`madvise(MADV_DONTNEED)`), so host
memory never holds more than the tensor being converted. `read(name, index)` reads
only a slice along the leading axis (a device's shard).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

from gsm_jax.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> numpy dtype of the raw bytes (E8M0 stays bytes: decoded by block_quant)
DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32), "I16": np.dtype(np.int16), "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(np.uint8),
}
_NAMES = {v: k for k, v in DTYPES.items() if k != "F8_E8M0"}
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: Path
    dtype: str  # the safetensors dtype string (F8_E8M0 and U8 differ only here)
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Every tensor's dtype, shape and absolute byte range; errors name the file."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelLoadError(f"{file}: not a safetensors file (shorter than 8 bytes)")
            n = struct.unpack("<Q", raw)[0]
            if n > min(size - 8, _MAX_HEADER):
                raise ModelLoadError(f"{file}: not a safetensors file (header length {n} "
                                     f"does not fit a {size}-byte file)")
            header = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file}: cannot read the safetensors header ({e})") from e
    start = 8 + n
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = entry["dtype"], tuple(int(d) for d in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{file}: malformed header entry for {name!r}") from e
        if dtype not in DTYPES:
            raise ModelLoadError(f"{file}: tensor {name!r} has dtype {dtype!r}, "
                                 f"which is not supported ({sorted(DTYPES)})")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dtype].itemsize
        if end - begin != want or begin < 0 or start + end > size:
            raise ModelLoadError(
                f"{file}: tensor {name!r} ({dtype} {list(shape)}) has byte range "
                f"[{begin}, {end}) that does not match its shape or lies past the end "
                f"of the {size}-byte file (truncated?)")
        out[name] = TensorInfo(name, file, dtype, shape, start + begin, start + end)
    return out


class SafetensorsStore:
    """All tensors of a model directory, read one at a time through memory maps."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{index}: not a safetensors index ({e})") from e
            shards = sorted(set(weight_map.values()))
            missing = [s for s in shards if not (self.directory / s).exists()]
            if missing:
                raise ModelLoadError(f"{self.directory}: shard(s) {missing} listed in "
                                     f"{INDEX_FILE} are missing")
        else:
            weight_map = None
            shards = sorted(p.name for p in self.directory.glob("*.safetensors"))
            if not shards:
                raise ModelLoadError(f"{self.directory}: no *.safetensors files next to "
                                     "config.json")
        self.tensors: dict[str, TensorInfo] = {}
        for shard in shards:
            for name, info in read_header(self.directory / shard).items():
                if name in self.tensors:
                    raise ModelLoadError(f"{self.directory}: tensor {name!r} is stored in both "
                                         f"{self.tensors[name].file.name} and {shard}")
                self.tensors[name] = info
        if weight_map is not None:
            absent = sorted(n for n, s in weight_map.items()
                            if n not in self.tensors or self.tensors[n].file.name != s)
            if absent:
                raise ModelLoadError(f"{self.directory}: {len(absent)} tensor(s) of "
                                     f"{INDEX_FILE} are not in their shard, e.g. {absent[:3]}")
        self._maps: dict[Path, mmap.mmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def largest_shard_bytes(self) -> int:
        return max(f.stat().st_size for f in {t.file for t in self.tensors.values()})

    def _map(self, file: Path) -> mmap.mmap:
        if file not in self._maps:
            with open(file, "rb") as f:
                self._maps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._maps[file]

    def read(self, name: str, index: slice | None = None) -> np.ndarray:
        """A copy of tensor `name` (or of rows `index` of its leading axis), then the
        mapped pages are dropped again."""
        t = self.tensors[name]
        dtype = DTYPES[t.dtype]
        begin, shape = t.begin, t.shape
        if index is not None:
            start, stop, step = index.indices(shape[0])
            if step != 1:
                raise ValueError("only contiguous row ranges are read")
            row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
            begin, shape = begin + start * row, (stop - start, *shape[1:])
        count = int(np.prod(shape, dtype=np.int64))
        mm = self._map(t.file)
        out = np.frombuffer(mm, dtype=dtype, count=count, offset=begin).reshape(shape).copy()
        page = mmap.PAGESIZE
        lo = begin // page * page
        length = begin + count * dtype.itemsize - lo
        if length > 0 and hasattr(mm, "madvise"):
            mm.madvise(mmap.MADV_DONTNEED, lo, length)
        return out

    def close(self) -> None:
        for mm in self._maps.values():
            mm.close()
        self._maps.clear()


def write_safetensors(file: str | os.PathLike,
                      tensors: dict[str, tuple[np.ndarray, str] | np.ndarray],
                      metadata: dict[str, str] | None = None) -> int:
    """Write `tensors` (name -> array, or (array, safetensors dtype) to say F8_E8M0 or an
    I8-packed FP4); returns the file size."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset, arrays = 0, []
    for name, value in tensors.items():
        arr, dtype = value if isinstance(value, tuple) else (value, None)
        arr = np.ascontiguousarray(arr)
        dtype = dtype or _NAMES.get(arr.dtype)
        if dtype is None or DTYPES[dtype].itemsize != arr.dtype.itemsize:
            raise ValueError(f"{name}: cannot store numpy dtype {arr.dtype} as {dtype}")
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())
    return 8 + len(blob) + offset
