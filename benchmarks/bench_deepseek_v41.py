"""DeepSeek-V4.1: weights as stored vs bf16 (bytes, decode) and prefill against NeMo's reference.

    python benchmarks/bench_deepseek_v41.py --threads 1 --out runs/bench_deepseek_v41
    python benchmarks/bench_deepseek_v41.py --quick --out /tmp/bench_v41_quick   # smoke run

The model: a mid-size random V4.1 (`--preset mid`: ~290M parameters: a ~215M backbone in
the release's proportions, the routed experts holding most of it, plus two Engram tables of
~1.2M rows x 32; 8 layers with every CSA2 role: window-only 0-1, Full ratio 2 at 2, Reuse
ratio 2 at 3-4, Full ratio 1 + candidate source at 5, Reuse ratio 1 at 6, Reindex at 7;
Engram at 1 and 5; 30 experts top-4, hc_mult 4; the test harness's 128-id tokenizer, whose
Engram token map NeMo checks). Its weights are NeMo AutoModel's seeded initialisation (the
test harness `tests/v41_reference.py`, which also carries the backend switches that run
NeMo on CPU), written by `models.deepseek_v41_checkpoint.write_checkpoint` in the released
layout (FP8 e4m3 32 x 32 dense weights, packed FP4 experts, FP8 Engram tables, E8M0
scales, bf16 / f32 rest, several shards) to a temporary directory, then read back by
`gsm_jax.load` and by NeMo's own state-dict adapter (so both sides hold the *same*,
dequantized weights). Three measurements:

(a) bytes in memory: `gsm_jax.load(dir)` (FP8 / FP4 / Engram as stored, the rest bf16 as
    stored) against `gsm_jax.load(dir, dtype="bfloat16")` with its Engram tables (kept FP8
    by gsm_jax) counted at 2 bytes per value, each loaded in a child process
    (`params.nbytes()`, load seconds, peak RSS). Target: <= 0.35x.
(b) prefill tokens/s: gsm_jax's jitted `prefill` (into a fresh decode cache) on the
    checkpoint dequantized to float32 against NeMo's fp32 forward on the same weights
    (`torch.no_grad`, eager), one thread each (`--threads 1`: the process is pinned to one
    core before jax starts, and torch.set_num_threads(1)). Prompts of `--prompt-len`
    tokens, no padding; the last-token logits of both are compared (sanity). Target: >= 2x.
(c) greedy decode tokens/s of the whole `generate_tokens` call with FP8 / FP4 kept as
    stored against bf16 weights (and the float32 pair: dequantized f32 vs as stored with
    f32 activations), decode rate = (new_tokens - 1) extra tokens over the extra time of
    the long call against a 1-token call of the same prompt, as
    `bench_deepseek_v4_lowp.py`; with a profile of one long call by kind of op (the
    dequantizing converts are where the difference comes from), and the reason written
    out.

Every timed block runs its sides interleaved (alternating order per round) and records
the load average before and after; a figure measured with a 1-minute load above 1.5 is
marked not comparable. Engram: the tables are included when this gsm_jax runs Engram
layers (checked first: a tiny Engram checkpoint loaded and run); otherwise the output says
that it does not, and the model is measured without them (`--no-engram` leaves them out).

Run on an idle machine: `python benchmarks/bench_deepseek_v41.py --threads 1 --out
runs/bench_deepseek_v41` (~30-45 min on one core, most of it compiling the 16 decode
programs; ~6 GB of memory).

Outputs in `--out`: results.json, results.md, results.png (the three ratios against
their targets).
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (no jax at import)

if common.threads_arg() == 1 and hasattr(os, "sched_setaffinity"):
    # one core for this process and its children (XLA:CPU's pool follows the mask)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

TESTS_DIR = common.REPO_ROOT / "tests"  # the NeMo harness lives with the tests
MAX_COMPARABLE_LOAD = 1.5
TARGETS = {"bytes_x_bf16": 0.35, "prefill_x_nemo": 2.0}

_ROLES = dict(compress_ratios=[0, 0, 2, 2, 2, 1, 1, 1], kv_source_layer_ids=[2, 5],
              index_source_layer_ids=[2, 5, 7], candidate_source_layer_id=5,
              num_hidden_layers=8, num_nextn_predict_layers=0)
# The harness's 128-id tokenizer (its Engram token map is what NeMo checks): vocab 128.
# Engram on layers 1 and 5 (the harness's default), 8 heads x 3 n-gram orders per layer.
PRESETS = {
    # ~215M backbone parameters: 30 experts (top-4) hold ~88% of them (the release: ~96%,
    # so this preset's dense FP8 share, and its bytes ratio, is higher than the release's);
    # every projection dimension a multiple of 32 (whole FP8 blocks); two Engram
    # tables of ~1.2M rows x 32 (24 primes >= 50000 per layer)
    "mid": dict(
        hidden_size=512, moe_intermediate_size=512, num_attention_heads=8,
        head_dim=128, qk_rope_head_dim=64, q_lora_rank=256, o_groups=4, o_lora_rank=256,
        n_routed_experts=30, num_experts_per_tok=4, sliding_window=128, index_n_heads=8,
        index_head_dim=64, index_topk=64, candidate_topk_blocks=16, candidate_block_size=8,
        hc_mult=4, engram_n_heads=8, engram_head_dim=32, engram_vocab_size=50000, **_ROLES),
    # seconds end to end: checks the script itself (the harness's tiny config)
    "tiny": dict(**_ROLES),
}
# name -> gsm_jax.load keywords
VARIANTS = {
    "bf16": dict(dtype="bfloat16"),
    "fp8/fp4": {},
    "fp32": dict(dtype="float32"),
    "fp8/fp4 f32": dict(dtype="float32", keep_quantized=True),
}


def _harness():
    sys.path.insert(0, str(TESTS_DIR))
    import v41_reference

    return v41_reference


# ----------------------------------------------------------------------------- model


def engram_support(tmp: Path) -> dict:
    """Whether this gsm_jax runs a V4.1 with Engram layers: a tiny Engram checkpoint of the
    harness (NeMo's weights) loaded and run forward on 8 tokens."""
    import gsm_jax
    from gsm_jax.errors import UnsupportedModelError
    from gsm_jax.models.deepseek_v41_checkpoint import write_checkpoint

    ref = _harness()
    hf = ref.tiny_config()
    path = write_checkpoint(tmp / "engram_probe", hf,
                            ref.released_state_dict(ref.nemo_model(hf, seed=0)),
                            ref.tiny_tokenizer_json())
    try:
        gsm_jax.forward(gsm_jax.load(str(path)), [[5, 6, 7, 8, 9, 10, 11, 12]])
    except UnsupportedModelError as e:
        return {"supported": False, "reason": str(e)}
    return {"supported": True, "reason": ""}


def build_checkpoint(preset: str, path: Path, seed: int, engram: bool):
    """NeMo's seeded model of the preset, written in the released layout; returns
    (NeMo reading that checkpoint with its own adapter: the same, dequantized weights,
    hf config, parameters, Engram table rows)."""
    from gsm_jax.models.deepseek_v41_checkpoint import write_checkpoint

    ref = _harness()
    kw = dict(PRESETS[preset])
    if not engram:
        kw["engram_layer_ids"] = []
    hf = ref.tiny_config(**kw)
    model = ref.nemo_model(hf, seed=seed)
    released = ref.released_state_dict(model)
    n_params = int(sum(v.size for v in released.values()))
    rows = int(sum(v.shape[0] for k, v in released.items() if k.endswith("engram.embed.weight")))
    write_checkpoint(path, hf, released, ref.tiny_tokenizer_json(), shard_bytes=1 << 26)
    del released
    return ref.nemo_from_checkpoint(model, path), hf, n_params, rows


# ----------------------------------------------------------------------------- (a) bytes


def _child_load(path: str, variant: str) -> None:
    """In a child: load once, print bytes, load seconds and VmHWM beyond the start."""
    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    import jax

    import gsm_jax

    before = status("VmRSS")
    t = time.perf_counter()
    params = gsm_jax.load(path, **VARIANTS[variant])
    seconds = time.perf_counter() - t
    # Engram tables (always kept as stored, FP8 + E8M0 row scales) counted apart
    table_bytes = table_values = 0
    for keys, leaf in jax.tree_util.tree_flatten_with_path(params.weights)[0]:
        names = [str(getattr(k, "key", getattr(k, "idx", ""))) for k in keys]
        if "engram" in names and names[-1] in ("table", "table_scale"):
            table_bytes += int(leaf.nbytes)
            table_values += int(leaf.size) if names[-1] == "table" else 0
    print(json.dumps({"bytes": params.nbytes(), "load_s": seconds,
                      "peak_beyond_start": status("VmHWM") - before,
                      "parameters": params.num_parameters(),
                      "engram_table_bytes": table_bytes, "engram_table_values": table_values}))


def measure_load(path: str, variant: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child-load", path, variant],
                         capture_output=True, text=True, check=True, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])


