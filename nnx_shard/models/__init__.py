"""Reference models annotated only with logical axis names.

>>> from flax import nnx
>>> model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
>>> sorted(CONFIGS)[:3]
['125m', '1b', '7b']
"""

from nnx_shard.models.transformer import (
    CONFIGS,
    Transformer,
    TransformerConfig,
    get_config,
    lm_loss,
)

__all__ = ["CONFIGS", "Transformer", "TransformerConfig", "get_config", "lm_loss"]
