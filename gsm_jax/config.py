"""GSM configuration: the names of `gsm_jax.gsm.schema`, `profile_io`, `resolve` and
`watcher`, re-exported here so ``from gsm_jax.config import X`` keeps working.

`GSMConfig` is the document's ``gsm_config`` (spec §5), validated on creation;
profiles (schema ``gsm-jax/profile/v1``) are described in `gsm_jax.gsm.profile_io`;
everything numeric reaches the jitted step as `GSMInputs` (`gsm_jax.gsm_runtime`),
a pytree of arrays, so a new config never recompiles (only ``max_window`` is static).
"""

from gsm_jax.gsm.profile_io import (
    DEFAULT_HIGH_KURTOSIS_FRACTION,
    KURTOSIS_DEFINITION,
    PROFILE_SCHEMA,
    build_profile,
    load_profile,
    select_high_kurtosis,
    write_profile,
)
from gsm_jax.gsm.resolve import (
    describe,
    high_kurtosis_pairs,
    resolve_mask,
    rollout_value,
    row_enabled,
)
from gsm_jax.gsm.schema import (
    ADAPTIVE,
    ADAPTIVE_DIVISOR,
    ADAPTIVE_MIN_WINDOW,
    DEFAULT_PROTECT_FIRST,
    PRECISIONS,
    SITES,
    STRENGTH_CEILING,
    STRENGTH_SEEN_BREAKING,
    TARGET_KEYWORDS,
    GSMConfig,
    TargetLayers,
)
from gsm_jax.gsm.watcher import ConfigWatcher

__all__ = [
    "ADAPTIVE",
    "ADAPTIVE_DIVISOR",
    "ADAPTIVE_MIN_WINDOW",
    "DEFAULT_HIGH_KURTOSIS_FRACTION",
    "DEFAULT_PROTECT_FIRST",
    "KURTOSIS_DEFINITION",
    "PRECISIONS",
    "PROFILE_SCHEMA",
    "SITES",
    "STRENGTH_CEILING",
    "STRENGTH_SEEN_BREAKING",
    "TARGET_KEYWORDS",
    "ConfigWatcher",
    "GSMConfig",
    "TargetLayers",
    "build_profile",
    "describe",
    "high_kurtosis_pairs",
    "load_profile",
    "resolve_mask",
    "rollout_value",
    "row_enabled",
    "select_high_kurtosis",
    "write_profile",
]
