"""TEST HELPER (not part of the gsm-jax library): the DeepSeek-V4.1 CPU reference harness.

The independent reference for V4.1 parity tests is NVIDIA NeMo AutoModel 0.7.0's PyTorch port
(`nemo_automodel.components.models.deepseek_v41`), run on CPU in fp32 with the torch backends
(research note `deepseek_v41.md` §11). `scripts/env.sh` installs it (`--no-deps`) plus pillow.
This module only *drives* NeMo: it builds a tiny tokenizer and config, constructs and seeds the
model, and reads logits, Engram hash ids and the released-name state dict back as numpy.

Provides
- `tiny_tokenizer() -> PreTrainedTokenizerFast` and `tiny_tokenizer_json() -> str`: a 128-id
  WordLevel tokenizer whose case/accent/whitespace variants make the Engram normaliser merge ids
  (`TINY_ENGRAM_CLASSES` classes), with U+FFFD tokens and an all-accent token as edge cases.
- `tiny_config(**overrides) -> dict`: a nested HF-style `deepseek_v41` config dict with every
  layer role (SWA-only 0-1; Full ratio 2 at 2; Reuse ratio 2 at 3-4; Full ratio 1 + candidate
  source at 5; Reuse ratio 1 at 6; Reindex at 7) and Engram on layers 1 and 5. Overrides are
  text-config keys (`num_hidden_layers=4`, ...); `vision_config=`/`text_config=` dicts merge.
- `nemo_model(config_dict, tokenizer=None, seed=0)`: NeMo's `DeepseekV41ForCausalLM` on CPU,
  fp32, `initialize_weights`, then non-identity sinks / router biases / norms / Engram q,k weights.
  Cached per (config, seed) for the pytest session; treat the result as read-only.
- `saved_config(model) -> dict`: the config.json NeMo's `save_pretrained` writes for `model` (what
  parity tests load on our side).
- `nemo_logits(model, ids, attention_mask=None, *, cache_qdq=True) -> np.ndarray[B, T, V]`
  (fp32); `cache_qdq=False` makes NeMo's cache quantize/dequantize the identity.
- `stable_topk()`: a context making NeMo's top-k deterministic (ties to the lower index, as JAX),
  yielding a count of the ties met.
- `nemo_streams(model, ids, attention_mask=None) -> list[np.ndarray[B, T, hc_mult, D]]`: the
  residual streams entering each decoder block.
- `nemo_engram_hash(model, ids, attention_mask=None) -> np.ndarray[B, T, n_engram_layers, n_ids]`.
- `nemo_engram_layer(model, layer_id)`: the layer's `DeepseekV41Engram` module (for unit parity).
- `released_state_dict(model) -> dict[str, np.ndarray]`: float tensors under the released
  checkpoint names (§9.2), via NeMo's `state_dict_adapter.to_hf` (unquantised, fp32).
- `nemo_from_checkpoint(model, path)`: a copy of `model` whose weights are those of the
  released-layout checkpoint at `path` (FP8 / FP4 / Engram FP8 as written), decoded and loaded
  by NeMo's own `state_dict_adapter.from_hf` (0 missing, 0 unexpected keys). Cached per
  (model, path) for the pytest session; treat the result as read-only.
- DSpark: `dspark_config(**overrides)` (tiny_config with 3 stages targeting layers 5-7),
  `nemo_dspark(model, seed)` (NeMo's `DeepseekV41DSparkModel`), `dspark_state_dict(draft)`
  (released `mtp.*` names), `nemo_dspark_from_checkpoint(draft, path)`,
  `nemo_dspark_features(model, ids)` (the target features) and
  `nemo_draft_logits(draft, features, ids, anchor, previous)`.
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np

# ------------------------------------------------------------------------------------------------
# tokenizer

_SPECIALS = ["<s>", "</s>", "<pad>"]  # ids 0 (bos), 1 (eos), 2 (pad = engram_pad_token_id)
_BASE_WORDS = [
    "cafe", "hello", "world", "naive", "resume", "zebra", "apple", "river", "stone", "cloud",
    "light", "green", "music", "table", "chair", "glass", "paper", "water", "fire", "earth",
]


def _tiny_vocab() -> list[str]:
    accent = {"a": "\u00e1", "e": "\u00e9", "i": "\u00ef", "o": "\u00f6", "u": "\u00fc"}
    toks: list[str] = list(_SPECIALS)
    for w in _BASE_WORDS:  # 4 variants each: lower, Title, UPPER, accented -> one class
        acc = "".join(accent.get(c, c) for c in w)
        toks += [w, w.capitalize(), w.upper(), acc]
    # whitespace-only and odd tokens (WordLevel vocab entries can be any string)
    toks += [" ", "  ", "\t", "\n\n", "\u3000"]  # all normalise to the kept lone space
    toks += ["\ufffd", "x\ufffd", "\ufffdy"]  # keyed by the raw token string
    toks += ["\u0301", "\u0301\u0308"]  # accent-only: normalises to "", keyed by decoded text
    toks += ["\uff21\uff22", "ab", "AB", "\ufb01", "fi"]  # NFKC folds fullwidth / ligature
    toks += [" pad ", "pad", "x y", "x  y", "X\tY"]  # inner-whitespace runs collapse
    i = 0
    while len(toks) < 128:
        toks.append(f"w{i}")
        i += 1
        if len(toks) < 128 and i % 3 == 0:
            toks.append(f"W{i - 1}")
    assert len(toks) == 128 and len(set(toks)) == 128
    return toks


@functools.lru_cache(maxsize=1)
def tiny_tokenizer_json() -> str:
    """The tokenizer.json text of the tiny WordLevel tokenizer (what a checkpoint ships)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(_tiny_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(_SPECIALS))
    return tok.to_str()


