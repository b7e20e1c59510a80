"""Automatic prefix caching for the serving engine (vLLM's APC, JetStream's prefix cache).

A long prompt is prefilled in chunks of `prefill_chunk` tokens (the first by the family's
`prefill`, the rest by its `extend`; `serving/engine.py`). With prefix caching on, the
engine keeps the one-row cache each chunk boundary reached, keyed by a hash chain of the
token ids before it: key_k = sha256(key_{k-1} + the k-th chunk's ids), key_0 = a hash of
what else decides that state (below). A later request whose prompt starts with the same
k chunks restores the state at boundary k x chunk and prefills only the rest, one chunk
per engine step as before.

**Exact, not approximately equal.** A hit runs the very calls a cold prefill runs after
that boundary (same chunk shapes, same read bounds), from a bit-identical state, so its
tokens and logits are those of the engine with caching off, bit for bit (tested). Hence
the block is the prefill chunk (a finer block would change how a cold prompt is cut, and
so its rounding), and only boundaries strictly inside the prompt are cached: the last
chunk always runs, because it gives the first token's logits.

**What the state holds**: every cache of the family (KV, DeepSeek's window / compressed /
index-key caches and compressor state, Engram's n-gram history) and the **GSM ring
buffers**: the filter's last `ring` inputs per site, so a hit resumes the filter where a
cold prefill would be at that boundary, mid-window included. A state depends on more than
the tokens; key_0 hashes it all: the row's GSM strengths [layers, sites] and window (or
"not smoothed"), the batch's protect_first, the compiled ring size / precision / kernel,
and the chunk size. Same numbers under another config version share entries (the state is
the same); any difference is another key.

**Memory**: a dense family's KV cache (`models.common.KVCache`) is stored trimmed to the
boundary's slots (a 512-token state of a 2048-slot row costs a quarter of the row) and
padded back with zeros when restored (a cold row holds zeros there too: bit for bit the
same); other families' rows are stored whole (their caches have their own, smaller
sizes). Entries are evicted least recently used first to stay within `capacity_bytes`;
one larger than that is not stored. `stats()` counts queried and hit prompt tokens
(vLLM's `prefix_cache_queries` / `prefix_cache_hits`), entries, bytes and evictions.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import InvalidInputError
from gsm_jax.models.common import KVCache

__all__ = ["PrefixCache", "check_capacity", "restore_rows", "snapshot_rows"]


def check_capacity(value: Any, name: str = "prefix_cache_bytes") -> int:
    """A byte budget >= 0 (0: off); anything else is refused by `name`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise InvalidInputError(f"{name} must be an integer >= 0 (bytes; 0 = off), "
                                f"got {value!r}")
    return int(value)


# ----------------------------------------------------------------------------- states

def _own(tree: Any) -> Any:
    """A copy of every array of `tree` in buffers of its own. (Not a jitted identity: JAX
    forwards a jitted function's unchanged inputs as its outputs, and the engine's `extend`
    donates what it is given, which would delete a kept state.)"""
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def _kv_leaves(rows: KVCache) -> tuple:
    return rows.k, rows.v, rows.k_scale, rows.v_scale  # each [B, K, S, ...] (scales: hd // 32)


def _with_kv(rows: KVCache, kv: tuple) -> KVCache:
    k, v, k_scale, v_scale = kv
    return rows.replace(k=k, v=v, k_scale=k_scale, v_scale=v_scale,
                        lengths=_own(rows.lengths), rings=_own(rows.rings))


@functools.partial(jax.jit, static_argnames=("n",))
def _trim(kv: tuple, *, n: int) -> tuple:
    return jax.tree.map(lambda a: a[:, :, :n], kv)


@functools.partial(jax.jit, static_argnames=("max_len",))
def _pad(kv: tuple, *, max_len: int) -> tuple:
    def pad(a):
        return jnp.pad(a, [(0, 0), (0, 0), (0, max_len - a.shape[2])] + [(0, 0)] * (a.ndim - 3))

    return jax.tree.map(pad, kv)


