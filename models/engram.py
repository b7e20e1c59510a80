"""DeepSeek-V4.1 Engram: token compression, n-gram hash and the gated residual update.

Source: the project's research note `deepseek_v41.md` §6 (which describes the official
`inference/engram.py` and NeMo AutoModel 0.7.0's port); the code here is our own.

Engram layers (released: 1 and 14) run before their block's attention mHC mix and update
all `hc_mult` residual streams from a memory table looked up by hashed n-grams of
*compressed* token ids:

1. `token_class_map(tokenizer.json)`: vocab id -> class (§6.1). Each id is decoded alone with
   the fast tokenizer backend and normalised (NFKC, NFD, strip accents, lowercase, whitespace
   runs -> one space, a lone space kept, strip); texts with U+FFFD are keyed by the raw token
   string; a text that normalises to "" is keyed by itself; classes are numbered by first
   appearance. The released tokenizer gives 99092 classes.
2. `engram_specs(text_config, token_map)`: per Engram layer the 4 (= max n-gram) odd int64
   multipliers (`numpy.random.default_rng(10007 * layer)`), the 24 (= (max_ngram - 1) * n_heads)
   consecutive primes from `engram_vocab_size` up (never reused across layers) and their
   running-sum offsets. The released constants are baked in `RELEASED_MULTIPLIERS` /
   `RELEASED_PRIMES` and checked whenever the config is the released one (numpy does not
   promise the same random stream across releases).
3. `hash_ids(compressed, spec, valid, history)`: row ids [B, T, n_ids]. At position p and
   shift k the token is the compressed id at p - k; once p - k is before the sequence start
   or a blocked (invalid: image / padding) token is met, that slot and every larger shift
   become the pad class. `P_k = t_k * M_k`, `R_n = P_0 ^ ... ^ P_{n-1}`, and the id of
   (n, head j) is `offset + R_n mod prime`. The products need 64 bits; `hash_ids` is pure
   32-bit JAX (jittable with x64 off): the products are built as 8 byte limbs and reduced
   mod the prime by Horner's rule on bytes, exact because every prime is < 2**24.
   `hash_ids_np` is the plain int64 numpy version (host side; the test oracle for the JAX one).
   For decode / chunked prefill, `history` [B, max_ngram - 1] carries each row's last
   compressed ids (-1 = blocked / before the start); `update_history` advances it, so a step
   computes the same ids as a full prefill. The ids depend only on the tokens, so a caller
   may also hash a whole prompt on the host and prefetch its rows.
4. `engram_update(h, rows_fp8, row_scales, ids, wkv, q_weight, k_weight, eps, valid)`: gather
   only the needed table rows (or take rows the caller already gathered), dequantize FP8 e4m3
   with one E8M0 scale per row per 32 columns, `kv = e @ wkv^T` split into a key per stream
   and one shared value, then per stream in fp32
   `dot = sum(h * q_weight * k_weight * key) * rsqrt(mean(h^2)+eps) * rsqrt(mean(key^2)+eps)
   / sqrt(D)`, `gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot))`,
   `h <- h + gate * value`; invalid tokens get gate 0.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.models.partitioning import batch_spec, model_axis_mesh

# ----------------------------------------------------------------------------- §6.1 token map

_LONE_SPACE = "\ue000"  # private-use sentinel that carries a lone space through Strip()


def _normaliser():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _LONE_SPACE),
        normalizers.Strip(),
        normalizers.Replace(_LONE_SPACE, " "),
    ])


def _load_tokenizer(tokenizer_json: str | os.PathLike):
    from tokenizers import Tokenizer

    if isinstance(tokenizer_json, str) and tokenizer_json.lstrip().startswith("{"):
        return Tokenizer.from_str(tokenizer_json)
    path = os.fspath(tokenizer_json)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(path)


def token_class_map(tokenizer_json: str | os.PathLike) -> np.ndarray:
    """Vocab id -> compressed class id, int32 [vocab] (§6.1).

    `tokenizer_json`: the text of a `tokenizer.json`, its path, or the directory holding it.
    The vocab size is the backend's, added tokens included (what `len(tokenizer)` gives)."""
    tok = _load_tokenizer(tokenizer_json)
    norm = _normaliser()
    n = tok.get_vocab_size(with_added_tokens=True)
    texts = tok.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
    classes: dict[str, int] = {}
    out = np.empty(n, np.int32)
    for i, text in enumerate(texts):
        if "\ufffd" in text:
            key = tok.id_to_token(i)
        else:
            key = norm.normalize_str(text) or text
        out[i] = classes.setdefault(key, len(classes))
    return out