@functools.lru_cache(maxsize=1)
def tiny_tokenizer():
    """A `PreTrainedTokenizerFast` over `tiny_tokenizer_json()` (bos 0, eos 1, pad 2)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tiny_tokenizer_json()),
        bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<pad>",
    )


# Class count of the tiny tokenizer under the Engram normaliser (NeMo checks it at construction).
TINY_ENGRAM_CLASSES = 52

# ------------------------------------------------------------------------------------------------
# config


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


def _engram_rows(n_layers: int, ngram: int, heads: int, start: int) -> list[int]:
    """Rows per Engram layer: the sum of its (ngram-1)*heads consecutive primes >= start."""
    out, p = [], start - 1
    for _ in range(n_layers):
        s = 0
        for _ in range((ngram - 1) * heads):
            p += 1
            while not _is_prime(p):
                p += 1
            s += p
        out.append(s)
    return out


def tiny_config(**overrides) -> dict:
    """Nested HF-style V4.1 config dict (`model_type: deepseek_v41`), tiny and deterministic."""
    text = dict(
        model_type="deepseek_v41_text",
        vocab_size=128, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16,
        q_lora_rank=32, o_groups=2, o_lora_rank=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
        scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
        routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-20,
        sliding_window=8, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": 65536},
        max_position_embeddings=1048576,
        compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1],
        kv_source_layer_ids=[2, 5], index_source_layer_ids=[2, 5, 7],
        index_n_heads=4, index_head_dim=32, index_topk=4,
        candidate_source_layer_id=5, candidate_topk_blocks=2, candidate_block_size=4,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        engram_layer_ids=[1, 5], engram_max_ngram_size=4, engram_n_heads=2,
        engram_head_dim=32, engram_vocab_size=50, engram_pad_token_id=2,
        engram_compressed_vocab_size=TINY_ENGRAM_CLASSES,
        num_nextn_predict_layers=0, dspark_noise_token_id=127,
        initializer_range=0.02, dtype="float32", tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2,
    )
    vision = {"num_hidden_layers": 0}
    for key in ("text_config", "vision_config"):
        if key in overrides:
            (text if key == "text_config" else vision).update(overrides.pop(key))
    text.update(overrides)
    if "engram_num_embeddings" not in text:
        text["engram_num_embeddings"] = _engram_rows(
            len(text["engram_layer_ids"]), text["engram_max_ngram_size"],
            text["engram_n_heads"], text["engram_vocab_size"])
    return {
        "model_type": "deepseek_v41",
        "architectures": ["DeepseekV41ForCausalLM"],
        "text_config": text,
        "vision_config": vision,
        "tie_word_embeddings": False,
    }


# ------------------------------------------------------------------------------------------------
# NeMo model


def _cpu_backend():
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope="torch",
                         experts="torch", dispatcher="torch", gate_precision="float32")


def _randomise(model, seed: int) -> None:
    """Move every identity/zero-initialised parameter off its init value, deterministically."""
    import torch

    g = torch.Generator().manual_seed(10_000 + seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point():
                continue
            leaf = name.rsplit(".", 1)[-1]
            if "norm" in name and leaf == "weight":
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "sink" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(("_hc.base", "_hc.scale")):
                init = 1.0 if leaf == "scale" else 0.0
                p.copy_(init + 0.2 * torch.randn(p.shape, generator=g))
            elif ".gate." in name and ("bias" in leaf):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(("engram.q_weight", "engram.k_weight")):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if b.is_floating_point() and ".gate." in name and "bias" in name:
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def _freeze(obj):
    return json.dumps(obj, sort_keys=True)


@functools.lru_cache(maxsize=8)
def _nemo_model_cached(config_json: str, tokenizer_key: int, seed: int):
    import torch
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    cfg = json.loads(config_json)
    tokenizer = _TOKENIZERS[tokenizer_key]
    text = {k: v for k, v in cfg["text_config"].items() if k != "model_type"}
    vision = dict(cfg.get("vision_config") or {"num_hidden_layers": 0})
    vision.pop("model_type", None)
    config = DeepseekV41Config(text_config=text, vision_config=vision)
    torch.manual_seed(seed)
    with torch.no_grad():
        model = DeepseekV41ForCausalLM(config, backend=_cpu_backend(), tokenizer=tokenizer)
        model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
        model = model.float()
        _randomise(model, seed)
    model.eval()
    return model


_TOKENIZERS: dict[int, object] = {}


def nemo_model(config_dict: dict | None = None, tokenizer=None, seed: int = 0):
    """NeMo's V4.1 causal LM on CPU, fp32, seeded (cached per (config, tokenizer, seed))."""
    config_dict = tiny_config() if config_dict is None else config_dict
    tokenizer = tiny_tokenizer() if tokenizer is None else tokenizer
    _TOKENIZERS[id(tokenizer)] = tokenizer
    return _nemo_model_cached(_freeze(config_dict), id(tokenizer), int(seed))


