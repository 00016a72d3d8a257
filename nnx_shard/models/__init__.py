"""Reference models annotated only with logical axis names.

>>> from flax import nnx
>>> model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
>>> sorted(CONFIGS)[:3]
['125m', '1b', '7b']
"""

from nnx_shard.models.transformer import (
    CONFIGS,
    REMAT_POLICIES,
    Transformer,
    TransformerConfig,
    get_config,
    lm_loss,
    remat_policy,
)

__all__ = ["CONFIGS", "REMAT_POLICIES", "Transformer", "TransformerConfig", "get_config",
           "lm_loss", "remat_policy"]
