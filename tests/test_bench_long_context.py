"""Smoke run of benchmarks/bench_long_context.py (so it cannot rot): the three families'
tiny configs at two contexts, in-process, and what it writes. No timing assertions."""

from __future__ import annotations

import json

import pytest
from conftest import import_benchmark


@pytest.fixture(scope="module")
def bench():
    return import_benchmark("bench_long_context")


def test_quick_tiny_run_writes_every_model_and_context(bench, tmp_path):
    out = tmp_path / "lc"
    assert bench.main(["--size", "tiny", "--quick", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert list(res["models"]) == list(bench.MODELS)
    families = {r["config"]["family"] for r in res["models"].values()}
    assert families == {"deepseek_v4", "deepseek_v41", "llama"}
    for name, r in res["models"].items():
        assert list(r["contexts"]) == ["256", "1024"], name
        small, big = r["contexts"]["256"], r["contexts"]["1024"]
        assert small["step_ms_median"] > 0 and big["step_ms_median"] > 0
        assert small["ratio_to_smallest"] == pytest.approx(1.0)
        # the cache grows with the context it holds (a full-attention cache 4x)
        assert big["cache_bytes"] > small["cache_bytes"], name
    # V4.1's caches packed in the released formats hold fewer bytes than float ones
    packed, flt = (res["models"][m]["contexts"]["1024"]["cache_bytes"]
                   for m in ("v41-released", "v41"))
    assert packed < flt / 2, (packed, flt)
    llama = res["models"]["llama"]["contexts"]
    assert 3.5 < llama["1024"]["cache_bytes"] / llama["256"]["cache_bytes"] <= 4.0
    md = (out / "results.md").read_text()
    assert "Decode step against context length" in md and "target <= 1.3" in md
    assert "v41-released against v41" in md
    assert (out / "results.png").stat().st_size > 1000
    # prefill memory: v4 at 64 tokens, in its own process (--quick: the chunked arm only)
    pre = res["prefill"]["models"]["v4"]["lengths"]["64"]
    assert set(pre) == {"chunked"}
    for arm in pre.values():
        assert arm["peak_rss_bytes"] >= arm["rss_before_call_bytes"] > 0
        assert arm["second_call_s"] > 0
    assert "Prefill memory against prompt length" in md


def test_bad_arguments_are_named(bench, tmp_path):
    for argv, words in ((["--models", "gpt"], "unknown"), (["--contexts", "1k"], "integers"),
                        (["--steps", "0"], ">= 1"), (["--prefill-models", "x"], "unknown"),
                        (["--prefill-lengths", "2k"], "integers")):
        with pytest.raises(SystemExit, match=words):
            bench.main([*argv, "--out", str(tmp_path / "x")])
