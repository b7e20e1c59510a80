"""DeepSeek-V4-Flash or V4.1-Flash at real width, fewer layers, FP8/FP4 as stored: decode
tokens/s on one accelerator (GSM off and on) and the HBM bytes each decode step must read,
against the chip's bandwidth (H200: 4.8 TB/s).

    python scripts/gpu_check_deepseek.py --layers 8 --batches 1,8,32   # V4, one H200, < 8 min
    python scripts/gpu_check_deepseek.py --model v4.1                  # V4.1, one H200, < 8 min
    python scripts/gpu_check_deepseek.py --dry-run [--model v4.1]      # CPU, CI: same code,
                                                                       # reduced width

V4.1 runs six real-width layers that cover every layer kind: SWA 0, SWA + Engram 1, Full
ratio 2 at 2, Full ratio 1 + candidate source at 3, Reindex 4, Reuse 5. Its Engram table
has the real row width and the real 24 row gathers per token, but ~24 M rows (6.3 GB;
primes from 1,000,000) instead of 384 M (101 GB, which would not fit one H200 beside the
experts): a token reads the same bytes from it either way.
The weights are random stored bytes made on the device (valid FP8 e4m3 values, E8M0
scales near 1, any FP4 nibble), in exactly the tree `gsm_jax.load` gives for the
official checkpoint (`planner.abstract_weights`), so nothing is written to disk.

Bytes one decode step reads (the roofline of a memory-bound step): every non-expert
weight once, each routed expert that at least one row chose once (expected distinct
experts for B rows of k of E uniform choices: E (1 - (1 - k / E)^B); random routers
are close to uniform), and the caches in use. Achieved bandwidth = bytes / step time.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
H200_BYTES_PER_S = 4.8e12
# --dry-run: the same program at reduced width (every FP8 block boundary kept)
DRY_RUN = dict(hidden_size=512, num_attention_heads=8, head_dim=128, q_lora_rank=256,
               o_groups=2, o_lora_rank=256, n_routed_experts=16, moe_intermediate_size=256,
               vocab_size=4096, index_n_heads=8, index_topk=16, num_hash_layers=1)


V41_SCHEDULE = dict(num_hidden_layers=6, compress_ratios=[0, 0, 2, 1, 1, 1],
                    kv_source_layer_ids=[2, 3], index_source_layer_ids=[2, 3, 4],
                    candidate_source_layer_id=3, engram_layer_ids=[1],
                    num_nextn_predict_layers=0, engram_vocab_size=1_000_000)
V41_DRY_RUN = dict(hidden_size=512, num_attention_heads=8, head_dim=128, q_lora_rank=256,
                   o_groups=2, o_lora_rank=256, n_routed_experts=16, moe_intermediate_size=256,
                   vocab_size=4096, index_n_heads=8, index_head_dim=64, index_topk=16,
                   candidate_topk_blocks=4, candidate_block_size=8, engram_vocab_size=1000,
                   engram_head_dim=64)


def config_v41(dry_run: bool) -> dict:
    from gsm_jax.models.deepseek_v41_checkpoint import engram_rows

    hf = json.loads((REPO / "gsm_jax" / "data" / "deepseek_v41_flash_config.json").read_text())
    text = hf["text_config"]
    text.update(V41_SCHEDULE)
    if dry_run:
        text.update(V41_DRY_RUN)
    text["engram_num_embeddings"] = list(engram_rows(text).values())
    return hf


def config(layers: int, dry_run: bool) -> dict:
    hf = json.loads((REPO / "gsm_jax" / "data" / "deepseek_v4_flash_config.json").read_text())
    ratios = hf["compress_ratios"]
    # keep the real mix: the first two sliding layers, then CSA / HCA alternating
    hf["compress_ratios"] = ratios[:layers]
    hf["num_hidden_layers"] = layers
    hf["num_hash_layers"] = min(hf["num_hash_layers"], layers - 1)
    if dry_run:
        hf.update(DRY_RUN)
    return hf


def random_stored_weights(abstract, n_experts: int, seed: int = 0):
    """Device-made random leaves with the dtypes and shapes of the stored checkpoint. One
    jitted maker per kind of leaf, its shape static: leaves of the same kind and shape (every
    layer's) share one compiled program."""
    import dataclasses
    from functools import partial

    import jax
    import jax.numpy as jnp

    from gsm_jax.models.block_quant import BlockQuantWeight

    @partial(jax.jit, static_argnums=(1, 2, 3))
    def fill(key, shape, kind, dtype):
        if kind == "fp8":  # top exponent bit clear: no NaN
            return jax.lax.bitcast_convert_type(jax.random.bits(key, shape, jnp.uint8) & 0xBF,
                                                jnp.float8_e4m3fn)
        if kind == "fp4":  # packed FP4 pairs: every nibble is a value
            return jax.random.bits(key, shape, jnp.uint8)
        if kind == "e8m0":  # block / row scales: E8M0 2^-3 .. 2^0
            return 124 + (jax.random.bits(key, shape, jnp.uint8) & 3)
        if kind == "index":  # hash-routing table / Engram token map
            return jax.random.randint(key, shape, 0, n_experts, jnp.dtype(dtype))
        return (0.02 * jax.random.normal(key, shape)).astype(jnp.dtype(dtype))

    counter = iter(range(1 << 30))

    def made(leaf, kind):
        key = jax.random.fold_in(jax.random.key(seed), next(counter))
        return fill(key, tuple(leaf.shape), kind, jnp.dtype(leaf.dtype).name)

    def make(leaf):
        if isinstance(leaf, BlockQuantWeight):
            kind = "fp8" if leaf.values.dtype == jnp.float8_e4m3fn else "fp4"
            return dataclasses.replace(leaf, values=made(leaf.values, kind),
                                       scale=made(leaf.scale, "e8m0"))
        if leaf.dtype == jnp.uint8:  # Engram table scales
            return made(leaf, "e8m0")
        if leaf.dtype == jnp.float8_e4m3fn:  # Engram table rows
            return made(leaf, "fp8")
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            return made(leaf, "index")
        return made(leaf, "normal")

    return jax.tree.map(make, abstract, is_leaf=lambda x: isinstance(x, BlockQuantWeight))


def bytes_per_step(weights, cfg, batch: int, context: int) -> dict:
    import jax

    from gsm_jax.models.block_quant import BlockQuantWeight

    expert, other, engram_rows = 0, 0, 0
    for layer in weights["layers"]:
        for name, leaf in jax.tree_util.tree_flatten_with_path(
                layer, is_leaf=lambda x: isinstance(x, BlockQuantWeight))[0]:
            n = sum(a.nbytes for a in jax.tree.leaves(leaf))
            last = str(getattr(name[-1], "key", name[-1]))
            if "experts_" in last and "shared" not in last:
                expert += n
            elif last in ("table", "table_scale"):  # V4.1 Engram: 24 rows per token
                engram_rows += batch * 24 * n / leaf.shape[0]
            else:
                other += n
    top = sum(a.nbytes for k, v in weights.items() if k not in ("layers", "mtp")
              for a in jax.tree.leaves(v))
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    distinct = e * (1 - (1 - k / e) ** batch)
    # embedding: one row per token; everything else whole
    embed = weights["embed"].nbytes
    read = (other + top - embed + embed * batch / cfg.vocab_size + expert * distinct / e
            + engram_rows)
    return {"weights_read": read, "expert_fraction_read": distinct / e,
            "all_weights": other + top + expert, "context": context}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("v4", "v4.1"), default="v4",
                    help="DeepSeek-V4-Flash or V4.1-Flash (V4.1: 6 layers, every layer kind)")
    ap.add_argument("--layers", type=int, default=8, help="V4 layers (V4.1: always 6)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU smoke run: reduced width, 3 layers, one batch (V4: 2 rows, "
                         "V4.1: 1), 4 tokens")
    ap.add_argument("--out", default=None, help="write results.json here")
    args = ap.parse_args()
    if args.dry_run:  # one batch each (every batch size is more programs to compile on CPU)
        args.layers, args.new_tokens, args.repeats = 3, 4, 1
        args.batches = "1" if args.model == "v4.1" else "2"  # one batch: its programs
        args.prompt_len = 16

    import jax

    import gsm_jax
    from gsm_jax.families import family_module
    from gsm_jax.planner import abstract_weights

    if args.model == "v4.1":
        hf = config_v41(args.dry_run)
        expert_dtype = hf["quantization_config"]["expert_dtype"]
    else:
        hf = config(args.layers, args.dry_run)
        expert_dtype = hf["expert_dtype"]
    family = family_module("deepseek_v41" if args.model == "v4.1" else "deepseek_v4")
    cfg = family.CONFIG_CLASS.from_hf_config(hf)
    t = time.perf_counter()
    weights = random_stored_weights(abstract_weights(cfg, hf["quantization_config"],
                                                     expert_dtype), cfg.n_routed_experts)
    params = gsm_jax.ModelParams(weights, cfg)
    print(f"[gpu_check] {jax.devices()[0].device_kind}: {cfg.num_layers} layers at "
          f"hidden {cfg.hidden_size}, {params.nbytes() / 1e9:.2f} GB of weights as stored, "
          f"made in {time.perf_counter() - t:.1f} s", flush=True)
    rng = np.random.default_rng(0)
    result = {"device": jax.devices()[0].device_kind, "model": args.model,
              "layers": cfg.num_layers, "hidden": cfg.hidden_size,
              "weight_bytes": params.nbytes(), "batches": {}}
    # GSM at every site (window 16): the cost side of the claim; strength is a runtime value
    gsm_on = gsm_jax.GSMConfig(window_size=16, smooth_strength=0.3, target_layers="all")
    variants = {"gsm off": None, "gsm on": gsm_on} if args.model == "v4.1" else {"gsm off": None}
    if args.dry_run and args.model == "v4.1":  # CI: the GSM path only (V4's covers "off")
        variants = {"gsm on": gsm_on}
    for b in (int(x) for x in args.batches.split(",")):
        rows = [rng.integers(2, cfg.vocab_size, args.prompt_len).tolist() for _ in range(b)]
        for label, gsm in variants.items():
            def call(n, rows=rows, gsm=gsm):
                return gsm_jax.generate_tokens(params, rows, max_new_tokens=n, eos_ids=[],
                                               gsm=gsm)

            call(1), call(args.new_tokens)  # compile
            short, long = [], []
            for _ in range(args.repeats):
                for n, store in ((1, short), (args.new_tokens, long)):
                    t = time.perf_counter()
                    jax.block_until_ready(call(n))
                    store.append(time.perf_counter() - t)
            step_s = float(np.median(np.subtract(long, short))) / (args.new_tokens - 1)
            read = bytes_per_step(weights, cfg, b, args.prompt_len + args.new_tokens)
            # the long call not slower than the short one: no rate (None), not an absurd
            # one from a clamped time
            ok = step_s > 0
            bw = read["weights_read"] / step_s if ok else None
            row = {"decode_tok_s": b / step_s if ok else None,
                   "step_ms": step_s * 1e3 if ok else None,
                   "bytes_read_per_step": read["weights_read"], "achieved_bytes_per_s": bw,
                   "fraction_of_h200_peak": bw / H200_BYTES_PER_S if ok else None}
            if label == "gsm off" or b not in result["batches"]:
                result["batches"][b] = row
            if label != "gsm off":
                result["batches"][b][label] = dict(row)
            if not ok:
                print(f"[gpu_check] batch {b:3d} {label}: decode rate not resolved (the "
                      f"{args.new_tokens}-token call was not slower than the 1-token call)",
                      flush=True)
                continue
            print(f"[gpu_check] batch {b:3d} {label}: {b / step_s:9.1f} tok/s, step "
                  f"{step_s * 1e3:7.2f} ms, reads {read['weights_read'] / 1e9:6.2f} GB/step "
                  f"({read['expert_fraction_read']:.0%} of experts) -> {bw / 1e12:5.2f} TB/s "
                  f"= {bw / H200_BYTES_PER_S:.0%} of the H200's 4.8 TB/s", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(result, indent=1))
    rates = [r["decode_tok_s"] for r in result["batches"].values()] + [
        r["gsm on"]["decode_tok_s"] for r in result["batches"].values() if "gsm on" in r]
    # a device run must produce every rate; the CPU dry run (CI) checks the script runs
    return 0 if args.dry_run or all(x is not None and math.isfinite(x) for x in rates) else 1


if __name__ == "__main__":
    sys.exit(main())
