"""Random-weight models for the cost claims (`gsm-jax evidence --models random:<preset>`,
issue 25 item 3): the checkpoint written from the released layout alone, its provenance,
the KV-cache kinds of V4.1 (float / released), claim 13's speed-only form, and the report
marking such a model "random weights: cost only" apart from the trained ones."""

from __future__ import annotations

import json

import numpy as np
import pytest

import gsm_jax
from gsm_jax.errors import InvalidInputError, UnsupportedModelError
from gsm_jax.models import common
from gsm_jax.workflow.evidence import random_models as rm

TINY = "random:deepseek-v4.1-tiny"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return rm.materialize(TINY, root=tmp_path_factory.mktemp("random_models"))


def test_random_checkpoint_is_the_released_layout(tiny_dir):
    """Every tensor the release's layout names for this config, and no other, with the
    stored dtypes of `released_layout`; the provenance says random; a second call reuses
    the folder; the weights follow the stated draws (norms ~1, projections ~0.02)."""
    from gsm_jax.models.deepseek_v41_checkpoint import random_tensors, released_layout
    from gsm_jax.models.safetensors_io import SafetensorsStore

    hf = json.loads((tiny_dir / "config.json").read_text())
    store = SafetensorsStore(tiny_dir)
    want = released_layout(hf, vision=False, mtp=False)
    assert set(store) == set(want)
    for name, (shape, dtype) in want.items():
        info = store.info(name)
        assert info.shape == tuple(shape) and info.dtype == dtype, name
    prov = rm.provenance(tiny_dir)
    assert prov["weights"] == "random" and prov["preset"] == "deepseek-v4.1-tiny"
    assert rm.materialize(TINY, root=tiny_dir.parent) == tiny_dir
    t = random_tensors(hf, 0)
    norm = t["layers.0.attn_norm.weight"]
    proj = t["layers.0.attn.wq_a.weight"]
    assert abs(norm.mean() - 1) < 0.05 and 0.05 < norm.std() < 0.15
    assert abs(proj.std() - 0.02) < 0.002
    assert not np.array_equal(random_tensors(hf, 1)["layers.0.attn.wq_a.weight"], proj)


def test_random_model_loads_and_runs(tiny_dir):
    params = gsm_jax.load(str(tiny_dir))
    assert params.family == "deepseek_v41" and params.config.cache_qdq
    assert params.tokenizer.vocab_size == params.config.vocab_size
    ids = params.tokenizer.encode("The history of the river and the city")
    logits = np.asarray(gsm_jax.forward(params, [ids]))
    assert logits.shape == (1, len(ids), params.config.vocab_size)
    assert np.isfinite(logits).all()


def test_unknown_random_model_is_refused_by_name():
    from gsm_jax.workflow.evidence.runner import check_models

    with pytest.raises(InvalidInputError, match="random:deepseek-v4.1-mid"):
        check_models(["random:llama-7b"])
    assert check_models([TINY]) == [TINY]


def test_v41_kv_cache_kinds(tiny_dir):
    """V4.1 takes 'released' (its default: the release's roundings) and 'float' (none);
    int8 / fp8 are refused by name, and 'released' is refused for a family without one."""
    cfg = gsm_jax.load(str(tiny_dir)).config
    assert common.config_with_kv_cache_dtype(cfg, "float").cache_qdq is False
    assert common.config_with_kv_cache_dtype(cfg, "released") is cfg
    assert common.config_with_kv_cache_dtype(cfg, "auto") is cfg
    for kind in ("int8", "fp8"):
        with pytest.raises(UnsupportedModelError, match="released"):
            common.config_with_kv_cache_dtype(cfg, kind)
    from gsm_jax.models.llama import LlamaConfig

    llama = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16)
    with pytest.raises(UnsupportedModelError, match="no released cache format"):
        common.config_with_kv_cache_dtype(llama, "released")
    assert common.config_with_kv_cache_dtype(llama, "fp8").kv_cache_dtype == "fp8"


def test_claim13_cost_only_verdict():
    from gsm_jax.workflow.evidence import kv_claims as kc

    def d(mean, se):
        return {"mean": mean, "stderr": se, "z": mean / se}

    assert kc.claim13_verdict({"released": {"speed": d(0.05, 0.01), "quality": None}},
                              cost_only=True)[0] == "supported"
    assert kc.claim13_verdict({"released": {"speed": d(0.01, 0.01), "quality": None}},
                              cost_only=True)[0] == "refuted"
    # without cost_only a format lacking its quality side does not count
    assert kc.claim13_verdict({"released": {"speed": d(0.05, 0.01), "quality": None}}
                              )[0] == "not testable here"


