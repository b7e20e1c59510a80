"""Profile (step 1): streamed moments equal numpy's; the capture sees the model's sites."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

import gsm_jax
from gsm_jax.config import SITES, resolve_mask
from gsm_jax.errors import InvalidInputError
from gsm_jax.models import llama
from gsm_jax.models.sites import Sites
from gsm_jax.params import ModelParams
from gsm_jax.workflow import profile as prof


def _np_stats(x: np.ndarray) -> dict[str, float]:
    x = x.astype(np.float64).ravel()
    mu = x.mean()
    d = x - mu
    m2, m3, m4 = (d**2).mean(), (d**3).mean(), (d**4).mean()
    return {"mean": mu, "variance": m2, "excess_kurtosis": m4 / m2**2 - 3,
            "skewness": m3 / m2**1.5, "max_abs": np.abs(x).max(),
            "outlier_share_6sigma": float(np.mean(np.abs(d) > 6 * np.sqrt(m2)))}


_partials = jax.jit(prof.site_partials)


def _chunk_partials(xs, lengths, center, scale):
    """One 'layer', two sites: the [L=1, ...] partials SiteAccumulator takes."""
    out = []
    for s, x in enumerate(xs):
        valid = np.arange(x.shape[1])[None, :] < lengths[:, None]
        p = _partials(jnp.asarray(x), jnp.asarray(valid), center[0, s], scale[0, s])
        out.append({k: np.asarray(v)[None] for k, v in p.items()})
    return out


def test_streamed_moments_equal_numpy():
    rng = np.random.default_rng(0)
    sizes = (5, 7)
    chunks = []
    for b in range(4):  # four chunks, ragged lengths (padding must not count)
        lengths = rng.integers(1, 9, size=3)
        xs = []
        for c in sizes:
            x = rng.standard_t(3, size=(3, 8, c)).astype(np.float32) * 2 + 0.7
            x[0, 0, 1] = 40.0 + b  # a massive activation on a first token
            x[:, lengths.min():] += np.where(
                np.arange(8)[lengths.min():][None, :, None] >= lengths[:, None, None], 1e4, 0)
            xs.append(x)
        chunks.append((xs, lengths))
    real = [np.concatenate([xs[s][i, :n].reshape(-1) for xs, ln in chunks
                            for i, n in enumerate(ln)]) for s in range(2)]
    # pass 1 (moments), pass 2 (6-sigma against the final mean and sigma: two_pass)
    acc = prof.SiteAccumulator(1, sizes)
    for xs, ln in chunks:
        c, s = acc.center_scale()
        acc.add(_chunk_partials(xs, ln, c, s), ln, count_outliers=False)
    c, s = acc.center_scale()
    for xs, ln in chunks:
        acc.add(_chunk_partials(xs, ln, c, s), ln, count_outliers=True, count_moments=False)
    stats = acc.stats(top_channels=3)
    assert acc.tokens == sum(int(ln.sum()) for _, ln in chunks)
    for s, site in enumerate(SITES):
        got = next(st for st in stats if st["site"] == site)
        want = _np_stats(real[s])
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-5, abs=1e-9), (site, k)
        assert got["n_elements"] == real[s].size
        # per-channel max over real tokens, and the first-token max
        per_chan = np.max(np.abs(np.concatenate(
            [xs[s][i, :n] for xs, ln in chunks for i, n in enumerate(ln)])), axis=0)
        top = np.argsort(-per_chan, kind="stable")[:3]
        assert [c["channel"] for c in got["top_channels"]] == top.tolist()
        assert got["top_channels"][0]["max_abs"] == pytest.approx(per_chan[top[0]])
        first = max(np.abs(xs[s][i, 0]).max() for xs, ln in chunks for i in range(3))
        assert got["max_abs_first_token"] == pytest.approx(first)


def test_running_sigma_rule():
    """sigma_mode="running": chunk k counts against the mean/sigma of chunks < k."""
    rng = np.random.default_rng(1)
    chunks = [rng.standard_t(4, size=(2, 6, 9)).astype(np.float32) for _ in range(3)]
    ln = np.array([6, 6])
    acc = prof.SiteAccumulator(1, (9, 9))
    want = 0
    seen = []
    for x in chunks:
        c, s = acc.center_scale()
        acc.add(_chunk_partials([x, x], ln, c, s), ln)
        ref = np.concatenate(seen) if seen else x.ravel().astype(np.float64)
        want += int(np.sum(np.abs(x.astype(np.float64) - ref.mean()) > 6 * ref.std()))
        seen.append(x.ravel().astype(np.float64))
    assert acc.n_out[0, 0] == want


@pytest.fixture(scope="module")
def tiny():
    cfg = llama.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_layers=3,
                            num_heads=4, num_kv_heads=2, head_dim=12,
                            max_position_embeddings=256)
    return ModelParams(llama.init_weights(cfg, jax.random.key(3)), cfg, None, "tiny-llama")


@struct.dataclass
class _Raw(Sites):
    """A hook that sows the site activations themselves."""

    def site(self, step, layer, index, x, next_weight=None):
        step.sow(SITES[index], x)
        return x


def _raw_sites(params, tokens):
    """The site activations themselves [L, B, T, C], through the model's own layer loop."""
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    fn = jax.jit(functools.partial(llama.hidden_states, cfg=params.config, sites=_Raw()))
    sown = fn(params.weights, tokens=jnp.asarray(tokens), lengths=lengths)[1]
    return [np.asarray(sown[s]) for s in SITES]


