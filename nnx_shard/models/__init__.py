"""Reference models annotated only with logical axis names (:class:`Transformer`,
and :class:`Llama` for Llama-family checkpoints), the attention op
(:func:`attention`: dense, blockwise or cuDNN on each device; ring / all-gather
context parallelism as the strategy asks) a model calls to be memory-efficient
and context-parallel, and :func:`attention_fn`, its adapter for
``nnx.MultiHeadAttention(attention_fn=...)``.

>>> from flax import nnx
>>> model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
>>> sorted(CONFIGS)[:3]
['125m', '1b', '7b']
"""

from nnx_shard.models.adapters import attention_fn
from nnx_shard.models.llama import LLAMA_CONFIGS, Llama, LlamaConfig, get_llama_config
from nnx_shard.models.transformer import (
    CONFIGS,
    REMAT_POLICIES,
    Transformer,
    TransformerConfig,
    get_config,
    lm_loss,
    remat_policy,
)
from nnx_shard.parallel.ring import attention

__all__ = ["CONFIGS", "LLAMA_CONFIGS", "REMAT_POLICIES", "Llama", "LlamaConfig", "Transformer",
           "TransformerConfig", "attention", "attention_fn", "get_config", "get_llama_config",
           "lm_loss", "remat_policy"]
