"""Logical axis rules shared by the models and the runtime (the lowest layer that names mesh
axes, so that model code can constrain its own intermediates without importing the runtime).

`RULES` maps logical axes (declared beside each family's weights, `LOGICAL_AXES` in the
family file) to the mesh axes "data" and "model", as MaxText's logical axis rules do;
`gsm_jax.sharding` applies them to weights, this module to what the models compute.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import PartitionSpec

MESH_AXES = ("data", "model")
RULES: dict[str, str | None] = {
    "vocab": "model",
    "heads": "model",
    "mlp": "model",
    "experts": "model",
    "engram_rows": "model",
    "batch": "data",
}
# Logical axes a mesh axis need not divide: the array is padded (zeros) to a multiple of
# the mesh axis when placed. Only table rows that nothing indexes past the real size.
PADDED_AXES = frozenset({"engram_rows"})


def padded_size(size: int, n: int) -> int:
    """`size` rounded up to a multiple of `n` (a PADDED_AXES axis on n devices)."""
    return -(-size // n) * n


def model_axis_mesh(size: int) -> Any:
    """The mesh set around the call (`jax.set_mesh`, done by gsm_jax.generate / forward
    for sharded params) when its "model" axis (> 1) divides `size` (the routed experts,
    an Engram table's rows), else None: who may split that axis under `shard_map`."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "model" not in mesh.axis_names:
        return None
    n = mesh.shape["model"]
    return mesh if n > 1 and size % n == 0 else None


def _split(mesh: Any, axis: str, size: int | None) -> str | None:
    """`axis` when the mesh has it and it divides `size` (a split of that array axis), else
    None (the axis stays whole)."""
    return axis if size and axis in mesh.axis_names and size % mesh.shape[axis] == 0 else None


def batch_spec(mesh: Any, rows: int) -> PartitionSpec:
    """`shard_map`'s spec of an input whose leading axis is the batch: split over "data"
    when that divides it, else whole."""
    data = _split(mesh, "data", rows)
    return PartitionSpec() if data is None else PartitionSpec(data)


def table_axes(table: dict[str, tuple[str | None, ...]], name: str,
               ndim: int) -> tuple[str | None, ...]:
    """The logical axes of a weight named `name` with `ndim` axes, from a family's
    `LOGICAL_AXES` table: all None (replicated) when not listed; leading axes beyond the
    table's (stacked layers' [L]) replicated."""
    axes = table.get(name)
    if axes is None:
        return (None,) * ndim
    return (None,) * (ndim - len(axes)) + tuple(axes)


def constrain_rings(rings: Any) -> Any:
    """GSM ring buffers [layers, B, window, C] split like the batch (and their channels over
    "model" where it divides them), when the call runs under a mesh (`jax.set_mesh`);
    unchanged otherwise. Propagation alone leaves their batch axis whole."""
    mesh = jax.sharding.get_abstract_mesh()
    if rings is None or mesh.empty or not all(a in mesh.axis_names for a in MESH_AXES):
        return rings

    def one(r):
        return jax.lax.with_sharding_constraint(r, PartitionSpec(
            None, _split(mesh, RULES["batch"], r.shape[1]), None, _split(mesh, "model",
                                                                      r.shape[-1])))

    return tuple(one(r) for r in rings)


def map_rows_and_channels(fn: Any, args: tuple, kinds: tuple[str, ...], out_kinds: Any,
                          rows: int, channels: int | None) -> Any:
    """`fn(*args)`, under `shard_map` when the call runs under a mesh (`jax.set_mesh`), for
    computations independent across rows and channels (the GSM filter: a token-axis window
    per (row, channel)). `kinds` / `out_kinds` spell each array's axes: "b" the batch (split
    over "data" when it divides `rows`), "c" the channels (over "model" when it divides
    `channels`; never when `channels` is None: a computation that reduces over the
    channels, such as a per-token quantization scale), any other letter whole; "" a
    replicated scalar. `out_kinds` mirrors fn's output pytree. Exact: each device filters
    its own rows and channels. A Pallas kernel needs it: Mosaic (TPU) kernels cannot be
    partitioned automatically at all, and XLA would gather a Triton call's operands onto
    every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not all(a in mesh.axis_names for a in MESH_AXES):
        return fn(*args)
    axis = {"b": _split(mesh, RULES["batch"], rows), "c": _split(mesh, "model", channels)}

    def spec(kind: str) -> PartitionSpec:
        return PartitionSpec(*(axis.get(a) for a in kind))

    args = tuple(jax.numpy.asarray(a) for a in args)  # a Python layer index, too
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(k) for k in kinds),
                         out_specs=jax.tree.map(spec, out_kinds), check_vma=False)(*args)
