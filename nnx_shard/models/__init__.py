"""Reference models annotated only with logical axis names: :class:`Transformer`
(GPT-style, for tests, demos and planning) and :class:`Llama` (the Llama family:
Llama, Qwen2/3, Mistral, Gemma 2, OLMo 2; built and filled from a Hugging Face
checkpoint by :func:`nnx_shard.hf.load_pretrained`), the configurations they are
built from (:func:`get_config`), their loss (:func:`lm_loss`), remat policies, and the
attention op a model calls to be memory-efficient and context-parallel
(:func:`attention`, and :func:`attention_fn`, its adapter for
``nnx.MultiHeadAttention(attention_fn=...)``). Generation is
:mod:`nnx_shard.inference`.

Both models take transformers' fine-tuning inputs, ``model(tokens, *,
attention_mask=None, positions=None, segment_ids=None)`` (padding masked out and,
on the left, shifting the positions; packed segments attending within
themselves), and :func:`lm_loss` skips ``-100`` targets.

>>> from flax import nnx
>>> from nnx_shard.models import CONFIGS, Transformer, get_config
>>> model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
>>> sorted(CONFIGS)[:3]
['125m', '1b', '7b']
"""

from nnx_shard._attention import attention
from nnx_shard.models._adapters import attention_fn
from nnx_shard.models._family.qwen3_moe import Qwen3MoeConfig
from nnx_shard.models._llama import Llama, LlamaConfig
from nnx_shard.models._named import CONFIGS, get_config
from nnx_shard.models._resize import resize_token_embeddings
from nnx_shard.models._transformer import Transformer, lm_loss
from nnx_shard.models._transformer_config import (
    REMAT_POLICIES,
    TransformerConfig,
    remat_policy,
)

__all__ = ["CONFIGS", "REMAT_POLICIES", "Llama", "LlamaConfig", "Qwen3MoeConfig", "Transformer",
           "TransformerConfig", "attention", "attention_fn", "get_config", "lm_loss",
           "remat_policy", "resize_token_embeddings"]