def test_evidence_on_a_random_v41_is_cost_only(tiny_dir, tmp_path, monkeypatch):
    """`run_evidence` on `random:...`: the checkpoint comes from GSM_JAX_RANDOM_MODELS;
    claim 4 (quality) is written as not testable without running; claim 13 runs its four
    V4.1 arms (float / released cache x GSM off / on, the cache kinds checked on the params
    each arm was given) and no quality arm; the report labels the column and answers apart
    for the target's architecture."""
    from gsm_jax.workflow import overhead
    from gsm_jax.workflow.evidence import runner
    from gsm_jax.workflow.evidence.runner import EvidenceSizes, run_evidence

    monkeypatch.setenv("GSM_JAX_RANDOM_MODELS", str(tiny_dir.parent))
    seen = {}

    def rounds(arms, **kw):  # known decode times: released x GSM 10% faster than the product
        seen.update({n: (p.config.cache_qdq, g is not None) for n, (p, g) in arms.items()})
        secs = {"float/off": 0.02, "float/on": 0.022, "released/off": 0.021,
                "released/on": 0.021}
        return {n: {"decode_s": [secs[n] * (1 + 0.01 * i) for i in range(kw["repeats"])]}
                for n in arms}

    monkeypatch.setattr(overhead, "generate_call_rounds", rounds)
    evaluated = []
    monkeypatch.setattr("gsm_jax.workflow.evidence.kv_claims.evaluate_arms",
                        lambda *a, **k: evaluated.append(1))
    md = run_evidence([TINY], tmp_path, sizes=EvidenceSizes.smoke(), claims=[4, 13],
                      progress=False, smoke=False)
    assert seen == {"float/off": (False, False), "float/on": (False, True),
                    "released/off": (True, False), "released/on": (True, True)}
    assert not evaluated  # no quality arm on random weights
    edir = runner.evidence_dir(tmp_path, TINY)
    r4 = json.loads((edir / "claim_4.json").read_text())
    assert r4["verdict"] == "not testable here" and rm.COST_ONLY in r4["why"]
    r13 = json.loads((edir / "claim_13.json").read_text())
    assert r13["weights_kind"] == "random" and r13["provenance"]["seed"] == 0
    assert r13["verdict"] == "supported", r13["why"]  # +4.8% interaction, z >> 2
    assert r13["numbers"]["interactions"]["released"]["quality"] is None
    assert "Random weights, cost only" in r13["why"]
    # the released arm's caches are held packed: fewer bytes per cached token, in the why
    arms = r13["numbers"]["arms"]
    packed, flt = (arms[f"{k}/off"]["cache_bytes_per_token"] for k in ("released", "float"))
    assert 0 < packed < flt / 3, (packed, flt)
    assert f"{packed:.0f} B per cached token against {flt:.0f} B float" in r13["why"]
    text = md.read_text()
    assert f"| {TINY} ({rm.COST_ONLY}) |" in text
    assert f"DeepSeek-V4.1-Flash's architecture, {rm.COST_ONLY}" in text
    assert "claim 13 supported" in text


def test_answer_keeps_random_weights_apart():
    """Trained models decide the verdicts; a random-weight V4.1 adds its cost claims in a
    bullet of its own and a sentence on claim 1, and never enters claim 3's verdict."""
    from gsm_jax.workflow.evidence import render

    def res(n, verdict, **kw):
        return {"claim": n, "verdict": verdict, "why": f"claim {n} why", "measurement": f"m{n}",
                "family": "llama", "num_layers": 4, "hidden_size": 32, "smoke": False, **kw}

    trained = {m: {1: res(1, "refuted"), 3: res(3, "refuted")} for m in ("a", "b")}
    rnd = dict(family="deepseek_v41", num_layers=8, hidden_size=512, weights_kind="random")
    results = {**trained, "r": {1: res(1, "refuted", **rnd), 3: res(3, "not testable here",
                                                                    **rnd),
                                13: res(13, "supported", **rnd)}}
    text = "\n".join(render.answer_section(list(results), results))
    assert "No evidence that it does" in text and "claim 3: refuted on both" in text
    assert "agrees on cost: smoothing makes its decode step slower too" in text
    assert (f"DeepSeek-V4.1-Flash's architecture, {rm.COST_ONLY}**: `r` (deepseek_v41, 8 "
            "layers x 512); claim 1 refuted (r: m1); claim 13 supported (r: m13)") in text
    assert "configuration with random weights" in text
    only_random = {"r": results["r"]}
    text = "\n".join(render.answer_section(["r"], only_random))
    assert "Not answered yet: only random weights were measured" in text