def snapshot_rows(rows: Any, tokens: int) -> Any:
    """A copy of the one-row cache `rows` holding `tokens` tokens, for keeping: a dense KV
    cache trimmed to its first `tokens` slots, any other cache whole."""
    if isinstance(rows, KVCache) and tokens < rows.max_len:
        return _with_kv(rows, _trim(_kv_leaves(rows), n=int(tokens)))
    return _own(rows)


def restore_rows(snapshot: Any, max_len: int) -> Any:
    """A fresh one-row cache (its own buffers: the engine's `extend` donates it) equal to
    the row `snapshot_rows` was given."""
    if isinstance(snapshot, KVCache) and snapshot.max_len < max_len:
        return _with_kv(snapshot, _pad(_kv_leaves(snapshot), max_len=int(max_len)))
    return _own(snapshot)


def tree_bytes(tree: Any) -> int:
    return int(sum(a.nbytes for a in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------- the cache

@dataclass
class _Entry:
    tokens: int
    rows: Any
    nbytes: int


class PrefixCache:
    """States at prefill-chunk boundaries, keyed by token-id hash chains, LRU within
    `capacity_bytes`. The engine calls `keys`, `lookup`, `store`; `clear` when the state's
    structure changes (a new GSM ring size)."""

    def __init__(self, capacity_bytes: int, block: int) -> None:
        self.capacity = check_capacity(capacity_bytes)
        self.block = int(block)
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.nbytes = 0
        self.queries = 0  # prompt tokens of the requests looked up
        self.hits = 0  # of those, tokens restored instead of prefilled
        self.evictions = 0
        self.stored = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self, prompt: np.ndarray, context: bytes) -> list[tuple[int, bytes]]:
        """(boundary, key) for every chunk boundary strictly inside `prompt`, in order;
        `context` is what besides the tokens decides the state (the engine's fingerprint)."""
        h = hashlib.sha256(b"gsm-jax prefix v1|%d|" % self.block + context).digest()
        out = []
        ids = np.ascontiguousarray(prompt, dtype=np.int32)
        for end in range(self.block, ids.size, self.block):
            h = hashlib.sha256(h + ids[end - self.block: end].tobytes()).digest()
            out.append((end, h))
        return out

    def lookup(self, keys: Sequence[tuple[int, bytes]], prompt_len: int) -> tuple[int, Any]:
        """The longest cached boundary among `keys`: (tokens, stored rows), or (0, None).
        Counts the query; a hit becomes the most recently used entry, with its ancestors."""
        self.queries += int(prompt_len)
        for i in range(len(keys) - 1, -1, -1):
            entry = self._entries.get(keys[i][1])
            if entry is not None:
                for _, k in keys[: i + 1]:
                    if k in self._entries:
                        self._entries.move_to_end(k)
                self.hits += entry.tokens
                return entry.tokens, entry.rows
        return 0, None

    def wants(self, key: bytes) -> bool:
        """True when `store` would keep something new under `key` (so the engine skips the
        copy for a boundary already cached, or when caching is off)."""
        return self.capacity > 0 and key not in self._entries

    def store(self, key: bytes, tokens: int, rows: Any) -> bool:
        """Keep `rows` (already a snapshot: `snapshot_rows`) as the state at `tokens`;
        evicts least recently used entries to fit. False if it is larger than the budget."""
        nbytes = tree_bytes(rows)
        if nbytes > self.capacity or key in self._entries:
            return False
        while self.nbytes + nbytes > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1
        self._entries[key] = _Entry(int(tokens), rows, nbytes)
        self.nbytes += nbytes
        self.stored += 1
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def stats(self) -> dict[str, Any]:
        return {"capacity_bytes": self.capacity, "block_tokens": self.block,
                "entries": len(self._entries), "bytes": self.nbytes,
                "queries_tokens": self.queries, "hits_tokens": self.hits,
                "hit_rate": self.hits / self.queries if self.queries else 0.0,
                "stored": self.stored, "evictions": self.evictions}
