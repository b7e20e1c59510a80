"""Models on a mesh of forced host devices vs one device: decode tokens/s and the bytes
the compiled decode step communicates, against the cost model.

    python benchmarks/bench_mesh.py --out runs/bench_mesh

On one CPU, 8 "devices" are 8 XLA:CPU clients sharing the same cores and memory: a
collective is a memcpy plus a rendezvous of 8 threads, and the per-device work is
1/8 of a step each but runs on the same 2 cores. So the mesh is expected to be
*slower* than one device here; what this measures is that cost (the price of the
SPMD program's synchronisation on a machine where it buys nothing) and, from the
compiled program, how many bytes each device sends per decode step, by named scope,
beside the cost model of `models/moe.py` (expert dispatch) and of tensor parallelism
(two all-reduces of B x D per Llama layer). On real accelerators the same byte
counts go over NVLink / ICI.

Models: SmolLM2-135M (the real GGUF), a mid-size random DeepSeek-V4 (the
`bench_deepseek_v4_lowp` preset, float32) and a mid-size random DeepSeek-V4.1 (the
`bench_deepseek_v41` preset, float32, Engram tables row-sharded), one device against
meshes 1x8 and 2x4; for V4 and V4.1 both expert dispatches ("psum", "all_to_all") on
1x8. V4.1's cost model adds the Engram gather's all-reduce (`models/engram.py`), and V4.1
runs both Engram placements on 1x8 psum: tables row-sharded in device memory (the default)
and in pinned host memory (`engram_memory="host"`: gathered on the host, the rows copied
to the device; on XLA:CPU both memories are the same RAM, so the step time shows the
host path's extra work, not a PCIe transfer).
Decode tok/s of the whole `generate_tokens` call (median over interleaved rounds of a
long call minus a 1-token call). The load average is recorded around every timed block; a block that
starts above 1.5 (after waiting for the compile's load to settle) is marked not
comparable. During a block the load rises to ~3 from the benchmark's own device
threads; that is recorded, and expected.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

N_DEVICES = 8
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={N_DEVICES}").strip()

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

MAX_COMPARABLE_LOAD = 1.5


def smollm2():
    import gsm_jax

    return gsm_jax.load("smollm2-135m", dtype="float32")


def dsv4_mid(preset: str):
    import jax
    from bench_deepseek_v4_lowp import PRESETS

    import gsm_jax
    from gsm_jax.models import deepseek_v4 as dv

    hf = dict(PRESETS[preset])
    # heads, output groups and experts must divide the 8 devices' model axis
    if preset == "tiny":  # a smoke-test size
        hf.update(num_attention_heads=8, o_groups=8, n_routed_experts=8, vocab_size=1024)
    else:
        hf.update(o_groups=8)
    cfg = dv.DeepseekV4Config.from_hf_config(hf)
    return gsm_jax.ModelParams(dv.init_weights(cfg, jax.random.key(0)), cfg)


def dsv41_mid(preset: str):
    """The `bench_deepseek_v41` mid preset (every CSA2 role, two Engram layers of ~1.2 M
    rows), random float32 weights, with 32 experts and 8 output groups so that the model
    axis of 8 divides them; "tiny" for smoke runs."""
    import jax
    from bench_deepseek_v41 import PRESETS, _harness

    import gsm_jax
    from gsm_jax.models import deepseek_v41 as dv

    kw = dict(PRESETS[preset], n_routed_experts=32, num_attention_heads=8, o_groups=8)
    cfg = dv.DeepseekV41Config.from_hf_config(_harness().tiny_config(**kw))
    return gsm_jax.ModelParams(dv.init_weights(cfg, jax.random.key(0)), cfg)


def variants(params, family: str) -> dict:
    import jax

    import gsm_jax

    out = {"1 device": params}
    # V4 on 1x8: both expert dispatches ("auto" is one of them, psum here)
    dispatches = ("psum", "all_to_all") if family in ("deepseek_v4", "deepseek_v41") \
        else (None,)
    for dispatch in dispatches:
        cfg = params.config if dispatch is None else dataclasses.replace(
            params.config, expert_dispatch=dispatch)
        out[f"1x8 {dispatch}" if dispatch else "1x8"] = gsm_jax.shard(
            gsm_jax.ModelParams(params.weights, cfg, params.tokenizer),
            jax.make_mesh((1, 8), ("data", "model")))
    if getattr(params.config, "active_engram_layers", ()):
        # the other Engram placement: the same row split in pinned host memory
        cfg = dataclasses.replace(params.config, expert_dispatch="psum")
        out["1x8 psum engram-in-host-memory"] = gsm_jax.shard(
            gsm_jax.ModelParams(params.weights, cfg, params.tokenizer),
            jax.make_mesh((1, 8), ("data", "model")), engram_memory="host")
    out["2x4"] = gsm_jax.shard(params, jax.make_mesh((2, 4), ("data", "model")))
    return out


def engram_bytes_on_device0(params) -> dict:
    """Bytes of the Engram tables (and row scales) device 0 holds, by memory kind."""
    import jax

    out: dict = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(params.weights):
        if not jax.tree_util.keystr(path).endswith(("['table']", "['table_scale']")):
            continue
        shard = next(s for s in leaf.addressable_shards if s.device.id == 0)
        kind = getattr(leaf.sharding, "memory_kind", None) or "device"
        out[kind] = out.get(kind, 0) + shard.data.nbytes
    return out


def decode_collectives(params, batch: int, prompt_len: int) -> dict | None:
    """Collectives of the compiled decode step (cache from a real prefill, so its
    shardings are the ones generate runs with)."""
    import jax
    import jax.numpy as jnp

    from gsm_jax.collectives import collective_summary
    from gsm_jax.families import family_module
    from gsm_jax.sharding import batch_sharding, mesh_of

    mesh = mesh_of(params.weights)
    if mesh is None:
        return None
    cfg, fam = params.config, family_module(params.config.family)
    tokens = jax.device_put(np.ones((batch, prompt_len), np.int32), batch_sharding(mesh, 2))
    lengths = jax.device_put(np.full((batch,), prompt_len, np.int32), batch_sharding(mesh, 1))
    with jax.set_mesh(mesh):
        cache = fam.init_cache(cfg, batch, prompt_len + 8, dtype=jnp.float32)
        _, cache = jax.jit(lambda w, t, n, c: fam.prefill(w, cfg, t, n, c))(
            params.weights, tokens, lengths, cache)
        step = jax.jit(lambda w, t, c: fam.decode_step(w, cfg, t, c))
        text = step.lower(params.weights, lengths, cache).compile().as_text()
    return collective_summary(text, mesh.size)


def cost_model(params, mesh_shape: tuple[int, int], batch: int, dispatch: str,
               host_tables: bool = False) -> dict:
    """Bytes per device per decode step predicted for the parts with a model
    (`host_tables`: V4.1's Engram tables in host memory)."""
    from gsm_jax.models.moe import choose_dispatch, dispatch_bytes

    cfg = params.config
    data, m = mesh_shape
    t = batch // data
    share = (m - 1) / m
    out = {}  # (the vocabulary-split logits stay split inside the step: no line for them)
    if cfg.family in ("deepseek_v4", "deepseek_v41"):
        if dispatch == "auto":
            dispatch = choose_dispatch(t, cfg.num_experts_per_tok, cfg.hidden_size, m, 4,
                                       ragged=False)
        per_layer = dispatch_bytes(t, cfg.num_experts_per_tok, cfg.hidden_size, m, 4,
                                   ragged=False)[dispatch]
        out["routed experts"] = per_layer * cfg.num_layers
        if cfg.family == "deepseek_v41" and cfg.active_engram_layers:
            from gsm_jax.models.engram import gather_bytes

            n_ids = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
            # float32 tables here: the partial rows are summed in float32
            out["engram"] = len(cfg.active_engram_layers) * gather_bytes(
                t, n_ids, cfg.engram_head_dim, m, itemsize=4)
            if host_tables:  # + the gathered rows copied host -> device (not a collective)
                from gsm_jax.models.engram import host_copy_bytes

                out["engram host copy (not a collective)"] = len(
                    cfg.active_engram_layers) * host_copy_bytes(
                    t, n_ids, cfg.engram_head_dim, itemsize=4, scale_itemsize=4)
    else:
        out["tensor-parallel all-reduces"] = cfg.num_layers * 2 * 2 * t * cfg.hidden_size * 4 \
            * share
    return out


def settle(limit: float = 1.0, wait_s: float = 120.0) -> None:
    """Wait (at most wait_s) for the 1-minute load average to fall below `limit` after
    compiling, so a timed block starts on a quiet machine. During the block the load
    includes this process's own device threads (8 XLA:CPU clients on the same cores)."""
    import time

    end = time.time() + wait_s
    while time.time() < end and (common.load_average() or [0])[0] >= limit:
        time.sleep(5)


def measure(params_by_variant: dict, batch: int, prompt_len: int, new_tokens: int,
            repeats: int, vocab: int, settle_s: float = 120.0) -> dict:
    fns = common.short_and_long_calls(params_by_variant, batch, prompt_len, new_tokens, vocab)
    ref = None
    equal = {}
    for key, fn in fns.items():  # compile every program before timing; tokens agree?
        toks = fn()
        if key.endswith(f"|{new_tokens}"):
            ref = toks if ref is None else ref
            equal[key.split("|")[0]] = all(np.array_equal(a, b)
                                           for a, b in zip(toks, ref, strict=True))
    settle(wait_s=settle_s)
    load_before = common.load_average()
    times = common.interleaved(fns, repeats)
    load_after = common.load_average()
    out = {"load_average_before": load_before, "load_average_after": load_after,
           # the load *after* includes this block's own 8 device threads on the same cores
           # (about 3 on 2 cores); what says no other process competed is the load before
           "comparable": (load_before or [0])[0] <= MAX_COMPARABLE_LOAD, "variants": {}}
    for name in params_by_variant:
        short = np.asarray(times[f"{name}|1"])
        long = np.asarray(times[f"{name}|{new_tokens}"])
        decode_s = float(np.median(long - short))
        out["variants"][name] = {
            "decode_s": common.summarize((long - short).tolist()),
            "decode_tok_s": batch * (new_tokens - 1) / decode_s if decode_s > 0 else None,
            "generate_tok_s": batch * new_tokens / float(np.median(long)),
            "greedy_equal_to_one_device": equal[name]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report-only", action="store_true",
                    help="re-render results.md / .png from --out's results.json")
    ap.add_argument("--out", default="runs/bench_mesh")
    ap.add_argument("--models", default="smollm2,dsv4,dsv41")
    ap.add_argument("--dsv4-preset", default="mid", choices=("mid", "tiny"),
                    help="size of the random DeepSeek-V4 and V4.1 models")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--settle-s", type=float, default=120.0,
                    help="wait at most this long for the load to fall below 1 before timing "
                         "(0 for smoke runs, whose times are not read)")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report_only:
        write_report(out, json.loads((out / "results.json").read_text()))
        return
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"machine": common.machine_info(), "args": vars(args), "models": {}}
    for model in args.models.split(","):
        print(f"[bench_mesh] {model}: building the variants", flush=True)
        build = {"smollm2": smollm2, "dsv4": lambda: dsv4_mid(args.dsv4_preset),
                 "dsv41": lambda: dsv41_mid(args.dsv4_preset)}
        if model not in build:
            raise SystemExit(f"--models: unknown model {model!r}; one of {sorted(build)}")
        params = build[model]()
        family = params.config.family
        by_variant = variants(params, family)
        print(f"[bench_mesh] {model}: compiling and timing {list(by_variant)}", flush=True)
        r = measure(by_variant, args.batch, args.prompt_len, args.new_tokens, args.repeats,
                    params.config.vocab_size, settle_s=args.settle_s)
        for name, p in by_variant.items():
            if name == "1 device":
                continue
            shape = tuple(int(x) for x in name.split()[0].split("x"))
            dispatch = name.split()[1] if " " in name else "auto"
            r["variants"][name]["collectives"] = decode_collectives(p, args.batch,
                                                                    args.prompt_len)
            host_tables = "engram-in-host-memory" in name
            r["variants"][name]["cost_model"] = cost_model(p, shape, args.batch, dispatch,
                                                           host_tables)
            if getattr(p.config, "active_engram_layers", ()):
                r["variants"][name]["engram_bytes_device0"] = engram_bytes_on_device0(p)
        result["models"][model] = r
        common.write_json(out / "results.json", result)
    write_report(out, result)


