"""Automatic prefix caching for the serving engine (vLLM's APC, JetStream's prefix cache).

A long prompt is prefilled in chunks of `prefill_chunk` tokens, in place in its slot of
the running cache (the family's `extend`; `serving/engine.py`). With prefix caching on,
the engine keeps what each chunk added, keyed by a hash chain of the token ids up to its
end: key_k = sha256(key_{k-1} + the k-th chunk's ids), key_0 = a hash of
what else decides that state (below). A later request whose prompt starts with the same
k chunks restores the state at boundary k x chunk and prefills only the rest, one chunk
per engine step as before.

**Exact, not approximately equal.** A hit runs the very calls a cold prefill runs after
that boundary (same chunk shapes), from a bit-identical state, so its
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

**Memory**: a dense family's KV cache (`models.common.KVCache`) is kept as blocks, as
vLLM's paged blocks: the entry of boundary k holds the chunk's own slots [(k-1) C, k C)
and the GSM rings at k C, and a hit restores the blocks 1..k in order (one compiled
`restore` program, whatever k: `serving/programs.py`), so a prompt's states cost one
row's worth of slots however many boundaries it has; a hit needs every block from the
first (`lookup_chain`). Slots past the restored length hold whatever the slot held
before: attention never reads them (`cache_attention` masks past each row's length, to
exactly zero weight). Other families' rows are kept whole at each boundary (their
caches have their own, smaller sizes). Entries are evicted least recently used first to
stay within `capacity_bytes`; one larger than that is not stored. `stats()` counts
queried and hit prompt tokens (vLLM's `prefix_cache_queries` / `prefix_cache_hits`), entries, bytes
and evictions.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from gsm_jax.errors import InvalidInputError
from gsm_jax.models.common import KVCache

__all__ = ["PrefixCache", "check_capacity"]


def check_capacity(value: Any, name: str = "prefix_cache_bytes") -> int:
    """A byte budget >= 0 (0: off); anything else is refused by `name`."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise InvalidInputError(f"{name} must be an integer >= 0 (bytes; 0 = off), "
                                f"got {value!r}")
    return int(value)


def tree_bytes(tree: Any) -> int:
    return int(sum(a.nbytes for a in jax.tree.leaves(tree)))


# ----------------------------------------------------------------------------- the cache

@dataclass
class _Entry:
    tokens: int  # the boundary: the state after this many prompt tokens
    start: int  # where the kept block starts (tokens - block for a KV block)
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

    def lookup_chain(self, keys: Sequence[tuple[int, bytes]],
                     prompt_len: int) -> list[tuple[int, Any]]:
        """The kept blocks of the longest run of boundaries cached from the first one:
        [(start, kept)] in order (empty: a miss). Counts the query; the blocks become the
        most recently used entries."""
        self.queries += int(prompt_len)
        chain = []
        for _, k in keys:
            entry = self._entries.get(k)
            if entry is None:
                break
            chain.append((k, entry))
        if not chain:
            return []
        for k, _ in chain:
            self._entries.move_to_end(k)
        if not isinstance(chain[-1][1].rows, KVCache):
            chain = chain[-1:]  # a whole row: the last one alone is the state
        self.hits += chain[-1][1].tokens
        return [(e.start, e.rows) for _, e in chain]

    def wants(self, key: bytes) -> bool:
        """True when `store` would keep something new under `key` (so the engine skips the
        copy for a boundary already cached, or when caching is off)."""
        return self.capacity > 0 and key not in self._entries

    def store(self, key: bytes, tokens: int, rows: Any, *, start: int = 0) -> bool:
        """Keep `rows` (the engine's snapshot: a KV block from `start`, or a whole row) as
        the state at `tokens`; evicts least recently used entries to fit. False if it is
        larger than the budget."""
        nbytes = tree_bytes(rows)
        if nbytes > self.capacity or key in self._entries:
            return False
        while self.nbytes + nbytes > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1
        self._entries[key] = _Entry(int(tokens), int(start), rows, nbytes)
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