def saved_config(model) -> dict:
    """The config.json NeMo's own serializer writes for `model` (`save_pretrained`:
    transformers 5 underneath, so rotary settings go under `rope_parameters`, with every
    PretrainedConfig key). Parity tests load this, never the dict `tiny_config` built."""
    from reference_config import saved_config as saved

    return saved(model.config)


def _ids_tensor(ids):
    import torch

    return torch.as_tensor(np.asarray(ids, dtype=np.int64))


def nemo_logits(model, ids, attention_mask=None, *, cache_qdq: bool = True) -> np.ndarray:
    """Full-sequence logits [B, T, V] (fp32). Right padding only (NeMo's contract).
    `cache_qdq=False` runs NeMo with its cache quantize/dequantize boundaries (window KV FP8,
    compressed KV NVFP4, index keys and queries MXFP4) as the identity, the counterpart of our
    `cache_qdq=False`: the comparison then does not hinge on which side of a rounding midpoint
    a value that differs in its last ulp falls."""
    import torch

    with torch.no_grad(), _cache_qdq(cache_qdq):
        mask = None if attention_mask is None else _ids_tensor(attention_mask)
        out = model(_ids_tensor(ids), attention_mask=mask)
    return out.logits.float().numpy()


def _cache_qdq(on: bool):
    """A context in which NeMo's `quantize_cache` is itself (on) or the identity (off)."""
    import contextlib
    from unittest import mock

    from nemo_automodel.components.models.deepseek_v41 import attention, dspark

    if on:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for mod in (attention, dspark):
        stack.enter_context(mock.patch.object(mod, "quantize_cache",
                                              lambda values, **_: values))
    return stack


class TopkTies:
    """What `stable_topk` saw: calls, and rows whose k-th and (k+1)-th finite values tie
    (where an unstable top-k may pick either)."""

    def __init__(self) -> None:
        self.calls = 0
        self.boundary_ties = 0


