"""Will it fit? Per-device memory of a model on a mesh, before anyone rents the hardware.

    gsm_jax.plan("gsm_jax/data/deepseek_v4_flash_config.json", mesh_shape=(1, 8),
                 device_memory="141GB", batch=64, context=32768)
    gsm-jax plan --model deepseek-v4-flash --devices 8 --device-memory 141GB \\
                 --batch 64 --context 32768

Counted per device, with the sharding rules of `gsm_jax.sharding` (a sharded axis
divides by its mesh axis; replicated weights count whole on every device):

- weights by stored dtype: for a DeepSeek-V4 checkpoint with a `quantization_config`,
  as the release stores them and `gsm_jax.load` keeps them (FP8 e4m3 + one E8M0 byte
  per 128 x 128 block for the dense projections, packed FP4 + one byte per 32 for the
  routed experts, bf16 for embeddings / router / compressors, f32 for the small
  mixing weights); otherwise in `weights_dtype`. The MTP block counts as one more
  sliding-window layer;
- the decode caches of `batch` sequences of `context` tokens, by kind (sliding-window
  K=V, compressed entries, indexer entries, compressor rings; Llama's K/V), split over
  the data axis with the batch, and the GSM ring buffers (`gsm_max_window` raw site
  inputs per layer and site);
- activations: the larger of one decode step of the whole batch and the prefill of one
  prompt of `prefill_tokens` (default: the context) — prompts are prefilled one at a
  time and inserted into the running batch, as the engine does. A prompt longer than
  `prefill_chunk` (`generate`'s default, `gsm_jax.generation.PREFILL_CHUNK`) is prefilled
  in chunks of it, each attending over the whole prompt so far: [H, chunk, T + entries]
  attention scores, which dominate at long prompts (None: one call, [H, T, T + entries]).

The shapes come from the model code itself (`weight_shapes`, `init_cache` under
`jax.eval_shape`), so the plan follows the implementation; what a family counts otherwise
(stored dtypes, a released layout, cache labels, activation widths) its `PLANNER` says
(`models/family_planner.py`). It is an estimate: XLA's temporaries are not modelled
beyond the activation line (compare with `compiled.memory_analysis()` of the real
program).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import InvalidInputError
from gsm_jax.families import KV_CACHE_KINDS, family_for_model_type, family_module
from gsm_jax.generation import PREFILL_CHUNK
from gsm_jax.sharding import RULES, logical_axes, parse_mesh_spec

DATA_DIR = Path(__file__).resolve().parent / "data"
KNOWN_CONFIGS = {"deepseek-v4-flash": DATA_DIR / "deepseek_v4_flash_config.json",
                 "deepseek-v4.1-flash": DATA_DIR / "deepseek_v41_flash_config.json"}
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


_MEMORY = re.compile(r"\s*((?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)\s*([KMGT]i?B?|B)?\s*",
                     re.IGNORECASE)
_UNITS = {"": 1e9, "B": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
MIN_DEVICE_MEMORY = 2**20  # below 1 MiB a "device memory" is a typo, not a device


def parse_bytes(text: Any) -> int:
    """Device memory -> bytes: '141GB', '139GiB', '1.5TB', '512MiB', '80e9B', or a bare
    number of **GB** in a string ('141' = 141 GB, as H200s are sold); a Python int or float
    is bytes. Units are case-insensitive, with or without the B (G = GB, Gi = GiB). Refused
    with an error naming the value: anything else, zero or negative, under 1 MiB, or a bare
    number over 100 000 (GB: a byte count written without its B)."""
    if isinstance(text, bool):
        raise InvalidInputError(f"device memory {text!r}: expected e.g. 141GB or 139GiB")
    if isinstance(text, int | float):
        value = float(text)
        if not math.isfinite(value) or value < MIN_DEVICE_MEMORY:
            raise InvalidInputError(
                f"device memory {text!r} bytes: expected at least 1 MiB (a number is bytes; "
                "a string such as '141GB' or '141' (GB) takes units)")
        return int(value)
    m = _MEMORY.fullmatch(str(text))
    if not m:
        raise InvalidInputError(
            f"device memory {text!r}: expected a size such as 141GB, 80GiB or 141 (GB)")
    number, unit = float(m.group(1)), (m.group(2) or "").upper().removesuffix("B")
    if not unit and (m.group(2) or "").upper() == "B":
        unit = "B"
    if not unit and number > 1e5:
        raise InvalidInputError(
            f"device memory {text!r}: a bare number is GB, and {number:g} GB is not a device; "
            f"write the unit ({m.group(1)}B for bytes)")
    value = number * _UNITS[unit]
    if not math.isfinite(value) or value < MIN_DEVICE_MEMORY:
        raise InvalidInputError(
            f"device memory {text!r} is {value:g} bytes: expected at least 1 MiB "
            "(e.g. 141GB, 80GiB, or 141 for GB)")
    return int(value)


def load_config(model: Any) -> Any:
    """(config, quantization_config, expert_dtype) from a known name, a config.json path,
    a dict or a config dataclass."""
    return _load_config(model)[:3]


def _load_config(model: Any) -> Any:
    """load_config's triple plus the config.json dict (None for a dataclass)."""
    if dataclasses.is_dataclass(model):
        return model, None, "fp8", None
    hf = model
    if isinstance(model, str | Path):
        path = KNOWN_CONFIGS.get(str(model), Path(model))
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise InvalidInputError(f"model {str(model)!r} is neither a known name "
                                    f"({sorted(KNOWN_CONFIGS)}) nor a config.json path")
        hf = json.loads(path.read_text())
    family = family_module(family_for_model_type(hf.get("model_type")))
    cfg = family.CONFIG_CLASS.from_hf_config(hf)
    quant = hf.get("quantization_config")
    return cfg, quant, (quant or {}).get("expert_dtype", hf.get("expert_dtype", "fp8")), hf


