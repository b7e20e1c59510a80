"""DSpark speculative decoding on DeepSeek-V4.1 vs plain greedy decoding, whole calls.

    python benchmarks/bench_dspark.py --threads 1 --out runs/bench_dspark
    python benchmarks/bench_dspark.py --preset tiny --new-tokens 12 --repeats 1 --settle-s 0 \
        --out /tmp/bench_dspark_quick   # smoke run (seconds after compiling)

The model: the mid-size random V4.1 of `bench_deepseek_v41.py` (8 layers with every CSA2
role, Engram at 1 and 5, 30 experts top-4, float32) plus a random 3-stage DSpark draft
targeting layers 5-7 (16 experts top-3, Markov rank 64). Random weights: the draft's
proposals are accepted about never, so the figure that matters on real weights, tokens per
verify step, is ~1 here and says nothing about V4.1-Flash; it is reported anyway. What this
run can say is what a round costs, so three whole `generate` calls of `--new-tokens` tokens
from the same prompt are timed, interleaved:

- `greedy`: `gsm_jax.generate_tokens` (prefill + one decode step per token);
- `dspark`: `gsm_jax.speculative.dspark_generate` with the random draft (acceptance ~0:
  a round = draft + verify of 6 tokens + rollback, for one token);
- `dspark_oracle`: the same loop, the draft still run (its cost counted) but its proposals
  replaced by the greedy continuation (acceptance 100%: 6 tokens per round, the upper
  bound of this machinery on this machine).

Also the cost of each piece of a round, jitted and timed alone: one decode step, one draft
call, one verify (6 tokens), one rollback commit; and the break-even: the tokens per round
at which a round costs what that many decode steps cost.

Every timed block records the load average; a figure with a 1-minute load above 1.5 is
marked not comparable. Outputs in `--out`: results.json, results.md, results.png.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (no jax at import)

if common.threads_arg() == 1 and hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

import bench_deepseek_v41 as b41  # noqa: E402  (its presets; no jax at import)

MAX_COMPARABLE_LOAD = 1.5
DRAFT = dict(num_nextn_predict_layers=3, dspark_target_layer_ids=[5, 6, 7],
             dspark_markov_rank=64, dspark_n_routed_experts=16, dspark_num_experts_per_tok=3,
             dspark_block_size=5, dspark_noise_token_id=127)


def build(preset: str, seed: int):
    """(ModelParams of the random target, the random draft's weights)."""
    import jax

    sys.path.insert(0, str(b41.TESTS_DIR))
    import v41_reference as ref

    from gsm_jax.models import deepseek_v41 as dv
    from gsm_jax.models import deepseek_v41_dspark as ds
    from gsm_jax.params import ModelParams

    kw = {**b41.PRESETS[preset], **DRAFT}
    kw["compress_ratios"] = list(kw["compress_ratios"]) + [0, 0, 0]
    if preset == "tiny":
        kw.update(dspark_markov_rank=8, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2)
    cfg = dv.DeepseekV41Config.from_hf_config(ref.tiny_config(**kw))
    return (ModelParams(dv.init_weights(cfg, jax.random.key(seed)), cfg),
            ds.init_weights(cfg, jax.random.key(seed + 1)))


def _loads(before, after) -> dict:
    return {"load_average_before": before, "load_average_after": after,
            "comparable": max((before or [0])[0], (after or [0])[0]) <= MAX_COMPARABLE_LOAD}


def measure_calls(params, dw, prompt, new_tokens: int, repeats: int) -> dict:
    """Whole calls, interleaved; plus the oracle's tokens per round."""
    import jax.numpy as jnp
    import numpy as np

    import gsm_jax.speculative as spec
    from gsm_jax.generation import generate_tokens

    greedy = generate_tokens(params, [prompt], max_new_tokens=new_tokens + 6, eos_ids=[])[0]
    seq = np.concatenate([prompt, greedy]).astype(np.int32)
    real_draft = spec._dspark_draft

    def oracle(weights, dw_, cur, anchor, ring, ring_pos, *, config, draft_len):
        real_draft(weights, dw_, cur, anchor, ring, ring_pos, config=config,
                   draft_len=draft_len).block_until_ready()  # the draft's cost, counted
        a = int(anchor[0])
        return jnp.asarray(seq[None, a + 1:a + 1 + draft_len])

    def run_oracle():
        spec._dspark_draft = oracle
        try:
            return spec.dspark_generate(params, prompt, max_new_tokens=new_tokens,
                                        eos_ids=[], draft=dw)
        finally:
            spec._dspark_draft = real_draft

    fns = {
        "greedy": lambda: generate_tokens(params, [prompt], max_new_tokens=new_tokens,
                                          eos_ids=[]),
        "dspark": lambda: spec.dspark_generate(params, prompt, max_new_tokens=new_tokens,
                                               eos_ids=[], draft=dw),
        "dspark_oracle": run_oracle,
    }
    results = {k: f() for k, f in fns.items()}  # compile
    for k in ("dspark", "dspark_oracle"):
        assert (results[k].tokens == greedy[:new_tokens]).all(), f"{k} != greedy"
    b41.settle()
    before = common.load_average()
    times = common.interleaved(fns, repeats)
    after = common.load_average()
    out = {"new_tokens": new_tokens, "prompt_len": int(prompt.size), "repeats": repeats,
           **_loads(before, after)}
    for k, ts in times.items():
        out[k] = {"median_s": float(np.median(ts)), "all_s": ts,
                  "tokens_per_s": new_tokens / float(np.median(ts))}
    for k in ("dspark", "dspark_oracle"):
        r = results[k]
        out[k].update(rounds=r.rounds, accepted=r.accepted,
                      tokens_per_verify_step=r.tokens_per_round,
                      x_greedy=out["greedy"]["median_s"] / out[k]["median_s"])
    return out


def measure_pieces(params, dw, prompt, repeats: int) -> dict:
    """One decode step, one draft call, one verify of 6 tokens, one rollback commit (m=0),
    each jitted and timed alone from the same prefilled state."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gsm_jax.speculative as spec
    from gsm_jax.models import deepseek_v41 as dv

    cfg = params.config
    w = params.weights
    tokens = np.asarray(prompt[None], np.int32)
    n = np.asarray([prompt.size], np.int32)
    cur, cache, ring, ring_pos = spec._dspark_prefill(w, tokens, n, None, config=cfg,
                                                      cache_len=prompt.size + 64)
    anchor = jnp.asarray(n)
    decode = jax.jit(lambda w, t, c: dv.decode_step(w, cfg, t, c))
    drafts = spec._dspark_draft(w, dw, cur, anchor, ring, ring_pos, config=cfg, draft_len=5)
    _, m, feats, grown = spec._dspark_verify(w, cur, drafts, cache, None, config=cfg)
    zero = jnp.zeros((1,), jnp.int32)
    fns = {
        "decode_step": lambda: decode(w, cur, cache),
        "draft": lambda: spec._dspark_draft(w, dw, cur, anchor, ring, ring_pos, config=cfg,
                                            draft_len=5),
        "verify_6": lambda: spec._dspark_verify(w, cur, drafts, cache, None, config=cfg),
        "commit_rollback": lambda: spec._dspark_commit(w, cache, grown, cur, drafts, zero,
                                                       None, ring, ring_pos, feats, anchor,
                                                       config=cfg),
    }
    for f in fns.values():
        jax.block_until_ready(f())
    b41.settle()
    before = common.load_average()
    times = common.interleaved(fns, repeats)
    after = common.load_average()
    ms = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    step = ms["decode_step"]
    full_round = ms["draft"] + ms["verify_6"]  # all accepted: no rollback
    return {"ms": ms, **_loads(before, after),
            "x_decode_step": {k: v / step for k, v in ms.items()},
            "break_even_tokens_per_round_all_accepted": full_round / step,
            "round_ms_with_rollback": full_round + ms["commit_rollback"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(b41.PRESETS), default="mid")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle-s", type=float, default=120.0)
    ap.add_argument("--out", default="runs/bench_dspark")
    args = ap.parse_args()
    b41.SETTLE_S = args.settle_s
    import numpy as np

    out = Path(args.out)
    t0 = time.time()
    print(f"[bench_dspark] building the {args.preset} model + draft", flush=True)
    params, dw = build(args.preset, args.seed)
    prompt = np.random.default_rng(args.seed).integers(3, 127, args.prompt_len).astype(np.int32)
    print("[bench_dspark] whole calls (compiling first)", flush=True)
    calls = measure_calls(params, dw, prompt, args.new_tokens, args.repeats)
    print("[bench_dspark] pieces of a round", flush=True)
    pieces = measure_pieces(params, dw, prompt, max(3, 3 * args.repeats))
    r = {"machine": common.machine_info(), "preset": args.preset, "args": vars(args),
         "config": {**b41.PRESETS[args.preset], **DRAFT}, "calls": calls, "pieces": pieces,
         "wall_s": time.time() - t0,
         "note": "random weights: the draft is accepted ~never; tokens per verify step on "
                 "real V4.1-Flash weights cannot be measured here"}
    common.write_json(out / "results.json", r)
    write_report(out, r)
    print((out / "results.md").read_text())


def write_report(out: Path, r: dict) -> None:
    c, p = r["calls"], r["pieces"]
    rows = [[k, common.fmt(c[k]["median_s"], 3), common.fmt(c[k]["tokens_per_s"], 1),
             common.fmt(c[k].get("tokens_per_verify_step", 1.0), 2),
             common.fmt(c["greedy"]["median_s"] / c[k]["median_s"], 2)]
            for k in ("greedy", "dspark", "dspark_oracle")]
    md = [f"# DSpark speculative decoding vs greedy ({r['preset']} V4.1, random weights)", "",
          f"{c['new_tokens']} new tokens after a {c['prompt_len']}-token prompt, batch 1, "
          f"median of {c['repeats']} interleaved whole calls; load "
          f"{c['load_average_before']} -> {c['load_average_after']}"
          f"{'' if c['comparable'] else ' (NOT comparable: load > 1.5)'}.", "",
          common.markdown_table(["call", "s", "tok/s", "tokens / verify step", "x greedy"],
                                rows), "",
          "Pieces of a round (ms, median; load "
          f"{p['load_average_before']} -> {p['load_average_after']}"
          f"{'' if p['comparable'] else ', NOT comparable'}):", "",
          common.markdown_table(["piece", "ms", "x decode step"],
                                [[k, common.fmt(v, 2), common.fmt(p["x_decode_step"][k], 2)]
                                 for k, v in p["ms"].items()]), "",
          f"Break-even with every proposal accepted: a round (draft + verify of 6) costs "
          f"{common.fmt(p['break_even_tokens_per_round_all_accepted'], 2)} decode steps, so "
          "DSpark wins when a round yields more tokens than that.", "",
          f"Note: {r['note']}."]
    common.write_markdown(out / "results.md", "\n".join(md))
    common.bar_chart(out / "results.png", ["tok/s"],
                     {k: [c[k]["tokens_per_s"]] for k in ("greedy", "dspark", "dspark_oracle")},
                     title=f"DSpark vs greedy, {r['preset']} V4.1 (random weights)",
                     ylabel="tokens / s")


if __name__ == "__main__":
    main()
