"""Evaluate a GSM configuration against the unsmoothed model on the same tokens.

Three parts (each optional), all compared with the unsmoothed ("base") model:

- ``quality``: teacher-forced next-token statistics over WikiText-2 sequences
  (mean/99th-percentile KLD, same-top-1 %, RMS Δp, perplexity and its ratio;
  see `gsm_jax.workflow.metrics`). The base log-probabilities are computed once
  and kept on the device; each configuration then costs one jitted forward per
  batch, and only per-token [B, T] statistics come back to the host.
- ``lambada``: LAMBADA last-word accuracy, greedy. Scored exactly as greedy
  generation would, but mostly without generating: one teacher-forced pass over
  context + target tokens gives the greedy token at each target position, which
  *is* the greedy continuation as long as it agrees with the target (and the
  first disagreeing token is the real greedy token). When that does not decide
  the word by the rule of `metrics.first_word` (e.g. the model spells the
  target with other tokens), the example falls back to real greedy generation
  (`generate_tokens`, up to 16 new tokens).
- ``greedy``: agreement of 64-token greedy continuations of WikiText-2 prompts
  (prefix agreement, identical continuations, token match).

The evaluation sequences are taken from the *end* of the text file
(``from_end=True``), the profile's from its start, so they do not overlap.
`Evaluator` holds the data and the base results, so calibration evaluates many
configurations against one reference; `evaluate` is the one-shot entry point.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gsm_jax.config import GSMConfig, resolve_mask
from gsm_jax.errors import InvalidInputError
from gsm_jax.families import family_module
from gsm_jax.generation import generate_tokens
from gsm_jax.gsm_runtime import as_gsm_config, gsm_inputs_for_batch
from gsm_jax.params import ModelParams
from gsm_jax.workflow import data as data_mod
from gsm_jax.workflow import metrics
from gsm_jax.workflow.metrics import Budget

PARTS = ("quality", "lambada", "greedy")
LAMBADA_BUCKET = 32  # LAMBADA batches are padded to a multiple of this many tokens
LAMBADA_FALLBACK_TOKENS = 16
DEFAULT = "default"  # "use the shared data file"
# The base log-probabilities of the quality set are kept when they fit in this
# many bytes (else they are recomputed with every configuration: 2x the work).
REFERENCE_BYTES_LIMIT = 6 * 2**30


def _progress_bar(iterable, *, desc: str, enabled: bool, total: int | None = None):
    from tqdm import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=not enabled, leave=False,
                dynamic_ncols=True)


def check_params(params: Any) -> ModelParams:
    if not isinstance(params, ModelParams):
        raise InvalidInputError(
            f"params must be what gsm_jax.load returns (ModelParams), got {type(params).__name__}"
        )
    return params


# ----------------------------------------------------------------------------- jitted kernels


@functools.partial(jax.jit, static_argnames=("config",))
def _base_pass(weights, tokens, *, config):
    """Base log-probs [B, T, V] and per-token NLL of the next token [B, T]."""
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    logits = family_module(config.family).forward(weights, config, tokens, lengths, None)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    targets = jnp.roll(tokens, -1, axis=1)
    nll = -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]
    return lp, nll


@functools.partial(jax.jit, static_argnames=("config",))
def _compare_pass(weights, tokens, gsm, base_lp, *, config):
    lengths = jnp.full((tokens.shape[0],), tokens.shape[1], jnp.int32)
    logits = family_module(config.family).forward(weights, config, tokens, lengths, gsm)
    return metrics.token_stats(base_lp, logits, jnp.roll(tokens, -1, axis=1))


@functools.partial(jax.jit, static_argnames=("config",))
def _compare_recompute(weights, tokens, gsm, *, config):
    base_lp, _ = _base_pass(weights, tokens, config=config)
    return _compare_pass(weights, tokens, gsm, base_lp, config=config)


@functools.partial(jax.jit, static_argnames=("config",))
def _greedy_at(weights, tokens, lengths, positions, gsm, *, config):
    """argmax of the next-token logits at `positions` [B, K] only (no full-vocab logits
    elsewhere): the hidden states are gathered before the LM head (the family contract:
    `logits(weights, cfg, hidden_states(...)[0])` is `forward`)."""
    fam = family_module(config.family)
    h, _ = fam.hidden_states(weights, config, tokens, lengths, gsm)
    idx = positions.reshape(positions.shape + (1,) * (h.ndim - 2))
    logits = fam.logits(weights, config, jnp.take_along_axis(h, idx, axis=1))
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _bucket_up(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# ----------------------------------------------------------------------------- result


@dataclasses.dataclass
class EvalResult:
    """One configuration's quality against the base model. ``save`` writes it as JSON."""

    model: str
    config: dict | None  # GSMConfig.to_dict(); None for the unsmoothed model itself
    label: str = ""
    smoothed_pairs: int = 0  # (layer, site) pairs the config smooths
    quality: dict | None = None
    lambada: dict | None = None
    greedy: dict | None = None
    sizes: dict = dataclasses.field(default_factory=dict)
    seconds: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "gsm-jax/eval/v1", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def gsm_config(self) -> GSMConfig | None:
        return None if self.config is None else GSMConfig.from_dict(self.config)

    def save(self, path: str | os.PathLike) -> Path:
        """Write as JSON (a directory gets ``eval.json`` inside it)."""
        path = Path(path)
        if path.suffix.lower() != ".json":
            path = path / "eval.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(jsonable(self.to_dict()), indent=2, allow_nan=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvalResult:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def violations(self, budget: Budget) -> list[str]:
        return budget.violations(self.quality, self.lambada)

    def summary(self) -> str:
        """A few human-readable lines."""
        lines = [f"[{self.label or 'eval'}] {self.model}: {self.smoothed_pairs} (layer, site) "
                 "pairs smoothed"]
        if self.config is not None:
            c = self.config
            lines[0] += (f"; strength {c['smooth_strength']}, window {c['window_size']}, "
                         f"protect_first {c['protect_first']}, precision {c['precision']}")
        q = self.quality
        if q is not None:
            lines.append(
                f"  tokens {q['n_tokens']}: mean KLD {q['mean_kld']:.5f} "
                f"(± {q['mean_kld_stderr']:.5f}), p99 KLD {q['p99_kld']:.4f}, same top-1 "
                f"{q['same_top1_pct']:.2f}%, RMS Δp {q['rms_dp_pct']:.3f}%, PPL "
                f"{q['ppl']:.3f} vs {q['ppl_base']:.3f} (ratio {q['ppl_ratio']:.5f})"
            )
        la = self.lambada
        if la is not None:
            lines.append(
                f"  LAMBADA ({la['n_examples']}): {la['accuracy_pct']:.2f}% vs "
                f"{la['accuracy_base_pct']:.2f}% base (drop {la['accuracy_drop_points']:+.2f} "
                f"points; {la['lost']} lost, {la['gained']} gained)"
            )
        g = self.greedy
        if g is not None:
            lines.append(
                f"  greedy {g['tokens']}-token continuations ({g['n_prompts']} prompts): prefix "
                f"agreement {g['prefix_agreement_pct']:.1f}%, identical {g['identical_pct']:.1f}%"
            )
        return "\n".join(lines)


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# ----------------------------------------------------------------------------- evaluator


