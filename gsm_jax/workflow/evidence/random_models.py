"""Random-weight models for the cost claims: `gsm-jax evidence --models random:<preset>`.

A claim about cost (time per step, throughput, what a cache format saves: claims 1, 2, 6,
13, 14) does not depend on what the weights are, only on the architecture and its sizes.
So the target's architecture can be measured here, where its released weights cannot run:
`random:deepseek-v4.1-mid` is a mid-size DeepSeek-V4.1 (the `bench_deepseek_v41.py` "mid"
preset's widths, 8 layers with every attention kind of the release: SWA, CSA2 shared-KV,
Reindex with candidate blocks, HCA) with random weights, written once in the released
checkpoint layout (FP8 / FP4 / BF16 / F32, `models.deepseek_v41_checkpoint`) and then
loaded, served and measured like any checkpoint folder. Its tokenizer is SmolLM2-135M's
(shipped with the package), so the claims read the same WikiText-2 text.

Every result on such a model is marked "random weights: cost only": the runner refuses its
quality claims by name (`QUALITY_CLAIMS`), and claim 13 measures its speed side only.

`provenance(path)` tells a random-weight folder from a real one: the writer leaves
`gsm_jax_provenance.json` beside the config (preset, seed, tokenizer's source).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gsm_jax.errors import InvalidInputError

PREFIX = "random:"
PROVENANCE_FILE = "gsm_jax_provenance.json"
# the claims whose answer lies in the weights (a random model answers them with noise)
QUALITY_CLAIMS = frozenset({3, 4, 5, 7, 8, 9, 10, 11, 12})
COST_ONLY = "random weights: cost only"

# The release's layer roles in 8 layers (`deepseek_v41` schedule): SWA x2, CSA2 (ratio 2,
# sharing KV from layer 2) x3, HCA (ratio 1) x3; index sources 2, 5, 7; candidate blocks
# from layer 5. No Engram and no DSpark draft (they add lookups and a drafter, not what
# GSM changes); the widths of `bench_deepseek_v41.py`'s "mid" preset.
_MID = dict(
    hidden_size=512, moe_intermediate_size=512, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=1, head_dim=128, qk_rope_head_dim=64,
    q_lora_rank=256, o_groups=4, o_lora_rank=256,
    n_routed_experts=30, num_experts_per_tok=4, n_shared_experts=1,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
    routed_scaling_factor=1.5, swiglu_limit=10.0, rms_norm_eps=1e-20,
    sliding_window=128, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling={"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": 65536},
    max_position_embeddings=1048576,
    compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1], kv_source_layer_ids=[2, 5],
    index_source_layer_ids=[2, 5, 7], index_n_heads=8, index_head_dim=64, index_topk=64,
    candidate_source_layer_id=5, candidate_topk_blocks=16, candidate_block_size=8,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    engram_layer_ids=[], num_nextn_predict_layers=0,
    initializer_range=0.02, dtype="float32", tie_word_embeddings=False,
)
# the same layer roles at test widths: the pipeline end to end in seconds (numbers
# meaningless, as `--smoke`)
_TINY = dict(_MID, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4,
             head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
             n_routed_experts=8, num_experts_per_tok=2, sliding_window=8, index_n_heads=4,
             index_head_dim=32, index_topk=4, candidate_topk_blocks=2, candidate_block_size=4)
PRESETS: dict[str, dict[str, Any]] = {"deepseek-v4.1-mid": _MID, "deepseek-v4.1-tiny": _TINY}
TOKENIZER_SOURCE = "smollm2-135m"


def is_random(model: str) -> bool:
    return str(model).startswith(PREFIX)


def check(model: str) -> str:
    """The preset of a `random:<preset>` name, refused by name when unknown."""
    preset = str(model)[len(PREFIX):]
    if preset not in PRESETS:
        raise InvalidInputError(f"unknown random-weight model {model!r}: choose from "
                                f"{', '.join(PREFIX + p for p in PRESETS)}")
    return preset


def cache_root() -> Path:
    """Where random checkpoints are written once (GSM_JAX_RANDOM_MODELS, else
    ~/.cache/gsm-jax/random-models)."""
    env = os.environ.get("GSM_JAX_RANDOM_MODELS")
    return Path(env) if env else Path.home() / ".cache" / "gsm-jax" / "random-models"


def provenance(path: str | os.PathLike) -> dict[str, Any] | None:
    """The random-weight record of a checkpoint folder, or None (not written by us)."""
    f = Path(path) / PROVENANCE_FILE
    try:
        return json.loads(f.read_text()) if f.is_file() else None
    except (OSError, ValueError):
        return None


def hf_config(preset: str, vocab_size: int, bos: int, eos: int, pad: int) -> dict[str, Any]:
    text = dict(PRESETS[preset], vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos,
                pad_token_id=pad, dspark_noise_token_id=vocab_size - 1,
                engram_pad_token_id=pad)
    return {"text_config": text, "vision_config": {"num_hidden_layers": 0}}


def materialize(model: str, *, seed: int = 0, root: str | os.PathLike | None = None,
                progress: bool = False) -> Path:
    """The checkpoint folder of `random:<preset>` (seed `seed`), written on first use."""
    preset = check(model)
    path = Path(root or cache_root()) / f"{preset}-seed{seed}"
    if provenance(path) is not None:
        return path
    from gsm_jax.models.deepseek_v41_checkpoint import random_tensors, write_checkpoint
    from gsm_jax.models.gguf_reader import default_gguf_path, read_gguf

    if progress:
        print(f"[gsm-jax] writing {model} (random weights, seed {seed}) to {path}",
              flush=True)
    tok = read_gguf(default_gguf_path(TOKENIZER_SOURCE)).tokenizer
    hf = hf_config(preset, tok.vocab_size, tok.bos_id, tok.eos_ids[0], tok.pad_id)
    tmp = path.with_name(path.name + ".partial")
    write_checkpoint(tmp, hf, random_tensors(hf, seed), tok.backend.to_str(),
                     shard_bytes=1 << 28)
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "pad_token": tok.pad_token,
         "add_bos_token": bool(tok.add_bos), "add_eos_token": bool(tok.add_eos)}, indent=1))
    (tmp / PROVENANCE_FILE).write_text(json.dumps(
        {"weights": "random", "model": model, "preset": preset, "seed": seed,
         "tokenizer": TOKENIZER_SOURCE, "note": COST_ONLY}, indent=1))
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path