@dataclasses.dataclass
class Plan:
    """Per-device bytes by line item, and whether they fit."""

    model: str
    mesh_shape: tuple[int, int]
    device_memory: int
    batch: int
    context: int
    lines: dict[str, int]  # name -> bytes per device
    parameters: int
    notes: list[str] = dataclasses.field(default_factory=list)
    # bytes per device kept in the device's pinned host memory (not counted in `total`)
    host_lines: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.lines.values())

    @property
    def fits(self) -> bool:
        return self.total <= self.device_memory

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total, "fits": self.fits}

    def table(self) -> str:
        data, model = self.mesh_shape
        w = max([38, *map(len, self.lines)])
        rows = [f"{self.model}: {self.parameters / 1e9:.1f}B parameters on a {data} x {model} "
                f"(data x model) mesh, batch {self.batch}, context {self.context}",
                f"{'per device':<{w + 2}} {'GB':>10}"]
        rows += [f"  {name:<{w}} {b / 1e9:>10.2f}" for name, b in self.lines.items()]
        verdict = "fits" if self.fits else "does NOT fit"
        rows.append(f"  {'total':<{w}} {self.total / 1e9:>10.2f}   of "
                    f"{self.device_memory / 1e9:.2f} GB: {verdict} "
                    f"({100 * self.total / self.device_memory:.0f}%)")
        for name, b in self.host_lines.items():
            rows.append(f"  {name + ' (pinned host memory)':<{w}} {b / 1e9:>10.2f}   not on "
                        f"the device; {b * data * model / 1e9:.2f} GB of host RAM in all")
        rows += [f"note: {n}" for n in self.notes]
        rows.append(ACTIVATIONS_NOTE)
        return "\n".join(rows)


ACTIVATIONS_NOTE = (
    "activations (estimate): the tensors live at once in the larger of one decode step of the "
    "whole batch\nand the prefill of one prompt (the engine prefills prompts one at a time); "
    "XLA's own temporaries\n(fusion scratch, copies, per-block dequantized weights) are not "
    "modelled: `--compile` measures them.")


def _shard_factor(family: str, path: tuple, ndim: int, mesh: dict[str, int]) -> int:
    axes = logical_axes(family, path, ndim)
    return math.prod(mesh[RULES[a]] for a in axes if a and RULES.get(a))


