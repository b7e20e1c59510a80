"""Routed experts: the single-device dispatches and expert parallelism over a mesh.

`routed_experts(x, idx, w, gate_up, down, limit)` computes
sum_j w[:, j] * expert_{idx[:, j]}(x) for the SwiGLU experts of DeepSeek-V4. Without a
mesh it runs one of the local dispatches below; under a mesh whose "model" axis
splits the experts (set by gsm_jax.generate / forward for sharded params) it runs
expert-parallel with `shard_map` (see `expert_parallel`).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gsm_jax.models.linear import linear
from gsm_jax.models.partitioning import batch_spec, model_axis_mesh


def swiglu(gate_up: jax.Array, limit: float) -> jax.Array:
    """silu(min(gate, limit)) * clip(up, -limit, limit); gate_up = [gate | up]."""
    gate, up = jnp.split(gate_up, 2, axis=-1)
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)



# ----------------------------------------------------------------------------- routed experts
#
# Cost model (M tokens, k experts each, A = M*k assignments, E experts, D hidden,
# I expert width; one expert = 3*D*I weights, 6*D*I flops per token):
#
# - "blocks" (every backend but TPU): assignments are sorted by expert and each
#   expert's group is padded to a multiple of b rows; a loop over the *used* experts
#   (a dynamic trip count) slices each one's weights once and runs its blocks, one
#   [b, D] x [D, 2I] and [b, I] x [I, D] product per block. With G = min(E, A) groups
#   at most:
#     rows computed = sum_e ceil(n_e / b) * b <= A + G * (b - 1)
#     weights read  = used experts * 3DI     <= G * 3DI (each block reads its
#                     expert's slice again, from cache at decode sizes)
#   Prefill (many rows per expert: compute-bound) takes b <= A / (2G), so at most
#   half the rows are padding. Decode (a few rows per expert: memory-bound) takes b
#   ~ twice the mean group size (<= 16): padded rows cost nothing next to the
#   weight traffic, and each chosen expert's weights are read about once per step
#   (rows <= 5A). Sort + scatter are O(A log A) + O(A D); apart from two length-E
#   vectors nothing scales with E.
# - "ragged" (TPU): the sorted rows go through `jax.lax.ragged_dot`, which TPU
#   lowers to a native grouped matmul. (Elsewhere jax lowers ragged_dot to a
#   masked dense product over all E groups, so it is not used there.)
# - "dense": every expert on every token, A*E/k work: the test reference only.


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _block_rows(assignments: int, experts: int) -> int:
    """Rows per block (a power of two) for the cost model above."""
    groups = min(experts, assignments)
    mean = assignments / groups
    if mean <= 1:  # one row per expert (batch 1): mat-vecs
        return 1
    if mean < 16:  # memory-bound: about one block per chosen expert
        return min(16, 1 << math.ceil(math.log2(2 * mean)))
    return min(128, _pow2_floor(assignments // (2 * groups)))


def _sort_assignments(idx: jax.Array, w: jax.Array):
    m, k = idx.shape
    flat_e = idx.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(flat_e, stable=True)
    return flat_e[order], (order // k).astype(jnp.int32), w.reshape(-1)[order]


def _experts_blocks(x, idx, w, gate_up, down, limit, shards: int = 1):
    """The block dispatch. An assignment with idx outside [0, E) is skipped (expert
    parallelism: another device's expert); `shards` > 1 sizes the blocks for the ~1/shards
    of the assignments that are expected to be local (the capacity stays exact)."""
    m, d = x.shape
    n_exp = gate_up.shape[0]
    a = idx.size
    b = _block_rows(max(a // shards, 1), n_exp)
    n_blocks = -(-(a + min(n_exp, a) * (b - 1)) // b)
    cap = n_blocks * b
    e_sorted, t_sorted, w_sorted = _sort_assignments(idx, w)
    counts = jnp.bincount(e_sorted, length=n_exp)  # out-of-range experts are not counted
    blocks = (counts + b - 1) // b
    block_end = jnp.cumsum(blocks)  # [E], in blocks
    pad_start = (block_end - blocks) * b  # first padded row of each expert's group
    start = jnp.cumsum(counts) - counts
    local = (e_sorted >= 0) & (e_sorted < n_exp)
    e_safe = jnp.clip(e_sorted, 0, n_exp - 1)
    dest = jnp.where(local, pad_start[e_safe] + jnp.arange(a) - start[e_safe], cap)
    slot_token = jnp.full((cap,), m, jnp.int32).at[dest].set(t_sorted, mode="drop")  # m: zeros
    slot_w = jnp.zeros((cap,), jnp.float32).at[dest].set(w_sorted.astype(jnp.float32),
                                                         mode="drop")
    rows = jnp.concatenate([x, jnp.zeros((1, d), x.dtype)])[slot_token]
    # the experts with rows, in order (then padding); slicing an expert's weights out of
    # the stack copies them on XLA:CPU, so the loop goes expert by expert and runs each
    # expert's blocks with its slice: one copy per used expert, not one per block (a
    # 256-token mid V4.1 prefill: ~3 blocks per expert)
    used = jnp.nonzero(blocks > 0, size=min(n_exp, n_blocks), fill_value=0)[0]

    def per_expert(i, ys):
        e = used[i]
        wg, wd = gate_up[e], down[e]

        def per_block(j, ys):
            xb = jax.lax.dynamic_slice_in_dim(rows, j * b, b)
            h = swiglu(linear(xb, wg), limit)
            return jax.lax.dynamic_update_slice_in_dim(ys, linear(h, wd), j * b, 0)

        return jax.lax.fori_loop(block_end[e] - blocks[e], block_end[e], per_block, ys)

    ys = jax.lax.fori_loop(0, jnp.sum(blocks > 0), per_expert, jnp.zeros((cap, d), x.dtype))
    out = jnp.zeros((m + 1, d), jnp.float32).at[slot_token].add(ys * slot_w[:, None])
    return out[:m].astype(x.dtype)


def _experts_ragged(x, idx, w, gate_up, down, limit):
    m, d = x.shape
    e_sorted, t_sorted, w_sorted = _sort_assignments(idx, w)
    counts = jnp.bincount(e_sorted, length=gate_up.shape[0]).astype(jnp.int32)
    h = swiglu(jax.lax.ragged_dot(x[t_sorted], gate_up.astype(x.dtype), counts), limit)
    ys = jax.lax.ragged_dot(h, down.astype(x.dtype), counts)
    out = jnp.zeros((m, d), jnp.float32).at[t_sorted].add(ys * w_sorted[:, None])
    return out.astype(x.dtype)


def _experts_dense(x, idx, w, gate_up, down, limit):
    m = x.shape[0]
    combine = jnp.zeros((m, gate_up.shape[0]), jnp.float32)
    combine = combine.at[jnp.arange(m)[:, None], idx].add(w.astype(jnp.float32))
    h = swiglu(jnp.einsum("md,edf->emf", x, gate_up.astype(x.dtype)), limit)
    ys = jnp.einsum("emf,efd->emd", h, down.astype(x.dtype))
    return jnp.einsum("emd,me->md", ys.astype(jnp.float32), combine).astype(x.dtype)


# ----------------------------------------------------------------------------- over a mesh
#
# Expert parallelism (M devices on the mesh axis "model", each owning E / M whole
# experts). The tokens of a data shard, T of them with k experts each and D channels,
# are replicated over "model" (attention is tensor-parallel there and ends in an
# all-reduce). Two ways to combine (bytes moved per device and MoE layer, b bytes per
# activation, ring collectives):
#
# - "psum": every device runs the block dispatch over all T x k assignments, skipping
#   the other devices' experts, and the partial outputs are summed:
#       all-reduce of T x D:                      2 T D b (M - 1) / M
# - "all_to_all": every device takes T / M of the tokens, sends each assignment's row
#   to its expert's device, gets the expert outputs back, and the T / M combined rows
#   are all-gathered:
#       ragged_all_to_all (GPU, TPU), both ways:  2 (T / M) k D b (M - 1) / M
#       all-gather of T x D:                      T D b (M - 1) / M
#   XLA:CPU has no ragged-all-to-all (UNIMPLEMENTED in its thunk emitter), so there the
#   exchange is a dense `all_to_all` with room for every assignment per destination:
#       2 T k D b (M - 1) / M, always more than the psum.
#
# Both compute the same rows (each device only its own experts' assignments) and read
# the same weights, and neither moves a weight. The token exchange is cheaper than the
# psum iff 2 k < M (ragged): not for V4-Flash on 8 devices (k = 6), yes from 16 on.
# `expert_dispatch="auto"` takes the cheaper one by these formulas; the benchmark
# `benchmarks/bench_mesh.py` measures both (on forced host devices, where a collective
# is a memcpy, the formulas' ranking is what it can check, not network time).
# GSPMD alone (no shard_map) all-gathers every chosen expert's weights instead: ~150 GB
# of temporaries per device on the real V4-Flash decode step (1 x 8), against ~2 here.

DISPATCHES = ("auto", "psum", "all_to_all")


def _expert_mesh(n_experts: int) -> Any:
    """The mesh whose "model" axis splits the experts, else None."""
    return model_axis_mesh(n_experts)


def dispatch_bytes(tokens: int, k: int, hidden: int, devices: int, itemsize: int,
                   ragged: bool) -> dict[str, float]:
    """Bytes each device moves per MoE layer for both dispatches (the model above)."""
    t, m, share = tokens, devices, (devices - 1) / devices
    a2a = (2 * (-(-t // m)) * k if ragged else 2 * t * k) * hidden * itemsize * share
    return {"psum": 2 * t * hidden * itemsize * share,
            "all_to_all": a2a + t * hidden * itemsize * share}


def choose_dispatch(tokens: int, k: int, hidden: int, devices: int, itemsize: int,
                    ragged: bool) -> str:
    cost = dispatch_bytes(tokens, k, hidden, devices, itemsize, ragged)
    return "all_to_all" if cost["all_to_all"] < cost["psum"] else "psum"


def _data_rows(mesh, rows: int):
    return batch_spec(mesh, rows)


def _experts_psum(x, idx, w, gate_up, down, limit, mesh):
    from jax.sharding import PartitionSpec as P

    n_model = mesh.shape["model"]
    rows = _data_rows(mesh, x.shape[0])

    def local(x, idx, w, gate_up, down):
        e_local = gate_up.shape[0]
        first = jax.lax.axis_index("model") * e_local
        mine = (idx >= first) & (idx < first + e_local)
        idx = jnp.where(mine, idx - first, e_local)  # e_local: skipped by the dispatch
        y = _experts_blocks(x, idx, jnp.where(mine, w, 0), gate_up, down, limit, n_model)
        return jax.lax.psum(y, "model")

    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, P("model"), P("model")),
                         out_specs=rows, check_vma=False)(x, idx, w, gate_up, down)


class _Route(NamedTuple):
    """Where each of my assignments (sorted by destination device) goes, and what comes
    back: dest / slot (its device and row within that device's slab), sizes / offsets
    (rows per destination and where they start in my sorted order), recv_sizes (rows
    each device sends me) and back_offsets (where my results start in its order)."""

    dest: jax.Array
    slot: jax.Array
    sizes: jax.Array
    offsets: jax.Array
    recv_sizes: jax.Array
    back_offsets: jax.Array


def _exchange_dense(send, route: _Route, inverse: bool = False):
    """Dense exchange: a [M, C, D] buffer, slab j for device j (C = all my assignments)."""
    n_dev = route.sizes.shape[0]
    if inverse:  # send: [M * C, D] results, slab j for the rows device j sent
        back = jax.lax.all_to_all(send.reshape(n_dev, -1, *send.shape[1:]), "model", 0, 0)
        return back[route.dest, route.slot]
    c = send.shape[0]
    buf = jnp.zeros((n_dev, c) + send.shape[1:], send.dtype).at[route.dest, route.slot].set(send)
    return jax.lax.all_to_all(buf, "model", 0, 0).reshape((n_dev * c,) + send.shape[1:])


def ragged_all_to_all_reference(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
    """`jax.lax.ragged_all_to_all` written with all-gathers (for CPU tests of the offsets):
    rows [input_offsets[j], + send_sizes[j]) of device i land at output_offsets[j] in
    device j's output."""
    del recv_sizes
    me = jax.lax.axis_index(axis_name)
    ops = jax.lax.all_gather(operand, axis_name)  # [M, N, ...]
    start = jax.lax.all_gather(input_offsets, axis_name)[:, me]  # [M] per source
    size = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    at = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    r = jnp.arange(operand.shape[0])
    valid = r[None, :] < size[:, None]  # [M, N]
    src = jnp.clip(start[:, None] + r[None, :], 0, operand.shape[0] - 1)
    rows = jnp.take_along_axis(ops, src.reshape(src.shape + (1,) * (ops.ndim - 2)), axis=1)
    pos = jnp.where(valid, at[:, None] + r[None, :], output.shape[0])
    return output.at[pos.reshape(-1)].set(rows.reshape((-1,) + operand.shape[1:]), mode="drop")


def _exchange_ragged(send, route: _Route, inverse: bool = False,
                     collective=jax.lax.ragged_all_to_all):
    """Ragged exchange of rows sorted by destination; the receiver keeps slab i
    (C rows) for device i, so the same expert loop runs on it as on the dense layout."""
    n_dev = route.sizes.shape[0]
    c = send.shape[0] // n_dev if inverse else send.shape[0]
    slabs = jnp.arange(n_dev, dtype=jnp.int32) * c
    if inverse:  # results of slab i go back to device i, at its sorted positions
        out = jnp.zeros((c,) + send.shape[1:], send.dtype)
        return collective(send, out, slabs, route.recv_sizes, route.back_offsets, route.sizes,
                          axis_name="model")
    out = jnp.zeros((n_dev * c,) + send.shape[1:], send.dtype)
    mine = jnp.full((n_dev,), jax.lax.axis_index("model") * c, jnp.int32)
    return collective(send, out, route.offsets, route.sizes, mine, route.recv_sizes,
                      axis_name="model")


def _exchange_by_platform(send, route: _Route, inverse: bool = False):
    """Ragged where XLA has it; XLA:CPU does not, so the dense exchange there."""
    return jax.lax.platform_dependent(
        send, route,
        cpu=functools.partial(_exchange_dense, inverse=inverse),
        default=functools.partial(_exchange_ragged, inverse=inverse))


def _experts_all_to_all(x, idx, w, gate_up, down, limit, mesh, exchange=None):
    """Token-moving expert parallelism (see the cost model above). `exchange` overrides
    the platform's choice (ragged on GPU/TPU, dense on CPU) - tests use it."""
    from jax.sharding import PartitionSpec as P

    n_dev = mesh.shape["model"]
    rows = _data_rows(mesh, x.shape[0])
    n_rows = x.shape[0] // (mesh.shape["data"] if rows != P() else 1)
    pad = -n_rows % n_dev

    def local(x, idx, w, gate_up, down):
        e_local = gate_up.shape[0]
        k = idx.shape[1]
        if pad:  # padded tokens choose no expert (n_dev * e_local: out of range)
            x = jnp.pad(x, ((0, pad), (0, 0)))
            idx = jnp.pad(idx, ((0, pad), (0, 0)), constant_values=n_dev * e_local)
            w = jnp.pad(w, ((0, pad), (0, 0)))
        t_mine = x.shape[0] // n_dev
        me = jax.lax.axis_index("model")
        xs = jax.lax.dynamic_slice_in_dim(x, me * t_mine, t_mine)
        ids = jax.lax.dynamic_slice_in_dim(idx, me * t_mine, t_mine).reshape(-1)
        ws = jax.lax.dynamic_slice_in_dim(w, me * t_mine, t_mine).reshape(-1)
        dest = jnp.minimum(ids // e_local, n_dev - 1).astype(jnp.int32)
        order = jnp.argsort(dest, stable=True)
        dest, ids, ws, tok = dest[order], ids[order], ws[order], (order // k).astype(jnp.int32)
        live = ids < n_dev * e_local
        sizes = jnp.bincount(dest, length=n_dev).astype(jnp.int32)
        offsets = (jnp.cumsum(sizes) - sizes).astype(jnp.int32)
        route = _Route(dest, (jnp.arange(dest.shape[0]) - offsets[dest]).astype(jnp.int32),
                       sizes, offsets,
                       # what each device sends me, and where my rows sit in its order
                       jax.lax.all_to_all(sizes, "model", 0, 0, tiled=True),
                       jax.lax.all_to_all(offsets, "model", 0, 0, tiled=True))
        ex = exchange or _exchange_by_platform
        got = ex(xs[tok], route)  # [M * C, D]: slab i = rows from device i
        got_e = ex(jnp.where(live, ids % e_local, e_local).astype(jnp.int32)[:, None], route)
        # a slab's rows past what its device sent are zeros (dense) or untouched zeros
        # (ragged); mark them with the out-of-range expert so the loop skips them
        filled = (jnp.arange(got.shape[0]) % dest.shape[0]) < jnp.repeat(
            route.recv_sizes, dest.shape[0], total_repeat_length=got.shape[0])
        e_recv = jnp.where(filled, got_e[:, 0], e_local)[:, None]
        y = _experts_blocks(got, e_recv, jnp.ones(e_recv.shape, jnp.float32), gate_up, down,
                            limit, n_dev)
        back = ex(y, route, inverse=True)  # [A, D] in my sorted order
        contrib = back.astype(jnp.float32) * jnp.where(live, ws, 0)[:, None]
        mine = jnp.zeros((t_mine, x.shape[1]), jnp.float32).at[tok].add(contrib)
        out = jax.lax.all_gather(mine.astype(x.dtype), "model", tiled=True)
        return out[:out.shape[0] - pad] if pad else out

    return jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, P("model"), P("model")),
                         out_specs=rows, check_vma=False)(x, idx, w, gate_up, down)


def routed_experts(x: jax.Array, idx: jax.Array, w: jax.Array, gate_up: jax.Array,
                   down: jax.Array, limit: float, impl: str = "auto",
                   dispatch: str = "auto") -> jax.Array:
    """sum_j w[:, j] * expert_{idx[:, j]}(x): x [M, D]; idx, w [M, k]; gate_up [E, D, 2I].

    impl: the local dispatch ("blocks", "ragged", "dense"; "auto" by platform).
    dispatch: under a mesh that splits the experts, "psum", "all_to_all" or "auto"
    (by `choose_dispatch`)."""
    fns = {"blocks": _experts_blocks, "ragged": _experts_ragged, "dense": _experts_dense}
    if impl != "auto":
        return fns[impl](x, idx, w, gate_up, down, limit)
    mesh = _expert_mesh(gate_up.shape[0])
    if mesh is not None:
        if dispatch == "auto":
            data = mesh.shape["data"] if "data" in mesh.axis_names else 1
            dispatch = choose_dispatch(
                max(x.shape[0] // data, 1), idx.shape[1], x.shape[1], mesh.shape["model"],
                x.dtype.itemsize, ragged=jax.default_backend() != "cpu")
        fn = _experts_all_to_all if dispatch == "all_to_all" else _experts_psum
        return fn(x, idx, w, gate_up, down, limit, mesh)
    return jax.lax.platform_dependent(
        x, idx, w, gate_up, down,
        tpu=functools.partial(_experts_ragged, limit=limit),
        default=functools.partial(_experts_blocks, limit=limit),
    )
