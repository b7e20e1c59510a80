"""What a compiled SPMD program communicates: its collectives, read from the HLO text.

    compiled = jax.jit(step).lower(*args).compile()
    summary = collective_summary(compiled.as_text())
    summary["bytes_per_device"], summary["by_scope"]

Each collective (all-reduce, all-gather, reduce-scatter, all-to-all, ragged-all-to-all,
collective-permute; their async -start forms too) is counted once with its result
bytes, its replica-group size n and the bytes one device sends under the usual ring
algorithms: all-reduce 2 S (n - 1) / n, all-gather and all-to-all S (n - 1) / n,
reduce-scatter S (n - 1), collective-permute S (S: result bytes). Ops inside a
while-loop body are flagged (`in_loop`): they run once per iteration, which the text
cannot tell. The scope is the op's `jax.named_scope` path, three levels (layers merged).
"""

from __future__ import annotations

import collections
import re
from typing import Any

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
             "f4e2m1fn": 0.5, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
             "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_KINDS = ("ragged-all-to-all", "all-reduce", "all-gather", "reduce-scatter", "all-to-all",
          "collective-permute")
_OP = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.+?)\s+(?P<kind>"
                 + "|".join(re.escape(k) for k in _KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_BODY = re.compile(r"body=%?([\w.\-]+)")


def _bytes(shape: str) -> float:
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in _ITEMSIZE:
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * _ITEMSIZE[dtype]
    return total


def _group_size(line: str, devices: int) -> int:
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)  # iota form: [groups, size]
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if m and m.group(1):
        return len(m.group(1).split(","))
    m = re.search(r"source_target_pairs=", line)
    return 2 if m else devices


def _clean(path: str) -> str:
    # the last part names the primitive; Flax method scopes keep their method name
    parts = [re.sub(r"^[A-Z]\w*\.", "", p) for p in path.split("/")[:-1]
             if p and not re.match(r"^(layer(_\d+)?|jit\(.*\)|.*shard_map.*|.*;.*)$", p)]
    parts = [p for p in parts if p not in ("decode", "prefill")]  # V4's per-layer wrappers
    return "/".join(parts[:3]) or "(top level)"


def _scopes(line: str) -> list[str]:
    """Named-scope paths of an op; a combined op (XLA merges neighbouring all-reduces)
    names its parts as prefix/(a/...:b/...), one per tuple element."""
    m = re.search(r'op_name="([^"]*)"', line)
    if not m:
        return ["(no scope)"]
    path = re.sub(r"^jit\([^)]*\)/", "", m.group(1))
    merged = re.match(r"^(.*?)\(([^()]*:[^()]*)\)$", path)
    if merged:
        return [_clean(merged.group(1) + alt) for alt in merged.group(2).split(":")]
    return [_clean(path)]


def _sent(kind: str, size: float, n: int) -> float:
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * size * (n - 1) / n
    if kind == "reduce-scatter":
        return size * (n - 1)
    if kind == "collective-permute":
        return size
    return size * (n - 1) / n


def collectives(hlo_text: str, devices: int) -> list[dict[str, Any]]:
    """One record per collective op of a compiled module's text."""
    loop_bodies = set(_BODY.findall(hlo_text))
    ops, computation = [], ""
    for line in hlo_text.splitlines():
        head = _COMPUTATION.match(line)
        if head and "=" not in line.split("{")[0]:
            computation = head.group(1)
            continue
        m = _OP.match(line)
        if not m:
            continue
        kind, shape = m.group("kind"), m.group("shape")
        n = _group_size(line, devices)
        scopes = _scopes(line)
        elements = _ARRAY.findall(shape)
        if len(scopes) != len(elements):  # attribute all of it to the first part
            scopes, parts = scopes[:1], [shape]
        else:
            parts = [f"{d}[{dims}]" for d, dims in elements]
        by_scope: dict[str, float] = collections.Counter()
        for scope, part in zip(scopes, parts, strict=True):
            by_scope[scope] += _sent(kind, _bytes(part), n)
        size = _bytes(shape)
        ops.append({"kind": kind, "result_bytes": size, "group": n,
                    "sent_bytes": _sent(kind, size, n), "scopes": dict(by_scope),
                    "in_loop": computation in loop_bodies})
    return ops


def collective_summary(hlo_text: str, devices: int) -> dict[str, Any]:
    ops = collectives(hlo_text, devices)
    by_kind: dict[str, float] = collections.Counter()
    by_scope: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for op in ops:
        by_kind[op["kind"]] += op["sent_bytes"]
        for scope, sent in op["scopes"].items():
            by_scope[scope] += sent
        count[op["kind"]] += 1
    return {"ops": len(ops), "count_by_kind": dict(count),
            "bytes_per_device": sum(op["sent_bytes"] for op in ops),
            "by_kind": dict(by_kind), "by_scope": dict(by_scope),
            "in_loop_ops": sum(op["in_loop"] for op in ops)}