def stored_bytes(path: Path) -> int:
    """The tensor bytes of a safetensors checkpoint folder, from the shards' headers."""
    total = 0
    for shard in sorted(Path(path).glob("*.safetensors")):
        with open(shard, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(e["data_offsets"][1] - e["data_offsets"][0]
                     for k, e in header.items() if k != "__metadata__")
    return total


def release_bytes_ratio() -> dict:
    """The same ratio at the release's size, counted (nothing loaded): the text model's
    tensors as `gsm_jax.load` holds them (`held_weight_bytes`) and as stored in the 510 GB
    release (`released_layout`, DSpark and vision left out as in (a)) against 2 bytes per
    parameter."""
    import numpy as np

    from gsm_jax import planner
    from gsm_jax.models import deepseek_v41 as dv
    from gsm_jax.models.deepseek_v41_checkpoint import (
        STORED_BYTES,
        check_quantization_config,
        is_vision,
        released_layout,
    )
    from gsm_jax.models.deepseek_v41_plan import held_weight_bytes

    hf = json.loads(planner.KNOWN_CONFIGS["deepseek-v4.1-flash"].read_text())
    held = held_weight_bytes(dv.DeepseekV41Config.from_hf_config(hf),
                             check_quantization_config(hf), {}, "bfloat16")
    params = stored = 0
    for name, (shape, dtype) in released_layout(hf).items():
        if name.startswith("mtp.") or is_vision(name):
            continue
        stored += int(np.prod(shape)) * STORED_BYTES[dtype]
        if not name.endswith(".scale"):
            params += int(np.prod(shape)) * (2 if dtype == "I8" else 1)
    return {"parameters": params, "held_bytes": held, "stored_bytes": stored,
            "held_x_bf16": held / (2 * params), "stored_x_bf16": stored / (2 * params)}


# ----------------------------------------------------------------------------- (b) prefill


def _loads(before, after) -> dict:
    return {"load_average_before": before, "load_average_after": after,
            "comparable": max((before or [0])[0], (after or [0])[0]) <= MAX_COMPARABLE_LOAD}


SETTLE_S = 120.0  # set by --settle-s (0 for smoke runs)


def settle(limit: float = 1.0) -> None:
    """`common.settle` for at most SETTLE_S (--settle-s)."""
    common.settle(SETTLE_S, limit)


def measure_prefill(params, model, batch: int, prompt_len: int, repeats: int,
                    seed: int) -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    from gsm_jax.models import deepseek_v41 as dv

    cfg = params.config
    tokens = np.random.default_rng(seed + batch).integers(
        3, cfg.vocab_size, (batch, prompt_len)).astype(np.int32)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)

    @jax.jit
    def prefill(weights, tokens, lengths):
        cache = dv.init_cache(cfg, batch, prompt_len + 1)
        return dv.prefill(weights, cfg, tokens, lengths, cache)[0]

    ids = torch.as_tensor(tokens, dtype=torch.long)

    def nemo():
        with torch.no_grad():
            return model(ids).logits[:, -1].float().numpy()

    fns = {"gsm_jax": lambda: prefill(params.weights, jnp.asarray(tokens), lengths),
           "nemo": nemo}
    t = time.perf_counter()
    ours = np.asarray(jax.block_until_ready(fns["gsm_jax"]()))
    compile_s = time.perf_counter() - t
    theirs = nemo()  # warm-up at this shape (allocator, kernels)
    settle()
    before = common.load_average()
    times = common.interleaved(fns, repeats)
    after = common.load_average()
    out = {"batch": batch, "prompt_len": prompt_len, "gsm_jax_compile_s": compile_s,
           "last_logits_max_rel_diff": float(np.abs(ours - theirs).max()
                                             / np.abs(theirs).max()),
           "last_top1_equal": int((ours.argmax(-1) == theirs.argmax(-1)).sum()),
           **_loads(before, after)}
    for name, ts in times.items():
        s = common.summarize(ts)
        out[name] = {"s": s, "tok_s": batch * prompt_len / s["median"]}
    out["x_nemo"] = out["gsm_jax"]["tok_s"] / out["nemo"]["tok_s"]
    out["bound"] = prefill_bound(cfg, prompt_len, out["gsm_jax"]["tok_s"],
                                 out["nemo"]["tok_s"])
    # where gsm_jax's prefill spends its time, by jax.named_scope (after the timing)
    text = prefill.lower(params.weights, jnp.asarray(tokens), lengths).compile().as_text()
    out["gsm_jax_profile_ms_by_scope"] = common.profile_breakdown(fns["gsm_jax"], steps=2,
                                                                  hlo_text=text)
    return out


