"""The hooks a model calls, and the only way tools observe or change what it computes.

Every family's one `layer(...)` function calls two hooks, through the `Step` it is given
(`models/common.py`):

- `step.site(layer, index, x, next_weight)` at each GSM site (`attn_out`: the input of the
  output projection; `ffn_mid`: the input of the down projection — search `GSM site`
  in a family file), and returns what the next projection multiplies;
- `step.linear(layer, name, x, w)` for each projection (`name` is the weight's leaf name),
  and returns the product.

The object behind both is a `Sites` implementation, passed to the model as its `sites=`
argument (a `GSMInputs` is one). Implementations in the library:

| implementation | where | what it does |
|---|---|---|
| `Sites()` (the no-op) | here | returns x; `linear(x, w)` |
| `GSMInputs` | `models/gsm_sites.py` | GSM smoothing, with the decode rings in the cache |
| `StatsSites` | `gsm_jax/workflow/profile.py` | sows per-site moments for the profiler |
| `LinearInputs` | `gsm_jax/quant.py` | sows the inputs of the projections (SmoothQuant) |
| `LowpSites` | `gsm_jax/workflow/evidence/lowp_claims.py` | counts saturation / flush-to-zero |

A hook that wants to hand something back calls `step.sow(name, value)`, Flax `sow`'s idea:
the layer loop stacks what each layer sowed over a leading layer axis and the family's
`hidden_states` returns it. Nothing in a model module is ever replaced at run time, so
two tools can trace side by side in threads.

A `Sites` object is a pytree (a `flax.struct` dataclass: its arrays are runtime values
of the compiled program, its other fields static), so it goes through `jax.jit` as an
argument like the weights do.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from flax import struct

from gsm_jax.models.linear import linear

if TYPE_CHECKING:  # pragma: no cover
    from gsm_jax.models.common import Step

SITES = ("attn_out", "ffn_mid")
ATTN_OUT, FFN_MID = 0, 1


@struct.dataclass
class Sites:
    """The no-op hooks: a site returns its input, a projection is `linear(x, w)`.

    Subclasses override `site` and/or `linear`; `uses_rings` says whether the site keeps
    per-row state in the cache's GSM rings (only GSM does).
    """

    @property
    def uses_rings(self) -> bool:
        return False

    def site(self, step: Step, layer: Any, index: int, x: jax.Array,
             next_weight: Any = None) -> Any:
        del step, layer, index, next_weight
        return x

    def linear(self, step: Step, layer: Any, name: str, x: Any, w: Any) -> jax.Array:
        del step, layer, name
        return linear(x, w)


NO_SITES = Sites()


def as_sites(sites: Any) -> Sites:
    """What a model's `sites=` argument may be: None (no hooks), a `GSMInputs`, or any
    other `Sites` implementation."""
    if sites is None:
        return NO_SITES
    if not isinstance(sites, Sites):
        raise TypeError(f"sites= must be None or a models.sites.Sites (such as GSMInputs), "
                        f"got {type(sites).__name__}")
    return sites


def takes_sites(fn: Callable) -> Callable:
    """A model entry point whose hooks argument is `sites=` (any `Sites`), still taking the
    name it had before, `gsm=`, with a DeprecationWarning (the public `gsm=` of
    `gsm_jax.generate` / `forward` takes a GSM config, not hooks)."""
    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        if "gsm" in kw:
            if "sites" in kw:
                raise TypeError(f"{fn.__name__}() got both sites= and its old name gsm=")
            warnings.warn(f"{fn.__module__}.{fn.__name__}(gsm=...) is now sites=...",
                          DeprecationWarning, stacklevel=2)
            kw["sites"] = kw.pop("gsm")
        return fn(*args, **kw)

    return call
