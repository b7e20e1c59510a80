"""Model weights on a `jax.sharding.Mesh`: one table of sharding rules, JAX's own SPMD.

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    params = gsm_jax.shard(gsm_jax.load("smollm2-135m"), mesh)   # or load(..., mesh=mesh)
    gsm_jax.generate(params, prompts)                             # the same jitted programs

Every weight leaf gets logical axes by its name (`LOGICAL_AXES`, declared in each
family's module beside its weights; a family may add its own rule, `logical_axes`); the
logical axes map to mesh axes through `RULES`, as MaxText's logical axis rules do.
The jitted prefill / decode programs are unchanged: XLA's SPMD partitioner
(GSPMD) propagates the weights' shardings through them and inserts the collectives.

The rules (mesh axes "data" and "model"):

| logical axis | mesh axis | what it splits |
|---|---|---|
| vocab | model | embedding rows, LM head columns (vocabulary-parallel) |
| heads | model | attention tensor-parallel: Llama's fused q/k/v columns and o rows; |
| | | V4's q_b columns, o_a head groups, o_b rows and sinks |
| mlp | model | Llama's gate/up columns and down rows; V4's shared expert (tensor-parallel) |
| experts | model | V4's routed experts, whole experts per device (expert-parallel) |
| engram_rows | model | V4.1's Engram table rows (padded with zero rows to a multiple of |
| | | the axis; each device gathers its own rows, `models/engram.py`) |
| batch | data | tokens, caches and GSM rings follow the batch the jitted call is given |

Memory kinds: `engram_memory="host"` (`shard`, `load`) keeps V4.1's Engram tables in
pinned host memory (the same row split, 0 bytes of device memory; the rows a step needs
are gathered on the host and copied: `models/engram.py` has the cost model of both
placements). Everything else lives in device memory.

Everything else (norms, routers, compressors, the indexer, hyper-connections, V4's
single K=V head and low-rank q_a) is replicated: small, and needed whole by every
device. Quantized weights shard with their scales: int8 (`QuantizedWeight`) as its float
weight would, a grouped one's input axis along whole groups, FP8 / FP4
(`BlockQuantWeight`, stored [out, in]) along whole blocks.

Routed experts are not left to GSPMD (which would all-gather every chosen expert's
weights to every device): under a mesh that splits them, `models/moe.py` runs them
expert-parallel with `shard_map`, combining either by a psum of the outputs or by
moving tokens to their experts' devices (`ragged_all_to_all`); the cost model that
picks one is written out there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gsm_jax import families
from gsm_jax.errors import InvalidInputError
from gsm_jax.families import family_module
from gsm_jax.models.block_quant import BlockQuantWeight
from gsm_jax.models.linear import QuantizedWeight
from gsm_jax.models.partitioning import (  # noqa: F401
    MESH_AXES,
    PADDED_AXES,
    RULES,
    constrain_rings,
    padded_size,
    table_axes,
)
from gsm_jax.params import ModelParams


def __getattr__(name: str) -> Any:
    """`LOGICAL_AXES`: {family: its logical axes table}, from the registry (each family
    declares its table beside its weights, `LOGICAL_AXES` in its module)."""
    if name == "LOGICAL_AXES":
        return {f: family_module(f).LOGICAL_AXES for f in families.names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_mesh(mesh: Any) -> Mesh:
    """The mesh, checked for the axes the rules use, with Auto axis types."""
    if not isinstance(mesh, Mesh):
        raise InvalidInputError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    missing = [a for a in MESH_AXES if a not in mesh.axis_names]
    if missing:
        raise InvalidInputError(
            f"the mesh has axes {tuple(mesh.axis_names)}; gsm_jax needs {MESH_AXES} "
            f"(missing {missing}); e.g. jax.make_mesh((1, {mesh.devices.size}), "
            f"('data', 'model'))")
    return _auto_axes(mesh)


def parse_mesh_spec(text: str, flag: str = "--mesh") -> tuple[int, int]:
    """A command line's "DATAxMODEL" (e.g. "1x8") -> (data, model), positive sizes."""
    try:
        data, model = (int(x) for x in str(text).lower().split("x"))
    except ValueError as e:
        raise InvalidInputError(f"{flag} must be DATAxMODEL, e.g. 1x8; got {text!r}") from e
    if data < 1 or model < 1:
        raise InvalidInputError(f"{flag} must be DATAxMODEL with sizes >= 1; got {text!r}")
    return data, model