def plan(model: Any, mesh_shape: tuple[int, int] = (1, 1), device_memory: Any = "141GB",
         batch: int = 1, context: int = 4096, *, weights_dtype: str = "bfloat16",
         gsm_max_window: int | None = 64, prefill_tokens: int | None = None,
         vision: bool = False, engram_memory: str = "device",
         kv_cache_dtype: str | None = None, prefill_chunk: int | None = PREFILL_CHUNK) -> Plan:
    """Per-device memory of `model` (a config or its path / name) on a data x model mesh.
    A family with its own released layout (`PLANNER.plan_weights`: DeepSeek-V4.1) counts its
    weights from it, by part; `vision` counts a vision tower too (skipped by default:
    gsm_jax runs text only). engram_memory="host": V4.1's Engram tables in pinned host
    memory (`load(..., engram_memory=)`), listed apart and not counted against the device.
    kv_cache_dtype: the KV cache's format (`with_kv_cache_dtype`: "float", "int8" / "fp8",
    DeepSeek-V4.1's "released").
    prefill_chunk: the chunk of a chunked prefill (None: one prefill call)."""
    from gsm_jax.models.common import config_with_kv_cache_dtype
    from gsm_jax.sharding import check_engram_memory, host_axes

    host = host_axes(engram_memory)
    cfg, quant, expert_dtype, hf = _load_config(model)
    cfg = config_with_kv_cache_dtype(cfg, kv_cache_dtype)
    check_engram_memory(cfg, host)
    data, tp = (int(x) for x in mesh_shape)
    if data < 1 or tp < 1:
        raise InvalidInputError(f"mesh shape {mesh_shape}: both axes must be >= 1")
    if batch < 1 or context < 1:
        raise InvalidInputError("batch and context must be >= 1")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise InvalidInputError(f"prefill_chunk must be >= 1 (or None: one call), "
                                f"got {prefill_chunk}")
    if batch % data:
        raise InvalidInputError(f"batch {batch} is not divisible by mesh axis 'data' of "
                                f"size {data}")
    if context > cfg.max_position_embeddings:
        raise InvalidInputError(f"context {context} exceeds the model's "
                                f"{cfg.max_position_embeddings} positions")
    if weights_dtype not in _BYTES:
        raise InvalidInputError(f"weights_dtype {weights_dtype!r}: one of {sorted(_BYTES)}")
    from gsm_jax.sharding import check_model

    mesh = {"data": data, "model": tp}
    check_model(cfg, _FakeMesh(mesh))
    family = family_module(cfg.family)
    planner = family.PLANNER  # models/family_planner.py: the family's answers
    shapes = family.weight_shapes(cfg, jnp.dtype(weights_dtype))
    lines: dict[str, float] = {}
    params = 0
    per_layer: list[float] = []
    notes: list[str] = []
    by_part = None  # counted from the family's released layout, or None: from its tree
    if hf is not None and quant:
        by_part = planner.plan_weights(hf, mesh, weights_dtype, vision=vision)
    if by_part is not None:
        lines, params, notes = by_part
        shapes = {}  # counted by part
    for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
        name = str(getattr(path[-1], "key", path[-1]))
        params += math.prod(leaf.shape)
        if np.dtype(leaf.dtype) == np.float32:
            label, b = "float32", math.prod(leaf.shape) * 4
        elif np.dtype(leaf.dtype).kind in "iu":
            label, b = "int32 (hash tables)", math.prod(leaf.shape) * 4
        else:  # as a checkpoint stores it
            label, b = planner.stored_weight_bytes(name, leaf.shape, quant, expert_dtype,
                                                   weights_dtype)
        b /= _shard_factor(cfg.family, path, len(leaf.shape), mesh)
        lines[f"weights: {label}"] = lines.get(f"weights: {label}", 0) + b
        if str(getattr(path[0], "key", "")) == "layers" and len(path) > 1 \
                and getattr(path[1], "idx", None) == 0:
            per_layer.append(b)
    mtp = planner.mtp_layers(cfg, quant)
    if mtp and by_part is None:
        lines["weights: MTP block (as a layer)"] = mtp * sum(per_layer)
    # caches, from the model's own init_cache
    cache = jax.eval_shape(lambda: family.init_cache(
        cfg, batch, context, dtype=jnp.dtype(weights_dtype), gsm_max_window=gsm_max_window))
    for path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
        names = [str(getattr(p, "name", getattr(p, "key", getattr(p, "idx", p)))) for p in path]
        if "lengths" in names:
            continue
        kind = _cache_kind(names, planner.cache_kinds)
        lines[kind] = lines.get(kind, 0) + leaf.size * leaf.dtype.itemsize / data
    lines["activations (estimate)"] = _activations(cfg, batch // data, context,
                                                   prefill_tokens, weights_dtype, tp,
                                                   prefill_chunk)
    host_lines = {}
    if host:
        tables = [k for k in lines if "Engram tables" in k]
        if not tables:
            raise InvalidInputError("engram_memory='host': the plan of this model has no "
                                    "Engram tables line (a config without a quantization_"
                                    "config is counted as one tree); leave it 'device'")
        host_lines = {k: int(lines.pop(k)) for k in tables}
        from gsm_jax.models.engram import host_copy_bytes

        per_token = host_copy_bytes(1, (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads,
                                    cfg.engram_head_dim)
        notes.append(f"Engram tables in pinned host memory: each step copies the gathered "
                     f"rows, {per_token:,} B per token and Engram layer "
                     f"({len(cfg.active_engram_layers)} layers), host -> device")
    return Plan(model=str(model if isinstance(model, str | Path) else type(cfg).__name__),
                mesh_shape=(data, tp), device_memory=parse_bytes(device_memory), batch=batch,
                context=context, lines={k: int(v) for k, v in lines.items()},
                parameters=int(params), notes=notes, host_lines=host_lines)


class _FakeMesh:
    """The shape-only view of a mesh that `check_model` needs."""

    def __init__(self, shape: dict[str, int]):
        self.shape = shape


def _cache_kind(names: list[str], kinds: dict[str, str]) -> str:
    """The line of a cache leaf: its family's label for it (`PLANNER.cache_kinds`), else its
    name."""
    if "rings" in names:
        return "cache: GSM ring buffers"
    # the nearest named field: per-layer tuples (k/0, ...) and packed entries' leaves
    # (window/codes, window/scales) count as their field
    leaf = next((n for n in reversed(names) if n in kinds),
                next(n for n in reversed(names) if not n.isdigit()))
    return f"cache: {kinds.get(leaf, leaf)}"


def _activations(cfg: Any, rows: int, context: int, prefill_tokens: int | None,
                 dtype: str, tp: int, chunk: int | None = None) -> float:
    """max(decode step of `rows`, prefill of one prompt) live activations, bytes per device.
    A chunked prefill holds one chunk's queries (and stream) against the whole prompt's
    keys."""
    b = _BYTES[dtype]
    decode_rows, rows = rows, 1
    t = min(prefill_tokens or context, context)
    d = cfg.hidden_size * getattr(cfg, "hc_mult", 1)
    heads = cfg.num_heads // tp if cfg.num_heads % tp == 0 else cfg.num_heads
    inter, keys = family_module(cfg.family).PLANNER.activation_widths(cfg, t)
    q = t if chunk is None else min(t, chunk)  # queries of one prefill call
    scores = rows * heads * q * keys * 4  # f32 scores, materialised
    stream = rows * q * (4 * d + inter) * b
    decode = decode_rows * ((4 * d + inter) * b + heads * context * 4 + cfg.vocab_size * 4)
    return max(stream + scores, decode)


# ----------------------------------------------------------------------------- compiled check


def abstract_weights(cfg: Any, quant: dict | None, expert_dtype: str,
                     dtype: str = "bfloat16") -> Any:
    """The weight tree as ShapeDtypeStructs, block-quantized leaves as stored (a family's
    `PLANNER.abstract_stored_weights`, given a quantization_config: DeepSeek-V4's FP8 dense
    projections, FP4 or FP8 routed experts)."""
    family = family_module(cfg.family)
    shapes = family.weight_shapes(cfg, jnp.dtype(dtype))
    if not quant:
        return shapes
    return family.PLANNER.abstract_stored_weights(shapes, quant, expert_dtype)


def compile_check(model: Any, mesh_shape: tuple[int, int], batch: int, context: int,
                  prompt_tokens: int = 128, dtype: str = "bfloat16",
                  kv_cache_dtype: str | None = None) -> dict:
    """Lower and compile the sharded prefill and decode step with abstract arrays (no
    weights are allocated) and return `memory_analysis()` per device of each, beside
    the planner's estimate. Needs mesh_shape devices (forced host devices will do:
    `gsm-jax plan --compile` starts a child process with them)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from gsm_jax.models.common import config_with_kv_cache_dtype
    from gsm_jax.sharding import check_mesh, check_model, padded_shape, weight_shardings

    cfg, quant, expert_dtype = load_config(model)
    cfg = config_with_kv_cache_dtype(cfg, kv_cache_dtype)
    data, tp = mesh_shape
    if jax.device_count() < data * tp:
        raise InvalidInputError(f"a {data} x {tp} mesh needs {data * tp} devices, "
                                f"{jax.device_count()} present")
    mesh = check_mesh(jax.make_mesh((data, tp), ("data", "model")))
    check_model(cfg, mesh)
    family = family_module(cfg.family)
    weights = abstract_weights(cfg, quant, expert_dtype, dtype)
    shardings = weight_shardings(cfg.family, weights, mesh)
    weights = jax.tree.map(  # padded as `place` pads them (V4.1's Engram table rows)
        lambda a, s: jax.ShapeDtypeStruct(padded_shape(a.shape, s), a.dtype, sharding=s),
        weights, shardings)
    rows = NamedSharding(mesh, PartitionSpec("data"))
    rows2 = NamedSharding(mesh, PartitionSpec("data", None))
    cache = jax.eval_shape(lambda: family.init_cache(cfg, batch, context,
                                                     dtype=jnp.dtype(dtype)))
    out: dict[str, Any] = {"mesh": [data, tp], "batch": batch, "context": context,
                           "prompt_tokens": prompt_tokens}
    with jax.set_mesh(mesh):  # as generate does: the expert-parallel dispatch reads it
        t = time.perf_counter()
        prefill = jax.jit(family.prefill, static_argnums=1).lower(
            weights, cfg,
            jax.ShapeDtypeStruct((batch, prompt_tokens), jnp.int32, sharding=rows2),
            jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows), cache).compile()
        out["prefill_compile_s"] = time.perf_counter() - t
        t = time.perf_counter()
        decode = jax.jit(family.decode_step, static_argnums=1, donate_argnums=3).lower(
            weights, cfg, jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows),
            cache).compile()
        out["decode_compile_s"] = time.perf_counter() - t
    from gsm_jax.collectives import collective_summary

    c = collective_summary(decode.as_text(), data * tp)
    out["decode_collectives"] = {"bytes_per_device": c["bytes_per_device"],
                                 "by_kind": c["by_kind"], "by_scope": c["by_scope"]}
    for name, compiled in (("prefill", prefill), ("decode", decode)):
        m = compiled.memory_analysis()
        out[name] = {k: int(getattr(m, k)) for k in
                     ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                      "temp_size_in_bytes", "generated_code_size_in_bytes")}
    p = plan(model, mesh_shape, "1TB", batch, context, weights_dtype=dtype,
             gsm_max_window=None, prefill_tokens=prompt_tokens, kv_cache_dtype=kv_cache_dtype,
             prefill_chunk=None)  # the compiled prefill is one call
    no_mtp = {k: v for k, v in p.lines.items() if "MTP" not in k and "DSpark" not in k}
    out["plan"] = {"weights": sum(v for k, v in no_mtp.items() if k.startswith("weights")),
                   "caches": sum(v for k, v in no_mtp.items() if k.startswith("cache")),
                   "activations": no_mtp["activations (estimate)"]}
    return out


def compile_report(r: dict) -> str:
    gb = 1e9
    lines = [f"compiled with abstract arrays on a {r['mesh'][0]} x {r['mesh'][1]} mesh "
             f"(batch {r['batch']}, context {r['context']}); per device, GB:"]
    plan_wc = r["plan"]["weights"] + r["plan"]["caches"]
    for name in ("prefill", "decode"):
        m = r[name]
        lines.append(f"  {name:<8} arguments {m['argument_size_in_bytes'] / gb:8.2f}  "
                     f"outputs {m['output_size_in_bytes'] / gb:8.2f}  "
                     f"temporaries {m['temp_size_in_bytes'] / gb:8.2f}  "
                     f"(compiled in {r[name + '_compile_s']:.0f} s)")
    lines.append(f"  planner  weights + caches {plan_wc / gb:8.2f}  activations "
                 f"{r['plan']['activations'] / gb:8.2f}")
    arg = r["decode"]["argument_size_in_bytes"]
    lines.append(f"  decode arguments / planner weights + caches = {arg / plan_wc:.3f}")
    lines.append(
        "Why the two activation figures differ: the planner's 'activations' is its estimate of "
        "the tensors\nlive at once in one decode step, or in the prefill of ONE prompt of "
        f"{r.get('prompt_tokens', '?')} tokens (the engine prefills one prompt at "
        "a time).\nXLA's 'temporaries' is every scratch buffer of the compiled program at its "
        f"peak: the prefill above\nwas compiled for the whole batch of {r['batch']} prompts "
        "at once, and XLA also counts fusion scratch,\ncopies and weights dequantized per "
        "block inside the step, which the estimate does not model.\nArguments (weights + "
        "caches) are what to compare with the planner's weights + caches line.")
    return "\n".join(lines)


def _compile_child(args: Any) -> int:
    """`gsm-jax plan --compile`: the check in a child with forced host devices."""
    import os
    import subprocess
    import sys

    data, tp = args.mesh_shape
    env = dict(os.environ)
    if jax.default_backend() == "cpu" and jax.device_count() < data * tp:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                            f" --xla_force_host_platform_device_count={data * tp}").strip()
    code = ("import json, sys; from gsm_jax.planner import compile_check, compile_report; "
            f"r = compile_check({args.model!r}, ({data}, {tp}), {args.batch}, {args.context}, "
            f"{args.compile_prompt_tokens}, {args.weights_dtype!r}, "
            f"{getattr(args, 'kv_cache_dtype', None)!r}); "
            "print(compile_report(r)); print('JSON', json.dumps(r))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, text=True,
                          capture_output=True)
    if proc.returncode:
        sys.stderr.write(proc.stderr[-5000:])
        return proc.returncode
    print("\n".join(ln for ln in proc.stdout.splitlines() if not ln.startswith("JSON ")))
    return 0


def _device_memory_arg(text: str) -> int:
    """argparse type of ``--device-memory``: `parse_bytes`, its error as a usage error."""
    import argparse

    try:
        return parse_bytes(text)
    except InvalidInputError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_plan_args(p: Any) -> None:
    p.add_argument("--model", required=True,
                   help=f"config.json path, model directory, or one of {sorted(KNOWN_CONFIGS)}")
    p.add_argument("--devices", type=int, default=None,
                   help="devices in all, on the model axis (unset: 1, or what --mesh says)")
    p.add_argument("--mesh", default=None, help="DATAxMODEL, e.g. 2x4 (unset: 1xDEVICES)")
    p.add_argument("--device-memory", type=_device_memory_arg, default="141GB",
                   help="memory per device: 141GB, 80GiB, 1.5TB, or a bare number of GB "
                        "(141 = 141 GB)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence (cache size)")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="longest prompt prefilled (unset: --context)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="a longer prompt is prefilled in chunks of this many tokens, as "
                        f"generate does (default {PREFILL_CHUNK}; 0: in one call)")
    p.add_argument("--weights-dtype", default="bfloat16", choices=sorted(_BYTES),
                   help="dtype of weights not stored quantized by the checkpoint")
    p.add_argument("--with-vision", action="store_true",
                   help="also count a checkpoint's vision tower (DeepSeek-V4.1; gsm_jax runs "
                        "text only, so it is skipped by default)")
    p.add_argument("--engram-memory", default="device", choices=("device", "host"),
                   help="where DeepSeek-V4.1's Engram tables live: device memory (default) "
                        "or pinned host memory (not counted against the device)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_KINDS,
                   help="the KV cache's format: 'auto' the model's own; 'float'; int8 / fp8 "
                        "(Llama-family and Gemma 3 models) one byte per value + a float32 "
                        "scale per token, head and 32 values; 'released' (DeepSeek-V4.1)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--compile", action="store_true",
                   help="also lower and compile the sharded prefill / decode step with "
                        "abstract arrays (forced host devices when needed) and print "
                        "memory_analysis() beside the estimate")
    p.add_argument("--compile-prompt-tokens", type=int, default=128,
                   help="prompt length of the --compile prefill")


def run_plan(args: Any) -> int:
    if args.mesh:
        data, tp = parse_mesh_spec(args.mesh)
        if args.devices is not None and data * tp != args.devices:
            raise InvalidInputError(f"--mesh {args.mesh} has {data * tp} devices, "
                                    f"--devices says {args.devices}")
    else:
        data, tp = 1, args.devices or 1
    p = plan(args.model, (data, tp), args.device_memory, args.batch, args.context,
             weights_dtype=args.weights_dtype, prefill_tokens=args.prefill_tokens,
             vision=args.with_vision, engram_memory=args.engram_memory,
             kv_cache_dtype=args.kv_cache_dtype, prefill_chunk=args.prefill_chunk or None)
    print(json.dumps(p.to_dict(), indent=1) if args.json else p.table())
    if args.compile:
        args.mesh_shape = (data, tp)
        rc = _compile_child(args)
        if rc:
            return rc
    return 0 if p.fits else 3
