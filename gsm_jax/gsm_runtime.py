"""The names of `gsm_jax.gsm.step_inputs` (a GSM config -> the `GSMInputs` of the jitted
model step; the kernel implementation), re-exported so ``from gsm_jax.gsm_runtime import X``
keeps working."""

from gsm_jax.gsm.step_inputs import (
    KERNEL_IMPLS,
    as_gsm_config,
    gsm_inputs_for_batch,
    kernel_impl,
    resolved_kernel_impl,
    resolved_precision,
    ring_rows,
    set_kernel_impl,
)

__all__ = [
    "KERNEL_IMPLS",
    "as_gsm_config",
    "gsm_inputs_for_batch",
    "kernel_impl",
    "resolved_kernel_impl",
    "resolved_precision",
    "ring_rows",
    "set_kernel_impl",
]