def mesh_from_shape(shape: tuple[int, int], flag: str = "--mesh") -> Mesh:
    """A ("data", "model") mesh of the first data x model devices, refused by name (and
    before any loading) when this process sees fewer devices."""
    data, model = shape
    devices = jax.devices()
    if data * model > len(devices):
        raise InvalidInputError(
            f"{flag} {data}x{model} needs {data * model} devices; this process sees "
            f"{len(devices)} ({jax.default_backend()})")
    return check_mesh(Mesh(np.asarray(devices[:data * model]).reshape(data, model),
                           MESH_AXES))


def _auto_axes(mesh: Mesh) -> Mesh:
    """The same devices with every axis in Auto mode: the weights carry shardings and
    GSPMD propagates them through the unchanged programs. (`jax.make_mesh` gives
    Explicit axes in recent JAX, under which every ambiguous gather in the model would
    need an out_sharding.)"""
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is None or all(t == axis_type.Auto for t in mesh.axis_types):
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(axis_type.Auto,) * len(
        mesh.axis_names))


def _leaf_name(path: tuple) -> str:
    last = path[-1]
    return str(getattr(last, "key", getattr(last, "name", getattr(last, "idx", last))))


def _path_names(path: tuple) -> list[str]:
    return [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path]


ENGRAM_MEMORY = ("device", "host")


def host_axes(engram_memory: str = "device") -> frozenset:
    """The logical axes whose weights live in pinned host memory for an `engram_memory`
    choice ("device": none; "host": the Engram tables' rows)."""
    if engram_memory not in ENGRAM_MEMORY:
        raise InvalidInputError(f"engram_memory must be one of {ENGRAM_MEMORY}, got "
                                f"{engram_memory!r}")
    return frozenset({"engram_rows"}) if engram_memory == "host" else frozenset()


def check_engram_memory(config: Any, host: frozenset) -> None:
    """Refuse engram_memory="host" for a model without Engram tables (nothing to place)."""
    if host and not getattr(config, "active_engram_layers", ()):
        raise InvalidInputError(
            f"engram_memory='host': this {config.family} model has no Engram tables "
            "(only DeepSeek-V4.1 with Engram layers has); leave it 'device'")


def check_host_memory(mesh: Mesh) -> None:
    """Refuse host placement on devices without a pinned-host memory space."""
    device = mesh.devices.flat[0]
    kinds = [m.kind for m in device.addressable_memories()]
    if "pinned_host" not in kinds:
        raise InvalidInputError(f"engram_memory='host': {device.platform} devices have no "
                                f"'pinned_host' memory (they have {kinds})")


def logical_axes(family: str, path: tuple, ndim: int) -> tuple[str | None, ...]:
    """The logical axes of the float weight at `path` (replicated: all None)."""
    names = _path_names(path)
    fam = family_module(family)
    rule = getattr(fam, "logical_axes", None)  # a family's own rule, else its table
    if rule is not None:
        return rule(names, ndim)
    return table_axes(fam.LOGICAL_AXES, names[-1], ndim)


def _mesh_spec(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh: Mesh,
               what: str, blocks: tuple[int, ...] | None = None) -> PartitionSpec:
    """Logical axes -> PartitionSpec; a sharded size the mesh axis does not divide is an
    error naming the axis and the sizes (a block-quantized weight with too few blocks
    along it is replicated instead)."""
    spec = []
    for i, (axis, size) in enumerate(zip(axes, shape, strict=True)):
        mesh_axis = RULES.get(axis) if axis else None
        if mesh_axis is None or mesh.shape[mesh_axis] == 1:
            spec.append(None)
            continue
        n = mesh.shape[mesh_axis]
        if axis in PADDED_AXES:  # padded to a multiple of n when placed
            spec.append(mesh_axis)
            continue
        if blocks is not None and blocks[i] % n:
            # a block-quantized weight splits along whole scale blocks only; one with too
            # few blocks (small models) stays whole on every device
            spec.append(None)
            continue
        if size % n:
            raise InvalidInputError(
                f"{what}: its {axis} axis ({size}) is not divisible by mesh axis "
                f"{mesh_axis!r} of size {n}")
        spec.append(mesh_axis)
    return PartitionSpec(*spec)


