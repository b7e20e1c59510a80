"""DeepSeek-V4.1-Flash checkpoints in the released layout: reader and tiny-checkpoint writer.

The layout (the release's config.json, index and shard headers):

- config.json is nested: `text_config` (the architecture), `vision_config`,
  `image_token_id` and a top-level `quantization_config` with
  `weight_block_size` [32, 32], `scale_fmt` ue8m0, `expert_dtype` fp4.
- Dense FP8 e4m3 weights (`attn.{wq_a,wq_b,wkv,wo_a,wo_b}`, `attn.indexer.wq_b`,
  `ffn.shared_experts.w{1,2,3}`, `engram.wkv`) with an E8M0 `.scale` per 32 x 32
  block, [ceil(out/32), ceil(in/32)] (V4 used 128 x 128).
- Routed experts `ffn.experts.{e}.w{1,2,3}`: packed FP4 e2m1 in I8 (low nibble =
  even column) with an E8M0 scale per row per 32 columns, as in V4.
- Engram tables `layers.{i}.engram.embed.weight`: FP8 e4m3 [rows, head_dim] with an
  E8M0 `embed.scale` [rows, head_dim/32] (one scale per row per 32 columns). Each
  table holds exactly the sum of its layer's hash primes in rows (section 6.2).
- F32: `hc_{attn,ffn}_{fn,base,scale}`, `attn.attn_sink`, `ffn.gate.bias`,
  `ffn.gate.bias_vl`. Everything else of the backbone is BF16.
- `mtp.*` (the DSpark draft) and the vision tower (`vision.*`, `aligner.*`,
  `image_{start,end,newline}`) are written as given; the reader lists the vision
  tensors as unused (text-only inference).

Reading (`read_checkpoint`) checks the headers of every tensor up front (shapes of
all scales against the config's block size, the Engram tables against the primes,
the tokenizer next to an Engram model) and returns a `V41Checkpoint` whose tensors are
read lazily, one at a time: FP8 / FP4 weights as `deepseek_common_checkpoint.StoredQuant`
(bytes + E8M0 scales as stored), Engram tables as `EngramTableRef` (rows gathered on
demand, never dequantized whole unless asked).

Converting (`weights_from_hf`, `load_checkpoint`: the family's checkpoint hooks, which
`models/deepseek_v41.py` exposes; `layer_tree`, which the DSpark draft's stages share):
released names -> the model's weight tree, FP8 / FP4 kept as stored or dequantized.

Writing (`write_checkpoint`): released-name float tensors -> that layout, the tests'
stand-in for the 510 GB release.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from gsm_jax.errors import ModelLoadError, UnsupportedModelError
from gsm_jax.models import block_quant as bq
from gsm_jax.models.block_quant import BlockQuantWeight
from gsm_jax.models.deepseek_common_checkpoint import QuantRef, StoredQuant, TensorRef, to_device
from gsm_jax.models.safetensors_io import (
    DTYPES,
    INDEX_FILE,
    SafetensorsStore,
    write_safetensors,
)

if TYPE_CHECKING:
    from gsm_jax.models.deepseek_v41 import DeepseekV41Config

MODEL_TYPE = "deepseek_v41"
TEXT_MODEL_TYPE = "deepseek_v41_text"
VISION_MODEL_TYPE = "deepseek_v41_vision"
ARCHITECTURE = "DeepseekV41ForCausalLM"
BLOCK = (32, 32)
ENGRAM_ROW_BLOCK = (1, 32)  # Engram tables: one scale per row per 32 columns
EXPERT_BLOCK = (1, 32)  # FP4 experts (MXFP4)
QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic",
                       "weight_block_size": list(BLOCK), "scale_fmt": "ue8m0",
                       "expert_dtype": "fp4"}
TOKENIZER_FILE = "tokenizer.json"

_LAYER = r"(?:layers|mtp)\.(\d+)\."
_FP8_RE = re.compile(r"layers\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b"
                     r"|ffn\.shared_experts\.w[123]|engram\.wkv)\.weight")
_EXPERT_RE = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_ENGRAM_TABLE_RE = re.compile(r"layers\.(\d+)\.engram\.embed\.weight")
_ENGRAM_RE = re.compile(r"layers\.(\d+)\.engram\.")
_F32_RE = re.compile(r"layers\.\d+\.(?:hc_(?:attn|ffn)_(?:fn|base|scale)|attn\.attn_sink"
                     r"|ffn\.gate\.bias|ffn\.gate\.bias_vl)")
_VISION_PREFIXES = ("vision.", "aligner.")
_VISION_NAMES = ("image_start", "image_end", "image_newline")
_TOP = ("embed.weight", "head.weight", "norm.weight")
ENGRAM_TENSORS = ("embed.weight", "embed.scale", "wkv.weight", "wkv.scale", "q_weight",
                  "k_weight")


def is_vision(name: str) -> bool:
    return name.startswith(_VISION_PREFIXES) or name in _VISION_NAMES


# ----------------------------------------------------------------------------- config


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The architecture keys: `text_config` of the nested config.json."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        raise UnsupportedModelError("config.json of a DeepSeek-V4.1 checkpoint needs a "
                                    "'text_config' object (the nested released layout)")
    return text


def check_quantization_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The released `quantization_config` (FP8 e4m3, 32 x 32 blocks, UE8M0 scales, FP4
    experts) validated; any other value is an UnsupportedModelError naming the key."""
    qc = hf.get("quantization_config")
    if not isinstance(qc, dict):
        raise UnsupportedModelError("config field quantization_config is missing or not an "
                                    "object (a released V4.1 checkpoint is FP8/FP4)")
    expert = qc.get("expert_dtype", hf.get("expert_dtype", text_config(hf).get("expert_dtype")))
    checks = (("quant_method", qc.get("quant_method"), ("fp8",)),
              ("fmt", qc.get("fmt", "e4m3"), ("e4m3",)),
              ("scale_fmt", qc.get("scale_fmt"), ("ue8m0",)),
              ("activation_scheme", qc.get("activation_scheme", "dynamic"), ("dynamic",)),
              ("expert_dtype", expert, ("fp4",)),
              ("weight_block_size", qc.get("weight_block_size"), (list(BLOCK), BLOCK)))
    for key, value, allowed in checks:
        if value not in allowed:
            raise UnsupportedModelError(
                f"config field quantization_config.{key}={value!r} is not supported "
                f"(a released DeepSeek-V4.1 checkpoint has {allowed[0]!r})")
    return {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
            "weight_block_size": BLOCK, "expert_dtype": "fp4"}


def nested_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """config.json in the released nested form. `hf_config` is either nested already
    (has `text_config`) or the text config alone; the quantization_config is the
    released one (a different one given here is a ValueError)."""
    hf = dict(hf_config)
    if "text_config" not in hf:
        hf = {"text_config": hf}
    text = dict(hf["text_config"])
    text.pop("quantization_config", None)
    text["model_type"] = TEXT_MODEL_TYPE
    given = hf.get("quantization_config") or hf_config.get("quantization_config")
    if given and any(given.get(k, v) != v for k, v in QUANTIZATION_CONFIG.items()):
        raise ValueError(f"quantization_config {given!r}: this writer writes the released "
                         f"{QUANTIZATION_CONFIG!r}")
    vision = dict(hf.get("vision_config") or {"num_hidden_layers": 0})
    vision.setdefault("model_type", VISION_MODEL_TYPE)
    out = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE,
           "image_token_id": hf.get("image_token_id", 129264),
           "bos_token_id": text.get("bos_token_id", 0), "eos_token_id": text.get("eos_token_id", 1),
           "pad_token_id": text.get("pad_token_id", 2), "tie_word_embeddings": False,
           "torch_dtype": "bfloat16"}
    out.update({k: v for k, v in hf.items() if k not in ("text_config", "vision_config")})
    out.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, text_config=text,
               vision_config=vision, quantization_config=dict(QUANTIZATION_CONFIG))
    return out


