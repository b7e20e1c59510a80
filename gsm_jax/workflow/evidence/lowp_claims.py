"""Verdicts on the source document's low-precision claims (issue 15): claims 3 and 9.

- Claim 3, "smoothing makes low-precision inference more stable" (2.2: 极端值少了溢出和下溢的
  概率降低低精度推理的精度损失也更可控): the mean KLD against the float model of INT8 W8A8 and
  FP8 (e4m3 weights in 128 x 128 blocks, per-token e4m3 activations), each alone, with GSM,
  with SmoothQuant and with the Hadamard rotation; and whether overflow / underflow
  happens at all without GSM, counted on the activations that enter each quantized
  linear (`capture_linear_inputs`).
- Claim 9, "quantize, then smooth" (5.2: 和量化配合先量化再平滑因为量化会放大数值抖动平滑正好对症):
  the two orders of the activation path at the GSM sites, at W8A8 (`run_claim_9`).

Every arm is scored by one jitted evaluator built from the family interface
(`family_module(cfg.family).forward`, the function `gsm_jax.forward` jits) on unpadded
[B, T] rows, so nothing but the arm differs. The arms that change how the model computes
(the capture, order (b) of claim 9) pass the model their own hooks (`models/sites.py`:
`LowpSites`, `OrderBSites`, each wrapping the arm's GSM), nothing patched: they are
arguments of the traced program, so arms can run side by side in threads.

Significance: "beyond the standard error" is a paired per-sequence difference larger
than `SE_MULTIPLE` (2) standard errors of that difference (the runs are deterministic, so
the sequences are the only source of noise).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from gsm_jax.config import GSMConfig
from gsm_jax.errors import InvalidInputError, UnsupportedModelError
from gsm_jax.families import family_module
from gsm_jax.models.block_quant import (
    ACT_BLOCK,
    ACT_MIN_AMAX,
    E4M3_MAX,
    BlockQuantWeight,
    quantize_activation_e4m3,
)
from gsm_jax.models.linear import (
    QuantizedActivation,
    QuantizedWeight,
    hadamard_rotate,
    linear,
    quantize_activation,
    wants_int8_input,
)
from gsm_jax.models.sites import Sites, as_sites
from gsm_jax.pallas_kernels.quant_reference import quantize_rows
from gsm_jax.params import ModelParams
from gsm_jax.workflow import metrics

__all__ = ["activation_counts", "capture_linear_inputs", "claim3_verdict", "claim9_verdict",
           "order_b", "paired_difference", "run_claim_3", "run_claim_9"]

DEFAULT_GSM = {"smooth_strength": 0.1, "window_size": 8, "target_layers": "all"}
SE_MULTIPLE = 2.0
LOAD_COMPARABLE = 1.5
UNAVAILABLE = "not available for this family"
VERDICTS = ("supported", "refuted", "not testable here")

# the originals, taken at import: the patches below swap the model modules' bindings


# ----------------------------------------------------------------------------- shared helpers
# (also used by serving_claim.py)


def log_line(progress: bool, claim: int, msg: str) -> None:
    if progress:
        print(f"[claim {claim}] {msg}", flush=True)


def gsm_config(sizes: dict) -> GSMConfig:
    """sizes["gsm"] (a GSMConfig or a mapping), default strength 0.1, window 8, all layers."""
    g = sizes.get("gsm")
    if isinstance(g, GSMConfig):
        return g
    return GSMConfig.from_dict({**DEFAULT_GSM, **dict(g or {})})


def load_avg(before: float, after: float) -> dict[str, Any]:
    return {"before": round(before, 2), "after": round(after, 2),
            "comparable": bool(before <= LOAD_COMPARABLE and after <= LOAD_COMPARABLE)}


def figures_dir(model_dir: Path | str | None) -> Path | None:
    if model_dir is None:
        return None
    d = Path(model_dir) / "figures"
    d.mkdir(parents=True, exist_ok=True)
    return d


def eval_tokens(params: ModelParams, sizes: dict, *, n: int, seq_len: int, from_end: bool,
                seed: int = 0) -> tuple[np.ndarray, str]:
    """[n, seq_len] token ids and where they came from: sizes["tokens"] if given, else
    WikiText-2 (packaged, gsm_jax/data) through the model's tokenizer, else (a model without
    a tokenizer) fixed random ids."""
    if sizes.get("tokens") is not None:
        t = np.asarray(sizes["tokens"], np.int32)
        return t[:n, :seq_len], f"given token ids {t.shape}"
    if params.tokenizer is not None:
        from gsm_jax.workflow.data import load_wikitext_sequences

        t = load_wikitext_sequences(params.tokenizer, seq_len=seq_len, num_sequences=n,
                                    from_end=from_end)
        return t, (f"WikiText-2 test, {'last' if from_end else 'first'} {n} x {seq_len} "
                   "tokens")
    rng = np.random.default_rng(seed + (1 if from_end else 0))
    t = rng.integers(0, params.config.vocab_size, (n, seq_len)).astype(np.int32)
    return t, f"random token ids {n} x {seq_len} (the model has no tokenizer)"


def paired_difference(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """mean(a - b) over paired sequences, its standard error and their ratio (z)."""
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    mean = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(d.size)) if d.size > 1 else float("nan")
    z = mean / se if se > 0 else (math.inf if mean > 0 else -math.inf if mean < 0 else 0.0)
    return {"mean": mean, "stderr": se, "z": z}


def beyond_se(diff: dict[str, float]) -> bool:
    """True when the paired difference is positive by more than SE_MULTIPLE standard errors."""
    return bool(np.isfinite(diff["mean"]) and diff["z"] > SE_MULTIPLE)


def _mean_se(x: np.ndarray) -> tuple[float, float]:
    x = np.asarray(x, np.float64)
    se = float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else float("nan")
    return float(x.mean()), se


# ----------------------------------------------------------------------------- evaluation


def _make_kld_fn() -> Callable:
    """A new jitted (weights, tokens, gsm, base_logprobs) -> (mean KLD per sequence over the
    positions with a next token, non-finite logits per sequence). A new function object
    each call (an arm's hooks are arguments, so one would do; kept per arm for clarity)."""
    def kld_fn(weights, tokens, gsm, base_lp, *, config):
        lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
        logits = family_module(config.family).forward(weights, config, tokens, lengths, gsm)
        st = metrics.token_stats(base_lp, logits, jnp.roll(tokens, -1, axis=1))
        bad = jnp.sum(~jnp.isfinite(logits), axis=(1, 2))
        return jnp.mean(st["kld"][:, :-1], axis=1), bad

    return jax.jit(kld_fn, static_argnames=("config",))


def _make_logits_fn() -> Callable:
    def logits_fn(weights, tokens, gsm, *, config):
        lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
        return family_module(config.family).forward(weights, config, tokens, lengths, gsm)

    return jax.jit(logits_fn, static_argnames=("config",))


@functools.partial(jax.jit, static_argnames=("config",))
def _ref_logprobs(weights, tokens, *, config):
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    logits = family_module(config.family).forward(weights, config, tokens, lengths, None)
    return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)


