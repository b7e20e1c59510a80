"""The serving engine's per-slot state on the host: who holds each slot of the running
batch, and what its next decode step needs from the host.

A slot's request record, its GSM strengths [layers, sites] and window (runtime arrays:
`models/gsm_sites.GSMInputs`), its sampling settings (temperature, top-k, top-p, seed),
its penalties' scalars (the counters themselves live on the device:
`programs.penalty_row`), the log-probabilities it wants, and the token the host feeds it
(a just-admitted row's first token; rows already running are fed on device, `use_prev`).
`decode_inputs` cuts what a decode step over the first r slots takes.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from gsm_jax.serving.requests import RequestRecord, Sampling

__all__ = ["SlotState"]


class SlotState:
    """Per-slot host arrays of `max_batch` slots (numpy, read by the compiled steps as
    they are: no eager device op per step)."""

    def __init__(self, max_batch: int, num_layers: int) -> None:
        b = int(max_batch)
        self.records: list[RequestRecord | None] = [None] * b
        self.last = np.zeros((b,), np.int32)  # the host's token for each slot's next step
        self.use_prev = np.zeros((b,), bool)  # fed the step in flight's pick (on device)
        self.smoothed = np.zeros((b,), np.float32)  # 1: the row's GSM is on
        self.strength = np.zeros((b, num_layers, 2), np.float32)
        self.window = np.zeros((b,), np.int32)
        self.temps = np.zeros((b,), np.float32)
        self.top_k = np.zeros((b,), np.int32)
        self.top_p = np.ones((b,), np.float32)
        self.seeds = np.zeros((b,), np.int32)
        self.freq = np.zeros((b,), np.float32)
        self.pres = np.zeros((b,), np.float32)
        self.rep = np.ones((b,), np.float32)
        self.sampling: list[Sampling | None] = [None] * b
        self.logprobs: list[int | None] = [None] * b  # each row's Request.logprobs

    def __len__(self) -> int:
        return len(self.records)

    def occupy(self, slot: int, record: RequestRecord, sampling: Sampling,
               logprobs: int | None, gsm: tuple[np.ndarray, int] | None) -> None:
        """`record` holds `slot` from now on; `gsm`: its (strength, window), None: not
        smoothed."""
        self.records[slot] = record
        self.smoothed[slot] = float(gsm is not None)
        if gsm is not None:
            self.strength[slot], self.window[slot] = gsm
        s = sampling
        self.sampling[slot], self.logprobs[slot] = s, logprobs
        self.temps[slot], self.top_k[slot], self.top_p[slot] = s.temperature, s.top_k, s.top_p
        self.seeds[slot] = s.seed
        self.freq[slot], self.pres[slot], self.rep[slot] = s.frequency, s.presence, s.repetition
        self.use_prev[slot] = False  # its first token is the host's

    def free(self, slot: int) -> None:
        self.records[slot] = None
        self.smoothed[slot] = 0.0
        self.strength[slot] = 0.0
        self.temps[slot] = 0.0
        self.last[slot] = 0
        self.sampling[slot], self.logprobs[slot] = None, None
        self.freq[slot], self.pres[slot], self.rep[slot] = 0.0, 0.0, 1.0

    def flags(self, active: np.ndarray) -> tuple:
        """`programs.pick`'s run-time flags over the active slots: any sampled, filtered,
        penalized, wanting log-probabilities."""
        items = [(self.sampling[i], self.logprobs[i]) for i in np.flatnonzero(active)
                 if self.sampling[i] is not None]
        return pick_flags(items)

    def decode_inputs(self, active: np.ndarray, bound: int | None, counts: np.ndarray,
                      copy: bool) -> dict[str, Any]:
        """What a decode step over the first `bound` slots (None: all) takes from the host,
        cut to those rows. `counts` [max_batch]: the index of the token each row draws.
        `copy`: copies of the arrays (a step that runs while the host changes them, async
        scheduling), else views."""
        cut = slice(bound)
        own = functools.partial(np.array, copy=copy)
        return {
            "host": own(self.last[cut]), "use_prev": own(self.use_prev[cut]),
            "active": np.asarray(active[cut], bool),
            "smoothed": (self.smoothed * active)[cut],
            "strength": own(self.strength[cut]), "window": own(self.window[cut]),
            "sampling": (own(self.temps[cut]), own(self.top_k[cut]), own(self.top_p[cut]),
                         own(self.seeds[cut]), np.asarray(counts[cut], np.int32)),
            "fpr": (own(self.freq[cut]), own(self.pres[cut]), own(self.rep[cut])),
            "flags": self.flags(active),
        }


def pick_flags(items: list[tuple[Sampling, int | None]]) -> tuple:
    """(any sampled, any filtered, any penalized, any wanting log-probabilities) over
    (Sampling, logprobs) items, as numpy booleans (the programs' run-time flags)."""
    return (np.bool_(any(s.sample for s, _ in items)),
            np.bool_(any(s.filtered for s, _ in items)),
            np.bool_(any(s.penalized for s, _ in items)),
            np.bool_(any(lp is not None for _, lp in items)))