# ----------------------------------------------------------------------------- Engram primes


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (the bases 2..41)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(text: dict[str, Any]) -> dict[int, tuple[int, ...]]:
    """layer id -> its hash primes, in the order n = 2 heads 0.., n = 3 heads 0.., ...

    The rule (section 6.2): consecutive primes from `engram_vocab_size` up, never
    reused; each Engram layer, in `engram_layer_ids` order, takes
    (engram_max_ngram_size - 1) * engram_n_heads of them."""
    layers = [int(layer) for layer in text.get("engram_layer_ids") or []]
    if not layers:
        return {}
    if len(set(layers)) != len(layers):
        raise UnsupportedModelError(f"config field text_config.engram_layer_ids={layers!r} "
                                    "repeats a layer")
    for key in ("engram_vocab_size", "engram_max_ngram_size", "engram_n_heads"):
        if not isinstance(text.get(key), int):
            raise UnsupportedModelError(f"config field text_config.{key}={text.get(key)!r}: "
                                        "Engram layers need it as an integer")
    start = text["engram_vocab_size"]
    per_layer = (text["engram_max_ngram_size"] - 1) * text["engram_n_heads"]
    if per_layer <= 0:
        raise UnsupportedModelError("config fields text_config.engram_max_ngram_size / "
                                    "engram_n_heads give no hash heads")
    out, p = {}, start - 1
    for layer in layers:
        primes = []
        while len(primes) < per_layer:
            p += 1
            if is_prime(p):
                primes.append(p)
        out[layer] = tuple(primes)
    return out


def engram_rows(text: dict[str, Any]) -> dict[int, int]:
    """layer id -> the row count of its Engram table (the sum of its primes)."""
    return {layer: sum(primes) for layer, primes in engram_primes(text).items()}


# ----------------------------------------------------------------------------- reading


