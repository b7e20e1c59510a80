"""Quality metrics of a smoothed model against the unsmoothed one, on the same tokens.

Per token (computed inside jit by `token_stats`, on device; only [B, T] arrays
come back to the host), with P the unsmoothed ("base") next-token distribution,
Q the smoothed one and y the real next token:

- KLD = sum_v P(v) (log P(v) - log Q(v))      (KL(base || smoothed), llama.cpp's direction)
- same top-1: argmax P == argmax Q
- Δp = Q(y) - P(y)
- NLL = -log Q(y) (and -log P(y) for the base)

Summaries (`summarize_quality`), the statistics of llama.cpp's perplexity tool
(`--kl-divergence`): mean KLD (± standard error), median, 99th percentile and
maximum KLD; same-top-1 % (± standard error); mean and RMS Δp in percentage
points; perplexity exp(mean NLL) of both models and their ratio. Every position
that has a next token in the same sequence is scored (llama.cpp scores only
the second half of each chunk; we score all, the first tokens included).

LAMBADA word rule (`first_word`): in the decoded greedy continuation, leading
whitespace is skipped; the generated word is the maximal run of word characters
(Python regex ``\\w``: Unicode letters, digits, underscore) that follows. It is
complete once any other character follows it, or when generation ended (EOS).
A continuation that starts with another character (e.g. a quote) generates the
empty word. The answer is right iff the word equals the target exactly
(case-sensitive). So " signs." and " signs'" both answer "signs"; " sign" and
" signsets" do not.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.errors import InvalidInputError

_WORD = re.compile(r"\w+")


# ----------------------------------------------------------------------------- on device


def token_stats(base_logprobs: jax.Array, logits: jax.Array,
                targets: jax.Array) -> dict[str, jax.Array]:
    """Per-token comparison of the smoothed model (``logits``) with the base.

    base_logprobs: [..., V] log-softmax of the base model; logits: [..., V] of the
    smoothed model; targets: [...] int, the real next token. Returns [...] arrays:
    ``kld``, ``same_top1`` (bool), ``p_base``, ``p`` (probabilities of the target),
    ``nll_base``, ``nll``. Jittable; arithmetic in float32.
    """
    lp = base_logprobs.astype(jnp.float32)
    lq = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    kld = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)
    same = jnp.argmax(lp, axis=-1) == jnp.argmax(lq, axis=-1)
    t = targets[..., None].astype(jnp.int32)
    lp_t = jnp.take_along_axis(lp, t, axis=-1)[..., 0]
    lq_t = jnp.take_along_axis(lq, t, axis=-1)[..., 0]
    return {"kld": kld, "same_top1": same, "p_base": jnp.exp(lp_t), "p": jnp.exp(lq_t),
            "nll_base": -lp_t, "nll": -lq_t}


# ----------------------------------------------------------------------------- host side


def kl_divergence(p_logits: Any, q_logits: Any) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) over the last axis, in float64 numpy (a reference)."""
    p = np.asarray(p_logits, np.float64)
    q = np.asarray(q_logits, np.float64)
    lp = p - np.logaddexp.reduce(p, axis=-1, keepdims=True)
    lq = q - np.logaddexp.reduce(q, axis=-1, keepdims=True)
    return np.sum(np.exp(lp) * (lp - lq), axis=-1)


def perplexity(nll: Any) -> float:
    """exp(mean negative log-likelihood) over all given tokens."""
    nll = np.asarray(nll, np.float64).ravel()
    if nll.size == 0:
        raise InvalidInputError("perplexity needs at least one scored token")
    return float(np.exp(nll.mean()))


def _stderr(x: np.ndarray) -> float:
    return float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else float("nan")


def summarize_quality(stats: Mapping[str, Any]) -> dict[str, float]:
    """The llama.cpp-style summary of per-token `token_stats` (already masked to real tokens)."""
    kld = np.asarray(stats["kld"], np.float64).ravel()
    n = kld.size
    if n < 2:
        raise InvalidInputError(
            f"quality statistics need at least 2 scored tokens, got {n}: give more or "
            "longer sequences"
        )
    same = np.asarray(stats["same_top1"], np.float64).ravel()
    dp = (np.asarray(stats["p"], np.float64) - np.asarray(stats["p_base"], np.float64)).ravel()
    nll = np.asarray(stats["nll"], np.float64).ravel()
    nll_base = np.asarray(stats["nll_base"], np.float64).ravel()
    ppl, ppl_base = perplexity(nll), perplexity(nll_base)
    return {
        "n_tokens": int(n),
        "mean_kld": float(kld.mean()),
        "mean_kld_stderr": _stderr(kld),
        "median_kld": float(np.median(kld)),
        "p99_kld": float(np.percentile(kld, 99)),
        "max_kld": float(kld.max()),
        "same_top1_pct": float(100 * same.mean()),
        "same_top1_stderr_pct": _stderr(100 * same),
        "mean_dp_pct": float(100 * dp.mean()),
        "rms_dp_pct": float(100 * math.sqrt(np.mean(dp * dp))),
        "ppl_base": ppl_base,
        "ppl": ppl,
        "ppl_ratio": ppl / ppl_base,
        "ln_ppl_ratio": float(nll.mean() - nll_base.mean()),
    }


# ----------------------------------------------------------------------------- LAMBADA


def first_word(text: str) -> tuple[str, bool]:
    """(word, complete) of a generated continuation, by the rule of the module docstring."""
    s = text.lstrip()
    m = _WORD.match(s)
    if m is None:
        return "", bool(s)
    return m.group(0), m.end() < len(s)


