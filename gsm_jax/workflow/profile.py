"""Step 1 of the GSM workflow: activation profile per (layer, site).

`profile` streams ``calibration_samples`` token sequences through the model in
batches and records, for every layer and both sites (``attn_out``: the input of
the output projection; ``ffn_mid``: the input of the down projection), without
keeping any activations:

- max |x|, mean, variance, skewness and excess kurtosis ``m4 / m2**2 - 3`` over
  all elements (every real token and channel; padding never counts);
- the share of elements with |x - mean| > 6 sigma;
- the channels with the largest max |x| (``top_channels``), and max |x| on each
  sequence's first token apart from the others (massive activations sit there).

How the activations are captured: through the models' hooks (`models/sites.py`),
nothing patched. `StatsSites` is a `Sites` implementation whose `site` returns the
input unchanged and sows that site's partial moments; the family's `hidden_states`
returns what every layer sowed, stacked over layers. The compiled capture is reused
for every batch, and any number of profiles can run side by side.

Moments: inside jit, per token, the mean over the channels and the central
sums sum d**2, d**3, d**4 (d = x - token mean) are computed in float32 (sums
of at most one token's channels); the host merges them exactly in float64
(shift formulas within a batch, Pebay's pairwise update across batches). This
is numerically stable whatever the mean and needs O(layers x sites) memory.

The 6-sigma share needs sigma before it is known. ``sigma_mode="running"``
(default, one pass): batch k is counted against the mean and sigma of batches
0..k-1; batch 0 against its own. ``sigma_mode="two_pass"``: a second pass
counts against the final mean and sigma (exact, twice the work).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gsm_jax.config import (
    DEFAULT_HIGH_KURTOSIS_FRACTION,
    KURTOSIS_DEFINITION,
    SITES,
    build_profile,
    write_profile,
)
from gsm_jax.errors import InvalidInputError, UnsupportedModelError
from gsm_jax.families import family_module
from gsm_jax.models.sites import Sites
from gsm_jax.params import ModelParams
from gsm_jax.workflow import data as data_mod

SIGMA_MODES = ("running", "two_pass")
OUTLIER_SIGMA = 6.0
PROFILE_FILE = "profile.json"
HEATMAP_FILE = "profile_heatmap.png"
SIXSIGMA_DEFINITION = {
    "running": "share of elements with |x - mean| > 6 sigma; batch k is counted against the "
               "mean and sigma of batches 0..k-1 (batch 0 against its own)",
    "two_pass": "share of elements with |x - mean| > 6 sigma, mean and sigma over all "
                "calibration elements (second pass)",
}


# ----------------------------------------------------------------------------- on device


def site_partials(x: jax.Array, valid: jax.Array, center: jax.Array, scale: jax.Array,
                  sigmas: float = OUTLIER_SIGMA) -> dict[str, jax.Array]:
    """Per-token partial moments of one site. Jittable.

    x [B, T, C]; valid [B, T] bool (real tokens); center, scale: scalars for the
    outlier count (NaN scale: use this batch's own mean and sigma). Returns
    [B, T] arrays ``mean`` (over channels), ``m2``/``m3``/``m4`` (central sums
    over channels), ``max_abs``, ``n_out`` (elements beyond ``sigmas`` sigma,
    int32) and ``chan_max`` [C] (max |x| per channel over real tokens).
    """
    xf = x.astype(jnp.float32)
    c = xf.shape[-1]
    mean = jnp.mean(xf, axis=-1)
    d = xf - mean[..., None]
    d2 = d * d
    m2 = jnp.sum(d2, axis=-1)
    m3 = jnp.sum(d2 * d, axis=-1)
    m4 = jnp.sum(d2 * d2, axis=-1)
    absx = jnp.abs(xf)
    vf = valid.astype(jnp.float32)
    # this batch's own mean and sigma (used where no earlier estimate exists)
    n = jnp.maximum(jnp.sum(vf) * c, 1.0)
    own_mu = jnp.sum(vf * mean) * c / n
    own_var = jnp.sum(vf * (m2 + c * (mean - own_mu) ** 2)) / n
    use_own = jnp.isnan(scale)
    mu = jnp.where(use_own, own_mu, center)
    sigma = jnp.where(use_own, jnp.sqrt(own_var), scale)
    n_out = jnp.sum(jnp.abs(xf - mu) > sigmas * sigma, axis=-1).astype(jnp.int32)
    chan_max = jnp.max(jnp.where(valid[..., None], absx, 0.0), axis=(0, 1))
    return {"mean": mean, "m2": m2, "m3": m3, "m4": m4, "max_abs": jnp.max(absx, axis=-1),
            "n_out": n_out, "chan_max": chan_max}


@struct.dataclass
class StatsSites(Sites):
    """The profiler's hooks: each GSM site sows its `site_partials` and returns x unchanged.

    center, scale: [layers, sites] f32, the outlier count's mean and sigma (NaN scale:
    each batch's own)."""

    center: jax.Array
    scale: jax.Array
    sigmas: float = struct.field(pytree_node=False, default=OUTLIER_SIGMA)

    def site(self, step, layer, index, x, next_weight=None):
        step.sow(f"partials/{SITES[index]}", site_partials(
            x, step.positions >= 0, self.center[layer, index], self.scale[layer, index],
            self.sigmas))
        return x


@functools.partial(jax.jit, static_argnames=("config", "sigmas"))
def _capture_jit(weights, tokens, lengths, center, scale, *, config, sigmas):
    fam = family_module(config.family)
    _, sown = fam.hidden_states(weights, config, tokens, lengths,
                                StatsSites(center, scale, sigmas))
    missing = [s for s in SITES if f"partials/{s}" not in sown]
    if missing:
        raise UnsupportedModelError(f"site(s) {missing} are not present in every layer of "
                                    "this model; the profiler needs both sites in all layers")
    return [sown[f"partials/{s}"] for s in SITES]


def capture_partials(params: ModelParams, tokens: Any, lengths: Any, center: Any = None,
                     scale: Any = None, *, sigmas: float = OUTLIER_SIGMA) -> list[dict]:
    """Run the model over right-padded ``tokens`` [B, T] and return, per site, the
    `site_partials` of every layer stacked on a leading layer axis ([L, B, T] ...)."""
    cfg = params.config
    shape = (cfg.num_layers, len(SITES))
    center = jnp.zeros(shape, jnp.float32) if center is None else jnp.asarray(center, jnp.float32)
    scale = (jnp.full(shape, jnp.nan, jnp.float32) if scale is None
             else jnp.asarray(scale, jnp.float32))
    return _capture_jit(params.weights, jnp.asarray(tokens, jnp.int32),
                        jnp.asarray(lengths, jnp.int32), center, scale,
                        config=cfg, sigmas=float(sigmas))


# ----------------------------------------------------------------------------- host side


class MomentAccumulator:
    """Streaming float64 moments of many groups at once (one group = one (layer, site)).

    Feed per-token partials with `add_tokens`; read `mean`, `variance`,
    `excess_kurtosis`, `skewness`. `n`, `m2`, `m3`, `m4` are the element count and
    the central sums over every element added so far.
    """

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.n = np.zeros(shape, np.float64)
        self.mu = np.zeros(shape, np.float64)
        self.m2 = np.zeros(shape, np.float64)
        self.m3 = np.zeros(shape, np.float64)
        self.m4 = np.zeros(shape, np.float64)

    def add_tokens(self, mean: np.ndarray, m2: np.ndarray, m3: np.ndarray, m4: np.ndarray,
                   count: int, valid: np.ndarray) -> None:
        """Per-token partials [..., N] (the group axes first) of ``count`` elements each;
        ``valid`` [N] (or broadcastable) selects the tokens that count."""
        v = np.broadcast_to(np.asarray(valid, bool), mean.shape)
        w = v.astype(np.float64)
        ntok = w.sum(axis=-1)
        nb = ntok * count
        if not np.any(nb > 0):
            return
        mean, m2, m3, m4 = (np.where(v, np.asarray(a, np.float64), 0.0)
                            for a in (mean, m2, m3, m4))
        safe = np.maximum(ntok, 1)
        mub = mean.sum(axis=-1) / safe
        dlt = np.where(v, mean - mub[..., None], 0.0)
        b2 = (m2 + count * dlt**2).sum(axis=-1)
        b3 = (m3 + 3 * dlt * m2 + count * dlt**3).sum(axis=-1)
        b4 = (m4 + 4 * dlt * m3 + 6 * dlt**2 * m2 + count * dlt**4).sum(axis=-1)
        self._merge(nb, mub, b2, b3, b4)

    def _merge(self, nb, mub, b2, b3, b4) -> None:
        na, mua, a2, a3, a4 = self.n, self.mu, self.m2, self.m3, self.m4
        n = na + nb
        safe = np.where(n > 0, n, 1.0)
        d = mub - mua
        self.m4 = (a4 + b4 + d**4 * na * nb * (na * na - na * nb + nb * nb) / safe**3
                   + 6 * d * d * (na * na * b2 + nb * nb * a2) / safe**2
                   + 4 * d * (na * b3 - nb * a3) / safe)
        self.m3 = (a3 + b3 + d**3 * na * nb * (na - nb) / safe**2
                   + 3 * d * (na * b2 - nb * a2) / safe)
        self.m2 = a2 + b2 + d * d * na * nb / safe
        self.mu = mua + d * nb / safe
        self.n = n

    @property
    def mean(self) -> np.ndarray:
        return np.where(self.n > 0, self.mu, np.nan)

    @property
    def variance(self) -> np.ndarray:
        """Population variance m2 / n."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.n > 0, self.m2 / self.n, np.nan)

    @property
    def excess_kurtosis(self) -> np.ndarray:
        """n * m4 / m2**2 - 3 (NaN where the variance is 0 or nothing was added)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where((self.n > 0) & (self.m2 > 0),
                            self.n * self.m4 / self.m2**2 - 3.0, np.nan)

    @property
    def skewness(self) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where((self.n > 0) & (self.m2 > 0),
                            np.sqrt(self.n) * self.m3 / self.m2**1.5, np.nan)


class SiteAccumulator:
    """Everything the profile records, accumulated over batches of `capture_partials`."""

    def __init__(self, num_layers: int, site_sizes: tuple[int, ...]) -> None:
        self.num_layers = num_layers
        self.site_sizes = tuple(int(c) for c in site_sizes)
        shape = (num_layers, len(SITES))
        self.moments = [MomentAccumulator((num_layers,)) for _ in SITES]
        self.max_abs = np.zeros(shape)
        self.max_abs_first = np.zeros(shape)
        self.max_abs_rest = np.zeros(shape)
        self.n_out = np.zeros(shape, np.int64)
        self.chan_max = [np.zeros((num_layers, c)) for c in self.site_sizes]
        self.tokens = 0
        self.sequences = 0

    def add(self, partials: list[dict[str, Any]], lengths: np.ndarray, *,
            count_outliers: bool = True, count_moments: bool = True) -> None:
        lengths = np.asarray(lengths)
        for s, part in enumerate(partials):
            p = {k: np.asarray(v) for k, v in part.items()}
            t = p["mean"].shape[-1]
            pos = np.arange(t)[None, :]
            valid = pos < lengths[:, None]  # [B, T]
            if count_outliers:
                self.n_out[:, s] += np.where(valid[None], p["n_out"], 0).sum(axis=(1, 2))
            if not count_moments:
                continue
            flat = valid.reshape(-1)
            self.moments[s].add_tokens(
                *(p[k].reshape(self.num_layers, -1) for k in ("mean", "m2", "m3", "m4")),
                count=self.site_sizes[s], valid=flat,
            )
            tok_max = np.where(valid[None], p["max_abs"], 0.0)
            self.max_abs[:, s] = np.maximum(self.max_abs[:, s], tok_max.max(axis=(1, 2)))
            first = valid & (pos == 0)
            rest = valid & (pos > 0)
            self.max_abs_first[:, s] = np.maximum(
                self.max_abs_first[:, s], np.where(first[None], p["max_abs"], 0.0).max(axis=(1, 2)))
            self.max_abs_rest[:, s] = np.maximum(
                self.max_abs_rest[:, s], np.where(rest[None], p["max_abs"], 0.0).max(axis=(1, 2)))
            self.chan_max[s] = np.maximum(self.chan_max[s], p["chan_max"])
        if count_moments:
            self.tokens += int(lengths.sum())
            self.sequences += int((lengths > 0).sum())

    def center_scale(self) -> tuple[np.ndarray, np.ndarray]:
        """Current mean and sigma per (layer, site); NaN sigma before any data."""
        n = self._stacked("n")
        return (np.where(n > 0, self._stacked("mu"), 0.0).astype(np.float32),
                np.where(n > 0, np.sqrt(self._stacked("variance")), np.nan).astype(np.float32))

    def _stacked(self, attr: str) -> np.ndarray:
        """[num_layers, len(SITES)] of one moment attribute."""
        return np.stack([getattr(m, attr) for m in self.moments], axis=1)

    def stats(self, top_channels: int = 8) -> list[dict[str, Any]]:
        var, kurt = self._stacked("variance"), self._stacked("excess_kurtosis")
        skew, mean, count = self._stacked("skewness"), self._stacked("mean"), self._stacked("n")
        out = []
        for layer in range(self.num_layers):
            for s, site in enumerate(SITES):
                cm = self.chan_max[s][layer]
                k = min(top_channels, cm.size)
                top = np.argsort(-cm, kind="stable")[:k]
                n = count[layer, s]
                out.append({
                    "layer": layer, "site": site,
                    "max_abs": float(self.max_abs[layer, s]),
                    "mean": float(mean[layer, s]),
                    "variance": float(var[layer, s]),
                    "std": float(math.sqrt(var[layer, s])) if var[layer, s] >= 0 else None,
                    "excess_kurtosis": float(kurt[layer, s]),
                    "skewness": float(skew[layer, s]),
                    "outlier_share_6sigma": float(self.n_out[layer, s] / n) if n else None,
                    "max_abs_first_token": float(self.max_abs_first[layer, s]),
                    "max_abs_other_tokens": float(self.max_abs_rest[layer, s]),
                    "n_elements": int(n),
                    "channels": int(cm.size),
                    "top_channels": [{"channel": int(c), "max_abs": float(cm[c])} for c in top],
                })
        return out


# ----------------------------------------------------------------------------- result


@dataclasses.dataclass
class Profile:
    """A profile (schema ``gsm-jax/profile/v1``, see `gsm_jax.config`) plus helpers."""

    data: dict[str, Any]
    path: Path | None = None

    @property
    def stats(self) -> list[dict[str, Any]]:
        return self.data["stats"]

    @property
    def high_kurtosis(self) -> list[tuple[int, str]]:
        return [(int(layer), str(site)) for layer, site in self.data["high_kurtosis"]]

    @property
    def num_layers(self) -> int:
        return int(self.data["num_layers"])

    def to_dict(self) -> dict[str, Any]:
        return self.data

    def array(self, key: str) -> np.ndarray:
        """float [num_layers, len(SITES)] of one per-stat number (NaN where null)."""
        out = np.full((self.num_layers, len(SITES)), np.nan)
        for st in self.stats:
            v = st.get(key)
            if v is not None:
                out[st["layer"], SITES.index(st["site"])] = v
        return out

    def save(self, out: str | os.PathLike, *, heatmap: bool = True) -> Path:
        """Write ``profile.json`` (and ``profile_heatmap.png``) into directory ``out``
        (or to ``out`` itself if it ends in .json). Returns the JSON path."""
        out = Path(out)
        path = out if out.suffix.lower() == ".json" else out / PROFILE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        write_profile(path, self.data)
        if heatmap:
            from gsm_jax.workflow.plots import profile_heatmap

            profile_heatmap(self, path.parent / HEATMAP_FILE)
        self.path = path
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Profile:
        from gsm_jax.config import load_profile

        return cls(load_profile(path), Path(path))

    def summary(self, top: int = 8) -> str:
        rows = sorted(self.stats, key=lambda s: -(s["excess_kurtosis"] or -1e300))[:top]
        lines = [f"profile of {self.data['model']}: {self.data.get('calibration_samples')} "
                 f"sequences x {self.data.get('seq_len')} tokens; "
                 f"{len(self.high_kurtosis)} high-kurtosis (layer, site) pairs"]
        lines.append("  layer  site       excess_kurt    max|x|   6σ share   top channels")
        for st in rows:
            ch = ",".join(str(c["channel"]) for c in st["top_channels"][:3])
            lines.append(f"  {st['layer']:5d}  {st['site']:<9} {st['excess_kurtosis']:12.1f} "
                         f"{st['max_abs']:9.2f}  {st['outlier_share_6sigma']:9.2e}   {ch}")
        return "\n".join(lines)


def profile(
    params: ModelParams,
    *,
    data: Any = None,
    calibration_samples: int = 512,
    seq_len: int = 256,
    batch_size: int = 8,
    fraction: float = DEFAULT_HIGH_KURTOSIS_FRACTION,
    threshold: float | None = None,
    top_channels: int = 8,
    sigma_mode: str = "running",
    progress: bool = True,
) -> Profile:
    """Profile the activations at every (layer, site) of ``params`` (spec §6 step 1).

    ``data``: a text file (default: the shared WikiText-2; sequences cut from its
    start) or int token ids [N, T]. ``calibration_samples`` sequences of
    ``seq_len`` tokens are streamed in batches of ``batch_size``. The
    "high_kurtosis" selection is the top ``fraction`` of pairs by excess kurtosis,
    or those with excess kurtosis >= ``threshold`` if given. Returns a `Profile`;
    ``.save(dir)`` writes profile.json and the heat map.
    """
    if not isinstance(params, ModelParams):
        raise InvalidInputError(
            f"params must be what gsm_jax.load returns (ModelParams), got {type(params).__name__}"
        )
    if sigma_mode not in SIGMA_MODES:
        raise InvalidInputError(f"sigma_mode must be one of {SIGMA_MODES}, got {sigma_mode!r}")
    for name, v in (("calibration_samples", calibration_samples), ("batch_size", batch_size),
                    ("top_channels", top_channels)):
        if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < 1:
            raise InvalidInputError(f"{name} must be an integer >= 1, got {v!r}")
    cfg = params.config
    seqs = data_mod.as_token_sequences(data, params.tokenizer, seq_len=seq_len,
                                       num_sequences=calibration_samples,
                                       vocab_size=cfg.vocab_size)
    n, t = seqs.shape
    if t > cfg.max_position_embeddings:
        raise InvalidInputError(f"seq_len {t} exceeds the model's context "
                                f"({cfg.max_position_embeddings})")
    if n * t * min(cfg.site_sizes) < 4:
        raise InvalidInputError("too few elements for kurtosis: give more or longer sequences")
    acc = SiteAccumulator(cfg.num_layers, cfg.site_sizes)
    t0 = time.perf_counter()

    def batches():
        for i in range(0, n, batch_size):
            rows = seqs[i: i + batch_size]
            lengths = np.full((batch_size,), t, np.int32)
            lengths[rows.shape[0]:] = 0
            if rows.shape[0] < batch_size:  # pad: one compiled shape, padding never counts
                rows = np.concatenate([rows, np.zeros((batch_size - rows.shape[0], t),
                                                      np.int32)])
            yield rows, lengths

    from tqdm import tqdm

    nb = -(-n // batch_size)
    for rows, lengths in tqdm(batches(), total=nb, desc="profile", disable=not progress,
                              dynamic_ncols=True):
        center, scale = acc.center_scale()
        parts = capture_partials(params, rows, lengths, center, scale)
        acc.add(parts, lengths, count_outliers=sigma_mode == "running")
    if sigma_mode == "two_pass":
        center, scale = acc.center_scale()
        for rows, lengths in tqdm(batches(), total=nb, desc="profile (6σ pass)",
                                  disable=not progress, dynamic_ncols=True):
            parts = capture_partials(params, rows, lengths, center, scale)
            acc.add(parts, lengths, count_outliers=True, count_moments=False)
    seconds = time.perf_counter() - t0
    prof = build_profile(
        params.source or "model", cfg.num_layers, acc.stats(top_channels),
        fraction=fraction, threshold=threshold,
        calibration_samples=int(n), seq_len=int(t), tokens=int(acc.tokens),
        data=("token array" if not (data is None or isinstance(data, str | os.PathLike))
              else str(data or data_mod.default_wikitext_path())),
        statistics={
            "excess_kurtosis": KURTOSIS_DEFINITION,
            "variance": "population variance m2 / n over the same elements",
            "outlier_share_6sigma": SIXSIGMA_DEFINITION[sigma_mode],
            "top_channels": "channels with the largest max |x| over all real tokens",
            "max_abs_first_token": "max |x| over each sequence's first token (position 0)",
            "sigma_mode": sigma_mode,
        },
        seconds=round(seconds, 2),
    )
    return Profile(prof)


def load_profile(path: str | os.PathLike) -> Profile:
    return Profile.load(path)


def _dumps(d: Any) -> str:  # for debugging / notebooks
    return json.dumps(d, indent=2)