@dataclasses.dataclass(frozen=True)
class EngramTableRef:
    """An Engram table as stored: FP8 rows [rows, d] + E8M0 row scales [rows, d/32].

    Nothing is read until asked; `rows(ids)` reads only the rows asked for."""

    store: SafetensorsStore
    name: str
    scale_name: str

    @property
    def shape(self) -> tuple[int, int]:
        return self.store.info(self.name).shape

    def _gather(self, name: str, ids: np.ndarray) -> np.ndarray:
        info = self.store.info(name)
        out = np.empty((len(ids), *info.shape[1:]), DTYPES[info.dtype])
        if not len(ids):
            return out
        order = np.argsort(ids, kind="stable")
        sorted_ids = ids[order]
        # runs of consecutive ids -> one contiguous read each
        breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
        for run in np.split(np.arange(len(ids)), breaks):
            lo, hi = int(sorted_ids[run[0]]), int(sorted_ids[run[-1]]) + 1
            out[order[run]] = self.store.read(name, slice(lo, hi))[sorted_ids[run] - lo]
        return out

    def rows(self, ids: Any) -> StoredQuant:
        """The rows `ids` (any shape of ints) as stored: values [n, d], scale [n, d/32]."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        rows = self.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= rows):
            raise IndexError(f"{self.name}: row ids must lie in [0, {rows})")
        scale = self._gather(self.scale_name, ids)
        self._check_scale(scale)
        return StoredQuant(self._gather(self.name, ids), scale, "e4m3", ENGRAM_ROW_BLOCK)

    def _check_scale(self, scale: np.ndarray) -> None:
        bad = int(np.count_nonzero(scale == bq.E8M0_NAN))
        if bad:
            raise ModelLoadError(f"scale {self.scale_name!r} holds {bad} E8M0 NaN byte(s) "
                                 "(0xFF)")

    def memmap(self) -> tuple[np.ndarray, np.ndarray]:
        """(values [rows, d] float8_e4m3fn, scale [rows, d/32] uint8) as read-only memory
        maps of the shard files: the whole table addressable without reading it."""
        out = []
        for name in (self.name, self.scale_name):
            info = self.store.info(name)
            out.append(np.memmap(info.file, DTYPES[info.dtype], "r", info.begin, info.shape))
        return out[0], out[1]

    def dequantize_rows(self, ids: Any) -> np.ndarray:
        """float32 [n, d] of the rows `ids`."""
        return self.rows(ids).dequantize()

    def load(self) -> StoredQuant:
        """The whole table as stored (bytes, not dequantized): for small tables."""
        scale = self.store.read(self.scale_name)
        self._check_scale(scale)
        return StoredQuant(self.store.read(self.name), scale, "e4m3", ENGRAM_ROW_BLOCK)

    def dequantize(self, chunk_rows: int = 1 << 16) -> np.ndarray:
        """float32 [rows, d], dequantized chunk by chunk (materialises the whole table)."""
        rows, d = self.shape
        out = np.empty((rows, d), np.float32)
        for lo in range(0, rows, chunk_rows):
            hi = min(rows, lo + chunk_rows)
            scale = self.store.read(self.scale_name, slice(lo, hi))
            self._check_scale(scale)
            out[lo:hi] = bq.dequantize_np(self.store.read(self.name, slice(lo, hi)), scale,
                                          "e4m3", ENGRAM_ROW_BLOCK)
        return out


@dataclasses.dataclass
class V41Checkpoint:
    """The tensors of a released-layout checkpoint, read lazily.

    tensors: name -> TensorRef (BF16 / F32 / ints), QuantRef (FP8 32 x 32 or FP4 1 x 32,
    `.load()` gives a StoredQuant) or EngramTableRef; scales are folded into their
    weight. unused: the vision tensors (text-only inference) and the tensors of layers
    past num_hidden_layers (a truncated config), for the loader to report.
    engram_primes: layer -> its hash primes (section 6.2)."""

    directory: Path
    store: SafetensorsStore
    tensors: dict[str, Any]
    unused: tuple[str, ...]
    engram_primes: dict[int, tuple[int, ...]]
    tokenizer_file: Path | None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __getitem__(self, name: str) -> Any:
        """The tensor as stored: numpy, a StoredQuant, or an EngramTableRef (lazy rows)."""
        ref = self._ref(name)
        return ref if isinstance(ref, EngramTableRef) else ref.load()

    def _ref(self, name: str) -> Any:
        if name not in self.tensors:
            raise KeyError(f"tensor {name!r} is not in the checkpoint {self.directory}")
        return self.tensors[name]

    def block_quant(self, name: str) -> bq.BlockQuantWeight:
        """An FP8 / FP4 weight or an Engram table as the model's `BlockQuantWeight` (host
        numpy leaves, stored [out, in(/2)] orientation; block (32, 32), (1, 32) for FP4
        experts and Engram rows). The Engram table is read whole: use `[name].rows` or
        `.memmap()` for the released sizes."""
        ref = self._ref(name)
        if not isinstance(ref, QuantRef | EngramTableRef):
            raise TypeError(f"tensor {name!r} is not block-quantized")
        q = ref.load()
        return bq.BlockQuantWeight(q.values, q.scale, q.fmt, q.block)

    def dequantized(self, name: str) -> np.ndarray:
        """The tensor as float32 (ints stay ints); FP8 / FP4 decoded with their scales."""
        ref = self._ref(name)
        if isinstance(ref, EngramTableRef):
            return ref.dequantize()
        value = ref.load()
        if isinstance(value, StoredQuant):
            return value.dequantize()
        return value if value.dtype.kind in "iub" else value.astype(np.float32)

    def close(self) -> None:
        self.store.close()


def _expected_scale(kind: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """The scale grid a weight of stored `shape` needs."""
    out, inp = shape[-2], shape[-1] * (2 if kind == "fp4" else 1)
    block = {"fp8": BLOCK, "fp4": EXPERT_BLOCK, "engram": ENGRAM_ROW_BLOCK}[kind]
    return bq.scale_grid((out, inp), block)


def _validate_pairs(store: SafetensorsStore) -> dict[str, str]:
    """weight -> its scale for every block-scaled weight, every header checked."""
    names = set(store.tensors)
    pairs: dict[str, str] = {}
    for name in sorted(names):
        if not name.endswith(".scale"):
            continue
        weight = name.removesuffix(".scale") + ".weight"
        sinfo = store.info(name)
        if weight not in names:
            if sinfo.dtype in ("F8_E8M0", "U8"):
                raise ModelLoadError(f"scale tensor {name!r} has no weight {weight!r}")
            continue
        winfo = store.info(weight)
        if sinfo.dtype not in ("F8_E8M0", "U8"):
            raise ModelLoadError(f"scale {name!r} has dtype {sinfo.dtype}; the released "
                                 "layout stores E8M0 scales (F8_E8M0)")
        table = _ENGRAM_TABLE_RE.fullmatch(weight)
        if table:
            kind = "engram"
            if winfo.dtype != "F8_E4M3":
                raise ModelLoadError(f"Engram table {weight!r} has dtype {winfo.dtype} "
                                     "(expected F8_E4M3)")
        elif winfo.dtype == "F8_E4M3":
            kind = "fp8"
        elif winfo.dtype in ("I8", "U8"):
            kind = "fp4"
        else:
            raise ModelLoadError(f"tensor {weight!r} has a scale but dtype {winfo.dtype} "
                                 "(expected F8_E4M3, or I8 holding packed FP4)")
        if len(winfo.shape) != 2 or len(sinfo.shape) != 2:
            raise ModelLoadError(f"weight {weight!r} {list(winfo.shape)} and scale {name!r} "
                                 f"{list(sinfo.shape)} must both be 2-D")
        want = _expected_scale(kind, winfo.shape)
        if tuple(sinfo.shape) != want:
            logical = [winfo.shape[0], winfo.shape[1] * (2 if kind == "fp4" else 1)]
            block = {"fp8": BLOCK, "fp4": EXPERT_BLOCK, "engram": ENGRAM_ROW_BLOCK}[kind]
            hint = ""
            if kind == "fp8" and tuple(sinfo.shape) == bq.scale_grid(logical, (128, 128)):
                hint = " (a 128 x 128 grid, as DeepSeek-V4 used; this checkpoint says 32 x 32)"
            raise ModelLoadError(
                f"scale {name!r} has shape {list(sinfo.shape)}, but its weight {weight!r} of "
                f"logical shape {logical} in blocks of {list(block)} needs {list(want)}{hint}")
        pairs[weight] = name
    for name in sorted(names - set(pairs)):
        info = store.info(name)
        if info.dtype in ("F8_E4M3", "F8_E5M2") or (_EXPERT_RE.fullmatch(name)
                                                      and info.dtype in ("I8", "U8")):
            raise ModelLoadError(f"low-precision tensor {name!r} ({info.dtype}) has no scale "
                                 f"tensor {name.removesuffix('.weight') + '.scale'!r}")
    return pairs


def _validate_engram(store: SafetensorsStore, text: dict[str, Any],
                     primes: dict[int, tuple[int, ...]]) -> None:
    """Every configured Engram layer has all its tensors, with the primes' row count."""
    names = set(store.tensors)
    n_layers = int(text.get("num_hidden_layers", 0))
    configured = set(primes)
    for name in sorted(names):
        m = _ENGRAM_RE.match(name)
        if m and int(m.group(1)) not in configured:
            raise ModelLoadError(f"tensor {name!r} is an Engram tensor of layer {m.group(1)}, "
                                 f"which is not in text_config.engram_layer_ids "
                                 f"{sorted(configured)}")
    declared = list(text.get("engram_num_embeddings") or [])
    if configured and len(declared) != len(primes):
        raise UnsupportedModelError(
            f"config field text_config.engram_num_embeddings={declared!r} needs one row count "
            f"per text_config.engram_layer_ids entry {list(primes)}")
    head_dim = text.get("engram_head_dim")
    for k, (layer, layer_primes) in enumerate(primes.items()):
        if layer >= n_layers:
            continue  # a truncated model: layers past num_hidden_layers are not loaded
        p = f"layers.{layer}.engram."
        for suffix in ENGRAM_TENSORS:
            if p + suffix not in names:
                what = "table" if suffix == "embed.weight" else \
                    "table scale" if suffix == "embed.scale" else "tensor"
                raise ModelLoadError(f"Engram {what} {p + suffix!r} of layer {layer} "
                                     "(text_config.engram_layer_ids) is missing")
        rows = sum(layer_primes)
        table = store.info(p + "embed.weight")
        if table.shape[0] != rows:
            raise ModelLoadError(
                f"Engram table {p + 'embed.weight'!r} has {table.shape[0]} rows, but layer "
                f"{layer}'s {len(layer_primes)} hash primes ({layer_primes[0]} .. "
                f"{layer_primes[-1]}, from engram_vocab_size {text.get('engram_vocab_size')}) "
                f"sum to {rows}")
        if declared[k] != rows:
            raise ModelLoadError(
                f"config field text_config.engram_num_embeddings[{k}]={declared[k]} for layer "
                f"{layer} differs from its table {p + 'embed.weight'!r} and primes ({rows} rows)")
        if head_dim is not None and table.shape[1] != int(head_dim):
            raise ModelLoadError(f"Engram table {p + 'embed.weight'!r} is {table.shape[1]} wide, "
                                 f"text_config.engram_head_dim is {head_dim}")
        scale = store.info(p + "embed.scale")
        if scale.shape[0] != table.shape[0]:
            raise ModelLoadError(f"Engram table scale {p + 'embed.scale'!r} has "
                                 f"{scale.shape[0]} rows, its table {table.shape[0]}")


def _config_checks(hf: dict[str, Any], directory: Path) -> dict[str, Any]:
    """The config-level checks; returns text_config."""
    if hf.get("model_type") != MODEL_TYPE:
        raise UnsupportedModelError(f"config field model_type={hf.get('model_type')!r}: "
                                    f"expected {MODEL_TYPE!r}")
    text = text_config(hf)
    check_quantization_config(hf)
    n_layers = int(text.get("num_hidden_layers", 0))
    active = [layer for layer in text.get("engram_layer_ids") or [] if layer < n_layers]
    if active and not (directory / TOKENIZER_FILE).exists():
        raise ModelLoadError(
            f"{directory}: text_config.engram_layer_ids {list(text['engram_layer_ids'])} needs "
            f"{TOKENIZER_FILE} next to config.json (the Engram token map is built from it), "
            "and there is none")
    return text


