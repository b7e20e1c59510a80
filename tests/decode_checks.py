"""maxtext-style decode consistency, shared by the model, GSM and INT8 tests."""

from __future__ import annotations

from typing import Any

import numpy as np

import gsm_jax


def decode_and_teacher_forced(params: Any, rows: list[list[int]], *, max_new_tokens: int,
                              gsm: Any = None, eos_ids: Any = ()) -> list[tuple]:
    """Greedy-generate with logits, then one forward pass over prompt + output.

    eos_ids: () runs every row to max_new_tokens; None stops at the model's EOS.
    Returns per row (generated tokens, decode logits [n, V], teacher-forced logits at
    the same positions [n, V]): the logits that chose output token j were computed at
    position len(prompt) - 1 + j.
    """
    eos = None if eos_ids is None else list(eos_ids)
    outs, logits = gsm_jax.generate_tokens(params, rows, max_new_tokens=max_new_tokens,
                                           eos_ids=eos, gsm=gsm, return_logits=True)
    full = [list(r) + [int(t) for t in o] for r, o in zip(rows, outs, strict=True)]
    tf = np.asarray(gsm_jax.forward(params, full, gsm=gsm))
    return [(np.asarray(o), np.asarray(lg), tf[i, len(r) - 1: len(r) - 1 + len(o)])
            for i, (r, o, lg) in enumerate(zip(rows, outs, logits, strict=True))]