def test_profile_of_model_equals_numpy(tiny, monkeypatch, tmp_path):
    tokens = np.random.default_rng(2).integers(0, 96, (5, 24)).astype(np.int32)
    # 5 sequences in batches of 2: the last batch has a padding row, which must not count
    p = prof.profile(tiny, data=tokens, calibration_samples=5, batch_size=2,
                     sigma_mode="two_pass", progress=False)
    raw = _raw_sites(tiny, tokens)
    for st in p.stats:
        x = raw[SITES.index(st["site"])][st["layer"]]
        want = _np_stats(x)
        for k in ("mean", "variance", "excess_kurtosis", "max_abs", "outlier_share_6sigma"):
            assert st[k] == pytest.approx(want[k], rel=2e-4, abs=1e-9), (st["layer"],
                                                                           st["site"], k)
        assert st["n_elements"] == x.size
    assert p.data["tokens"] == tokens.size and p.data["calibration_samples"] == 5
    assert len(p.high_kurtosis) == 2  # ceil(0.25 * 6)
    path = p.save(tmp_path / "prof")
    assert (tmp_path / "prof" / "profile_heatmap.png").stat().st_size > 1000
    cfg = gsm_jax.GSMConfig(profile=str(path))
    mask = resolve_mask(cfg, 3)
    assert sorted((int(i), SITES[j]) for i, j in zip(*np.nonzero(mask), strict=True)) == \
        sorted(p.high_kurtosis)
    back = prof.Profile.load(path)
    assert back.high_kurtosis == p.high_kurtosis
    assert "excess kurtosis" in back.data["kurtosis_definition"]
    assert np.isfinite(back.array("excess_kurtosis")).all()


def test_profile_threshold_and_errors(tiny):
    tokens = np.random.default_rng(4).integers(0, 96, (3, 24)).astype(np.int32)
    p = prof.profile(tiny, data=tokens, calibration_samples=3, batch_size=2, threshold=-10.0,
                     progress=False)
    assert len(p.high_kurtosis) == 6  # every pair has excess kurtosis >= -10
    with pytest.raises(InvalidInputError, match="requested"):
        prof.profile(tiny, data=tokens, calibration_samples=4, progress=False)
    with pytest.raises(InvalidInputError, match="sigma_mode"):
        prof.profile(tiny, data=tokens, calibration_samples=3, sigma_mode="exact",
                     progress=False)
    with pytest.raises(InvalidInputError, match="calibration_samples"):
        prof.profile(tiny, data=tokens, calibration_samples=0, progress=False)
