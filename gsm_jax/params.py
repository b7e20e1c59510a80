"""`ModelParams`: what `gsm_jax.load` returns and every API call takes as `params`.

A JAX pytree: the leaves are the weights; the static part carries the model
config (which names the model family) and the tokenizer. So `params` can be
passed straight into `jax.jit`-ed functions, saved with orbax, or mapped over
with `jax.tree.map` (e.g. to cast to bf16) without losing the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jax


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True, eq=False)
class ModelParams:
    weights: dict
    config: Any  # a frozen model config dataclass (LlamaConfig, DeepseekV4Config, ...)
    tokenizer: Any = None  # gsm_jax.tokenizer.Tokenizer or None (token-level use only)
    source: str = ""
    extra: dict = field(default_factory=dict)  # e.g. quantization scheme

    def tree_flatten(self):
        return (self.weights,), (self.config, self.tokenizer, self.source,
                                 tuple(sorted(self.extra.items())))

    @classmethod
    def tree_unflatten(cls, aux, children):
        config, tokenizer, source, extra = aux
        return cls(children[0], config, tokenizer, source, dict(extra))

    @property
    def family(self) -> str:
        return self.config.family

    @property
    def dtype(self) -> Any:
        return jax.tree.leaves(self.weights)[0].dtype

    def num_parameters(self) -> int:
        """Logical parameter count (a packed FP4 byte holds two; scales are not counted)."""
        from gsm_jax.models.block_quant import BlockQuantWeight

        leaves = jax.tree.leaves(self.weights, is_leaf=lambda a: isinstance(a, BlockQuantWeight))
        return sum(int(a.size) for a in leaves)

    def nbytes(self) -> int:
        """Bytes the weights occupy in memory (values and scales)."""
        return sum(int(a.nbytes) for a in jax.tree.leaves(self.weights))

    def __repr__(self) -> str:
        name = type(self.config).__name__
        return (f"ModelParams({name}, layers={self.config.num_layers}, "
                f"params={self.num_parameters() / 1e6:.1f}M, dtype={self.dtype}, "
                f"source={self.source!r})")
