"""Figures of the GSM workflow (matplotlib, Agg backend; every function writes one PNG).

Each function takes the workflow's result objects or their JSON dicts and a
path, and returns the path. matplotlib is imported lazily.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gsm_jax.config import SITES


def pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    pyplot().close(fig)
    return path


def profile_heatmap(profile: Any, path: str | os.PathLike) -> Path:
    """Layers x sites heat maps: kurtosis (log scale) and max |x| (log scale).

    Kurtosis is shown as m4/m2**2 = excess + 3 (always >= 1, so a log scale
    works); the high-kurtosis selection is outlined.
    """
    from matplotlib.colors import LogNorm

    plt = pyplot()
    data = profile.to_dict() if hasattr(profile, "to_dict") else profile
    n = int(data["num_layers"])
    kurt = np.full((len(SITES), n), np.nan)
    mx = np.full((len(SITES), n), np.nan)
    for st in data["stats"]:
        j, i = SITES.index(st["site"]), st["layer"]
        if st.get("excess_kurtosis") is not None:
            kurt[j, i] = st["excess_kurtosis"] + 3.0
        if st.get("max_abs") is not None:
            mx[j, i] = st["max_abs"]
    kurt = np.where(kurt > 0, kurt, np.nan)
    mx = np.where(mx > 0, mx, np.nan)
    fig, axes = plt.subplots(2, 1, figsize=(max(6.0, 0.32 * n + 2), 4.6), constrained_layout=True)
    for ax, arr, title in ((axes[0], kurt, "kurtosis m4/m2² (= excess + 3), log scale"),
                           (axes[1], mx, "max |x|, log scale")):
        finite = arr[np.isfinite(arr)]
        norm = LogNorm(vmin=max(finite.min(), 1e-6), vmax=max(finite.max(), finite.min() * 1.01)) \
            if finite.size else None
        im = ax.imshow(arr, aspect="auto", cmap="magma", norm=norm, interpolation="nearest")
        ax.set_yticks(range(len(SITES)), SITES)
        ax.set_xticks(range(n), [str(i) for i in range(n)], fontsize=7)
        ax.set_xlabel("layer")
        ax.set_title(title, fontsize=10)
        fig.colorbar(im, ax=ax, pad=0.01)
        for layer, site in data.get("high_kurtosis", []):
            ax.add_patch(_rect(layer, SITES.index(site)))
    sel = data.get("selection", {})
    how = (f"excess kurtosis >= {sel['threshold']}" if sel.get("threshold") is not None
           else f"top {100 * sel.get('fraction', 0.25):g}% by excess kurtosis")
    fig.suptitle(f"{data['model']}: activation profile, {data.get('calibration_samples')} seq x "
                 f"{data.get('seq_len')} tok (outlined: high_kurtosis, {how})", fontsize=10)
    return save_figure(fig, path)


def _rect(x: int, y: int):
    from matplotlib.patches import Rectangle

    return Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="cyan", linewidth=1.5)


def _metric(r: Mapping[str, Any], key: str) -> float:
    q = r.get("quality") or {}
    v = q.get(key)
    return np.nan if v is None else float(v)


def quality_vs_strength(trials: Sequence[Mapping[str, Any]], path: str | os.PathLike, *,
                        budget: Mapping[str, float] | None = None,
                        title: str = "") -> Path:
    """Mean KLD (log) and same-top-1 % against strength, one line per window.

    ``trials``: calibration trial dicts with ``strength``, ``window``,
    ``protect_first``, ``scope`` and an evaluation ``result``; only the trials of
    the full target set are drawn.
    """
    plt = pyplot()
    series: dict[str, list[tuple[float, float, float]]] = {}
    for t in trials:
        if t.get("scope", "targets") != "targets" or t.get("result") is None:
            continue
        label = f"window {t['window']}, protect_first {t['protect_first']}"
        r = t["result"]
        series.setdefault(label, []).append(
            (t["strength"], _metric(r, "mean_kld"), _metric(r, "same_top1_pct")))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True)
    for label, pts in sorted(series.items()):
        pts = sorted(pts)
        s = [p[0] for p in pts]
        style = "-o" if len(pts) > 1 else "o"
        a1.plot(s, [p[1] for p in pts], style, label=label, ms=4)
        a2.plot(s, [p[2] for p in pts], style, label=label, ms=4)
    if budget:
        a1.axhline(budget["max_mean_kld"], color="k", ls="--", lw=1, label="budget")
        a2.axhline(budget["min_same_top1_pct"], color="k", ls="--", lw=1, label="budget")
    a1.set_yscale("log")
    a1.set_xlabel("smooth_strength")
    a1.set_ylabel("mean KLD vs unsmoothed (log)")
    a2.set_xlabel("smooth_strength")
    a2.set_ylabel("same top-1 token (%)")
    a1.grid(alpha=0.3)
    a2.grid(alpha=0.3)
    a2.legend(fontsize=7, loc="lower left")
    fig.suptitle(title or "GSM quality cost against strength", fontsize=10)
    return save_figure(fig, path)


def layer_contributions(contrib: Sequence[Mapping[str, Any]], path: str | os.PathLike, *,
                        culprits: Sequence[int] = (), budget_kld: float | None = None,
                        title: str = "") -> Path:
    """Bar chart: mean KLD when only one layer's targeted sites are smoothed."""
    plt = pyplot()
    layers = [int(c["layer"]) for c in contrib]
    kld = [float(c["mean_kld"]) for c in contrib]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * len(layers) + 2), 3.6),
                           constrained_layout=True)
    colors = ["tab:red" if layer in set(culprits) else "tab:blue" for layer in layers]
    ax.bar(range(len(layers)), kld, color=colors)
    ax.set_xticks(range(len(layers)), [str(x) for x in layers], fontsize=8)
    ax.set_xlabel("layer (only this layer's targeted sites smoothed)")
    ax.set_ylabel("mean KLD vs unsmoothed")
    if kld and min(kld) > 0:
        ax.set_yscale("log")
    if budget_kld is not None:
        ax.axhline(budget_kld, color="k", ls="--", lw=1, label="budget (all layers together)")
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title or "per-layer contribution (red: culprits removed by back-off)",
                 fontsize=10)
    return save_figure(fig, path)


