"""DeepSeek-V4 with FP8 / FP4 weights kept as stored vs the same checkpoint dequantized.

A mid-size random V4 config (V4's proportions: the routed experts hold most of the
weights) is written in the official layout (FP8 e4m3 128 x 128 blocks with E8M0
scales, packed FP4 e2m1 experts with 1 x 32 scales, bf16 embeddings, several
shards), then loaded three ways from the same files:

- `bf16`: `gsm_jax.load(dir, dtype="bfloat16")` (dequantized at load),
- `fp8/fp4`: `gsm_jax.load(dir)` (low precision kept, dequantized per block inside
  the jitted step; the other tensors bf16, as stored),
- `fp8/fp4+act`: the same with FP8 activations (`gsm_jax.quantize(params, "fp8")`),
- `fp32` and `fp8/fp4 f32`: dequantized to float32, and low precision kept with the
  other tensors (and so the activations) in float32 (XLA:CPU's bf16 products are
  slower than its f32 ones, so these are the CPU's faster settings),

and measured for in-memory weight bytes (target: fp8/fp4 <= 0.35x bf16), peak host
memory while loading (each way in a child process), and greedy decode tokens/s of the
whole `generate_tokens` call at batch 1 and 8 (interleaved repeats; decode rate =
extra tokens over the extra time of a long call against a 1-token call of the same
prompt). The load average is recorded before and after every timed block; a figure
taken above 1.5 is marked not comparable.

    python benchmarks/bench_deepseek_v4_lowp.py --out runs/bench_dsv4_lowp
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (no jax at import)

if common.threads_arg() == 1 and hasattr(os, "sched_setaffinity"):
    # one core for this process and its children: XLA:CPU's thread pool ignores the
    # Eigen thread flags, pinning is what keeps a run (and the load average) to one core
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

MAX_COMPARABLE_LOAD = 1.5
# V4's proportions at ~230M parameters: 32 experts (top-4) hold ~88% of them, every
# projection dimension a multiple of 128 (whole FP8 blocks), small vocabulary.
PRESETS = {
    "mid": dict(
        model_type="deepseek_v4", vocab_size=8192, hidden_size=512, moe_intermediate_size=512,
        num_attention_heads=8, head_dim=128, qk_rope_head_dim=64, q_lora_rank=256, o_groups=4,
        o_lora_rank=256, n_routed_experts=32, num_experts_per_tok=4, hc_mult=4,
        sliding_window=128, compress_ratios=[128, 0, 4, 128, 4, 0, 4, 128],
        compress_rate_hca=32, num_hash_layers=2, index_n_heads=16, index_head_dim=64,
        index_topk=16, num_hidden_layers=8, max_position_embeddings=4096,
        rope_scaling={"type": "yarn", "factor": 4, "original_max_position_embeddings": 1024},
    ),
    "tiny": dict(
        model_type="deepseek_v4", vocab_size=512, hidden_size=128, moe_intermediate_size=128,
        num_attention_heads=2, head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2,
        o_lora_rank=128, n_routed_experts=4, num_experts_per_tok=2, hc_mult=2,
        sliding_window=16, compress_ratios=[0, 4, 128], compress_rate_hca=8,
        num_hash_layers=1, index_n_heads=2, index_head_dim=64, index_topk=4,
        num_hidden_layers=3, max_position_embeddings=1024,
    ),
}
# name -> (load keywords, FP8 activations); activations run in the dtype of the float
# tensors (bf16 as stored, or f32)
VARIANTS = {
    "bf16": (dict(dtype="bfloat16"), False),
    "fp8/fp4": ({}, False),
    "fp8/fp4+act": ({}, True),
    "fp32": (dict(dtype="float32"), False),
    "fp8/fp4 f32": (dict(dtype="float32", keep_quantized=True), False),
}


def load_variant(path: str, variant: str):
    import gsm_jax

    kwargs, fp8_act = VARIANTS[variant]
    params = gsm_jax.load(path, **kwargs)
    return gsm_jax.quantize(params, "fp8") if fp8_act else params


def _child_load(path: str, variant: str) -> None:
    """In a child: load once, print bytes, load seconds and VmHWM beyond the start."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    import gsm_jax  # noqa: F401  (imports before the baseline)

    before = status("VmRSS")
    t = time.perf_counter()
    params = load_variant(path, variant)
    seconds = time.perf_counter() - t
    print(json.dumps({"bytes": params.nbytes(), "load_s": seconds,
                      "peak_beyond_start": status("VmHWM") - before,
                      "parameters": params.num_parameters()}))