# ----------------------------------------------------------------------------- §6.2 hash

# Released config (text_config of deepseek-ai/DeepSeek-V4.1-Flash), computed with numpy 2.4.6.
RELEASED_LAYER_IDS = (1, 14)
RELEASED_NUM_EMBEDDINGS = (384006168, 384016682)
RELEASED_MULTIPLIERS = {
    1: (76632096046245, 4839876093313, 35959672319349, 73987337458391),
    14: (67716810739261, 51510806800915, 30921347202721, 82619226485591),
}
RELEASED_PRIMES = {
    1: (16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
        16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
        16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463),
    14: (16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627,
         16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769,
         16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889),
}
_RELEASED_HASH_KEYS = dict(engram_max_ngram_size=4, engram_n_heads=8,
                           engram_vocab_size=16000000, engram_compressed_vocab_size=99092)


@dataclasses.dataclass(frozen=True)
class EngramSpec:
    """The hash constants of one Engram layer (all Python ints: hashable, usable as static).

    multipliers: max_ngram_size odd ints; primes / offsets: n_ids = (max_ngram_size - 1) *
    n_heads ints, ordered n = 2 heads 0.., n = 3 heads 0.., ...; pad_class: the compressed id
    of `engram_pad_token_id`; num_embeddings: the table's row count (>= sum(primes))."""

    layer_id: int
    max_ngram_size: int
    n_heads: int
    multipliers: tuple[int, ...]
    primes: tuple[int, ...]
    offsets: tuple[int, ...]
    pad_class: int
    num_embeddings: int

    @property
    def n_ids(self) -> int:
        return len(self.primes)

    @property
    def history_len(self) -> int:
        return self.max_ngram_size - 1


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def engram_specs(text_config: Any, token_map: np.ndarray | None = None
                 ) -> tuple[EngramSpec, ...]:
    """One `EngramSpec` per Engram layer, in `engram_layer_ids` order.

    `text_config`: the text config (a dict, e.g. a config.json's `text_config`, or an object
    with those attributes). `token_map` (from `token_class_map`) gives the pad class and is
    checked against `engram_compressed_vocab_size`; without it the pad class is taken as the
    pad token's own id (only right for an identity map)."""
    cfg = text_config.get("text_config", text_config) if isinstance(text_config, Mapping) \
        else text_config
    layers = tuple(int(i) for i in (_get(cfg, "engram_layer_ids") or ()))
    if not layers:
        return ()
    ngram = int(_get(cfg, "engram_max_ngram_size"))
    heads = int(_get(cfg, "engram_n_heads"))
    start = int(_get(cfg, "engram_vocab_size"))
    n_classes = int(_get(cfg, "engram_compressed_vocab_size"))
    pad_token = int(_get(cfg, "engram_pad_token_id", 2))
    rows = tuple(int(r) for r in (_get(cfg, "engram_num_embeddings") or ()))
    if ngram < 2 or heads < 1 or start < 2 or not 1 <= n_classes < 1 << 24:
        raise ValueError("Engram needs engram_max_ngram_size >= 2, engram_n_heads >= 1, "
                         "engram_vocab_size >= 2 and 1 <= compressed vocab < 2**24")
    if len(set(layers)) != len(layers) or (rows and len(rows) != len(layers)):
        raise ValueError("Engram needs distinct engram_layer_ids and one "
                         "engram_num_embeddings entry per layer")
    if token_map is not None:
        token_map = np.asarray(token_map)
        got = int(token_map.max()) + 1
        if got != n_classes:
            raise ValueError(f"token map has {got} classes, config engram_compressed_vocab_size "
                             f"is {n_classes}; the hash multipliers depend on it")
        pad_class = int(token_map[pad_token])
    else:
        pad_class = pad_token
    bound = max(1, (np.iinfo(np.int64).max // n_classes) // 2)
    specs, p = [], start - 1
    for li, layer in enumerate(layers):
        primes = []
        while len(primes) < (ngram - 1) * heads:
            p += 1
            if _is_prime(p):
                primes.append(p)
        offsets = tuple(int(x) for x in np.cumsum([0, *primes[:-1]]))
        draw = np.random.default_rng(10007 * layer).integers(0, bound, size=ngram,
                                                             dtype=np.int64)
        mults = tuple(int(u) * 2 + 1 for u in draw)
        n_rows = rows[li] if rows else sum(primes)
        if n_rows < sum(primes):
            raise ValueError(f"Engram layer {layer}: its {len(primes)} hash buckets need "
                             f"{sum(primes)} rows, engram_num_embeddings gives {n_rows}")
        if max(primes) >= 1 << 24 or n_rows >= 1 << 31:
            raise ValueError("Engram primes must be < 2**24 and tables < 2**31 rows "
                             "(32-bit hash arithmetic)")
        specs.append(EngramSpec(layer, ngram, heads, mults, tuple(primes), offsets,
                                pad_class, n_rows))
    released = layers == RELEASED_LAYER_IDS and all(
        _get(cfg, k) == v for k, v in _RELEASED_HASH_KEYS.items())
    for s in specs if released else ():  # the draws must equal the baked constants
        if (s.multipliers, s.primes) != (RELEASED_MULTIPLIERS[s.layer_id],
                                         RELEASED_PRIMES[s.layer_id]):
            raise RuntimeError(f"Engram layer {s.layer_id}: numpy {np.__version__} drew "
                               "multipliers or primes different from the released constants")
    return tuple(specs)


def _shifted(compressed: Any, valid: Any, history: Any, spec: EngramSpec, xp,
             pad_class: Any = None) -> Any:
    """[B, T, max_ngram] tokens t_k (pad class where blocked) for every position."""
    pad = spec.pad_class if pad_class is None else pad_class
    c = xp.asarray(compressed)
    b, t = c.shape
    k1 = spec.history_len
    c = c.astype(xp.int32)
    if valid is not None:
        c = xp.where(xp.asarray(valid), c, -1)
    if history is None:
        history = xp.full((b, k1), -1, xp.int32)
    ext = xp.concatenate([xp.asarray(history).astype(xp.int32), c], axis=1)  # [B, k1 + T]
    blocked = xp.zeros((b, t), bool)
    toks = []
    for k in range(spec.max_ngram_size):
        src = ext[:, k1 - k: k1 - k + t]
        blocked = blocked | (src < 0)
        toks.append(xp.where(blocked, pad, src))
    return xp.stack(toks, axis=-1)


def hash_ids_np(compressed: np.ndarray, spec: EngramSpec, valid: np.ndarray | None = None,
                history: np.ndarray | None = None) -> np.ndarray:
    """Host (numpy int64) version of `hash_ids`; returns int64 [B, T, n_ids]."""
    toks = _shifted(compressed, valid, history, spec, np).astype(np.int64)
    prods = toks * np.asarray(spec.multipliers, np.int64)  # [B, T, K]; cannot overflow
    primes = np.asarray(spec.primes, np.int64).reshape(spec.max_ngram_size - 1, spec.n_heads)
    offsets = np.asarray(spec.offsets, np.int64).reshape(primes.shape)
    rolling, out = prods[..., 0], []
    for n in range(1, spec.max_ngram_size):
        rolling = rolling ^ prods[..., n]
        out.append(rolling[..., None] % primes[n - 1] + offsets[n - 1])
    return np.concatenate(out, axis=-1)


def _bytes_le(x: int, n: int = 8) -> tuple[int, ...]:
    return tuple((x >> (8 * i)) & 0xFF for i in range(n))


def hash_ids(compressed: jax.Array, spec: EngramSpec, valid: jax.Array | None = None,
             history: jax.Array | None = None, pad_class: Any = None) -> jax.Array:
    """Engram row ids int32 [B, T, n_ids] (offsets included) of one layer; jittable, 32-bit.

    compressed: int [B, T] class ids (`token_class_map[token_ids]`); valid: bool [B, T] or
    None (False = image / padding: blocks all lookback through it); history: int [B,
    max_ngram - 1] or None, the row's previous compressed ids, oldest first, -1 = blocked or
    before the start (None = the sequence starts here). `spec` is static. pad_class: the
    pad token's class when it is only known at run time (a traced int32 scalar: the model
    reads it from its token map); None = spec.pad_class."""
    toks = _shifted(compressed, valid, history, spec, jnp, pad_class).astype(jnp.uint32)
    # P_k = t_k * M_k as 8 little-endian byte limbs (t < 2**24 so t * byte + carry < 2**32)
    prods = []
    for k, m in enumerate(spec.multipliers):
        t, carry, limbs = toks[..., k], jnp.zeros_like(toks[..., k]), []
        for mb in _bytes_le(m):
            acc = t * jnp.uint32(mb) + carry
            limbs.append(acc & 0xFF)
            carry = acc >> 8
        prods.append(jnp.stack(limbs, axis=-1))  # [B, T, 8]
    primes = jnp.asarray(np.asarray(spec.primes, np.uint32).reshape(spec.max_ngram_size - 1,
                                                                   spec.n_heads))
    offsets = np.asarray(spec.offsets, np.int64).reshape(primes.shape)
    rolling, out = prods[0], []
    for n in range(1, spec.max_ngram_size):
        rolling = rolling ^ prods[n]
        r = jnp.zeros((*rolling.shape[:-1], spec.n_heads), jnp.uint32)
        for i in range(7, -1, -1):  # Horner on bytes: r < p < 2**24, r * 256 + 255 < 2**32
            r = (r * jnp.uint32(256) + rolling[..., i, None]) % primes[n - 1]
        out.append(r.astype(jnp.int32) + jnp.asarray(offsets[n - 1], jnp.int32))
    return jnp.concatenate(out, axis=-1)


def update_history(history: Any, compressed: Any, spec: EngramSpec, valid: Any = None,
                   lengths: Any = None, xp=jnp) -> Any:
    """The per-row n-gram history after appending `compressed` [B, T] (the first `lengths`
    [B] tokens of each row; all T when None). history None = a fresh row. Returns int32
    [B, max_ngram - 1] (-1 = blocked / before the start). xp: jnp (jittable) or np."""
    c = xp.asarray(compressed).astype(xp.int32)
    b, t = c.shape
    k1 = spec.history_len
    if valid is not None:
        c = xp.where(xp.asarray(valid), c, -1)
    if history is None:
        history = xp.full((b, k1), -1, xp.int32)
    ext = xp.concatenate([xp.asarray(history).astype(xp.int32), c], axis=1)
    n = xp.full((b,), t, xp.int32) if lengths is None else xp.asarray(lengths).astype(xp.int32)
    idx = n[:, None] + xp.arange(k1, dtype=xp.int32)[None, :]  # ext positions n .. n+k1-1
    return xp.take_along_axis(ext, idx, axis=1)


# ----------------------------------------------------------------------------- §6.3 update

def dequantize_rows(rows_fp8: jax.Array, row_scales: jax.Array) -> jax.Array:
    """FP8 e4m3 rows [..., d] with E8M0 scales [..., d/32] (uint8 bytes or float) -> f32."""
    if row_scales.dtype == jnp.uint8:
        s = jax.lax.bitcast_convert_type(row_scales, jnp.float8_e8m0fnu).astype(jnp.float32)
    else:
        s = row_scales.astype(jnp.float32)
    d = rows_fp8.shape[-1]
    block = d // s.shape[-1]
    return rows_fp8.astype(jnp.float32) * jnp.repeat(s, block, axis=-1)


# ----------------------------------------------------------------------------- placement
#
# Where the tables live on 8 x H200 (released: two tables of ~384 M rows x 256 FP8 + one
# E8M0 byte per 32, 101.4 GB each, 203 GB together; a token reads 24 rows x 264 B = 6.3 KB
# per Engram layer; D = 5120, n_ids x d = 6144). Per token and Engram layer, M devices:
#
# - row-sharded in device memory (the default): each device holds rows/M of each table
#   (25.3 GB of 141 GB), gathers the rows it owns (zeros for the others), dequantizes them
#   and the partial [n_ids x d] embeddings are summed over "model" (`gather_rows`):
#       HBM read:   24 x 264 B = 6.3 KB, spread over the owners
#       all-reduce: 2 x 6144 x 2 x (M - 1) / M  = 21.5 KB at M = 8 (bf16: FP8 rows
#                   times their power-of-two scales are exact in it; XLA:CPU promotes
#                   a bf16 all-reduce to f32, so 43 KB there)   -> `gather_bytes`
#   The sum is exact (one device contributes each row; the others add zeros). At batch 32
#   that is ~0.7 MB per Engram layer and step over NVLink (~1.5 us at 450 GB/s), against
#   ~13 GB of weights read per step (~3 ms at 4.8 TB/s): below the noise.
# - row-sharded in host memory (`load(..., engram_memory="host")`, JAX's "pinned_host"
#   memory kind): the same split, but each device's rows/M stay in pinned host RAM (203 GB
#   per 8-GPU node, 0 B of HBM). The gather runs on the host (`compute_on("device_host")`);
#   each device copies the 24 gathered FP8 rows + scales to itself, 24 x 264 B = 6.3 KB
#   per token over PCIe (~0.13 us at 50 GB/s; `host_copy_bytes`), dequantizes and masks
#   them there, then the same all-reduce. The bytes are small; the cost is latency: the
#   ids are known only when the step's tokens are, so every decode step waits on a
#   device -> host copy of the ids, a host gather and a host -> device copy (~10-30 us
#   on a GPU, per Engram layer). It frees 25.3 GB per device, which matters only when the
#   KV cache needs it: 890 B/token (released formats) leaves room for ~60 M cached tokens
#   beside the row-sharded tables.
# So the cost model favours device memory on 8 x H200 (no extra latency on the step's
# critical path); host memory is the option for a memory-bound deployment. Both run the
# same jitted programs: `gather_rows` dispatches on the table's memory space, as
# `linear()` dispatches on the weight type. XLA:CPU has a pinned-host memory space too
# (the same RAM), so CI runs the host path; benchmarks/bench_mesh.py puts both side by
# side.
#
# A table whose rows the model axis does not divide is padded with zero rows when it is
# placed (`gsm_jax.sharding`, the "engram_rows" axis): hash ids never reach them.


def gather_bytes(tokens: int, n_ids: int, d: int, devices: int, itemsize: int = 2) -> float:
    """Bytes each device sends per Engram layer for `tokens` tokens (the model above): the
    ring all-reduce of the [tokens, n_ids x d] partial rows (bf16 for FP8 tables),
    2 S (M - 1) / M."""
    return 2 * tokens * n_ids * d * itemsize * (devices - 1) / devices if devices > 1 else 0.0


def host_copy_bytes(tokens: int, n_ids: int, d: int, itemsize: int = 1,
                    scale_itemsize: int = 1, scale_block: int = 32) -> int:
    """Bytes each device copies from host memory per Engram layer for `tokens` tokens when
    the tables live there: the gathered rows as stored (FP8: 1 byte per value) and their
    scales (E8M0: one byte per `scale_block` values; a float table's are float32)."""
    return tokens * n_ids * (d * itemsize + -(-d // scale_block) * scale_itemsize)


def in_host_memory(x: Any) -> bool:
    """Is `x` (an array, or a tracer inside jit / shard_map) in host memory?"""
    space = getattr(jax.typeof(x), "memory_space", None)
    return space is not None and space == jax.memory.Space.Host


def _take_rows(table: jax.Array, scale: jax.Array, at: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """table[at], scale[at]: on the device, or, for tables in host memory, gathered on the
    host and only the rows copied to the device (`at` holds valid row indices)."""
    if not in_host_memory(table):
        return jnp.take(table, at, axis=0), jnp.take(scale, at, axis=0)
    from jax.experimental.compute_on import compute_on

    host, device = jax.memory.Space.Host, jax.memory.Space.Device
    with compute_on("device_host"):
        at_host = jax.device_put(at, host)
        # indices are in range by construction ("promise": no clamp, whose constants would
        # live in device memory)
        rows = table.at[at_host].get(mode="promise_in_bounds")
        scales = scale.at[at_host].get(mode="promise_in_bounds")
    return jax.device_put(rows, device), jax.device_put(scales, device)


def gather_rows(rows_fp8: jax.Array, row_scales: jax.Array, ids: jax.Array,
                dtype: Any = jnp.bfloat16) -> jax.Array:
    """The table rows of `ids` [B, T, n_ids], dequantized: [B, T, n_ids, d] in `dtype`.
    Under a mesh whose "model" axis splits the rows (see above), each device gathers the
    rows it holds and the partial results are summed (`shard_map` + `psum`); otherwise a
    plain gather (one device, or a table kept whole). Tables in host memory are gathered
    there (`_take_rows`)."""
    mesh = model_axis_mesh(rows_fp8.shape[0])
    if mesh is None:
        return dequantize_rows(*_take_rows(rows_fp8, row_scales, ids)).astype(dtype)
    from jax.sharding import PartitionSpec as P

    rows_spec = batch_spec(mesh, ids.shape[0])

    # FP8 rows times a power of two are exact in bf16: sum them in bf16 (half the bytes
    # of f32) whatever `dtype` is; a float table (tests) is summed in `dtype`
    wire = jnp.bfloat16 if rows_fp8.dtype == jnp.float8_e4m3fn else dtype

    def local(table, scale, ids):
        n_local = table.shape[0]
        first = jax.lax.axis_index("model") * n_local
        mine = (ids >= first) & (ids < first + n_local)
        at = jnp.where(mine, ids - first, 0)
        e = dequantize_rows(*_take_rows(table, scale, at))
        return jax.lax.psum(jnp.where(mine[..., None], e, 0.0).astype(wire), "model")

    return jax.shard_map(local, mesh=mesh, in_specs=(P("model", None), P("model", None),
                                                     rows_spec),
                         out_specs=rows_spec, check_vma=False)(
        rows_fp8, row_scales, ids).astype(dtype)


def engram_update(h: jax.Array, rows_fp8: jax.Array, row_scales: jax.Array,
                  ids: jax.Array | None, wkv: jax.Array | Callable[[jax.Array], jax.Array],
                  q_weight: jax.Array, k_weight: jax.Array, eps: float = 1e-20,
                  valid: jax.Array | None = None, embed_dtype: Any = jnp.bfloat16
                  ) -> jax.Array:
    """One Engram layer's residual update of all streams; returns h's shape and dtype.

    h: [B, T, N, D] streams. rows_fp8 / row_scales: the whole table [rows, d] / [rows, d/32]
    with ids int [B, T, n_ids] (only those rows are gathered), or, with ids=None, rows the
    caller already gathered, [B, T, n_ids, d] / [B, T, n_ids, d/32]. wkv: [(N + 1) * D,
    n_ids * d] (dequantized) or a callable e [B, T, n_ids * d] -> kv [B, T, (N + 1) * D].
    q_weight, k_weight: [N, D]. valid: bool [B, T] or None (False: gate 0, h unchanged).
    embed_dtype: the dtype the dequantized rows are cast to before wkv (bf16 as the
    reference; exact for e4m3 x 2**k); pass float32 for fp32 parity runs."""
    b, t, n, d = h.shape
    if ids is not None:
        e = gather_rows(rows_fp8, row_scales, ids, embed_dtype).reshape(b, t, -1)
    else:
        e = dequantize_rows(rows_fp8, row_scales).astype(embed_dtype).reshape(b, t, -1)
    if callable(wkv):
        kv = wkv(e)
    else:
        kv = jnp.einsum("bti,oi->bto", e, wkv.astype(embed_dtype),
                        preferred_element_type=jnp.float32)
    kv = kv.astype(jnp.float32)
    key = kv[..., : n * d].reshape(b, t, n, d)
    value = kv[..., n * d:]
    hf = h.astype(jnp.float32)
    w = q_weight.astype(jnp.float32) * k_weight.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(hf * hf, -1) + eps) * jax.lax.rsqrt(
        jnp.mean(key * key, -1) + eps)
    dot = jnp.sum(hf * w * key, -1) * rstd * (d ** -0.5)
    gate = jax.nn.sigmoid(jnp.copysign(jnp.sqrt(jnp.maximum(jnp.abs(dot), 1e-6)), dot))
    if valid is not None:
        gate = jnp.where(jnp.asarray(valid)[..., None], gate, 0.0)
    return (hf + gate[..., None] * value[:, :, None, :]).astype(h.dtype)