def _gsm_inputs(cfg: GSMConfig | None, params: ModelParams, rows: np.ndarray):
    if cfg is None:
        return None
    from gsm_jax.gsm_runtime import gsm_inputs_for_batch

    return gsm_inputs_for_batch(cfg, params.config.num_layers, rows.shape[0],
                                [rows.shape[1]] * rows.shape[0])


@dataclasses.dataclass
class Arm:
    """One variant scored against the float model; `hooks` wraps its GSM inputs (None or
    a `GSMInputs`) in the `Sites` the arm computes with (if any)."""

    name: str
    params: ModelParams | None
    gsm: GSMConfig | None = None
    hooks: Callable[[Any], Sites] | None = None
    note: str = ""
    unavailable: str | None = None
    fn: Callable = dataclasses.field(default_factory=_make_kld_fn)


def evaluate_arms(ref: ModelParams, arms: list[Arm], tokens: np.ndarray, *, batch_size: int,
                  log: Callable[[str], None]) -> dict[str, dict[str, Any]]:
    """Per available arm: KLD(ref || arm) per sequence and the count of non-finite logits.
    Streams batch by batch (the reference log-probs of one batch at a time: [B, T, V] f32).
    An arm that raises is marked unavailable with the error."""
    out: dict[str, dict[str, Any]] = {a.name: {"kld": [], "nonfinite_logits": 0}
                                      for a in arms if a.unavailable is None}
    for i in range(0, len(tokens), batch_size):
        rows = np.asarray(tokens[i: i + batch_size], np.int32)
        base = _ref_logprobs(ref.weights, jnp.asarray(rows), config=ref.config)
        for a in arms:
            if a.unavailable is not None:
                continue
            try:
                gsm = _gsm_inputs(a.gsm, a.params, rows)
                if a.hooks is not None:
                    gsm = a.hooks(gsm)
                k, bad = a.fn(a.params.weights, jnp.asarray(rows), gsm, base,
                              config=a.params.config)
                k, bad = np.asarray(k), np.asarray(bad)
            except (TypeError, ValueError, UnsupportedModelError, InvalidInputError) as e:
                a.unavailable = f"{type(e).__name__}: {e}"
                out.pop(a.name, None)
                continue
            out[a.name]["kld"].append(k)
            out[a.name]["nonfinite_logits"] += int(bad.sum())
        log(f"scored {min(i + batch_size, len(tokens))}/{len(tokens)} sequences")
    for v in out.values():
        v["kld"] = np.concatenate(v["kld"])
    return out