@dataclasses.dataclass
class _LambadaItem:
    ctx: np.ndarray
    tgt: np.ndarray
    target: str


class Evaluator:
    """Data plus base-model reference, reused across configurations.

    data: a text file (default: the shared WikiText-2) or int token ids [N, T].
    lambada: a jsonl path (default: the shared LAMBADA dev set), a list of
    (context, target) pairs, or None to skip the task metric.
    """

    def __init__(
        self,
        params: ModelParams,
        *,
        data: Any = None,
        lambada: Any = DEFAULT,
        num_sequences: int = 32,
        seq_len: int = 256,
        batch_size: int = 8,
        lambada_samples: int | None = None,
        greedy_prompts: int = 8,
        greedy_prompt_len: int = 64,
        greedy_tokens: int = 64,
        progress: bool = True,
    ) -> None:
        self.params = check_params(params)
        cfg = params.config
        for name, v, lo in (("num_sequences", num_sequences, 1), ("seq_len", seq_len, 2),
                            ("batch_size", batch_size, 1), ("greedy_prompts", greedy_prompts, 0),
                            ("greedy_tokens", greedy_tokens, 1),
                            ("greedy_prompt_len", greedy_prompt_len, 1)):
            if isinstance(v, bool) or not isinstance(v, int | np.integer) or v < lo:
                raise InvalidInputError(f"{name} must be an integer >= {lo}, got {v!r}")
        if lambada_samples is not None and (not isinstance(lambada_samples, int)
                                            or lambada_samples < 1):
            raise InvalidInputError(f"lambada_samples must be >= 1 or None, got {lambada_samples}")
        self.progress = progress
        self.batch_size = int(batch_size)
        tok = params.tokenizer
        self.sequences = data_mod.as_token_sequences(
            data, tok, seq_len=seq_len, num_sequences=num_sequences, from_end=True,
            vocab_size=cfg.vocab_size,
        )
        if self.sequences.shape[1] > cfg.max_position_embeddings:
            raise InvalidInputError(
                f"seq_len {self.sequences.shape[1]} exceeds the model's context "
                f"({cfg.max_position_embeddings})"
            )
        self.data_source = "token array" if not (data is None or isinstance(
            data, str | os.PathLike)) else str(data or data_mod.default_wikitext_path())
        if lambada == DEFAULT:
            lambada = data_mod.default_lambada_path()
        self.lambada_source = None if lambada is None else (
            str(lambada) if isinstance(lambada, str | os.PathLike) else "example list")
        examples = data_mod.as_lambada_examples(lambada, limit=lambada_samples)
        self.lambada_items: list[_LambadaItem] | None = None
        if examples is not None:
            if tok is None:
                raise InvalidInputError("LAMBADA needs a tokenizer; this model has none")
            items = []
            for ex in examples:
                ctx = np.asarray(tok.encode(ex.context), np.int32)
                tgt = np.asarray(tok.encode(ex.separator + ex.target, add_bos=False), np.int32)
                if ctx.size + tgt.size + 1 > cfg.max_position_embeddings:
                    raise InvalidInputError("a LAMBADA example exceeds the model's context")
                items.append(_LambadaItem(ctx, tgt, ex.target))
            self.lambada_items = items
        self.greedy_prompts = min(int(greedy_prompts), self.sequences.shape[0])
        self.greedy_prompt_len = min(int(greedy_prompt_len), self.sequences.shape[1])
        self.greedy_tokens = int(greedy_tokens)
        self._ref: dict[str, Any] | None = None

    # ---- sizes

    @property
    def num_layers(self) -> int:
        return int(self.params.config.num_layers)

    def sizes(self) -> dict[str, Any]:
        n, t = self.sequences.shape
        return {
            "quality_sequences": int(n), "seq_len": int(t), "batch_size": self.batch_size,
            "quality_tokens_scored": int(n * (t - 1)),
            "lambada_examples": 0 if self.lambada_items is None else len(self.lambada_items),
            "greedy_prompts": self.greedy_prompts, "greedy_prompt_len": self.greedy_prompt_len,
            "greedy_tokens": self.greedy_tokens,
            "data": self.data_source, "lambada": self.lambada_source,
        }

    def _batches(self) -> list[tuple[np.ndarray, int]]:
        n, b = self.sequences.shape[0], self.batch_size
        out = []
        for i in range(0, n, b):
            rows = self.sequences[i: i + b]
            real = rows.shape[0]
            if real < b:  # pad with copies of the last row (ignored): one compiled shape
                rows = np.concatenate([rows, np.repeat(rows[-1:], b - real, axis=0)])
            out.append((rows, real))
        return out

    def _gsm_inputs(self, cfg: GSMConfig | None, batch: int, totals: Sequence[int]):
        if cfg is None:
            return None
        return gsm_inputs_for_batch(cfg, self.num_layers, batch, list(totals))

    # ---- reference

    def reference(self, parts: Sequence[str] = PARTS) -> dict[str, Any]:
        """Base-model results of ``parts`` (each computed on first use, then reused)."""
        ref = self._ref if self._ref is not None else {}
        self._ref = ref
        p = self.params
        if "quality" in parts and "nll" not in ref:
            t0 = time.perf_counter()
            batches = self._batches()
            t = self.sequences.shape[1]
            vocab = p.config.vocab_size
            keep = len(batches) * self.batch_size * t * vocab * 4 <= REFERENCE_BYTES_LIMIT
            base_lp, nll = [], []
            for rows, real in _progress_bar(batches, desc="base model: quality set",
                                            enabled=self.progress):
                lp, nl = _base_pass(p.weights, jnp.asarray(rows), config=p.config)
                base_lp.append(lp if keep else None)
                nll.append(np.asarray(nl)[:real, : t - 1])
            ref["base_lp"], ref["nll"] = base_lp, np.concatenate(nll)
            ref["quality_seconds"] = time.perf_counter() - t0
        if "lambada" in parts and self.lambada_items is not None and "lambada_correct" not in ref:
            t1 = time.perf_counter()
            ref["lambada_correct"], ref["lambada_words"] = self._lambada(None, "base model")
            ref["lambada_seconds"] = time.perf_counter() - t1
        if "greedy" in parts and self.greedy_prompts > 0 and "greedy" not in ref:
            t1 = time.perf_counter()
            ref["greedy"] = self._greedy(None)
            ref["greedy_seconds"] = time.perf_counter() - t1
        return ref

    def baseline(self) -> EvalResult:
        """The unsmoothed model's own numbers (perplexity, LAMBADA accuracy)."""
        ref = self.reference()
        nll = ref["nll"]
        p_base = np.exp(-nll)
        quality = metrics.summarize_quality({
            "kld": np.zeros_like(nll), "same_top1": np.ones(nll.shape, bool),
            "p_base": p_base, "p": p_base, "nll_base": nll, "nll": nll})
        lam = None
        if "lambada_correct" in ref:
            c = ref["lambada_correct"]
            lam = metrics.summarize_lambada(c, c)
        return EvalResult(model=self.params.source, config=None, label="base", quality=quality,
                          lambada=lam, sizes=self.sizes(),
                          seconds={k: v for k, v in ref.items() if k.endswith("seconds")})

    # ---- parts

    def _quality(self, cfg: GSMConfig) -> dict[str, Any]:
        p, ref = self.params, self.reference(("quality",))
        t = self.sequences.shape[1]
        acc: dict[str, list[np.ndarray]] = {}
        batches = self._batches()
        for (rows, real), lp in _progress_bar(list(zip(batches, ref["base_lp"], strict=True)),
                                              desc="quality", enabled=self.progress):
            gsm = self._gsm_inputs(cfg, rows.shape[0], [t] * real)
            if lp is None:
                st = _compare_recompute(p.weights, jnp.asarray(rows), gsm, config=p.config)
            else:
                st = _compare_pass(p.weights, jnp.asarray(rows), gsm, lp, config=p.config)
            for k, v in st.items():
                acc.setdefault(k, []).append(np.asarray(v)[:real, : t - 1])
        return metrics.summarize_quality({k: np.concatenate(v) for k, v in acc.items()})

    def _lambada(self, cfg: GSMConfig | None, desc: str) -> tuple[list[bool], list[str]]:
        p, tok = self.params, self.params.tokenizer
        items = self.lambada_items
        eos = set(tok.eos_ids)
        order = sorted(range(len(items)), key=lambda i: items[i].ctx.size + items[i].tgt.size)
        correct: list[bool | None] = [None] * len(items)
        words: list[str] = [""] * len(items)
        undecided: list[int] = []
        b = self.batch_size
        chunks = [order[i: i + b] for i in range(0, len(order), b)]
        for idx in _progress_bar(chunks, desc=f"LAMBADA ({desc})", enabled=self.progress):
            rows = [np.concatenate([items[i].ctx, items[i].tgt]) for i in idx]
            width = _bucket_up(max(r.size for r in rows), LAMBADA_BUCKET)
            k = _pow2(max(items[i].tgt.size for i in idx) + 1)
            tokens = np.zeros((b, width), np.int32)
            lengths = np.ones((b,), np.int32)
            positions = np.zeros((b, k), np.int32)
            for j, (i, r) in enumerate(zip(idx, rows, strict=True)):
                tokens[j, : r.size] = r
                lengths[j] = r.size
                c = items[i].ctx.size
                positions[j] = np.minimum(np.arange(c - 1, c - 1 + k), r.size - 1)
            gsm = self._gsm_inputs(cfg, b, [int(r.size) for r in rows])
            greedy = np.asarray(_greedy_at(p.weights, jnp.asarray(tokens), jnp.asarray(lengths),
                                           jnp.asarray(positions), gsm, config=p.config))
            for j, i in enumerate(idx):
                tgt = items[i].tgt
                g = greedy[j, : tgt.size + 1]
                miss = np.nonzero(g[: tgt.size] != tgt)[0]
                n_ok = int(miss[0]) if miss.size else tgt.size
                gen = [*tgt[:n_ok].tolist(), int(g[n_ok])]
                text = tok.decode(gen)
                verdict = metrics.lambada_decision(text, items[i].target, gen[-1] in eos)
                words[i] = metrics.first_word(text)[0]
                if verdict is None:
                    undecided.append(i)
                else:
                    correct[i] = verdict
        for start in range(0, len(undecided), b):
            idx = undecided[start: start + b]
            outs = generate_tokens(p, [items[i].ctx for i in idx],
                                   max_new_tokens=LAMBADA_FALLBACK_TOKENS, gsm=cfg)
            for i, out in zip(idx, outs, strict=True):
                text = tok.decode(out)
                words[i] = metrics.first_word(text)[0]
                correct[i] = bool(metrics.lambada_decision(text, items[i].target, True))
        return [bool(c) for c in correct], words

    def _greedy(self, cfg: GSMConfig | None) -> list[np.ndarray]:
        prompts = self.sequences[: self.greedy_prompts, : self.greedy_prompt_len]
        outs = []
        b = self.batch_size
        for i in range(0, len(prompts), b):
            outs += generate_tokens(self.params, prompts[i: i + b],
                                    max_new_tokens=self.greedy_tokens, eos_ids=[], gsm=cfg)
        return outs

    # ---- public

    def evaluate(self, gsm: Any, *, parts: Sequence[str] = PARTS, label: str = "") -> EvalResult:
        """Evaluate one configuration (GSMConfig, dict or config file) on the given parts."""
        bad = [x for x in parts if x not in PARTS]
        if bad:
            raise InvalidInputError(f"unknown evaluation part(s) {bad}; choose from {PARTS}")
        if gsm is None:
            return self.baseline()
        cfg = as_gsm_config(gsm)
        pairs = int(resolve_mask(cfg, self.num_layers).sum()) if cfg.enable else 0
        ref = self.reference(parts)
        res = EvalResult(model=self.params.source, config=cfg.to_dict(), label=label,
                         smoothed_pairs=pairs, sizes=self.sizes())
        t0 = time.perf_counter()
        if "quality" in parts:
            res.quality = self._quality(cfg)
            res.seconds["quality"] = time.perf_counter() - t0
        if "lambada" in parts and self.lambada_items is not None:
            t1 = time.perf_counter()
            correct, _ = self._lambada(cfg, label or "GSM")
            res.lambada = metrics.summarize_lambada(ref["lambada_correct"], correct)
            res.seconds["lambada"] = time.perf_counter() - t1
        if "greedy" in parts and self.greedy_prompts > 0:
            t1 = time.perf_counter()
            res.greedy = metrics.greedy_agreement(ref["greedy"], self._greedy(cfg))
            res.seconds["greedy"] = time.perf_counter() - t1
        return res