def stable_topk():
    """A context in which `torch.Tensor.topk` is a stable descending (or ascending) sort cut
    to k: equal values keep their index order, so ties go to the lower index, as
    `jax.lax.top_k` breaks them (torch's own order of ties is implementation-defined).
    Covers NeMo's indexer top-k and its candidate-block top-k (the method form); the MoE
    gate's `torch.topk(...)` calls are not patched (router scores do not tie). Yields a
    `TopkTies` that counts the boundary ties met, so a test can show its inputs have some."""
    import contextlib
    from collections import namedtuple

    import torch

    result = namedtuple("topk", ["values", "indices"])
    original = torch.Tensor.topk
    ties = TopkTies()

    def topk(self, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (torch's name)
        values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
        ties.calls += 1
        if k < self.shape[dim]:
            kth, nxt = values.narrow(dim, k - 1, 1), values.narrow(dim, k, 1)
            ties.boundary_ties += int(((kth == nxt) & torch.isfinite(kth)).sum())
        return result(values.narrow(dim, 0, k), indices.narrow(dim, 0, k))

    @contextlib.contextmanager
    def ctx():
        torch.Tensor.topk = topk
        try:
            yield ties
        finally:
            torch.Tensor.topk = original

    return ctx()


def nemo_streams(model, ids, attention_mask=None) -> list[np.ndarray]:
    """The mHC residual streams entering each decoder block, [B, T, hc_mult, D] per layer
    (fp32), for layer-by-layer debugging."""
    import torch

    with torch.no_grad():
        mask = None if attention_mask is None else _ids_tensor(attention_mask)
        out = model(_ids_tensor(ids), attention_mask=mask, output_hidden_states=True)
    return [h.float().numpy() for h in out.hidden_states]


def nemo_engram_hash(model, ids, attention_mask=None) -> np.ndarray:
    """Engram row ids [B, T, n_engram_layers, (max_ngram-1)*n_heads] (int64, with offsets)."""
    import torch

    mask = None if attention_mask is None else _ids_tensor(attention_mask).bool()
    with torch.no_grad():
        return model.model.engram_hash(_ids_tensor(ids), token_mask=mask).numpy()


def nemo_engram_layer(model, layer_id: int):
    """The `DeepseekV41Engram` module of decoder layer `layer_id`."""
    return model.model.layers[str(layer_id)].engram


def released_state_dict(model) -> dict[str, np.ndarray]:
    """Float tensors under the released checkpoint names (§9.2), fp32 numpy (unquantised)."""
    import torch

    with torch.no_grad():
        hf = model.state_dict_adapter.to_hf(model.state_dict())
        return {k: v.detach().float().numpy().copy() for k, v in hf.items()
                if torch.is_tensor(v) and v.is_floating_point()}


_FROM_CHECKPOINT: dict[tuple[int, str], object] = {}


def nemo_from_checkpoint(model, path):
    """A copy of `model` loaded from the released-layout checkpoint at `path` by NeMo's own
    adapter (it dequantizes FP8 32x32, FP4 experts and the Engram tables itself). The
    DSpark (`mtp.*`) and vision tensors are left out (NeMo's text model has neither)."""
    import copy
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    path = Path(path)
    key = (id(model), str(path.resolve()))
    if key in _FROM_CHECKPOINT:
        return _FROM_CHECKPOINT[key][1]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    hf = {}
    for shard in sorted(set(index["weight_map"].values())):
        hf.update(load_file(path / shard))
    hf = {k: v for k, v in hf.items()
          if not k.startswith(("mtp.", "vision.", "aligner.", "image_"))}
    target = copy.deepcopy(model)
    with torch.no_grad():
        native = target.state_dict_adapter.from_hf(hf)
        result = target.load_state_dict(native, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"NeMo from_hf of {path}: missing {result.missing_keys}, "
                           f"unexpected {result.unexpected_keys}")
    target.eval()
    _FROM_CHECKPOINT[key] = (model, target)  # the model kept alive: its id stays unique
    return target


# ------------------------------------------------------------------------------------------------
# DSpark (the `mtp.*` draft, research note §7; NeMo's dspark.py)


def dspark_config(**overrides) -> dict:
    """`tiny_config` with 3 DSpark stages: target layers 5, 6, 7 (the last three, as V4.1-Flash's
    37-39 of 40), 4 experts top 2, Markov rank 8, block 5, noise token 127."""
    base = dict(num_nextn_predict_layers=3, compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0],
                dspark_target_layer_ids=[5, 6, 7], dspark_markov_rank=8,
                dspark_n_routed_experts=4, dspark_num_experts_per_tok=2, dspark_block_size=5)
    base.update(overrides)
    return tiny_config(**base)


def nemo_dspark(model, seed: int = 0):
    """NeMo's `DeepseekV41DSparkModel` for the target `model` (its text config), fp32 on CPU,
    seeded and randomised like the target, with the target's embedding and LM head copied in."""
    import torch
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel

    torch.manual_seed(1000 + seed)
    with torch.no_grad():
        draft = DeepseekV41DSparkModel(model.config.text_config, backend=_cpu_backend(),
                                       num_anchors=1, enable_confidence_head=True).float()
        _randomise(draft, seed)
        draft.initialize_embeddings_and_head(embed_tokens=model.get_input_embeddings(),
                                             lm_head=model.get_output_embeddings())
    draft.eval()
    return draft


def dspark_state_dict(draft) -> dict[str, np.ndarray]:
    """The draft's `mtp.*` tensors under the released names (fp32 numpy, unquantised)."""
    import torch

    with torch.no_grad():
        hf = draft.state_dict_adapter.to_hf(draft.state_dict())
    return {k: v.detach().float().numpy().copy() for k, v in hf.items()
            if k.startswith("mtp.") and torch.is_tensor(v) and v.is_floating_point()}


def nemo_dspark_from_checkpoint(draft, path, target_model):
    """A copy of `draft` whose `mtp.*` weights are those of the checkpoint at `path`, decoded by
    NeMo's own `DeepseekV41DSparkStateDictAdapter.from_hf` (0 missing, 0 unexpected keys
    besides the embedding and head), with the embedding and head of `target_model` (the
    target as loaded from the same checkpoint: `nemo_from_checkpoint`)."""
    import copy
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    path = Path(path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    hf = {}
    for shard in sorted({f for k, f in index["weight_map"].items() if k.startswith("mtp.")}):
        hf.update({k: v for k, v in load_file(path / shard).items() if k.startswith("mtp.")})
    target = copy.deepcopy(draft)
    with torch.no_grad():
        native = target.state_dict_adapter.from_hf(hf)
        result = target.load_state_dict(native, strict=False)
        missing = [k for k in result.missing_keys
                   if k not in ("embed_tokens.weight", "lm_head.weight")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"NeMo DSpark from_hf of {path}: missing {missing}, "
                               f"unexpected {result.unexpected_keys}")
        target.initialize_embeddings_and_head(
            embed_tokens=target_model.get_input_embeddings(),
            lm_head=target_model.get_output_embeddings())
    target.eval()
    return target


def nemo_dspark_features(model, ids, *, cache_qdq: bool = True) -> np.ndarray:
    """The DSpark target features [B, T, n_target * D]: the stream mean of the input of each
    target layer's attention hyper-connection (NeMo's `get_dspark_target_feature_modules`)."""
    import torch

    layer_ids = list(model.config.text_config.dspark_target_layer_ids)
    got: list = []
    hooks = [m.register_forward_hook(lambda mod, args, out: got.append(args[0].mean(dim=2)))
             for m in model.get_dspark_target_feature_modules(layer_ids)]
    try:
        with torch.no_grad(), _cache_qdq(cache_qdq):
            model(_ids_tensor(ids))
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(got, dim=-1).float().numpy()


def nemo_draft_logits(draft, features, ids, anchor: int, previous, *,
                      cache_qdq: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """NeMo's draft for one anchor per row (the same anchor in every row): the backbone run on
    [ids[:, anchor], noise x (block - 1)] at positions anchor .., with the target features of
    every position of `ids` as context (the mask keeps [anchor - window, anchor)), and the
    Markov bias of `previous` [B, K]. Returns (logits [B, K, V] = head + Markov, confidence
    logits [B, K])."""
    import torch
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkBackbone
    from nemo_automodel.components.speculative.dspark.common import create_noise_embed

    ids_t = _ids_tensor(ids)
    b, s = ids_t.shape
    anchors = torch.full((b, 1), anchor, dtype=torch.long)
    keep = torch.ones((b, 1), dtype=torch.bool)
    cfg = draft.config
    with torch.no_grad(), _cache_qdq(cache_qdq):
        noise = create_noise_embed(draft.embed_tokens, ids_t, anchors, keep,
                                   mask_token_id=cfg.dspark_noise_token_id,
                                   block_size=cfg.dspark_block_size)
        out = DeepseekV41DSparkBackbone.forward(
            draft, noise, torch.as_tensor(np.asarray(features, np.float32)),
            position_ids=draft.build_position_ids(anchors, s),
            attention_mask=draft.build_attention_mask(anchors, keep, s, noise.dtype),
            previous_token_ids=_ids_tensor(previous))
        logits = draft.compute_logits(out.normalized_hidden_states) + out.transition_logits
    return logits.float().numpy(), out.confidence_pred.float().numpy()