def protect_first_plot(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike, *,
                       title: str = "") -> Path:
    """Mean KLD against protect_first, one line per (strength, window) setting."""
    plt = pyplot()
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        label = f"strength {r['strength']}, window {r['window']}"
        series.setdefault(label, []).append((int(r["protect_first"]), float(r["mean_kld"])))
    fig, ax = plt.subplots(figsize=(5.5, 3.6), constrained_layout=True)
    for label, pts in sorted(series.items()):
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", label=label)
    ax.set_xlabel("protect_first")
    ax.set_ylabel("mean KLD vs unsmoothed")
    ax.set_yscale("log")
    ax.set_xticks(sorted({int(r["protect_first"]) for r in rows}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "does protecting the first tokens help?", fontsize=10)
    return save_figure(fig, path)


def overhead_plot(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike, *,
                  title: str = "") -> Path:
    """Bar chart of step times (ms) with GSM off and on, per measured step."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.6), constrained_layout=True)
    names = [r["step"] for r in rows]
    x = np.arange(len(rows))
    off = [r["off_ms"] for r in rows]
    on = [r["on_ms"] for r in rows]
    ax.bar(x - 0.2, off, 0.4, label="GSM off")
    ax.bar(x + 0.2, on, 0.4, label="GSM on")
    for i, r in enumerate(rows):
        ax.text(i + 0.2, on[i], f"{100 * (r['on_ms'] / r['off_ms'] - 1):+.1f}%",
                ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x, names, fontsize=8)
    ax.set_ylabel("time per call (ms)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(title or "GSM step-time overhead", fontsize=10)
    return save_figure(fig, path)