def checkpoint_tensors(hf: dict[str, Any], store: SafetensorsStore) -> V41Checkpoint:
    """The validated, lazily read tensors of an open store (what a family's
    `load_checkpoint(cfg, hf_config, store, ...)` hook calls; `read_checkpoint` opens
    the directory and calls this). The store stays owned by the caller."""
    text = _config_checks(hf, store.directory)
    primes = engram_primes(text)
    _validate_engram(store, text, primes)
    pairs = _validate_pairs(store)
    tensors: dict[str, Any] = {}
    scales = set(pairs.values())
    for name in sorted(set(store.tensors) - scales):
        if name in pairs:
            if _ENGRAM_TABLE_RE.fullmatch(name):
                tensors[name] = EngramTableRef(store, name, pairs[name])
            else:
                tensors[name] = QuantRef(store, name, pairs[name], BLOCK, "fp4")
        else:
            tensors[name] = TensorRef(store, name)
    n_layers = int(text.get("num_hidden_layers", 0))

    def unused(name: str) -> bool:
        m = re.match(r"layers\.(\d+)\.", name)
        return is_vision(name) or (m is not None and int(m.group(1)) >= n_layers)

    tokenizer = store.directory / TOKENIZER_FILE
    return V41Checkpoint(store.directory, store, tensors,
                         tuple(n for n in sorted(tensors) if unused(n)), primes,
                         tokenizer if tokenizer.exists() else None)


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any], V41Checkpoint]:
    """(config.json as a dict, the checkpoint's tensors) of a released-layout V4.1
    directory. Every header is validated here; tensor data is read on demand.

    Raises UnsupportedModelError for a config this layout does not describe (not
    nested, other quantization) and ModelLoadError for files that contradict it
    (missing or mis-shaped Engram tables or scales, scale grids of another block size,
    FP8 without scales, Engram layers without tokenizer.json), each naming the
    tensor or key. `unused` lists the vision tensors and those of layers past
    num_hidden_layers (a truncated config), for the loader to report."""
    path = Path(path)
    try:
        hf = json.loads((path / "config.json").read_text())
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path}: no config.json") from e
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path / 'config.json'}: not valid JSON ({e})") from e
    _config_checks(hf, path)  # before indexing the shards
    store = SafetensorsStore(path)
    try:
        return hf, checkpoint_tensors(hf, store)
    except Exception:
        store.close()
        raise


# ----------------------------------------------------------------------------- converting


_LAYER_TENSOR = re.compile(r"^layers\.(\d+)\.(.+)$")
# released name (after "layers.{i}.") -> path in the layer tree, a projection ([out, in]
# stored: transposed, or kept as a block-quantized container)?
LAYER_NAMES = {
    "attn_norm.weight": (("attn_norm",), False),
    "ffn_norm.weight": (("ffn_norm",), False),
    "hc_attn_fn": (("hc_attn", "fn"), True),
    "hc_attn_base": (("hc_attn", "base"), False),
    "hc_attn_scale": (("hc_attn", "scale"), False),
    "hc_ffn_fn": (("hc_ffn", "fn"), True),
    "hc_ffn_base": (("hc_ffn", "base"), False),
    "hc_ffn_scale": (("hc_ffn", "scale"), False),
    "attn.attn_sink": (("attn", "sinks"), False),
    "attn.wq_a.weight": (("attn", "q_a"), True),
    "attn.q_norm.weight": (("attn", "q_norm"), False),
    "attn.wq_b.weight": (("attn", "q_b"), True),
    "attn.wkv.weight": (("attn", "kv"), True),
    "attn.kv_norm.weight": (("attn", "kv_norm"), False),
    "attn.wo_b.weight": (("attn", "o_b"), True),
    "attn.compressor.wkv.weight": (("attn", "compressor", "wkv"), True),
    "attn.compressor.wgate.weight": (("attn", "compressor", "wgate"), True),
    "attn.compressor.norm.weight": (("attn", "compressor", "norm"), False),
    "attn.indexer.wq_b.weight": (("attn", "indexer", "q_b"), True),
    "attn.indexer.weights_proj.weight": (("attn", "indexer", "weights_proj"), True),
    "attn.indexer.wk.weight": (("attn", "indexer", "wk"), True),
    "attn.indexer.k_norm.weight": (("attn", "indexer", "k_norm"), False),
    "ffn.gate.weight": (("moe", "router"), True),
    "ffn.gate.bias": (("moe", "bias"), False),
    "ffn.gate.bias_vl": (("moe", "bias_vl"), False),
    "engram.wkv.weight": (("engram", "wkv"), True),
    "engram.q_weight": (("engram", "q_weight"), False),
    "engram.k_weight": (("engram", "k_weight"), False),
}


class MtpTensors(dict):
    """The DSpark draft's `mtp.*` tensors as read (name -> numpy [out, in], or the
    checkpoint's FP8 / FP4 `StoredQuant`), kept in `params.extra["mtp"]`;
    `draft_weights` (below) turns them into the draft's weight tree (FP8 / FP4
    kept as stored when `keep_quantized`, as the backbone was loaded). Hashed by identity
    (ModelParams' extra is part of its static tree structure)."""

    __hash__ = object.__hash__
    keep_quantized: bool = False

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return f"MtpTensors({len(self)} tensors)"


def _is_stored_quant(v: Any) -> bool:
    return hasattr(v, "fmt") and hasattr(v, "block") and hasattr(v, "dequantize") \
        and not isinstance(v, BlockQuantWeight)


def _resolve(v: Any) -> Any:
    """numpy (float32 unless an integer), a StoredQuant, or an Engram table reference."""
    if hasattr(v, "memmap") and hasattr(v, "rows"):  # deepseek_v41_checkpoint.EngramTableRef
        return v
    if hasattr(v, "load"):
        v = v.load()
    if hasattr(v, "detach"):  # a torch tensor
        v = v.detach().float().cpu().numpy() if v.is_floating_point() \
            else v.detach().cpu().numpy()
    if _is_stored_quant(v):
        return v
    v = np.asarray(v)
    return v if v.dtype.kind in "iub" else v.astype(np.float32)


def _cat_rows(parts: list[Any]) -> Any:
    """Stored [out, in] weights stacked along out (w1 | w3): one StoredQuant when every
    part is one of the same format and the block grid allows, else float32 numpy."""
    if all(_is_stored_quant(p) for p in parts):
        f, blk = parts[0].fmt, parts[0].block
        if all(p.fmt == f and p.block == blk and p.values.shape[-2] % blk[0] == 0
               for p in parts):
            return type(parts[0])(np.concatenate([p.values for p in parts], axis=-2),
                                  np.concatenate([p.scale for p in parts], axis=-2), f, blk)
    return np.concatenate([p.dequantize() if _is_stored_quant(p) else p for p in parts],
                          axis=-2)


def _stack(parts: list[Any]) -> Any:
    """Per-expert stored [out, in] weights -> [E, ...] (one StoredQuant when all are)."""
    if all(_is_stored_quant(p) for p in parts) and len(
            {(p.fmt, p.block, p.values.shape, p.scale.shape) for p in parts}) == 1:
        p0 = parts[0]
        return type(p0)(np.stack([p.values for p in parts]), np.stack([p.scale for p in parts]),
                        p0.fmt, p0.block)
    return np.stack([p.dequantize() if _is_stored_quant(p) else p for p in parts])


def _proj(v: Any, keep: bool) -> Any:
    """A stored [..., out, in] projection -> the model's [..., in, out]: a
    BlockQuantWeight (numpy leaves) when kept, else float32 numpy."""
    if _is_stored_quant(v):
        if keep:
            return BlockQuantWeight(v.values, v.scale, v.fmt, tuple(v.block))
        v = v.dequantize()
    return np.swapaxes(v, -1, -2)