def _swap_last(t: tuple) -> tuple:
    return (*t[:-2], t[-1], t[-2])


def leaf_shardings(family: str, path: tuple, leaf: Any, mesh: Mesh,
                   host: frozenset = frozenset()) -> Any:
    """NamedSharding(s) for one weight: an array's, or a container of its arrays'. A
    weight with a logical axis in `host` (`host_axes`) is placed in pinned host memory."""
    what = "weight " + "/".join(_path_names(path))
    if isinstance(leaf, BlockQuantWeight):
        axes = _swap_last(logical_axes(family, path, len(leaf.shape)))  # stored [.., out, in]
        stored = leaf.stored_shape
        blocks = (*stored[:-2], leaf.scale.shape[-2], leaf.scale.shape[-1])
        # values and scales split alike (a packed FP4 axis splits like its logical one)
        spec = NamedSharding(mesh, _mesh_spec(axes, stored, mesh, what, blocks))
        return leaf.replace(values=spec, scale=spec)
    if isinstance(leaf, QuantizedWeight):
        axes = logical_axes(family, path, leaf.values.ndim)
        if leaf.zero is not None:  # grouped: values, scales and offsets split alike, along
            # whole groups of the input axis (too few groups: that axis stays whole)
            blocks = (*leaf.values.shape[:-2], *leaf.scale.shape[-2:])
            spec = NamedSharding(mesh, _mesh_spec(axes, leaf.values.shape, mesh, what, blocks))
            return leaf.replace(values=spec, scale=spec, zero=spec)
        spec = _mesh_spec(axes, leaf.values.shape, mesh, what)
        return leaf.replace(values=NamedSharding(mesh, spec),
                            scale=NamedSharding(mesh, PartitionSpec(*spec[:-2], spec[-1])))
    shape = tuple(np.shape(leaf))
    axes = logical_axes(family, path, len(shape))
    spec = _mesh_spec(axes, shape, mesh, what)
    if host and host.intersection(axes):
        return NamedSharding(mesh, spec, memory_kind="pinned_host")
    return NamedSharding(mesh, spec)


def _is_container(a: Any) -> bool:
    return isinstance(a, BlockQuantWeight | QuantizedWeight)


def weight_shardings(family: str, weights: Any, mesh: Mesh,
                     host: frozenset = frozenset()) -> Any:
    """A tree like `weights` with a NamedSharding (or a container of them) per leaf."""
    return jax.tree_util.tree_map_with_path(
        lambda path, a: leaf_shardings(family, path, a, mesh, host), weights,
        is_leaf=_is_container)


def padded_shape(shape: tuple[int, ...], sharding: NamedSharding) -> tuple[int, ...]:
    """`shape` with every axis split by `sharding` rounded up to a multiple of its mesh
    axes (only PADDED_AXES axes are placed undivided: see `_mesh_spec`)."""
    out = []
    for i, size in enumerate(shape):
        entry = sharding.spec[i] if i < len(sharding.spec) else None
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        n = int(np.prod([sharding.mesh.shape[a] for a in names])) if names else 1
        out.append(padded_size(size, n))
    return tuple(out)


def _padded_slice(host: Any, index: tuple) -> np.ndarray:
    """host[index] where index may run past host's end (padding rows): zeros there."""
    index = tuple(index) + (slice(None),) * (host.ndim - len(index))
    inside = tuple(slice(min(s.start or 0, n), min(s.stop if s.stop is not None else n, n))
                   for s, n in zip(index, host.shape, strict=True))
    part = np.asarray(host[inside])
    want = tuple((s.stop if s.stop is not None else n) - (s.start or 0)
                 for s, n in zip(index, host.shape, strict=True))
    if part.shape == want:
        return part
    out = np.zeros(want, part.dtype)
    out[tuple(slice(0, k) for k in part.shape)] = part
    return out


