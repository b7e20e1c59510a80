"""The accelerator check of the Llama path, one run (< 8 min on one H200), JSON out.

    bash scripts/gpu_check.sh --out runs/gpu_check     # on the GPU machine
    bash scripts/gpu_check.sh --dry-run                # CPU (CI): same code, tiny sizes

1. The GSM filter kernels (Pallas: prefill, decode, smooth+quantize) against their
   pure-jnp references on the device (max abs error and the tolerance it must meet).
2. Decode tokens/s of a random ~1B-parameter Llama (24 layers, d 2048) in bf16 at
   batch 1 / 16 / 64 (whole `generate_tokens` call, long minus 1-token call), and
   the HBM bytes one decode step must read (all weights once + the KV cache in use)
   against the H200's 4.8 TB/s.
3. w8a16 and w8a8 (`gsm_jax.quantize`) against bf16 at the same batches.
4. GSM overhead: the same calls with GSM on every layer and both sites (window 8,
   strength 0.1, bf16 filter) against GSM compiled out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

H200_BYTES_PER_S = 4.8e12
REAL = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=24,
            num_heads=16, num_kv_heads=8, head_dim=128, max_position_embeddings=4096)
DRY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
           num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)


def check_kernels(dry: bool) -> dict:
    import jax
    import jax.numpy as jnp

    from gsm_jax.pallas_kernels.reference import smooth_decode_reference, smooth_prefill_reference
    from gsm_jax.smoothing import ring_from_prefill, smooth_decode, smooth_prefill

    impl = "pallas_interpret" if jax.default_backend() == "cpu" else "pallas"
    rng = np.random.default_rng(0)
    b, t, c = (2, 16, 128) if dry else (4, 512, 1536)
    x = jnp.asarray(rng.normal(size=(b, t, c)), jnp.float32)
    pos = jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1))
    win = jnp.full((b,), 8, jnp.int32)
    strength = jnp.full((b,), 0.1, jnp.float32)
    lo = jnp.int32(1)
    out = {}
    for precision, tol in (("f32", 1e-5), ("bf16", 2e-2)):
        got = smooth_prefill(x, pos, win, strength, lo, max_window=64, precision=precision,
                             impl=impl)
        ref = smooth_prefill_reference(x, pos, win, strength, lo, max_window=64,
                                       precision=precision)
        ring = ring_from_prefill(x, pos, 64)
        y, _ = smooth_decode(x[:, -1], ring, jnp.full((b,), t, jnp.int32), win, strength, lo,
                             precision=precision, impl=impl)
        y_ref, _ = smooth_decode_reference(x[:, -1], ring, jnp.full((b,), t, jnp.int32), win,
                                           strength, lo, precision=precision)
        out[precision] = {
            "prefill_max_abs_err": float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref))),
            "decode_max_abs_err": float(jnp.max(jnp.abs(y.astype(jnp.float32) - y_ref))),
            "tolerance": tol}
        out[precision]["pass"] = max(out[precision]["prefill_max_abs_err"],
                                     out[precision]["decode_max_abs_err"]) <= tol
    out["impl"] = impl
    return out


def decode_rate(params, batch: int, prompt_len: int, new_tokens: int, repeats: int,
                gsm=None) -> float:
    import jax

    import gsm_jax

    rng = np.random.default_rng(batch)
    rows = [rng.integers(2, params.config.vocab_size, prompt_len).tolist() for _ in range(batch)]

    def call(n):
        return gsm_jax.generate_tokens(params, rows, max_new_tokens=n, eos_ids=[-1], gsm=gsm)

    call(1), call(new_tokens)
    diffs = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(call(1))
        short = time.perf_counter() - t
        t = time.perf_counter()
        jax.block_until_ready(call(new_tokens))
        diffs.append(time.perf_counter() - t - short)
    decode_s = float(np.median(diffs))
    # the long call not slower than the short one: no rate can be read off (None), rather
    # than an absurd one from a clamped time
    return batch * (new_tokens - 1) / decode_s if decode_s > 0 else None


def _tok_s(rate: float | None) -> str:
    return "not resolved" if rate is None else f"{rate:.1f} tok/s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.dry_run:
        # one batch of 2 rows: the batch loop's code as a device runs it (each batch size is
        # eight more programs to compile on CPU)
        args.batches, args.prompt_len, args.new_tokens, args.repeats = "2", 8, 4, 1

    import jax
    import jax.numpy as jnp

    import gsm_jax
    from gsm_jax.models import llama

    result: dict = {"device": jax.devices()[0].device_kind, "backend": jax.default_backend()}
    print(f"[gpu_check] device {result['device']}", flush=True)
    result["kernels"] = check_kernels(args.dry_run)
    print(f"[gpu_check] kernels vs references: {json.dumps(result['kernels'])}", flush=True)

    cfg = llama.LlamaConfig(**(DRY if args.dry_run else REAL))
    bf16 = gsm_jax.ModelParams(llama.init_weights(cfg, jax.random.key(0), jnp.bfloat16), cfg)
    weight_bytes = bf16.nbytes()
    variants = {"bf16": bf16, "w8a16": gsm_jax.quantize(bf16, "w8a16"),
                "w8a8": gsm_jax.quantize(bf16, "w8a8")}
    gsm = gsm_jax.GSMConfig(target_layers="all", window_size=8, smooth_strength=0.1)
    result.update(parameters=bf16.num_parameters(), weight_bytes_bf16=weight_bytes,
                  batches={})
    for b in (int(x) for x in args.batches.split(",")):
        kv_bytes = (2 * cfg.num_layers * b * cfg.num_kv_heads * cfg.head_dim * 2
                    * (args.prompt_len + args.new_tokens // 2))
        row = {}
        for name, p in variants.items():
            rate = decode_rate(p, b, args.prompt_len, args.new_tokens, args.repeats)
            read = p.nbytes() + kv_bytes
            row[name] = {"decode_tok_s": rate, "bytes_read_per_step": read,
                         "fraction_of_h200_peak": None if rate is None
                         else read * rate / b / H200_BYTES_PER_S}
        on = decode_rate(bf16, b, args.prompt_len, args.new_tokens, args.repeats, gsm=gsm)
        off = row["bf16"]["decode_tok_s"]
        row["bf16 + GSM"] = {"decode_tok_s": on,
                             "overhead": None if on is None or off is None else off / on - 1.0}
        result["batches"][b] = row
        frac, over = row["bf16"]["fraction_of_h200_peak"], row["bf16 + GSM"]["overhead"]
        print(f"[gpu_check] batch {b:3d}: " + ", ".join(
            f"{k} {_tok_s(v['decode_tok_s'])}" for k, v in row.items())
            + f"; bf16 reads {row['bf16']['bytes_read_per_step'] / 1e9:.2f} GB/step = "
              + ("(rate not resolved)" if frac is None else f"{frac:.0%}")
              + " of the H200's 4.8 TB/s; GSM overhead "
              + ("not resolved" if over is None else f"{over:+.1%}"), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(result, indent=1))
    ok = all(v["pass"] for k, v in result["kernels"].items() if isinstance(v, dict))
    unresolved = [f"batch {b} {k}" for b, row in result["batches"].items()
                  for k, v in row.items() if v["decode_tok_s"] is None]
    if unresolved and not args.dry_run:  # a device run must produce every rate
        print(f"[gpu_check] decode rate not resolved for: {', '.join(unresolved)} (the "
              "long call was not slower than the 1-token call; raise --new-tokens / "
              "--repeats)", flush=True)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