def _o_a(v: Any, cfg: DeepseekV41Config, keep: bool) -> Any:
    """wo_a [G * O, H * hd / G] -> [G, H * hd / G, O] (a container [G, O, in] when its
    row blocks do not straddle groups)."""
    g, o = cfg.o_groups, cfg.o_lora_rank
    if _is_stored_quant(v):
        if keep and o % v.block[0] == 0:
            return BlockQuantWeight(v.values.reshape(g, o, -1),
                                    v.scale.reshape(g, o // v.block[0], -1), v.fmt,
                                    tuple(v.block))
        v = v.dequantize()
    return np.transpose(v.reshape(g, o, -1), (0, 2, 1))


def _engram_table(v: Any, d: int) -> tuple[Any, Any]:
    """(rows, scales) as stored: FP8 e4m3 [rows, d] + E8M0 bytes [rows, d / 32] from a
    checkpoint (never dequantized), or a float table with float32 scales 1."""
    if hasattr(v, "memmap"):  # an EngramTableRef: the shard's bytes, mapped
        return v.memmap()
    if _is_stored_quant(v):
        return v.values, v.scale
    v = np.asarray(v, np.float32)
    return v, np.ones((v.shape[0], -(-d // 32)), np.float32)


def _host_cast(tree: Any, want: Any) -> Any:
    """Float numpy leaves to their dtypes in `want`; containers and int leaves as they are."""
    def one(a, s):
        if isinstance(a, BlockQuantWeight):
            return a
        a = np.asarray(a) if not isinstance(a, np.ndarray) else a
        if a.dtype.kind in "iu" or a.dtype == np.dtype(ml_dtypes.float8_e4m3fn) \
                or a.dtype == np.uint8:
            return a
        return a.astype(s.dtype, copy=False)

    return jax.tree.map(one, tree, want, is_leaf=lambda a: isinstance(a, BlockQuantWeight))


def _take(src: dict, key: str, where: str) -> Any:
    if key not in src:
        raise ModelLoadError(f"deepseek_v41: tensor {where + key!r} is missing")
    return _resolve(src.pop(key))


def layer_tree(cfg: DeepseekV41Config, src: dict[str, Any], p: str, keep: bool) -> dict:
    """One block's weight tree from its released tensors `src` (names after the prefix `p`,
    e.g. "layers.3." or "mtp.0."; consumed): a backbone layer, or a DSpark stage with its
    stage-only tensors taken out first. Refuses a missing or an unexpected tensor by name."""
    lw: dict[str, Any] = {}
    for rest in [r for r in src if r in LAYER_NAMES]:
        path, is_proj = LAYER_NAMES[rest]
        v = _take(src, rest, p)
        node = lw
        for q in path[:-1]:
            node = node.setdefault(q, {})
        node[path[-1]] = _proj(v, keep) if is_proj else v
    if "attn.wo_a.weight" in src:
        lw.setdefault("attn", {})["o_a"] = _o_a(_take(src, "attn.wo_a.weight", p), cfg, keep)
    if "engram.embed.weight" in src:
        rows, scale = _engram_table(_take(src, "engram.embed.weight", p), cfg.engram_head_dim)
        lw.setdefault("engram", {}).update(table=rows, table_scale=scale)
    moe_w = lw.setdefault("moe", {})
    gate_up, down = [], []
    for k in range(cfg.n_routed_experts):
        q = f"ffn.experts.{k}."
        gate_up.append(_cat_rows([_take(src, q + "w1.weight", p), _take(src, q + "w3.weight", p)]))
        down.append(_take(src, q + "w2.weight", p))
    moe_w["experts_gate_up"] = _proj(_stack(gate_up), keep)
    moe_w["experts_down"] = _proj(_stack(down), keep)
    del gate_up, down
    moe_w["shared_gate_up"] = _proj(_cat_rows(
        [_take(src, "ffn.shared_experts.w1.weight", p),
         _take(src, "ffn.shared_experts.w3.weight", p)]), keep)
    moe_w["shared_down"] = _proj(_take(src, "ffn.shared_experts.w2.weight", p), keep)
    if src:
        raise ModelLoadError(f"deepseek_v41: unexpected tensors "
                             f"{sorted(p + r for r in src)[:8]}")
    return lw


def weights_from_hf(cfg: DeepseekV41Config, tensors: dict[str, Any], dtype: Any = jnp.float32,
                    *, keep_quantized: bool = False, mtp: dict | None = None,
                    unused: list[str] | None = None, place: Any = None,
                    token_map: Any = None) -> dict:
    """The weight tree from the released tensor names (§9.2).

    `tensors`: name -> float array ([out, in], torch or numpy), a lazy reference
    (`.load()`), a `StoredQuant` (FP8 e4m3 32 x 32 or packed FP4 1 x 32, E8M0 scales) or
    an Engram table reference: what `deepseek_v41_checkpoint.checkpoint_tensors` gives
    (scales folded into their weights). Block-quantized weights become `BlockQuantWeight`s
    as stored when `keep_quantized`, else they are dequantized (float32, then `dtype`).
    Engram tables are kept as stored either way (rows are gathered and dequantized per
    token); `token_map` (`engram.token_class_map` of the checkpoint's tokenizer.json) is
    required when an Engram layer is active and becomes `weights["engram_token_map"]`.

    `mtp.*` (the DSpark stages) go into `mtp` when given (as stored: [out, in]), else are
    dropped. Vision / aligner tensors and those of layers past num_hidden_layers go into
    `unused` when given, else are refused (text-only). `place(tree, prefix)` puts each
    finished layer on its devices (default: the default device)."""
    from gsm_jax.models import deepseek_v41 as dv
    from gsm_jax.models.engram import engram_specs

    place = place or to_device
    keep = keep_quantized
    want = dv.weight_shapes(cfg, dtype)
    specs = dv.active_engram_specs(cfg)
    if specs:
        if token_map is None:
            raise ModelLoadError(
                f"deepseek_v41: engram_layer_ids {list(cfg.engram_layer_ids)} need the token "
                "class map built from the checkpoint's tokenizer.json (token_map=)")
        token_map = np.asarray(token_map, np.int32)
        try:
            engram_specs(cfg, token_map)
        except ValueError as e:
            raise ModelLoadError(f"deepseek_v41: tokenizer.json: {e}") from None
        if token_map.shape[0] < cfg.vocab_size:
            token_map = np.concatenate([token_map, np.full(
                cfg.vocab_size - token_map.shape[0], token_map[cfg.engram_pad_token_id],
                np.int32)])
        token_map = token_map[:cfg.vocab_size]
    by_layer: list[dict[str, Any]] = [{} for _ in range(cfg.num_layers)]
    top: dict[str, Any] = {}
    unknown, skipped = [], []
    for name, value in tensors.items():
        if name.startswith("mtp."):
            if mtp is not None:  # as read (numpy [out, in] or a StoredQuant); converted by
                mtp[name] = _resolve(value)  # draft_weights, below
            continue
        if is_vision(name):
            if unused is None:
                raise UnsupportedModelError(f"deepseek_v41: vision tensor {name!r}: this "
                                            "model is text-only")
            skipped.append(name)
            continue
        if name.endswith(".scale"):
            raise UnsupportedModelError(
                f"deepseek_v41: scale tensor {name!r} on its own: pass the checkpoint's "
                "tensors with their scales folded in (deepseek_v41_checkpoint."
                "checkpoint_tensors, or gsm_jax.load of the directory)")
        if name in ("embed.weight", "head.weight", "norm.weight"):
            top[name] = value
            continue
        m = _LAYER_TENSOR.match(name)
        if m and int(m.group(1)) >= cfg.num_layers and unused is not None:
            skipped.append(name)
            continue
        if not m or int(m.group(1)) >= cfg.num_layers:
            unknown.append(name)
            continue
        li, rest = int(m.group(1)), m.group(2)
        if rest.startswith("engram.") and li not in cfg.active_engram_layers:
            unknown.append(name)
            continue
        by_layer[li][rest] = value
    if unknown:
        raise ModelLoadError(f"deepseek_v41: unexpected tensors {sorted(unknown)[:8]}"
                             f"{' ...' if len(unknown) > 8 else ''}")

    layers = []
    for li in range(cfg.num_layers):
        lw = layer_tree(cfg, by_layer[li], f"layers.{li}.", keep)
        _check(lw, want["layers"][li], f"layers.{li}")
        layers.append(place(_host_cast(lw, want["layers"][li]), ("layers", li)))
        del lw
    head = {"embed": _take(top, "embed.weight", ""),
            "lm_head": _proj(_take(top, "head.weight", ""), False),
            "final_norm": _take(top, "norm.weight", "")}
    if specs:
        head["engram_token_map"] = token_map
    want_top = {k: v for k, v in want.items() if k != "layers"}
    _check(head, want_top, "")
    out = {**place(_host_cast(head, want_top), ()), "layers": tuple(layers)}
    if unused is not None:
        unused.extend(sorted(skipped))
    return out


def _check(tree: Any, want: Any, where: str) -> None:
    if isinstance(want, dict):
        if not isinstance(tree, dict):
            raise ModelLoadError(f"deepseek_v41: {where} is not a subtree")
        missing, extra = set(want) - set(tree), set(tree) - set(want)
        if missing or extra:
            raise ModelLoadError(f"deepseek_v41: {where or 'top'}: missing {sorted(missing)}, "
                                 f"unexpected {sorted(extra)}")
        for k in want:
            _check(tree[k], want[k], f"{where}.{k}" if where else k)
    elif isinstance(want, tuple):
        for i, (a, s) in enumerate(zip(tree, want, strict=True)):
            _check(a, s, f"{where}.{i}")
    elif tuple(tree.shape) != tuple(want.shape):
        packed = " (logical: packed FP4 holds two values per byte)" \
            if isinstance(tree, BlockQuantWeight) and tree.fmt == "e2m1" else ""
        raise ModelLoadError(f"deepseek_v41: {where} has shape {tuple(tree.shape)}{packed}, "
                             f"expected {tuple(want.shape)}")


def load_checkpoint(cfg: DeepseekV41Config, hf_config: dict, store: Any, dtype: Any,
                    keep_quantized: bool, placer: Any, progress: Any) -> tuple[dict, dict]:
    """`gsm_jax.load` of a released-layout directory (`store`): (weights, what
    params.extra records). Every header is validated first
    (`deepseek_v41_checkpoint.checkpoint_tensors`: scale grids, Engram tables against
    their primes, tokenizer.json next to an Engram model). dtype None: bf16 for the float
    tensors. FP8 / FP4 weights are kept as stored when `keep_quantized`, else dequantized;
    Engram tables are kept as stored either way. extra: "checkpoint_quantization",
    "unused_tensors" (the vision tower, layers past num_hidden_layers) and "mtp" (the DSpark
    draft's tensors as stored, an `MtpTensors`, for speculative decoding)."""
    ckpt = checkpoint_tensors(hf_config, store)
    if dtype is None:
        dtype = jnp.bfloat16
    token_map = None
    if cfg.active_engram_layers:
        from gsm_jax.models.engram import token_class_map

        progress(f"building the Engram token map from {ckpt.tokenizer_file}")
        token_map = token_class_map(ckpt.tokenizer_file)
    unused: list[str] = []
    mtp = MtpTensors()
    mtp.keep_quantized = keep_quantized
    progress(f"converting {len(ckpt.tensors)} tensors "
             f"({'FP8/FP4 kept as stored' if keep_quantized else jnp.dtype(dtype).name}; "
             "Engram tables as stored)")
    weights = weights_from_hf(cfg, ckpt.tensors, dtype, keep_quantized=keep_quantized,
                              mtp=mtp, unused=unused, place=placer(), token_map=token_map)
    extra: dict[str, Any] = {"checkpoint_quantization": "fp8-e4m3+fp4" + (
        " (kept)" if keep_quantized else " (dequantized)")}
    unused = sorted(set(unused) | set(ckpt.unused))
    if unused:
        extra["unused_tensors"] = tuple(unused)
    if mtp:
        extra["mtp"] = mtp
    return weights, extra


# ----------------------------------------------------------------------------- writing


def stored_format(name: str, quantize_mtp: bool = False) -> str:
    """How the writer stores a released-name float tensor: 'fp8' (32 x 32 E8M0),
    'fp4' (packed, 1 x 32 E8M0), 'engram' (FP8, per-row / 32 E8M0), 'f32', 'bf16', or
    'given' (vision, and mtp.* unless `quantize_mtp`: the array's own dtype). With
    `quantize_mtp` the draft's `mtp.{i}.*` tensors follow the layer rules, plus an
    FP8 `main_proj`, as released."""
    if is_vision(name):
        return "given"
    if name.startswith("mtp."):
        if not quantize_mtp:
            return "given"
        if re.fullmatch(r"mtp\.\d+\.main_proj\.weight", name):
            return "fp8"
        return stored_format("layers." + name.removeprefix("mtp."))
    if _ENGRAM_TABLE_RE.fullmatch(name):
        return "engram"
    if _EXPERT_RE.fullmatch(name):
        return "fp4"
    if _FP8_RE.fullmatch(name):
        return "fp8"
    if _F32_RE.fullmatch(name):
        return "f32"
    if name in _TOP or name.startswith("layers."):
        return "bf16"
    raise ValueError(f"tensor {name!r} is not a released DeepSeek-V4.1 name (section 9.2)")


_SAFETENSORS_DTYPE = {np.dtype(np.float32): "F32", np.dtype(ml_dtypes.bfloat16): "BF16",
                      np.dtype(np.float16): "F16", np.dtype(np.float64): "F64",
                      np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3", np.dtype(np.int64): "I64",
                      np.dtype(np.int32): "I32", np.dtype(np.int8): "I8",
                      np.dtype(np.uint8): "U8", np.dtype(np.bool_): "BOOL"}


def stored_tensors(name: str, value: Any,
                   quantize_mtp: bool = False) -> dict[str, tuple[np.ndarray, str]]:
    """One released-name tensor in its stored dtype, plus its scale where it has one.
    `value` may be (array, safetensors dtype) to write bytes verbatim."""
    if isinstance(value, tuple):
        return {name: value}
    value = np.asarray(value)
    fmt = stored_format(name, quantize_mtp)
    if fmt == "given" or value.dtype.kind in "iub":
        if value.dtype not in _SAFETENSORS_DTYPE:
            raise ValueError(f"{name}: cannot store numpy dtype {value.dtype}")
        return {name: (value, _SAFETENSORS_DTYPE[value.dtype])}
    if fmt == "f32":
        return {name: (value.astype(np.float32), "F32")}
    if fmt == "bf16":
        return {name: (value.astype(ml_dtypes.bfloat16), "BF16")}
    if value.ndim != 2:
        raise ValueError(f"{name}: a {fmt} weight must be 2-D [out, in], got {value.shape}")
    block = {"fp8": BLOCK, "fp4": EXPERT_BLOCK, "engram": ENGRAM_ROW_BLOCK}[fmt]
    if fmt == "fp4" and value.shape[1] % 2:
        raise ValueError(f"{name}: packed FP4 needs an even input width, got {value.shape}")
    values, scale = bq.quantize_np(value, "e2m1" if fmt == "fp4" else "e4m3", block)
    stem = name.removesuffix(".weight")
    stored = (values.view(np.int8), "I8") if fmt == "fp4" else (values, "F8_E4M3")
    return {name: stored, stem + ".scale": (scale, "F8_E8M0")}


def _shard_order(name: str) -> tuple:
    """Top tensors, layers in order, mtp, vision, then the Engram tables (own shards,
    as in the release)."""
    table = _ENGRAM_TABLE_RE.fullmatch(re.sub(r"\.scale$", ".weight", name))
    if table:
        return (4, int(table.group(1)), name)
    m = re.match(_LAYER, name)
    if m:
        return (1 if name.startswith("layers.") else 2, int(m.group(1)), name)
    return (3 if is_vision(name) else 0, 0, name)


def write_checkpoint(path: str | os.PathLike, hf_config: dict[str, Any],
                     tensors: dict[str, Any], tokenizer_json: str | None = None, *,
                     shard_bytes: int = 1 << 20, quantize_mtp: bool = False) -> Path:
    """Write released-name float tensors as a released-layout V4.1 checkpoint.

    config.json (nested, released quantization_config), safetensors shards of at most
    `shard_bytes` each (a tensor larger than that gets a shard of its own; Engram
    tables start a new shard), model.safetensors.index.json with total_size, and
    tokenizer.json when given. A value may be (array, safetensors dtype), written
    verbatim. `mtp.*` and vision tensors keep their given dtype unless `quantize_mtp`
    (see `stored_format`). Returns the directory."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = nested_config(hf_config)
    stored: dict[str, tuple[np.ndarray, str]] = {}
    for name, value in tensors.items():
        for k, v in stored_tensors(name, value, quantize_mtp).items():
            if k in stored:
                raise ValueError(f"tensor {k!r} given twice")
            stored[k] = (np.ascontiguousarray(v[0]), v[1])
    files: list[list[str]] = [[]]
    size, group = 0, None
    for name in sorted(stored, key=_shard_order):
        nbytes = stored[name][0].nbytes
        order = _shard_order(name)
        table = order[:2] if order[0] == 4 else None  # an Engram table and its scale
        if files[-1] and (table != group if table else size + nbytes > shard_bytes):
            files.append([])
            size = 0
        group = table
        files[-1].append(name)
        size += nbytes
    weight_map = {}
    for k, names in enumerate(files):
        fname = f"model-{k + 1:05d}-of-{len(files):05d}.safetensors"
        write_safetensors(path / fname, {n: stored[n] for n in names})
        weight_map.update({n: fname for n in names})
    total = sum(a.nbytes for a, _ in stored.values())
    (path / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": int(total)}, "weight_map": weight_map}, indent=1))
    (path / "config.json").write_text(json.dumps(hf, indent=1))
    if tokenizer_json is not None:
        (path / TOKENIZER_FILE).write_text(tokenizer_json)
    return path


def random_tensors(hf_config: dict[str, Any], seed: int = 0, *,
                   std: float = 0.02) -> dict[str, np.ndarray]:
    """Random float32 released-name tensors of `hf_config` (text only: no vision tower),
    drawn from the layout alone (`_logical_tensors`), for `write_checkpoint`: a checkpoint
    of any size with no reference model at hand. Norm weights, `hc_*_scale` and the
    Engram q / k weights ~ 1 + 0.1 N(0, 1); sinks, `hc_*_base` and the router biases ~
    0.5 N(0, 1); everything else ~ `std` N(0, 1) (what `deepseek_v41.init_weights` draws).
    Such weights are good for cost only: time, bytes, compiled programs."""
    gen = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape in _logical_tensors(hf_config, vision=False).items():
        leaf = name.removesuffix(".weight").rsplit(".", 1)[-1]
        if leaf.endswith("norm") or leaf.endswith("_scale") or leaf in ("q_weight", "k_weight"):
            a = 1 + 0.1 * gen.standard_normal(shape, np.float32)
        elif leaf in ("attn_sink", "bias", "bias_vl") or leaf.endswith("_base"):
            a = 0.5 * gen.standard_normal(shape, np.float32)
        else:
            a = std * gen.standard_normal(shape, np.float32)
        out[name] = a
    return out


# ----------------------------------------------------------------------------- the manifest
#
# What a released-layout checkpoint holds, computed from its config alone: every tensor's
# name, stored shape and safetensors dtype (the names of section 9.2, the encodings of
# 9.3). The planner counts the 510 GB release from it without reading a byte; its totals
# are checked against the release's index (`total_size` 510,286,023,000 B, 96,085
# tensors) and the HF API's per-dtype counts, and its names and shapes against NeMo's
# state-dict adapters on tiny configs.

STORED_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "U8": 1}


def _logical_tensors(hf: dict[str, Any], vision: bool = True,
                     mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """name -> logical shape ([out, in] for projections) of every released tensor."""
    from gsm_jax.models.deepseek_v41 import FULL, REINDEX, DeepseekV41Config

    nested = hf if "text_config" in hf else {"text_config": hf}
    text = text_config(nested)
    cfg = DeepseekV41Config.from_hf_config(nested)
    d, h, hd, n = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.hc_mult
    g, ol, ql, inter = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank, cfg.moe_intermediate_size
    hi, ci, v = cfg.index_n_heads, cfg.index_head_dim, cfg.vocab_size
    rows = engram_rows(text)
    n_ids = (int(text.get("engram_max_ngram_size", 4)) - 1) * int(text.get("engram_n_heads", 8))
    ed = int(text.get("engram_head_dim", 256))

    def block(p: str, role: str | None, ratio: int, experts: int) -> dict:
        t = {p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,)}
        for s in ("attn", "ffn"):
            t.update({f"{p}hc_{s}_fn": ((2 + n) * n, n * d), f"{p}hc_{s}_base": ((2 + n) * n,),
                      f"{p}hc_{s}_scale": (3,)})
        t.update({p + "attn.attn_sink": (h,), p + "attn.wq_a.weight": (ql, d),
                  p + "attn.q_norm.weight": (ql,), p + "attn.wq_b.weight": (h * hd, ql),
                  p + "attn.wkv.weight": (hd, d), p + "attn.kv_norm.weight": (hd,),
                  p + "attn.wo_a.weight": (g * ol, h * hd // g),
                  p + "attn.wo_b.weight": (d, g * ol)})
        if role == FULL:
            t[p + "attn.compressor.wkv.weight"] = (hd, d)
            t[p + "attn.compressor.norm.weight"] = (hd,)
            if ratio > 1:
                t[p + "attn.compressor.wgate.weight"] = (hd, d)
        if role in (FULL, REINDEX):
            t[p + "attn.indexer.wq_b.weight"] = (hi * ci, ql)
            t[p + "attn.indexer.weights_proj.weight"] = (hi, d)
            if role == FULL:
                t[p + "attn.indexer.wk.weight"] = (ci, hd)
                t[p + "attn.indexer.k_norm.weight"] = (ci,)
        t.update({p + "ffn.gate.weight": (experts, d), p + "ffn.gate.bias": (experts,),
                  p + "ffn.gate.bias_vl": (experts,)})
        for e in range(experts):
            q = f"{p}ffn.experts.{e}."
            t.update({q + "w1.weight": (inter, d), q + "w3.weight": (inter, d),
                      q + "w2.weight": (d, inter)})
        t.update({p + "ffn.shared_experts.w1.weight": (inter, d),
                  p + "ffn.shared_experts.w3.weight": (inter, d),
                  p + "ffn.shared_experts.w2.weight": (d, inter)})
        return t

    out: dict[str, tuple[int, ...]] = {"embed.weight": (v, d), "head.weight": (v, d),
                                       "norm.weight": (d,)}
    for li in range(cfg.num_layers):
        plan = cfg.plan(li)
        out.update(block(f"layers.{li}.", plan.role, plan.ratio, cfg.n_routed_experts))
        if li in rows:
            p = f"layers.{li}.engram."
            out.update({p + "embed.weight": (rows[li], ed),
                        p + "wkv.weight": ((n + 1) * d, n_ids * ed),
                        p + "q_weight": (n, d), p + "k_weight": (n, d)})
    stages = int(text.get("num_nextn_predict_layers", text.get("n_mtp_layers", 0)) or 0)
    if mtp and stages:
        targets = list(text.get("dspark_target_layer_ids") or [])
        rank = int(text.get("dspark_markov_rank", 256))
        experts = int(text.get("dspark_n_routed_experts", cfg.n_routed_experts))
        for i in range(stages):
            p = f"mtp.{i}."
            out.update(block(p, None, 0, experts))
            if i == 0:
                out.update({p + "main_proj.weight": (d, len(targets) * d),
                            p + "main_norm.weight": (d,)})
            if i == stages - 1:
                out.update({p + "norm.weight": (d,), p + "markov_head.embed.weight": (v, rank),
                            p + "markov_head.head.weight": (v, rank),
                            p + "confidence_head.proj.weight": (1, d + rank)})
    vc = nested.get("vision_config") or {}
    layers = int(vc.get("num_hidden_layers", 32))
    if vision and layers:
        vd, vi = int(vc.get("hidden_size", 1024)), int(vc.get("intermediate_size", 2816))
        patch, down = int(vc.get("patch_size", 14)), int(vc.get("downsample_ratio", 3))
        out.update({"vision.patch_embed.proj.weight": (vd, 3 * patch * patch),
                    "vision.patch_embed.proj.bias": (vd,), "vision.norm.weight": (vd,)})
        for b in range(layers):
            p = f"vision.blocks.{b}."
            out.update({p + "norm1.weight": (vd,), p + "norm2.weight": (vd,),
                        p + "attn.wqkv.weight": (3 * vd, vd), p + "attn.wqkv.bias": (3 * vd,),
                        p + "attn.wo.weight": (vd, vd), p + "attn.wo.bias": (vd,),
                        p + "mlp.w1.weight": (2 * vi, vd), p + "mlp.w2.weight": (vd, vi)})
        out.update({"aligner.w1.weight": (d, vd * down * down), "aligner.w1.bias": (d,),
                    "aligner.w2.weight": (d, d), "aligner.w2.bias": (d,),
                    "image_start": (d,), "image_end": (d,), "image_newline": (d,)})
    return out


def _stored_shapes(name: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], str]]:
    """One released tensor as stored (`stored_tensors` without the data)."""
    fmt = "bf16" if is_vision(name) else stored_format(name, quantize_mtp=True)
    if fmt in ("f32", "bf16"):
        return {name: (shape, fmt.upper())}
    o, i = shape
    stem = name.removesuffix(".weight")
    if fmt == "fp4":
        return {name: ((o, i // 2), "I8"), stem + ".scale": ((o, -(-i // 32)), "F8_E8M0")}
    bo, bi = BLOCK if fmt == "fp8" else ENGRAM_ROW_BLOCK
    return {name: ((o, i), "F8_E4M3"), stem + ".scale": ((-(-o // bo), -(-i // bi)), "F8_E8M0")}


def released_layout(hf_config: dict[str, Any], *, vision: bool = True,
                    mtp: bool = True) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a released-layout checkpoint of `hf_config` (nested or the text
    config alone): name -> (stored shape, safetensors dtype), from the config alone.
    `vision=False` / `mtp=False` leave out the vision tower / the DSpark draft."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shape in _logical_tensors(hf_config, vision, mtp).items():
        out.update(_stored_shapes(name, shape))
    return out


def stored_nbytes(shape: tuple[int, ...], dtype: str) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n * STORED_BYTES[dtype]


def released_part(name: str) -> str:
    """The planner's line for a released tensor (its scale goes with it)."""
    if is_vision(name):
        return "vision tower + aligner (BF16)"
    if name.startswith("mtp."):
        return "DSpark draft mtp.* (FP8 / FP4 / BF16)"
    if _ENGRAM_TABLE_RE.fullmatch(re.sub(r"\.scale$", ".weight", name)):
        return "Engram tables (FP8 + E8M0)"
    if _ENGRAM_RE.match(name):
        return "Engram wkv / q / k (FP8, BF16)"
    if _EXPERT_RE.fullmatch(re.sub(r"\.scale$", ".weight", name)):
        return "routed experts (FP4 + E8M0)"
    if name in ("embed.weight", "head.weight"):
        return "embed + head (BF16)"
    return "backbone: attention, shared experts, router, mHC, norms"


def layout_totals(layout: dict[str, tuple[tuple[int, ...], str]]) -> dict[str, int]:
    """tensors, bytes, and elements per safetensors dtype (I8: bytes, each 2 FP4 values)."""
    out = {"tensors": len(layout), "bytes": 0}
    for shape, dtype in layout.values():
        b = stored_nbytes(shape, dtype)
        out["bytes"] += b
        out[dtype] = out.get(dtype, 0) + b // STORED_BYTES[dtype]
    return out


# ----------------------------------------------------------------------------- the DSpark draft

# stage-only tensors (after "mtp.{s}."): name -> (key in the draft tree, is a projection)
_DSPARK_FIRST = {"main_proj.weight": ("main_proj", True),
                 "main_norm.weight": ("main_norm", False)}
_DSPARK_LAST = {"norm.weight": ("norm", False),
                "markov_head.embed.weight": ("markov_embed", False),
                "markov_head.head.weight": ("markov_head", True),
                "confidence_head.proj.weight": ("confidence", True)}


def draft_weights(cfg: Any, mtp: dict, dtype: Any = jnp.float32,
                  keep_quantized: bool | None = None) -> dict:
    """The draft's weight tree from the `mtp.*` tensors as read (`params.extra["mtp"]`, or
    name -> [out, in] arrays), on the default device. keep_quantized (default: as the
    tensors were loaded) keeps FP8 / FP4 projections as stored. (The draft model itself:
    models/deepseek_v41_dspark.py.)"""
    from gsm_jax.models import deepseek_v41_dspark as ds

    ds.check_config(cfg)
    keep = getattr(mtp, "keep_quantized", False) if keep_quantized is None else keep_quantized
    n = cfg.num_nextn_predict_layers
    by_stage: list[dict] = [{} for _ in range(n)]
    for name, value in mtp.items():
        parts = name.split(".", 2)
        if len(parts) != 3 or parts[0] != "mtp" or not parts[1].isdigit() \
                or int(parts[1]) >= n:
            raise ModelLoadError(f"deepseek_v41: unexpected DSpark tensor {name!r} "
                                 f"(num_nextn_predict_layers = {n})")
        by_stage[int(parts[1])][parts[2]] = value
    sc = ds.stage_config(cfg)
    want = ds.weight_shapes(cfg, dtype)
    out: dict[str, Any] = {}
    stages = []
    for s, src in enumerate(by_stage):
        p = f"mtp.{s}."
        own = {**(_DSPARK_FIRST if s == 0 else {}), **(_DSPARK_LAST if s == n - 1 else {})}
        for rest, (key, is_proj) in own.items():
            v = _take(src, rest, p)
            out[key] = _proj(v, keep) if is_proj else v
        lw = layer_tree(sc, src, p, keep)
        _check(lw, want["stages"][s], f"mtp.{s}")
        stages.append(to_device(_host_cast(lw, want["stages"][s])))
    top = {k: v for k, v in want.items() if k != "stages"}
    if isinstance(out.get("markov_embed"), BlockQuantWeight):  # a lookup table: rows as floats
        out["markov_embed"] = np.asarray(out["markov_embed"].dequantize())
    _check(out, top, "mtp")
    return {**to_device(_host_cast(out, top)), "stages": tuple(stages)}