def place(array: Any, sharding: NamedSharding) -> jax.Array:
    """A host (numpy) or device array onto its sharding; from host, each device gets only
    its own slice (`make_array_from_callback`), never the whole array. An axis the
    sharding splits unevenly (a PADDED_AXES axis) is padded with zeros."""
    shape = padded_shape(tuple(np.shape(array)), sharding)
    if shape != tuple(np.shape(array)):
        if isinstance(array, jax.Array):  # already whole on a device: pad it there
            array = jax.numpy.pad(array, [(0, p - s) for p, s in zip(shape, array.shape,
                                                                     strict=True)])
            return jax.device_put(array, sharding)
        host = array if isinstance(array, np.ndarray) else np.asarray(array)
        return jax.make_array_from_callback(shape, sharding,
                                            lambda index: _padded_slice(host, index))
    if isinstance(array, jax.Array) and (sharding.is_fully_addressable
                                         or not array.is_fully_addressable):
        return jax.device_put(array, sharding)
    host = np.asarray(array)  # several processes: each fills its own devices from the host
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_tree(family: str, tree: Any, mesh: Mesh, prefix: tuple = (),
               host: frozenset = frozenset()) -> Any:
    """`tree` (a subtree of the weights at `prefix`) with every leaf placed by the rules
    (`host`: the logical axes whose weights go to pinned host memory)."""
    def put(path, a):
        s = leaf_shardings(family, prefix + path, a, mesh, host)
        if _is_container(a):
            zero = getattr(a, "zero", None)
            return a.replace(values=place(a.values, s.values), scale=place(a.scale, s.scale),
                             **({} if zero is None else {"zero": place(zero, s.zero)}))
        return place(a, s)

    return jax.tree_util.tree_map_with_path(put, tree, is_leaf=_is_container)


def check_model(config: Any, mesh: Any) -> None:
    """Refuse, up front, a model axis that does not divide what it splits whole: the
    vocabulary, and DeepSeek-V4's heads, head groups and experts. (Llama splits its
    fused q/k/v, o, gate/up and down matrices as flat columns / rows: every weight's
    sharded size is checked when it is placed.)"""
    n = mesh.shape["model"]
    sizes = {"vocabulary": config.vocab_size}
    sizes.update(family_module(config.family).PLANNER.model_axis_sizes(config))
    for name, size in sizes.items():
        if n > 1 and size % n:
            raise InvalidInputError(
                f"mesh axis 'model' of size {n} does not divide the model's {name} ({size}); "
                "choose a model axis size that divides it")


def shard(params: ModelParams, mesh: Mesh, *, engram_memory: str = "device") -> ModelParams:
    """The same params with every weight placed on `mesh` by the sharding rules.
    engram_memory: "device" (default) or "host" (V4.1's Engram tables in pinned host
    memory, same row split)."""
    if not isinstance(params, ModelParams):
        raise InvalidInputError("shard expects the ModelParams returned by gsm_jax.load")
    host = host_axes(engram_memory)
    mesh = check_mesh(mesh)
    if host:
        check_engram_memory(params.config, host)
        check_host_memory(mesh)
    check_model(params.config, mesh)
    weights = place_tree(params.config.family, params.weights, mesh, host=host)
    return dataclasses.replace(params, weights=weights)


def one_device_mesh(device: Any = None) -> Mesh:
    """A 1 x 1 ("data", "model") mesh of one device (default: the first): placement with
    memory kinds on a single device (`engram_memory="host"` without a mesh)."""
    device = jax.devices()[0] if device is None else device
    return Mesh(np.array([[device]]), MESH_AXES)


def mesh_of(weights: Any) -> Mesh | None:
    """The mesh the weights live on, or None (one device)."""
    for leaf in jax.tree.leaves(weights):
        s = getattr(leaf, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh.devices.size > 1:
            return s.mesh
    return None


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Inputs whose leading axis is the batch: split over "data"."""
    return NamedSharding(mesh, PartitionSpec(RULES["batch"], *([None] * (ndim - 1))))