def measure_load(path: str, variant: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child-load", path, variant],
                         capture_output=True, text=True, check=True, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="mid")
    ap.add_argument("--out", default="runs/bench_deepseek_v4_lowp")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--checkpoint", help="an existing official-layout directory to use")
    ap.add_argument("--threads", type=int, choices=(1,), default=None,
                    help="1: pin to one core (the machine's load average stays near 1)")
    ap.add_argument("--child-load", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_load:
        _child_load(*args.child_load)
        return

    from gsm_jax.models import deepseek_v4 as dv
    from gsm_jax.models.deepseek_v4_checkpoint import write_checkpoint

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": common.machine_info(), "preset": args.preset,
                    "args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint
        if path is None:
            cfg = dv.DeepseekV4Config.from_hf_config(PRESETS[args.preset])
            print(f"[bench] writing a random {args.preset} checkpoint (official layout)",
                  flush=True)
            path = str(write_checkpoint(cfg, None, Path(tmp) / "ckpt", shards=4, seed=0))
        print("[bench] loading each variant in a child process", flush=True)
        loads = {v: measure_load(path, v) for v in VARIANTS}
        result["load"] = loads
        bf16 = loads["bf16"]["bytes"]
        result["bytes_ratio_vs_bf16"] = {v: loads[v]["bytes"] / bf16 for v in VARIANTS}
        params = {v: load_variant(path, v) for v in VARIANTS}
        vocab = next(iter(params.values())).config.vocab_size
        result["decode"] = {}
        for b in (int(x) for x in args.batches.split(",")):
            print(f"[bench] decode, batch {b}", flush=True)
            result["decode"][str(b)] = common.measure_decode(params, b, args.prompt_len,
                                                      args.new_tokens, args.repeats, vocab)
    common.write_json(out / "results.json", result)
    write_report(out, result)


def write_report(out: Path, r: dict) -> None:
    loads, ratio = r["load"], r["bytes_ratio_vs_bf16"]
    rows = [(v, loads[v]["parameters"] / 1e6, loads[v]["bytes"] / 1e6, ratio[v],
             loads[v]["load_s"], loads[v]["peak_beyond_start"] / 1e6) for v in VARIANTS]
    text = (f"# DeepSeek-V4, FP8/FP4 kept as stored vs dequantized ({r['preset']} preset)\n\n"
            f"Machine: {r['machine'].get('cpu_model')}, load average at start "
            f"{r['machine'].get('load_average_1_5_15')}. Command: `python "
            f"benchmarks/bench_deepseek_v4_lowp.py --preset {r['preset']} ...` "
            f"(arguments in results.json).\n\n"
            + common.markdown_table(["weights", "parameters (M)", "bytes (MB)", "x bf16",
                                     "load (s)", "load peak RSS (MB)"], rows, 3))
    dec_rows = []
    for b, d in r["decode"].items():
        base = d["variants"]["bf16"]["decode_tok_s"]
        fp32 = d["variants"]["fp32"]["decode_tok_s"]
        for v in VARIANTS:
            x = d["variants"][v]
            rel = lambda ref, x=x: None if not (ref and x["decode_tok_s"]) \
                else x["decode_tok_s"] / ref  # noqa: E731
            dec_rows.append((b, v, x["decode_tok_s"], rel(base), rel(fp32),
                             x["decode_tok_s_best"], x["generate_tok_s"],
                             f"{d['load_average_before'][0]} / {d['load_average_after'][0]}",
                             "yes" if d["comparable"] else "NO (load > 1.5)"))
    text += ("\n## Greedy decode (whole `generate_tokens` call)\n\n"
             "decode tok/s: median over rounds of (long call - 1-token call); best: from "
             "the minimum of each.\n\n"
             + common.markdown_table(["batch", "weights", "decode tok/s", "x bf16", "x fp32",
                                      "best decode tok/s", "generate tok/s",
                                      "load avg before / after", "comparable"], dec_rows, 2))
    common.write_markdown(out / "results.md", text)
    groups = [f"batch {b}" for b in r["decode"]]
    common.bar_chart(out / "results.png", groups,
                     {v: [r["decode"][b]["variants"][v]["decode_tok_s"] for b in r["decode"]]
                      for v in VARIANTS},
                     title="DeepSeek-V4 decode tokens/s: weights as stored vs bf16 "
                           f"(bytes: fp8/fp4 = {ratio['fp8/fp4']:.2f}x bf16)",
                     ylabel="tokens/s")
    print(text)


if __name__ == "__main__":
    main()