def evaluate(
    params: ModelParams,
    gsm: Any,
    *,
    data: Any = None,
    lambada: Any = DEFAULT,
    num_sequences: int = 32,
    seq_len: int = 256,
    batch_size: int = 8,
    lambada_samples: int | None = None,
    greedy_prompts: int = 8,
    greedy_tokens: int = 64,
    greedy_prompt_len: int = 64,
    parts: Sequence[str] = PARTS,
    progress: bool = True,
) -> EvalResult:
    """Quality of GSM config ``gsm`` against the unsmoothed model on the same tokens.

    ``data``: WikiText-2 file (default: the shared copy) or token ids [N, T];
    ``lambada``: LAMBADA jsonl (default: the shared dev set; all of it unless
    ``lambada_samples``), a list of (context, target) pairs, or None to skip.
    Returns an `EvalResult` (``.save(path)`` writes JSON, ``.summary()`` prints).
    """
    ev = Evaluator(params, data=data, lambada=lambada, num_sequences=num_sequences,
                   seq_len=seq_len, batch_size=batch_size, lambada_samples=lambada_samples,
                   greedy_prompts=greedy_prompts, greedy_tokens=greedy_tokens,
                   greedy_prompt_len=greedy_prompt_len, progress=progress)
    return ev.evaluate(gsm, parts=parts, label="eval")