def lambada_decision(text: str, target: str, ended: bool) -> bool | None:
    """Right (True) / wrong (False) once the greedy text decides it, else None (need more).

    ``ended``: generation stopped for good (EOS or the token limit is final).
    A trailing U+FFFD (an incomplete UTF-8 sequence) is undecided until ended.
    """
    if not ended and text.endswith("\ufffd"):
        return None
    word, complete = first_word(text)
    if complete or ended:
        return word == target
    if word == "" or target.startswith(word):
        return None
    return False  # an open word that already differs can only grow


def summarize_lambada(correct_base: Sequence[bool], correct: Sequence[bool]) -> dict[str, Any]:
    """Accuracy of both models in %, the drop in points, and how many answers flipped."""
    b = np.asarray(correct_base, bool)
    c = np.asarray(correct, bool)
    if b.size == 0 or b.shape != c.shape:
        raise InvalidInputError("LAMBADA summary needs equal, non-empty result lists")
    acc_b, acc = 100 * b.mean(), 100 * c.mean()
    return {
        "n_examples": int(b.size),
        "accuracy_base_pct": float(acc_b),
        "accuracy_pct": float(acc),
        "accuracy_drop_points": float(acc_b - acc),
        "gained": int((~b & c).sum()),
        "lost": int((b & ~c).sum()),
    }


# ----------------------------------------------------------------------------- greedy


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    a, b = np.asarray(a), np.asarray(b)
    n = min(a.size, b.size)
    diff = np.nonzero(a[:n] != b[:n])[0]
    return int(diff[0]) if diff.size else n


def greedy_agreement(base_rows: Sequence[Sequence[int]],
                     rows: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Agreement of greedy continuations: prefix agreement (tokens before the first
    difference / length), share of identical continuations, positional token match."""
    if len(base_rows) == 0 or len(base_rows) != len(rows):
        raise InvalidInputError("greedy agreement needs equal, non-empty lists of continuations")
    prefix, ident, match, length = [], [], [], []
    for a, b in zip(base_rows, rows, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        n = max(a.size, b.size)
        k = common_prefix(a, b)
        m = min(a.size, b.size)
        prefix.append(k / n if n else 1.0)
        ident.append(a.size == b.size and k == n)
        match.append(float((a[:m] == b[:m]).sum()) / n if n else 1.0)
        length.append(n)
    return {
        "n_prompts": len(rows),
        "tokens": int(max(length)),
        "prefix_agreement_pct": float(100 * np.mean(prefix)),
        "identical_pct": float(100 * np.mean(ident)),
        "token_match_pct": float(100 * np.mean(match)),
    }


# ----------------------------------------------------------------------------- budget


@dataclasses.dataclass(frozen=True)
class Budget:
    """Quality budget of calibration (spec §6 step 4 defaults).

    mean KLD <= max_mean_kld; same-top-1 >= min_same_top1_pct;
    LAMBADA accuracy drop <= max_accuracy_drop_points (percentage points).

    margin_se: how many standard errors of the measurement (its own `mean_kld_stderr`,
    `same_top1_stderr_pct`) a result must stay inside the KLD and top-1 limits. A
    calibration search on a small set uses 2, so that what it accepts still holds on a
    larger evaluation set with ~97.7% probability per limit (one-sided normal bound);
    final evaluations are judged at 0.
    """

    max_mean_kld: float = 0.01
    min_same_top1_pct: float = 97.0
    max_accuracy_drop_points: float = 1.0
    margin_se: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise InvalidInputError(f"budget {f.name}={v!r}: must be a finite number")
        if self.max_mean_kld < 0:
            raise InvalidInputError("budget max_mean_kld must be >= 0")
        if self.margin_se < 0:
            raise InvalidInputError("budget margin_se must be >= 0")
        if not 0 <= self.min_same_top1_pct <= 100:
            raise InvalidInputError("budget min_same_top1_pct must be in [0, 100]")

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    def violations(self, quality: Mapping[str, Any] | None,
                   lambada: Mapping[str, Any] | None) -> list[str]:
        """Which limits a result breaks (empty: within budget). Missing parts are skipped."""
        out = []
        if quality is not None:
            m = self.margin_se
            kld = quality["mean_kld"] + m * quality.get("mean_kld_stderr", 0.0)
            top1 = quality["same_top1_pct"] - m * quality.get("same_top1_stderr_pct", 0.0)
            what = f" (+{m:g} s.e.)" if m else ""
            if kld > self.max_mean_kld:
                out.append(f"mean KLD{what} {kld:.4g} > {self.max_mean_kld:g}")
            if top1 < self.min_same_top1_pct:
                what = f" (-{m:g} s.e.)" if m else ""
                out.append(f"same-top-1{what} {top1:.2f}% < {self.min_same_top1_pct:g}%")
        if lambada is not None:
            drop = lambada["accuracy_drop_points"]
            if drop > self.max_accuracy_drop_points + 1e-9:
                out.append(f"LAMBADA accuracy drop {drop:.2f} points > "
                           f"{self.max_accuracy_drop_points:g}")
        return out

    def margin(self, quality: Mapping[str, Any] | None,
               lambada: Mapping[str, Any] | None) -> float:
        """How far inside (>= 0) or outside (< 0) the budget, as the worst relative slack."""
        slack = []
        if quality is not None:
            if self.max_mean_kld > 0:
                slack.append(1 - quality["mean_kld"] / self.max_mean_kld)
            slack.append((quality["same_top1_pct"] - self.min_same_top1_pct) / 100)
        if lambada is not None:
            slack.append((self.max_accuracy_drop_points - lambada["accuracy_drop_points"]) / 100)
        return float(min(slack)) if slack else 0.0