def _arm_summary(arm: Arm, res: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if arm.unavailable is not None:
        return {"unavailable": arm.unavailable}
    r = res[arm.name]
    mean, se = _mean_se(r["kld"])
    return {"mean_kld": mean, "stderr": se, "nonfinite_logits": r["nonfinite_logits"],
            "per_sequence": [float(x) for x in r["kld"]], "note": arm.note}


def _unavailable(e: Exception) -> str:
    return f"{UNAVAILABLE}: {e}" if isinstance(e, UnsupportedModelError) else str(e)


# ----------------------------------------------------------------------------- capture


def _e4m3_scale(x32: jax.Array, block: int = ACT_BLOCK) -> jax.Array:
    """The per-token, per-block power-of-two scale `quantize_activation_e4m3` uses,
    broadcast back to x's shape."""
    c = x32.shape[-1]
    n = -(-c // block)
    padded = jnp.pad(jnp.abs(x32), [(0, 0)] * (x32.ndim - 1) + [(0, n * block - c)])
    blocks = padded.reshape(x32.shape[:-1] + (n, block))
    amax = jnp.maximum(jnp.max(blocks, axis=-1, keepdims=True), ACT_MIN_AMAX)
    scale = jnp.exp2(jnp.ceil(jnp.log2(amax / E4M3_MAX)))
    return jnp.broadcast_to(scale, blocks.shape).reshape(padded.shape)[..., :c]


def activation_counts(x: jax.Array) -> dict[str, jax.Array]:
    """What the two activation quantizers do to x [..., C] (jittable; int32 counts):

    - ``nonfinite``: inf / NaN values;
    - ``nonzero``: finite values != 0 (the denominator of the flush shares);
    - ``int8_flush``: nonzero values that the per-token int8 quantizer (`quantize_rows`,
      scale absmax / 127) rounds to 0. Per-token int8 cannot saturate: its scale maps the
      row's largest value to 127 exactly;
    - ``e4m3_flush``: nonzero values that `quantize_activation_e4m3` (per token and
      128-channel block, power-of-two scale) returns as 0;
    - ``e4m3_saturated``: values that round to the format's largest magnitude
      (|e4m3(x / scale)| = 448: a block's largest value above 432 * scale does);
    - ``e4m3_clipped``: |x| / scale > 448, values beyond the range (0 by construction of the
      ceil-to-power-of-two scale; counted to show it);
    - ``raw_over_e4m3_max``: |x| > 448, what a cast to e4m3 *without* a scale would overflow;
    - ``max_abs``: the largest finite |x| (float32).
    """
    x32 = x.astype(jnp.float32)
    finite = jnp.isfinite(x32)
    nonzero = finite & (x32 != 0)
    q, _ = quantize_rows(x32)
    e4 = quantize_activation_e4m3(x32)
    scale = _e4m3_scale(x32)
    count = lambda m: jnp.sum(m, dtype=jnp.int32)  # noqa: E731
    return {
        "values": jnp.asarray(x32.size, jnp.int32),
        "nonfinite": count(~finite),
        "nonzero": count(nonzero),
        "int8_flush": count(nonzero & (q == 0)),
        "e4m3_flush": count(nonzero & (e4 == 0)),
        "e4m3_saturated": count(finite & (jnp.abs(e4) / scale >= E4M3_MAX)),
        "e4m3_clipped": count(finite & (jnp.abs(x32) / scale > E4M3_MAX)),
        "raw_over_e4m3_max": count(finite & (jnp.abs(x32) > E4M3_MAX)),
        "max_abs": jnp.max(jnp.where(finite, jnp.abs(x32), 0.0)),
    }


def _quantized_input(x: Any, w: Any) -> tuple[jax.Array | None, str | None]:
    """The activation a quantized linear actually quantizes (after its Hadamard rotation),
    and the format; (None, None) for a linear that keeps x in float."""
    if isinstance(x, QuantizedActivation):
        return None, None
    if isinstance(w, QuantizedWeight) and w.scheme == "w8a8":
        return (hadamard_rotate(x, w.hadamard) if w.hadamard else x), "int8"
    if isinstance(w, BlockQuantWeight) and w.act == "e4m3":
        return x, "e4m3"
    return None, None


class Recorder:
    """Per-call activation counts, appended from `jax.debug.callback` (one call per layer
    under `lax.scan`), keyed by the linear's name."""

    def __init__(self) -> None:
        self.calls: dict[str, list[dict[str, float]]] = {}
        self.formats: dict[str, str] = {}

    def add(self, label: str, fmt: str, counts: dict[str, Any]) -> None:
        self.formats[label] = fmt
        self.calls.setdefault(label, []).append({k: float(v) for k, v in counts.items()})

    def summary(self) -> dict[str, Any]:
        """Totals over every call, per linear and overall, with shares of the nonzero
        values (flush) and of all values (saturation, raw overflow)."""
        def tot(calls: list[dict[str, float]], fmt: str) -> dict[str, Any]:
            s = {k: sum(c[k] for c in calls) for k in calls[0] if k != "max_abs"}
            nz, n = max(s["nonzero"], 1.0), max(s["values"], 1.0)
            out = {"calls": len(calls), "values": int(s["values"]),
                   "nonfinite": int(s["nonfinite"]), "flush_share": s[f"{fmt}_flush"] / nz,
                   "worst_call_flush_share": max(c[f"{fmt}_flush"] / max(c["nonzero"], 1.0)
                                                 for c in calls),
                   "raw_over_e4m3_max_share": s["raw_over_e4m3_max"] / n,
                   "max_abs": max(c["max_abs"] for c in calls)}
            e4 = fmt == "e4m3"
            out["saturated_share"] = s["e4m3_saturated"] / n if e4 else 0.0
            out["clipped_share"] = s["e4m3_clipped"] / n if e4 else 0.0
            return out

        per = {k: {"format": self.formats[k], **tot(v, self.formats[k])}
               for k, v in self.calls.items()}
        every = [c for v in self.calls.values() for c in v]
        fmts = set(self.formats.values())
        if not every:
            return {"calls": 0, "per_linear": {}}
        fmt = fmts.pop() if len(fmts) == 1 else "int8"
        return {**tot(every, fmt), "format": fmt, "per_linear": per}


class _Identity:
    """A static hook field compared by the identity of what it holds (a recorder, a trace
    counter): hooks around the same object hit the same compiled program."""

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


@struct.dataclass
class LowpSites(Sites):
    """Records `activation_counts` of every activation entering a quantized linear (through
    `jax.debug.callback`, so the capture runs jitted, layer scan included), around the
    arm's own hooks `inner`. `unfuse_sites`: a GSM site feeding a W8A8 linear normally
    hands over an already quantized activation (fused smooth + quantize); here it hands
    over the smoothed float and `linear` quantizes it with the same reference quantizer
    (the CPU path is that very composition), so the counts see GSM's output."""

    inner: Sites
    recorder: _Identity = struct.field(pytree_node=False)
    unfuse_sites: bool = struct.field(pytree_node=False, default=True)

    @property
    def uses_rings(self) -> bool:
        return self.inner.uses_rings

    def site(self, step, layer, index, x, next_weight=None):
        return self.inner.site(step, layer, index, x,
                               None if self.unfuse_sites else next_weight)

    def linear(self, step, layer, name, x, w):
        y = self.inner.linear(step, layer, name, x, w)
        xin, fmt = _quantized_input(x, w)
        if xin is not None:
            jax.debug.callback(functools.partial(self.recorder.obj.add, name, fmt),
                               activation_counts(xin))
        return y


def capture_linear_inputs(recorder: Recorder, gsm: Any = None, *,
                          unfuse_sites: bool = True) -> LowpSites:
    """The hooks that record `activation_counts` of every activation entering a quantized
    linear into `recorder`, around `gsm` (None or a `GSMInputs`): pass them as the
    model's `sites=`. Labels are the weights' leaf names."""
    return LowpSites(as_sites(gsm), _Identity(recorder), unfuse_sites)


def capture(params: ModelParams, tokens: np.ndarray, gsm: GSMConfig | None) -> dict[str, Any]:
    """One captured forward over `tokens` [B, T]: the `Recorder` summary plus the
    non-finite logits."""
    rec = Recorder()
    fn = _make_logits_fn()
    hooks = capture_linear_inputs(rec, _gsm_inputs(gsm, params, tokens))
    logits = np.asarray(fn(params.weights, jnp.asarray(tokens), hooks, config=params.config))
    jax.effects_barrier()
    return {**rec.summary(), "nonfinite_logits": int((~np.isfinite(logits)).sum())}


# ----------------------------------------------------------------------------- order (b)


@struct.dataclass
class _FloatInput:
    """A site's output that the W8A8 linear must multiply in float (order (b))."""

    value: jax.Array


@struct.dataclass
class OrderBSites(Sites):
    """Order (b) at every GSM site that feeds a W8A8 linear: quantize the site's activation
    per token to int8 first (the reference quantizer, dequantized back), run the arm's GSM
    (`inner`) on those dequantized values, then feed the linear in float (`float_product`:
    the int8 weight times the float activation, `linear`'s w8a16 path) or requantize
    (False: the linear's own per-token int8). `traced.obj` (a list) gets one entry per
    site traced with the swap (empty: this family has no such site). Other sites are
    unchanged; without GSM (inner = no hooks) a site is a pass-through."""

    inner: Sites
    traced: _Identity = struct.field(pytree_node=False)
    float_product: bool = struct.field(pytree_node=False, default=True)

    @property
    def uses_rings(self) -> bool:
        return self.inner.uses_rings

    def site(self, step, layer, index, x, next_weight=None):
        if type(self.inner) is Sites or not wants_int8_input(next_weight):
            return self.inner.site(step, layer, index, x, next_weight)
        self.traced.obj.append(1)
        y = self.inner.site(step, layer, index, quantize_activation(x).dequantize(), None)
        return _FloatInput(y) if self.float_product else y

    def linear(self, step, layer, name, x, w):
        if isinstance(x, _FloatInput):
            return linear(x.value, w.replace(scheme="w8a16"))
        return self.inner.linear(step, layer, name, x, w)


def order_b(gsm: Any, traced: list | None = None, *, float_product: bool = True) -> OrderBSites:
    """The order-(b) hooks around `gsm` (None or a `GSMInputs`); pass them as `gsm=`."""
    return OrderBSites(as_sites(gsm), _Identity([] if traced is None else traced),
                       float_product)


# ----------------------------------------------------------------------------- claim 3

FORMATS = {"int8": ("w8a8", "INT8 W8A8"), "fp8": ("fp8", "FP8 e4m3")}
METHODS = ("alone", "gsm", "smoothquant", "hadamard")
METHOD_LABELS = {"alone": "alone", "gsm": "+ GSM", "smoothquant": "+ SmoothQuant",
                 "hadamard": "+ Hadamard(down)"}


def claim3_verdict(effects: dict[str, dict[str, Any] | None]) -> str:
    """Supported if GSM lowers some format's KLD beyond the standard error; not testable
    when no format has both arms; refuted otherwise. effects: {format: paired difference
    (alone - gsm) or None}."""
    tested = [e for e in effects.values() if e is not None]
    if not tested:
        return "not testable here"
    return "supported" if any(beyond_se(e) for e in tested) else "refuted"


def _hadamard_block(params: ModelParams, sizes: dict) -> int:
    if sizes.get("hadamard_block"):
        return int(sizes["hadamard_block"])
    d_ff = int(getattr(params.config, "intermediate_size", 0) or 0)
    b = 512
    while b > 1 and d_ff % b:
        b //= 2
    return b if d_ff else 0


def _build(fn: Callable[[], ModelParams]) -> tuple[ModelParams | None, str | None]:
    try:
        return fn(), None
    except (UnsupportedModelError, InvalidInputError) as e:
        return None, _unavailable(e)


def run_claim_3(params: ModelParams, *, sizes: dict, progress: bool,
                model_dir: Path | None) -> dict[str, Any]:
    """Claim 3 (see the module docstring). sizes: "sequences" (8), "seq_len" (256),
    "calib_sequences" (8, SmoothQuant statistics, disjoint from the evaluation rows),
    "capture_sequences" (2), "batch_size" (4), "gsm", "alpha" (0.5), "hadamard_block"."""
    from gsm_jax.quant import quantize, smoothquant

    sizes = dict(sizes or {})
    load0 = os.getloadavg()[0]
    log = functools.partial(log_line, progress, 3)
    cfg = gsm_config(sizes)
    n, t = int(sizes.get("sequences", 8)), int(sizes.get("seq_len", 256))
    tokens, data = eval_tokens(params, sizes, n=n, seq_len=t, from_end=True)
    calib, calib_data = eval_tokens(params, {}, n=int(sizes.get("calib_sequences", 8)),
                                    seq_len=t, from_end=False)
    block = _hadamard_block(params, sizes)
    log(f"{params.source}: {data}; GSM {cfg.smooth_strength} window {cfg.window_size}")

    sq, sq_err = _build(lambda: smoothquant(params, calib, alpha=float(sizes.get("alpha", 0.5)),
                                            batch_size=int(sizes.get("batch_size", 4))))
    arms: list[Arm] = []
    for fmt, (scheme, _) in FORMATS.items():
        q, err = _build(lambda scheme=scheme: quantize(params, scheme))
        arms.append(Arm(f"{fmt}/alone", q, None, unavailable=err))
        arms.append(Arm(f"{fmt}/gsm", q, cfg, unavailable=err))
        if sq is None:
            arms.append(Arm(f"{fmt}/smoothquant", None, unavailable=sq_err))
        else:
            q_sq, err_sq = _build(lambda scheme=scheme: quantize(sq, scheme))
            arms.append(Arm(f"{fmt}/smoothquant", q_sq, None, unavailable=err_sq,
                            note=f"alpha {sizes.get('alpha', 0.5)}"))
        q_h, err_h = (None, "no power-of-two block divides the FFN width") if not block else \
            _build(lambda scheme=scheme: quantize(params, scheme, hadamard_down=block))
        arms.append(Arm(f"{fmt}/hadamard", q_h, None, unavailable=err_h,
                        note=f"block {block}"))
    log(f"{sum(a.unavailable is None for a in arms)} arms available; scoring")
    res = evaluate_arms(params, arms, tokens, batch_size=int(sizes.get("batch_size", 4)), log=log)
    by = {a.name: a for a in arms}

    kld: dict[str, dict[str, Any]] = {}
    effects: dict[str, dict[str, Any] | None] = {}
    for fmt in FORMATS:
        kld[fmt] = {m: _arm_summary(by[f"{fmt}/{m}"], res) for m in METHODS}
        a, g = res.get(f"{fmt}/alone"), res.get(f"{fmt}/gsm")
        effects[fmt] = None if a is None or g is None else paired_difference(a["kld"], g["kld"])
    nonfinite = sum(v["nonfinite_logits"] for v in res.values())

    # overflow / underflow without GSM (and with it, for comparison), one short batch
    cap_rows = tokens[: int(sizes.get("capture_sequences", 2))]
    activations: dict[str, dict[str, Any]] = {}
    for fmt in FORMATS:
        arm = by[f"{fmt}/alone"]
        if arm.unavailable is not None:
            continue
        log(f"capturing the activations entering the {fmt} linears")
        activations[fmt] = {"alone": capture(arm.params, cap_rows, None),
                            "gsm": capture(arm.params, cap_rows, cfg)}

    verdict = claim3_verdict(effects)
    parts = []
    for fmt, e in effects.items():
        label = FORMATS[fmt][1]
        if e is None:
            parts.append(f"{label}: {kld[fmt]['alone'].get('unavailable', 'n/a')}")
            continue
        parts.append(f"{label} {kld[fmt]['alone']['mean_kld']:.4g} -> "
                     f"{kld[fmt]['gsm']['mean_kld']:.4g} with GSM (change "
                     f"{-e['mean']:+.3g} ± {e['stderr']:.2g}, {abs(e['z']):.1f} SE)")
    act = "; ".join(
        f"without GSM {v['alone']['flush_share'] * 100:.3f}% of nonzero {fmt} activations "
        f"flush to 0 (with GSM {v['gsm']['flush_share'] * 100:.3f}%), "
        f"{v['alone']['saturated_share'] * 100:.3f}% round to the format max, "
        f"{v['alone']['clipped_share'] * 100:.3f}% clip"
        for fmt, v in activations.items())
    why = (f"Mean KLD vs the float model: {'; '.join(parts)}; inf/NaN logits in "
           f"{'no' if nonfinite == 0 else nonfinite} case(s)" + (f"; {act}" if act else "")
           + ".")
    figures = []
    fig_dir = figures_dir(model_dir)
    if fig_dir is not None and res:
        figures.append(str(_claim3_figure(kld, params.source, fig_dir / "claim3_lowp_kld.png")))
    return {
        "claim": 3, "model": params.source, "verdict": verdict, "why": why,
        "numbers": {
            "data": data, "smoothquant_calibration": calib_data, "sequences": int(len(tokens)),
            "seq_len": t, "reference_dtype": str(params.dtype), "gsm": cfg.to_dict(),
            "kld_vs_float": kld,
            # KLD(alone) - KLD(+GSM) per sequence: > 0 means GSM lowers the KLD
            "gsm_effect": {f: None if e is None else {**e, "beyond_se": beyond_se(e)}
                           for f, e in effects.items()},
            "overflow": {"nonfinite_logits_total": nonfinite, "occurred": nonfinite > 0},
            "activations": activations,
            "definitions": {
                "kld": "KL(float || variant) per token over the positions with a next "
                       "token, averaged per sequence; stderr over sequences",
                "beyond_se": f"paired per-sequence difference > {SE_MULTIPLE} standard errors",
                "flush_share": "nonzero activations the format's quantizer rounds to 0 "
                               "(int8: per-token absmax/127 scale; e4m3: per-token, "
                               "128-channel power-of-two scale), over nonzero values",
                "saturated_share": "e4m3 values rounding to +-448, over all values (int8 "
                                   "per-token absmax cannot saturate)",
                "clipped_share": "e4m3 values beyond +-448 * scale, over all values",
                "capture": "linear() swapped under a context manager; counts computed in "
                           "the jitted program, returned by jax.debug.callback",
            },
        },
        "load_avg": load_avg(load0, os.getloadavg()[0]),
        "figures": figures,
    }


def _claim3_figure(kld: dict, model: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(METHODS)
    floor = 1e-8  # a log axis cannot show 0
    for j, m in enumerate(METHODS):
        xs, ys, es = [], [], []
        for i, fmt in enumerate(FORMATS):
            r = kld[fmt][m]
            if "mean_kld" not in r:
                ax.text(i + j * width, 0.03, "n/a", ha="center", fontsize=8,
                        transform=ax.get_xaxis_transform())
                continue
            xs.append(i + j * width)
            ys.append(max(r["mean_kld"], floor))
            es.append(0.0 if not np.isfinite(r["stderr"]) else r["stderr"])
        ax.bar(xs, ys, width, yerr=es, capsize=3, label=METHOD_LABELS[m])
    ax.set_yscale("log")
    ax.set_xlim(-width, len(FORMATS) - 1 + width * len(METHODS))  # room for "n/a" slots
    ax.set_xticks(np.arange(len(FORMATS)) + width * (len(METHODS) - 1) / 2)
    ax.set_xticklabels([FORMATS[f][1] for f in FORMATS])
    ax.set_ylabel("mean KLD vs float (log)")
    ax.set_title(f"Claim 3: low-precision quality, {model} (error bars: s.e. over sequences)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- claim 9


def claim9_verdict(a: np.ndarray | None, b: np.ndarray | None) -> tuple[str, dict | None]:
    """"Quantize, then smooth" read literally (order (b): smoothing sees the quantized
    activation, as the document's reason, that smoothing treats the jitter quantization
    adds, requires) beats smooth-then-quantize (a) when KLD(b) is below KLD(a) beyond the
    standard error. Returns (verdict, paired difference a - b)."""
    if a is None or b is None:
        return "not testable here", None
    d = paired_difference(a, b)
    return ("supported" if beyond_se(d) else "refuted"), d


ORDER_A = ("At each GSM site feeding a W8A8 linear (attn_out -> o, ffn_mid -> down) the "
           "filter runs on the float activation, then the per-token int8 scale is taken from "
           "the smoothed values and they are cast to int8 (models/gsm_sites.py "
           "smooth_site_prefill -> gsm_jax/smoothing.py smooth_quantize_prefill, kernels in "
           "pallas_kernels/smooth_quant.py: "
           "the XLA filter then quantize_rows off GPU, one fused kernel on GPU), and linear "
           "multiplies that QuantizedActivation as is.")


def run_claim_9(params: ModelParams, *, sizes: dict, progress: bool,
                model_dir: Path | None) -> dict[str, Any]:
    """Claim 9 (see `claim9_verdict`, `order_b`). sizes: "sequences" (8), "seq_len" (256),
    "batch_size" (4), "gsm"."""
    from gsm_jax.quant import quantize

    sizes = dict(sizes or {})
    load0 = os.getloadavg()[0]
    log = functools.partial(log_line, progress, 9)
    cfg = gsm_config(sizes)
    n, t = int(sizes.get("sequences", 8)), int(sizes.get("seq_len", 256))
    tokens, data = eval_tokens(params, sizes, n=n, seq_len=t, from_end=True)
    q, err = _build(lambda: quantize(params, "w8a8"))
    traced_float: list[int] = []
    traced_requant: list[int] = []
    b_float = functools.partial(order_b, traced=traced_float, float_product=True)
    b_requant = functools.partial(order_b, traced=traced_requant, float_product=False)

    arms = [Arm("w8a8", q, None, unavailable=err, note="no GSM"),
            Arm("a", q, cfg, unavailable=err, note="smooth in float, then quantize"),
            Arm("b", q, cfg, hooks=b_float, unavailable=err,
                note="quantize, then smooth the dequantized values; float product"),
            Arm("b_requant", q, cfg, hooks=b_requant, unavailable=err,
                note="quantize, smooth, requantize per token (all-int8 product)"),
            Arm("float+gsm", params, cfg, note="GSM on the float model")]
    log(f"{params.source}: {data}; scoring {len(arms)} arms")
    res = evaluate_arms(params, arms, tokens, batch_size=int(sizes.get("batch_size", 4)), log=log)
    by = {a.name: a for a in arms}
    if err is None and not traced_float and by["b"].unavailable is None:
        by["b"].unavailable = ("no GSM site of this family hands its activation to a W8A8 "
                               "linear, so order (b) cannot be swapped in without model changes")
        res.pop("b", None)
    kld = {name: _arm_summary(a, res) for name, a in by.items()}
    a_k = res["a"]["kld"] if "a" in res else None
    b_k = res["b"]["kld"] if "b" in res else None
    verdict, diff = claim9_verdict(a_k, b_k)
    if verdict == "not testable here":
        reason = by["b"].unavailable or by["a"].unavailable or err
        why = f"Order (b) could not be run: {reason}."
    else:
        req = kld["b_requant"]
        why = (f"W8A8 mean KLD vs float: no GSM {kld['w8a8']['mean_kld']:.4g}, (a) smooth then "
               f"quantize {kld['a']['mean_kld']:.4g}, (b) quantize then smooth "
               f"{kld['b']['mean_kld']:.4g} (KLD(a) - KLD(b) = {diff['mean']:+.3g} ± "
               f"{diff['stderr']:.2g}, {diff['z']:.1f} SE)"
               + (f", (b) requantized {req['mean_kld']:.4g}" if "mean_kld" in req else "")
               + "; 'quantize, then smooth' read as order (b).")
    figures = []
    fig_dir = figures_dir(model_dir)
    if fig_dir is not None and res:
        figures.append(str(_claim9_figure(kld, params.source, fig_dir / "claim9_order.png")))
    return {
        "claim": 9, "model": params.source, "verdict": verdict, "why": why,
        "numbers": {
            "data": data, "sequences": int(len(tokens)), "seq_len": t, "gsm": cfg.to_dict(),
            "kld_vs_float": kld,
            "a_minus_b": None if diff is None else {**diff, "beyond_se": beyond_se(diff)},
            # site traces (a layer scan traces each site once), not layer count
            "site_traces_swapped": {"b": len(traced_float), "b_requant": len(traced_requant)},
            "order_a": ORDER_A,
            "order_b": "Implemented in this module only (gsm_jax.workflow.evidence.lowp_claims."
                       "OrderBSites, the model's site and linear hooks); the site's "
                       "activation is quantized "
                       "per token (quantize_activation, dequantized back), filtered, and the "
                       "W8A8 linear multiplies the result in float (its w8a16 path).",
            "reading": "The document's 先量化再平滑 (quantize first, then smooth; because "
                       "quantization amplifies the jitter that smoothing treats) is read as "
                       "order (b). The project's own 'quantize, then smooth' label "
                       "(gsm_jax.quant) names order (a); 'a_minus_b' > 0 means (b) is better.",
        },
        "load_avg": load_avg(load0, os.getloadavg()[0]),
        "figures": figures,
    }


def _claim9_figure(kld: dict, model: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"w8a8": "W8A8\nno GSM", "a": "(a) smooth,\nthen quantize",
              "b": "(b) quantize,\nthen smooth", "b_requant": "(b) then\nrequantize",
              "float+gsm": "float\n+ GSM"}
    names = [k for k in labels if "mean_kld" in kld.get(k, {})]
    fig, ax = plt.subplots(figsize=(7, 4))
    ys = [kld[k]["mean_kld"] for k in names]
    es = [kld[k]["stderr"] if np.isfinite(kld[k]["stderr"]) else 0.0 for k in names]
    ax.bar(range(len(names)), ys, yerr=es, capsize=4,
           color=["#999999", "#1f77b4", "#ff7f0e", "#ffbb78", "#2ca02c"][: len(names)])
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([labels[k] for k in names], fontsize=8)
    ax.set_ylabel("mean KLD vs float")
    ax.set_title(f"Claim 9: order of quantization and smoothing, {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