def necessary_prefill_flops(cfg, tokens: int) -> dict[str, float]:
    """The FLOPs a prefill of `tokens` tokens (one row, from position 0) cannot avoid, by
    part: 2 x the multiply-adds of every projection a token goes through (the routed
    experts: its top-k of them; the Full layers' index-key projection once per compressed
    entry; the LM head for the last token only), attention over the keys a query may use
    (its visible window and at most `index_topk` selected compressed entries, averaged over
    the prompt), and the indexer's scores over the visible index keys. Norms, softmax,
    rotary, mHC's Sinkhorn, routing, top-k and gathers are not counted, so the time these
    FLOPs take at the GEMM peak is a lower bound on any implementation's prefill."""
    import numpy as np

    from gsm_jax.models import deepseek_v41 as dv

    t = tokens
    parts: dict[str, float] = {}

    def add(name: str, macs_per_token: float) -> None:
        parts[name] = parts.get(name, 0.0) + 2.0 * macs_per_token * t

    def size(s) -> float:
        return float(np.prod(s.shape))

    shapes = dv.weight_shapes(cfg)
    for li, lw in enumerate(shapes["layers"]):
        plan, a, m = cfg.plan(li), lw["attn"], lw["moe"]
        add("attention projections", sum(size(a[k]) for k in ("q_a", "q_b", "kv", "o_a", "o_b")))
        if "compressor" in a:
            add("compressor", sum(size(v) for v in a["compressor"].values() if v.ndim == 2))
        win = sum(min(cfg.sliding_window, q + 1) for q in range(t)) / t
        comp = 0.0
        if plan.ratio:
            comp = sum(min(cfg.index_topk, (q + 1) // plan.ratio) for q in range(t)) / t
        add("attention (window + selected)", 2 * cfg.num_heads * cfg.head_dim * (win + comp))
        if "indexer" in a:
            ix = a["indexer"]
            add("indexer", size(ix["q_b"]) + size(ix["weights_proj"])
                + (size(ix["wk"]) / plan.ratio if "wk" in ix else 0.0)
                + cfg.index_n_heads * cfg.index_head_dim
                * sum((q + 1) // plan.ratio for q in range(t)) / t)
        add("router", size(m["router"]))
        add("routed experts", cfg.num_experts_per_tok
            * (size(m["experts_gate_up"]) + size(m["experts_down"])) / cfg.n_routed_experts)
        add("shared expert", size(m["shared_gate_up"]) + size(m["shared_down"]))
        add("mHC", size(lw["hc_attn"]["fn"]) + size(lw["hc_ffn"]["fn"]))
        if "engram" in lw:
            add("Engram", size(lw["engram"]["wkv"]))
    add("LM head (last token)", size(shapes["lm_head"]) / t)
    return parts


def gemm_peak(shapes=((256, 512, 1024), (256, 1024, 512), (1024, 512, 1024)),
              repeats: int = 30) -> dict[str, float]:
    """fp32 GEMM GFLOP/s in this process (one core under --threads 1) for XLA and torch:
    the best over `shapes` ([M, K] x [K, N], the prefill's projection sizes)."""
    import jax
    import jax.numpy as jnp
    import torch

    best = {"xla": 0.0, "torch": 0.0}
    for m, k, n in shapes:
        x, w = jnp.ones((m, k), jnp.float32), jnp.ones((k, n), jnp.float32)
        f = jax.jit(jnp.matmul)
        f(x, w).block_until_ready()
        xt, wt = torch.ones(m, k), torch.ones(k, n)
        xt @ wt
        calls = {"xla": lambda f=f, x=x, w=w: f(x, w).block_until_ready(),
                 "torch": lambda xt=xt, wt=wt: xt @ wt}
        for name, ts in common.interleaved(calls, repeats).items():
            best[name] = max(best[name], 2 * m * k * n / min(ts) / 1e9)
    return best


def prefill_bound(cfg, tokens: int, gsm_tok_s: float, nemo_tok_s: float) -> dict:
    """What the GEMM peak allows: `necessary_prefill_flops` at the faster side's peak."""
    parts = necessary_prefill_flops(cfg, tokens)
    flops = sum(parts.values())
    peak = gemm_peak()
    bound_tok_s = max(peak.values()) * 1e9 / (flops / tokens)
    target = TARGETS["prefill_x_nemo"] * nemo_tok_s
    return {"necessary_gflop": flops / 1e9,
            "necessary_gflop_by_part": {k: v / 1e9 for k, v in parts.items()},
            "gemm_peak_gflop_s": peak, "bound_tok_s": bound_tok_s,
            "gsm_jax_of_bound": gsm_tok_s / bound_tok_s,
            "nemo_of_bound": nemo_tok_s / bound_tok_s,
            "target_tok_s": target, "target_of_bound": target / bound_tok_s}


# ----------------------------------------------------------------------------- (c) decode


def measure_decode(params: dict, batch: int, prompt_len: int, new_tokens: int,
                   repeats: int, vocab: int, profile: bool) -> dict:
    fns = common.short_and_long_calls(params, batch, prompt_len, new_tokens, vocab)
    for fn in fns.values():  # compile every program before timing
        fn()
    settle()
    before = common.load_average()
    times = common.interleaved(fns, repeats)
    after = common.load_average()
    out = {**_loads(before, after), "variants": {}}
    for name in params:
        short, long = np.asarray(times[f"{name}|1"]), np.asarray(times[f"{name}|{new_tokens}"])
        decode_s = float(np.median(long - short))
        out["variants"][name] = {
            "call_s": common.summarize(long.tolist()),
            "prefill_call_s": common.summarize(short.tolist()),
            "decode_s": common.summarize((long - short).tolist()),
            "decode_tok_s": batch * (new_tokens - 1) / decode_s if decode_s > 0 else None,
        }
        if profile:  # one long call by kind of op (ms per call)
            out["variants"][name]["profile_ms_by_kind"] = common.profile_breakdown(
                fns[f"{name}|{new_tokens}"], steps=1)
    return out


def decode_reason(d: dict) -> str:
    """The measured difference and where it comes from (the profile's converts)."""
    v = d["variants"]
    a, b = v["fp8/fp4"]["decode_tok_s"], v["bf16"]["decode_tok_s"]
    if not (a and b):
        return "decode rate not measurable (the long call was not slower than the short one)"
    conv = {k: v[k].get("profile_ms_by_kind", {}).get("convert") for k in ("fp8/fp4", "bf16")}
    evidence = ""
    if all(c is not None for c in conv.values()):
        evidence = (f" In the profiled {d['new_tokens']}-token call the converts take "
                    f"{conv['fp8/fp4']:.1f} ms with FP8/FP4 weights against "
                    f"{conv['bf16']:.1f} ms with bf16 ones.")
    mechanism = (
        "FP8/FP4 weights are dequantized per block inside every jitted step, right before "
        "their product (models/linear.py): XLA:CPU does not fuse that convert and scale "
        "multiply into its GEMM, it writes the dequantized tile out and multiplies it, so "
        "each decode step pays an extra pass over every weight it touches (all dense "
        "projections and the activated experts), while reading 2-4x fewer bytes from "
        "memory.")
    if a < b:
        verdict = (f"FP8/FP4 as stored decodes at {a / b:.2f}x the bf16 rate: the dequantizing "
                   "pass costs more than the smaller weight reads save at this size on "
                   "this CPU (on GPU the convert fuses into the GEMM's operand load).")
    else:
        verdict = (f"FP8/FP4 as stored decodes at {a / b:.2f}x the bf16 rate: reading 2-4x "
                   "fewer weight bytes saves more than the dequantizing pass costs here.")
    return f"{verdict} {mechanism}{evidence}"


# ----------------------------------------------------------------------------- main


def main() -> None:
    global SETTLE_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="mid")
    ap.add_argument("--out", default="runs/bench_deepseek_v41")
    ap.add_argument("--batches", default="1,4",
                    help="decode batch sizes ('' skips the decode part)")
    ap.add_argument("--settle-s", type=float, default=SETTLE_S,
                    help="before each timed block, wait at most this long for the load "
                         "average to fall below 1 (compiling raises it)")
    ap.add_argument("--prefill-batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, choices=(1,), default=None,
                    help="1: pin the process to one core and torch to one thread")
    ap.add_argument("--no-engram", action="store_true", help="leave the Engram layers out")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: tiny preset, 1 repeat, short prompts (numbers meaningless)")
    ap.add_argument("--child-load", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_load:
        _child_load(*args.child_load)
        return
    if args.quick:
        args.preset, args.repeats, args.prompt_len, args.new_tokens = "tiny", 1, 16, 4
        args.batches, args.settle_s = "1", 0.0
    SETTLE_S = args.settle_s
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"benchmark": "deepseek_v41: bytes / prefill vs NeMo / decode as stored",
                    "machine": common.machine_info(), "preset": args.preset,
                    "config": PRESETS[args.preset], "args": vars(args),
                    "torch_threads": torch.get_num_threads(), "targets": TARGETS,
                    "cpu_affinity": sorted(os.sched_getaffinity(0))
                    if hasattr(os, "sched_getaffinity") else None}
    with tempfile.TemporaryDirectory() as tmp:
        result["engram"] = engram_support(Path(tmp))
        engram = result["engram"]["supported"] and not args.no_engram
        result["engram"]["note"] = (
            "Engram tables included" if engram else
            "Engram left out (--no-engram)" if result["engram"]["supported"] else
            "Engram is not supported by this gsm_jax (a tiny Engram checkpoint was refused): "
            "measured without Engram tables")
        print(f"[bench] {result['engram']['note']}", flush=True)
        path = Path(tmp) / "ckpt"
        print(f"[bench] NeMo's {args.preset} model -> released layout", flush=True)
        model, hf, n_params, rows = build_checkpoint(args.preset, path, args.seed, engram)
        result["parameters"], result["engram"]["table_rows"] = n_params, rows
        print(f"[bench] {n_params / 1e6:.1f}M parameters ({rows} Engram table rows); loading "
              "each variant in a child", flush=True)
        loads = {v: measure_load(str(path), v) for v in VARIANTS}
        result["load"] = loads
        bf16 = loads["bf16"]
        # gsm_jax keeps Engram tables FP8 even in the bf16 variant: the bf16 reference
        # counts them at 2 bytes per value, as a bf16 copy of the checkpoint would hold them
        bf16_ref = bf16["bytes"] - bf16["engram_table_bytes"] + 2 * bf16["engram_table_values"]
        result["bf16_reference_bytes"] = bf16_ref
        result["bytes_ratio_vs_bf16"] = {v: loads[v]["bytes"] / bf16_ref for v in VARIANTS}
        result["checkpoint_tensor_bytes"] = stored_bytes(path)
        result["release"] = release_bytes_ratio()
        result["bytes_ratio_vs_bf16_without_engram"] = {
            v: (loads[v]["bytes"] - loads[v]["engram_table_bytes"])
            / (bf16["bytes"] - bf16["engram_table_bytes"]) for v in VARIANTS}

        import gsm_jax

        params = {v: gsm_jax.load(str(path), **VARIANTS[v]) for v in VARIANTS}
        print("[bench] prefill, gsm_jax f32 vs NeMo f32", flush=True)
        result["prefill"] = measure_prefill(params["fp32"], model, args.prefill_batch,
                                            args.prompt_len, args.repeats, args.seed)
        del model
        vocab = params["bf16"].config.vocab_size
        result["decode"] = {}
        for i, b in enumerate(int(x) for x in args.batches.split(",") if x.strip()):
            print(f"[bench] decode, batch {b}", flush=True)
            d = measure_decode(params, b, min(args.prompt_len, 64), args.new_tokens,
                               args.repeats, vocab, profile=i == 0)
            d["new_tokens"], d["prompt_len"] = args.new_tokens, min(args.prompt_len, 64)
            d["reason"] = decode_reason(d)
            result["decode"][str(b)] = d
    result["load_average_end"] = common.load_average()
    common.write_json(out / "results.json", result)
    write_report(out, result)


def _yes(flag: bool) -> str:
    return "yes" if flag else "NO (load > 1.5)"


def write_report(out: Path, r: dict) -> None:
    loads, ratio, p = r["load"], r["bytes_ratio_vs_bf16"], r["prefill"]
    threads = ("one core, torch 1 thread" if r["args"]["threads"] == 1
               else f"all cores, torch {r['torch_threads']} threads")
    text = (f"# DeepSeek-V4.1 ({r['preset']} preset, {r['parameters'] / 1e6:.0f}M parameters)"
            f"\n\nMachine: {r['machine'].get('cpu_model')} ({r['machine'].get('cpu_count')} "
            f"CPUs), {threads}; load average at the start "
            f"{r['machine'].get('load_average_1_5_15')}, at the end {r['load_average_end']}. "
            f"Command: `python benchmarks/bench_deepseek_v41.py --preset {r['preset']} ...` "
            "(arguments in results.json).\n\n"
            f"Engram: {r['engram']['note']}"
            + (f" ({r['engram']['reason']})" if r["engram"]["reason"] else "") + ".\n")
    rows = [(v, loads[v]["parameters"] / 1e6, loads[v]["bytes"] / 1e6, ratio[v],
             loads[v]["load_s"], loads[v]["peak_beyond_start"] / 1e6) for v in VARIANTS]
    nog = r["bytes_ratio_vs_bf16_without_engram"]
    rel = r["release"]
    text += (f"\n## (a) Weight bytes in memory (target: fp8/fp4 <= {TARGETS['bytes_x_bf16']}x "
             f"bf16): **{ratio['fp8/fp4']:.3f}x**\n\n"
             f"Engram table rows: {r['engram']['table_rows']}. gsm_jax keeps the Engram tables "
             "FP8 in every variant; the bf16 reference counts them at 2 bytes per value "
             f"({r['bf16_reference_bytes'] / 1e6:.1f} MB). Without the tables: fp8/fp4 = "
             f"{nog['fp8/fp4']:.3f}x bf16.\n\n"
             f"What is held is what is stored: the checkpoint's tensors are "
             f"{r['checkpoint_tensor_bytes'] / 1e6:.1f} MB, `gsm_jax.load` holds "
             f"{loads['fp8/fp4']['bytes'] / 1e6:.1f} MB (the difference: f32 copies of small "
             "tensors and the Engram token map), so the ratio is the checkpoint's mix: this "
             f"preset's dense FP8 projections are a larger share than the release's. At the "
             f"release's size ({rel['parameters'] / 1e9:.1f}B text parameters, counted, not "
             f"loaded) gsm_jax holds **{rel['held_x_bf16']:.3f}x** bf16 (stored: "
             f"{rel['stored_x_bf16']:.3f}x).\n\n"
             + common.markdown_table(["weights", "parameters (M)", "bytes (MB)", "x bf16",
                                      "load (s)", "load peak RSS (MB)"], rows, 3))
    text += (f"\n## (b) Prefill, gsm_jax vs NeMo, fp32, same weights (target >= "
             f"{TARGETS['prefill_x_nemo']}x): **{p['x_nemo']:.2f}x**\n\n"
             + common.markdown_table(
                 ["batch", "prompt", "gsm_jax tok/s", "NeMo tok/s", "x NeMo",
                  "last logits max rel diff", "top-1 equal", "load avg before / after",
                  "comparable"],
                 [(p["batch"], p["prompt_len"], p["gsm_jax"]["tok_s"], p["nemo"]["tok_s"],
                   p["x_nemo"], f"{p['last_logits_max_rel_diff']:.1e}",
                   f"{p['last_top1_equal']}/{p['batch']}",
                   f"{p['load_average_before'][0]} / {p['load_average_after'][0]}",
                   _yes(p["comparable"]))]))
    text += (f"\ngsm_jax: jitted `prefill` into a fresh cache (compiled once before timing, "
             f"{p['gsm_jax_compile_s']:.1f} s); NeMo: `model(ids)` under no_grad. Medians "
             "of interleaved repeats.\n")
    bd = p["bound"]
    text += (f"\nWhat the core allows: the prefill's unavoidable work is "
             f"{bd['necessary_gflop']:.2f} GFLOP "
             f"({bd['necessary_gflop'] * 1e3 / p['prompt_len']:.0f} MFLOP per token: "
             "projections, the routed experts a token uses, attention over "
             "its window and selected entries; `necessary_prefill_flops`), and the fp32 GEMM "
             f"peak measured in this process is {bd['gemm_peak_gflop_s']['xla']:.0f} GFLOP/s "
             f"(XLA) / {bd['gemm_peak_gflop_s']['torch']:.0f} GFLOP/s (torch), so no "
             f"implementation prefills faster than **{bd['bound_tok_s']:.0f} tok/s** here, "
             "even with norms, softmax, routing and gathers free. gsm_jax runs at "
             f"{bd['gsm_jax_of_bound']:.0%} of that bound, NeMo at {bd['nemo_of_bound']:.0%}; "
             f"the target ({TARGETS['prefill_x_nemo']}x NeMo = {bd['target_tok_s']:.0f} tok/s) "
             f"is {bd['target_of_bound']:.0%} of it.\n\n"
             + common.markdown_table(["part", "GFLOP"],
                                     list(bd["necessary_gflop_by_part"].items()), 3))
    if p.get("gsm_jax_profile_ms_by_scope"):
        text += ("\ngsm_jax's prefill by `jax.named_scope` (ms per call, jax.profiler "
                 "trace):\n\n" + common.markdown_table(
                     ["scope", "ms"], list(p["gsm_jax_profile_ms_by_scope"].items())[:10]))
    dec_rows, reasons = [], []
    for b, d in r["decode"].items():
        base, fp32 = d["variants"]["bf16"]["decode_tok_s"], d["variants"]["fp32"]["decode_tok_s"]
        for v in VARIANTS:
            x = d["variants"][v]["decode_tok_s"]
            dec_rows.append((b, v, x, x / base if x and base else None,
                             x / fp32 if x and fp32 else None,
                             f"{d['load_average_before'][0]} / {d['load_average_after'][0]}",
                             _yes(d["comparable"])))
        reasons.append(f"- batch {b}: {d['reason']}")
    text += ("\n## (c) Greedy decode, weights as stored vs bf16\n\n"
             "decode tok/s: median over rounds of (long call - 1-token call) of "
             "`generate_tokens`.\n\n"
             + common.markdown_table(["batch", "weights", "decode tok/s", "x bf16", "x fp32",
                                      "load avg before / after", "comparable"], dec_rows, 2)
             + "\nWhy:\n\n" + "\n".join(reasons) + "\n")
    prof = next((d for d in r["decode"].values()
                 if "profile_ms_by_kind" in d["variants"]["bf16"]), None)
    if prof is not None:
        kinds = list(dict.fromkeys(k for v in VARIANTS
                                   for k in prof["variants"][v]["profile_ms_by_kind"]))
        text += (f"\nOne {prof['new_tokens']}-token `generate_tokens` call by kind of op "
                 "(ms, jax.profiler trace):\n\n"
                 + common.markdown_table(
                     ["kind", *VARIANTS],
                     [[k, *[prof["variants"][v]["profile_ms_by_kind"].get(k) for v in VARIANTS]]
                      for k in kinds]))
    common.write_markdown(out / "results.md", text)
    groups = ["bytes (x bf16)", "prefill (x NeMo)",
              *[f"decode b={b} (x bf16)" for b in r["decode"]]]
    measured = [ratio["fp8/fp4"], p["x_nemo"],
                *[(d["variants"]["fp8/fp4"]["decode_tok_s"] or 0)
                  / (d["variants"]["bf16"]["decode_tok_s"] or float("inf"))
                  for d in r["decode"].values()]]
    target = [TARGETS["bytes_x_bf16"], TARGETS["prefill_x_nemo"], *[None] * len(r["decode"])]
    common.bar_chart(out / "results.png", groups, {"measured": measured, "target": target},
                     title=f"DeepSeek-V4.1 {r['preset']}: ratios (bytes: lower is better)",
                     ylabel="ratio")
    print(text)


if __name__ == "__main__":
    main()