def write_report(out: Path, r: dict) -> None:
    kb = 1e3
    text = (f"# Decode on a mesh of {N_DEVICES} forced host devices vs one device\n\n"
            f"Machine: {r['machine'].get('cpu_model')}, {r['machine'].get('cpu_count')} "
            f"cores. Command: `python benchmarks/bench_mesh.py` (arguments in "
            f"results.json); batch {r['args']['batch']}, prompt {r['args']['prompt_len']}, "
            f"{r['args']['new_tokens']} new tokens, float32.\n\n")
    rows, coll_rows = [], []
    for model, m in r["models"].items():
        base = m["variants"]["1 device"]["decode_tok_s"]
        load = f"{m['load_average_before'][0]} / {m['load_average_after'][0]}"
        for name, v in m["variants"].items():
            rows.append((model, name, v["decode_tok_s"],
                         # None: a decode time that came out <= 0 (a loaded machine)
                         None if not base or v["decode_tok_s"] is None
                         else v["decode_tok_s"] / base,
                         "yes" if v["greedy_equal_to_one_device"] else "NO", load,
                         "yes" if m["comparable"] else "NO (load > 1.5)"))
            c = v.get("collectives")
            if c:
                scopes = ", ".join(f"{s} {b / kb:.1f}" for s, b in sorted(
                    c["by_scope"].items(), key=lambda kv: -kv[1])[:4])
                model_kb = ", ".join(f"{k} {b / kb:.1f}" for k, b in v["cost_model"].items())
                eng = v.get("engram_bytes_device0")
                if eng:
                    model_kb += "; Engram tables on device 0: " + ", ".join(
                        f"{k} {b / 1e6:.2f} MB" for k, b in sorted(eng.items()))
                coll_rows.append((model, name, c["ops"], c["bytes_per_device"] / kb,
                                  scopes, model_kb))
    text += common.markdown_table(["model", "devices", "decode tok/s", "x one device",
                                   "greedy = one device", "load before / after",
                                   "comparable"], rows, 2)
    text += ("\n(load after: the block's own 8 device threads on the machine's cores; "
             "comparable = the block started below 1.5.)\n")
    text += ("\n## Bytes each device sends per decode step (compiled program, ring model)\n\n"
             + common.markdown_table(["model", "mesh", "collectives", "kB per device",
                                      "largest scopes (kB)", "cost model (kB)"], coll_rows, 1))
    common.write_markdown(out / "results.md", text)
    groups = list(r["models"])
    names = sorted({n for m in r["models"].values() for n in m["variants"]},
                   key=lambda n: (n != "1 device", n))
    common.bar_chart(out / "results.png", groups,
                     {n: [r["models"][g]["variants"].get(n, {}).get("decode_tok_s")
                          for g in groups] for n in names},
                     title=f"decode tokens/s, {N_DEVICES} forced host devices vs one",
                     ylabel="tokens/s")
    print(text)


if __name__ == "__main__":
    main()
