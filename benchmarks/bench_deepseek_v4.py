"""DeepSeek-V4 prefill and decode throughput: gsm_jax (jitted) vs transformers (eager).

    python benchmarks/bench_deepseek_v4.py --out runs/bench_deepseek_v4

One process, one random mid-size configuration (`--preset mid`: ~200M parameters, 8
layers mixing sliding / CSA / HCA attention, 8 routed experts top-2, 2 hash-routed
layers, hc_mult 4; `--preset mid32`: ~290M in V4's proportions, 12 layers, 32 experts
top-4), fp32 on both sides, the *same* weights (transformers' state dict
converted by `weights_from_hf`). For each batch size (default 1 and 8), prompts of
exactly `--prompt-tokens` tokens (no padding), then `--new-tokens` greedy tokens:

    prefill tok/s = batch * prompt_tokens / t_prefill
    decode tok/s  = batch * (new_tokens - 1) / t_decode

t_prefill: one prompt pass that also builds the decode cache (gsm_jax: the jitted
`prefill` into a fresh cache; transformers: `model(ids, use_cache=True)`).
t_decode: the new_tokens - 1 single-token steps after it (gsm_jax: the jitted
`decode_step` with a donated cache, greedy argmax on device; transformers: the same
loop over `model(next_ids, cache=...)`). Medians over `--repeats`, the two sides
interleaved (alternating order) so both see the same background load. Compile time
is excluded from the rates and reported separately. The greedy tokens of both
sides are compared as a sanity check.

`--threads 1` pins the process (both sides run in it) to one core with
sched_setaffinity before jax starts, and torch.set_num_threads(1). (XLA:CPU's pool
follows the affinity mask; the Eigen thread flags this script used to set are
ignored by current jaxlib: the process ran at ~173% CPU.) On an oversubscribed
machine this is the fairer
comparison: a multi-threaded torch op waits at a barrier whenever one of its
threads is descheduled, and eager decoding issues thousands of small ops per token.

Outputs in `--out`: results.json, results.md (a table), results.png.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import threads_arg  # noqa: E402  (no jax at import)

if threads_arg() == 1 and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from common import (  # noqa: E402
    bar_chart,
    load_average,
    machine_info,
    markdown_table,
    profile_breakdown,
    write_json,
    write_markdown,
)

from gsm_jax.models import deepseek_v4 as dv  # noqa: E402

PRESETS = {
    # ~200M parameters, ~90M active per token
    "mid": dict(
        vocab_size=32000, hidden_size=768, moe_intermediate_size=768, num_attention_heads=12,
        head_dim=128, q_lora_rank=384, o_groups=4, o_lora_rank=384, partial_rotary_factor=0.25,
        n_routed_experts=8, num_experts_per_tok=2, hc_mult=4, sliding_window=128,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        index_n_heads=16, index_head_dim=64, index_topk=16,
        layer_types=["heavily_compressed_attention", "sliding_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "hash_moe"] + ["moe"] * 6,
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 1024},
        max_position_embeddings=4096,
    ),
    # V4's proportions at ~290M parameters (~60M active): many small experts, top-4,
    # 3 hash-routed layers, 12 layers of CSA / HCA with two sliding ones
    "mid32": dict(
        vocab_size=32000, hidden_size=512, moe_intermediate_size=384, num_attention_heads=8,
        head_dim=128, q_lora_rank=256, o_groups=4, o_lora_rank=256, partial_rotary_factor=0.5,
        n_routed_experts=32, num_experts_per_tok=4, hc_mult=4, sliding_window=128,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 32},
        index_n_heads=16, index_head_dim=64, index_topk=16,
        layer_types=["heavily_compressed_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention",
                     "sliding_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention",
                     "compressed_sparse_attention", "sliding_attention",
                     "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * 9,
        rope_parameters={"rope_type": "yarn", "factor": 4.0,
                         "original_max_position_embeddings": 1024},
        max_position_embeddings=4096,
    ),
    # a few seconds end to end: for checking the script itself
    "tiny": dict(
        vocab_size=512, hidden_size=64, moe_intermediate_size=64, num_attention_heads=4,
        head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=32, partial_rotary_factor=0.25,
        n_routed_experts=4, num_experts_per_tok=2, hc_mult=2, sliding_window=16,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        index_n_heads=4, index_head_dim=32, index_topk=4,
        layer_types=["heavily_compressed_attention", "sliding_attention",
                     "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        max_position_embeddings=1024,
    ),
}


def build_models(preset: str, seed: int):
    import torch
    import transformers

    kw = dict(PRESETS[preset])
    kw["num_hidden_layers"] = len(kw["layer_types"])
    hf_cfg = transformers.DeepseekV4Config(**kw)
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(hf_cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # the reference initialises these to zeros / a constant table
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(hf_cfg.n_routed_experts, generator=g)
                                     [: hf_cfg.num_experts_per_tok] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias")):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    cfg = dv.DeepseekV4Config.from_hf_config(hf_cfg.to_dict())
    weights = dv.weights_from_hf(cfg, {k: v.numpy() for k, v in model.state_dict().items()})
    n_params = sum(int(a.size) for a in jax.tree.leaves(weights))
    return model, cfg, weights, n_params


class JaxSide:
    """Jitted prefill (fresh cache inside) and greedy decode step with a donated cache."""

    def __init__(self, cfg, weights, batch: int, max_len: int):
        self.cfg, self.weights = cfg, weights

        @jax.jit
        def prefill(weights, tokens, lengths):
            cache = dv.init_cache(cfg, batch, max_len)
            logits, cache = dv.prefill(weights, cfg, tokens, lengths, cache)
            return jnp.argmax(logits, -1).astype(jnp.int32), cache, logits

        @functools.partial(jax.jit, donate_argnums=(2,))
        def step(weights, tokens, cache):
            logits, cache = dv.decode_step(weights, cfg, tokens, cache)
            return jnp.argmax(logits, -1).astype(jnp.int32), cache

        self.prefill, self.step = prefill, step

    def compile(self, tokens: np.ndarray) -> dict:
        t = time.perf_counter()
        tok, cache, _ = self.prefill(self.weights, jnp.asarray(tokens),
                                     jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32))
        jax.block_until_ready(tok)
        t_prefill = time.perf_counter() - t
        t = time.perf_counter()
        jax.block_until_ready(self.step(self.weights, tok, cache))
        return {"prefill_compile_s": t_prefill, "decode_compile_s": time.perf_counter() - t}

    def decode_profile(self, tokens: np.ndarray, steps: int = 5) -> dict[str, dict]:
        """ms per decode step by named scope (layers merged) and by kind of op, from
        profiler traces."""
        lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
        tok, cache, _ = self.prefill(self.weights, jnp.asarray(tokens), lengths)
        hlo = self.step.lower(self.weights, tok, cache).compile().as_text()
        state = {"tok": tok, "cache": cache}

        def step():
            state["tok"], state["cache"] = self.step(self.weights, state["tok"], state["cache"])
            return state["tok"]

        return {"by_scope": profile_breakdown(step, steps, hlo_text=hlo),
                "by_kind": profile_breakdown(step, steps)}

    def run(self, tokens: np.ndarray, new_tokens: int):
        lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
        tokens = jnp.asarray(tokens)
        t0 = time.perf_counter()
        tok, cache, logits = self.prefill(self.weights, tokens, lengths)
        jax.block_until_ready((tok, cache))
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(new_tokens - 1):
            tok, cache = self.step(self.weights, tok, cache)
            out.append(tok)
        jax.block_until_ready(out)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, np.stack([np.asarray(o) for o in out], 1), np.asarray(logits)


class TorchSide:
    def __init__(self, model):
        self.model = model

    def run(self, tokens: np.ndarray, new_tokens: int):
        import torch

        with torch.no_grad():
            ids = torch.as_tensor(tokens, dtype=torch.long)
            t0 = time.perf_counter()
            out = self.model(ids, use_cache=True)
            logits = out.logits[:, -1]
            tok = logits.argmax(-1)
            t1 = time.perf_counter()
            cache, toks = out.cache, [tok]
            for _ in range(new_tokens - 1):
                out = self.model(tok[:, None], cache=cache, use_cache=True)
                cache, tok = out.cache, out.logits[:, -1].argmax(-1)
                toks.append(tok)
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1, torch.stack(toks, 1).numpy(), logits.numpy()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/bench_deepseek_v4")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="mid")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="also split gsm_jax's decode step by named scope (one traced pass)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads per side (default: the libraries' defaults, all cores)")
    args = ap.parse_args()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)

    info = machine_info()
    print(f"building the {args.preset} model ...", flush=True)
    model, cfg, weights, n_params = build_models(args.preset, args.seed)
    print(f"{n_params / 1e6:.1f}M parameters", flush=True)
    torch_side = TorchSide(model)
    rng = np.random.default_rng(args.seed)
    rows, results = [], []
    for batch in args.batches:
        tokens = rng.integers(2, cfg.vocab_size, (batch, args.prompt_tokens)).astype(np.int32)
        jax_side = JaxSide(cfg, weights, batch, args.prompt_tokens + args.new_tokens)
        compile_times = jax_side.compile(tokens)
        print(f"batch {batch}: compiled {compile_times}", flush=True)
        times = {"gsm_jax": [], "transformers": []}
        outputs = {}
        sides = {"gsm_jax": jax_side, "transformers": torch_side}
        torch_side.run(tokens, 2)  # warm-up at this shape (allocator, oneDNN kernels)
        for r in range(args.repeats):
            for name in (("gsm_jax", "transformers") if r % 2 == 0
                         else ("transformers", "gsm_jax")):
                t_pre, t_dec, toks, first = sides[name].run(tokens, args.new_tokens)
                times[name].append((t_pre, t_dec))
                outputs[name] = (toks, first)
                print(f"  {name:12s} repeat {r}: prefill {t_pre:.3f}s decode {t_dec:.3f}s",
                      flush=True)
        same_rows = int(np.sum(np.all(outputs["gsm_jax"][0] == outputs["transformers"][0],
                                      axis=1)))
        ref = outputs["transformers"][1]
        logit_err = float(np.abs(outputs["gsm_jax"][1] - ref).max() / np.abs(ref).max())
        entry = {"batch": batch, "prompt_tokens": args.prompt_tokens,
                 "new_tokens": args.new_tokens, "greedy_rows_equal": same_rows,
                 "prefill_logits_max_rel_diff": logit_err, **compile_times}
        for name, ts in times.items():
            t_pre = statistics.median(t[0] for t in ts)
            t_dec = statistics.median(t[1] for t in ts)
            entry[name] = {
                "prefill_s": t_pre, "decode_s": t_dec,
                "prefill_tok_s": batch * args.prompt_tokens / t_pre,
                "decode_tok_s": batch * (args.new_tokens - 1) / t_dec,
                "raw": [{"prefill_s": a, "decode_s": b} for a, b in ts],
            }
        if args.profile:
            prof = jax_side.decode_profile(tokens)
            entry["gsm_jax"]["decode_profile_ms"] = prof["by_scope"]
            entry["gsm_jax"]["decode_profile_kind_ms"] = prof["by_kind"]
            top = list(prof["by_scope"].items())[:6] + list(prof["by_kind"].items())[:3]
            print("  decode step by scope (ms): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in top), flush=True)
        for kind in ("prefill_tok_s", "decode_tok_s"):
            entry[kind.replace("tok_s", "speedup")] = (entry["gsm_jax"][kind]
                                                       / entry["transformers"][kind])
        results.append(entry)
        rows.append([batch, entry["gsm_jax"]["prefill_tok_s"],
                     entry["transformers"]["prefill_tok_s"], entry["prefill_speedup"],
                     entry["gsm_jax"]["decode_tok_s"], entry["transformers"]["decode_tok_s"],
                     entry["decode_speedup"], f"{same_rows}/{batch}", f"{logit_err:.1e}"])
    out = Path(args.out)
    end_load = load_average()
    comparable = max(((info.get("load_average_1_5_15") or [0])[0]),
                     (end_load or [0])[0]) <= 1.5
    data = {"benchmark": "deepseek_v4 prefill/decode, gsm_jax vs transformers", "machine": info,
            "load_average_end": end_load, "comparable": comparable, "preset": args.preset,
            "params": n_params,
            "threads": args.threads, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(
                os, "sched_getaffinity") else None,
            "config": PRESETS[args.preset], "results": results}
    write_json(out / "results.json", data)
    table = markdown_table(
        ["batch", "prefill tok/s gsm_jax", "prefill tok/s transformers", "prefill x",
         "decode tok/s gsm_jax", "decode tok/s transformers", "decode x", "greedy rows equal",
         "first logits max rel diff"],
        rows)
    threads = "default threads" if args.threads is None else f"{args.threads} thread(s) per side"
    text = (f"# DeepSeek-V4 ({args.preset}, {n_params / 1e6:.0f}M params, fp32), "
            f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens, {threads}\n\n"
            f"{info.get('cpu_model', '')} ({info.get('cpu_count', '')} CPUs), "
            f"load average at the start {info.get('load_average_1_5_15')}, at the end "
            f"{end_load}: {'comparable' if comparable else 'NOT comparable (load > 1.5)'}"
            f"\n\n{table}")
    profiled = [r for r in results if "decode_profile_ms" in r["gsm_jax"]]
    if profiled:
        scopes = list(dict.fromkeys(k for r in profiled for k, v in
                                    r["gsm_jax"]["decode_profile_ms"].items()
                                    if v >= 0.01 * sum(r["gsm_jax"]["decode_profile_ms"].values())))
        text += ("\n\n## gsm_jax decode step by named scope (ms per step, layers merged; "
                 "scopes under 1% left out)\n\n")
        text += markdown_table(["scope", *[f"batch {r['batch']}" for r in profiled]],
                               [[s, *[r["gsm_jax"]["decode_profile_ms"].get(s) for r in profiled]]
                                for s in scopes])
        kinds = list(dict.fromkeys(k for r in profiled
                                   for k in r["gsm_jax"]["decode_profile_kind_ms"]))
        text += "\n\nThe same steps by kind of op (ms per step):\n\n"
        text += markdown_table(["kind", *[f"batch {r['batch']}" for r in profiled]],
                               [[k, *[r["gsm_jax"]["decode_profile_kind_ms"].get(k)
                                      for r in profiled]] for k in kinds])
    write_markdown(out / "results.md", text)
    try:
        bar_chart(out / "results.png", [f"batch {r[0]}" for r in rows],
                  {"prefill x": [r[3] for r in rows], "decode x": [r[6] for r in rows]},
                  title="gsm_jax / transformers throughput", ylabel="speedup")
    except Exception as e:  # matplotlib is optional for the numbers
        print(f"no chart: {e}")
    print(text)


if __name__ == "__main__":
    main()
