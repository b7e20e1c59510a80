"""Step-time overhead of GSM: jitted prefill and decode step, GSM compiled out vs in.

Shared by the model report (`gsm_jax.workflow.report`, question 4) and the evidence
(`gsm_jax.workflow.evidence.quality_claims`, claim 1), so that neither imports the other.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.config import GSMConfig
from gsm_jax.families import family_module
from gsm_jax.gsm_runtime import gsm_inputs_for_batch
from gsm_jax.workflow.results import OverheadRow


def measure_overhead(params: Any, configs: dict[str, GSMConfig | None], *, batch: int = 8,
                     prompt: int = 256, steps: int = 32, reps: int = 3,
                     progress: bool = True) -> list[OverheadRow]:
    """Prefill and decode-step time per config (None = GSM compiled out), interleaved.

    Prefill: one jitted `prefill` of ``batch`` rows x ``prompt`` tokens. Decode:
    ``steps`` jitted `decode_step` calls (cache donated) from that prefill. Each
    repetition runs every config once, in rotating order, so drift of a shared
    machine falls on all; the median over repetitions is reported (ms per call).
    """
    cfg = params.config
    fam = family_module(cfg.family)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt)), jnp.int32)
    lengths = jnp.full((batch,), prompt, jnp.int32)
    cache_len = prompt + steps
    dtype = jax.tree.leaves(params.weights)[0].dtype

    @functools.partial(jax.jit, static_argnames=("max_window",))
    def prefill(weights, tokens, lengths, gsm, *, max_window):
        cache = fam.init_cache(cfg, batch, cache_len, dtype=dtype, gsm_max_window=max_window)
        return fam.prefill(weights, cfg, tokens, lengths, cache, gsm)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def step(weights, tok, cache, gsm):
        logits, cache = fam.decode_step(weights, cfg, tok, cache, gsm)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    # rings sized as `generate` sizes them for these lengths (`ring_rows`): the programs
    # measured are the ones a user's call runs (a 64-row ring for a window of 8 made the
    # GSM decode step's compile 7x longer and read nothing more)
    gsm_in = {name: None if c is None else gsm_inputs_for_batch(
        c, cfg.num_layers, batch, [prompt + steps] * batch, fit_ring=True)
        for name, c in configs.items()}
    mw = {name: None if g is None else g.max_window for name, g in gsm_in.items()}
    times: dict[str, dict[str, list[float]]] = {n: {"prefill": [], "decode": []} for n in configs}

    def once(name: str, record: bool) -> None:
        g = gsm_in[name]
        t0 = time.perf_counter()
        logits, cache = prefill(params.weights, tokens, lengths, g, max_window=mw[name])
        jax.block_until_ready(logits)
        t1 = time.perf_counter()
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        jax.block_until_ready(tok)
        t2 = time.perf_counter()
        for _ in range(steps):
            tok, cache = step(params.weights, tok, cache, g)
        jax.block_until_ready(tok)
        t3 = time.perf_counter()
        if record:
            times[name]["prefill"].append(t1 - t0)
            times[name]["decode"].append((t3 - t2) / steps)

    from tqdm import tqdm

    names = list(configs)
    for name in tqdm(names, desc="overhead: compile", disable=not progress, leave=False):
        once(name, record=False)
    for r in tqdm(range(reps), desc="overhead", disable=not progress, leave=False):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            once(name, record=True)
    rows: list[OverheadRow] = []
    for name in names:
        for kind in ("prefill", "decode"):
            v = np.asarray(times[name][kind]) * 1e3
            rows.append({"config": name, "step": kind, "median_ms": float(np.median(v)),
                         "min_ms": float(v.min()), "max_ms": float(v.max()), "reps": int(v.size),
                         "batch": batch, "prompt": prompt})
    return rows


def generate_call_rounds(arms: dict[str, tuple[Any, GSMConfig | None]], *, batch: int,
                         prompt_len: int, new_tokens: int, repeats: int, seed: int = 0,
                         progress: bool = False) -> dict[str, dict[str, list[float]]]:
    """Decode time of whole greedy `generate_tokens` calls, per arm (name -> (params, GSM
    config or None)), round by round.

    For each arm a 1-token and a `new_tokens`-token call on the same random rows (EOS
    ignored, so every arm does the same work), timed as neighbours; long minus short is the
    decode of `new_tokens - 1` tokens under the same conditions. Every program is compiled
    (both calls run once) before timing; each round runs every arm, in an order that
    rotates between rounds, so drift of a shared machine falls on all. Returns
    {name: {"short_s": [...], "long_s": [...], "decode_s": [...]}}, one entry per round,
    so that ratios between arms can be paired round by round."""
    from tqdm import tqdm

    from gsm_jax.generation import generate_tokens

    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time a decode, got {new_tokens}")
    names = list(arms)
    vocab = min(int(p.config.vocab_size) for p, _ in arms.values())
    rng = np.random.default_rng(seed)
    rows = [rng.integers(2, vocab, prompt_len).tolist() for _ in range(batch)]

    def call(name: str, n: int) -> float:
        p, g = arms[name]
        t = time.perf_counter()
        jax.block_until_ready(generate_tokens(p, rows, max_new_tokens=n, eos_ids=[], gsm=g))
        return time.perf_counter() - t

    for name in tqdm(names, desc="generate: compile", disable=not progress, leave=False):
        call(name, 1)
        call(name, new_tokens)
    out = {n: {"short_s": [], "long_s": [], "decode_s": []} for n in names}
    for r in tqdm(range(repeats), desc="generate", disable=not progress, leave=False):
        for name in names[r % len(names):] + names[: r % len(names)]:
            short = call(name, 1)
            long = call(name, new_tokens)
            out[name]["short_s"].append(short)
            out[name]["long_s"].append(long)
            out[name]["decode_s"].append(long - short)
    return out
