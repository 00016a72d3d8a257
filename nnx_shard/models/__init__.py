"""Reference models annotated only with logical axis names (:class:`Transformer`,
and :class:`Llama` for Llama-family checkpoints, built and filled from a
Hugging Face checkpoint by :func:`nnx_shard.hf.load_pretrained`), the attention op
(:func:`attention`: dense, blockwise or cuDNN on each device; ring / all-gather
context parallelism as the strategy asks) a model calls to be memory-efficient
and context-parallel, :func:`attention_fn`, its adapter for
``nnx.MultiHeadAttention(attention_fn=...)``, and :func:`generate`: sharded text
generation with a key/value cache laid out by the same rules
(:func:`explain_cache` reports its bytes per device), and text in and out of it
(:class:`Tokenizer`, :func:`generate_text`, :func:`stream_text`).

Both models take transformers' fine-tuning inputs, ``model(tokens, *,
attention_mask=None, positions=None, segment_ids=None)`` (padding masked out and,
on the left, shifting the positions; packed segments attending within
themselves), and :func:`lm_loss` skips ``-100`` targets.

>>> from flax import nnx
>>> model = Transformer(get_config("tiny"), rngs=nnx.Rngs(0))
>>> sorted(CONFIGS)[:3]
['125m', '1b', '7b']
"""

from nnx_shard.attention import attention
from nnx_shard.models.adapters import attention_fn
from nnx_shard.models.generation import (
    CACHE_AXES,
    explain_cache,
    generate,
    generation_rules,
    stream,
)
from nnx_shard.models.llama import LLAMA_CONFIGS, Llama, LlamaConfig, get_llama_config
from nnx_shard.models.resize import resize_token_embeddings
from nnx_shard.models.text import generate_text, stream_text
from nnx_shard.models.tokenizer import Tokenizer
from nnx_shard.models.transformer import (
    CONFIGS,
    REMAT_POLICIES,
    Transformer,
    TransformerConfig,
    get_config,
    lm_loss,
    remat_policy,
)

__all__ = ["CACHE_AXES", "CONFIGS", "LLAMA_CONFIGS", "REMAT_POLICIES", "Llama", "LlamaConfig",
           "Tokenizer", "Transformer", "TransformerConfig", "attention", "attention_fn",
           "explain_cache", "generate", "generate_text", "generation_rules", "get_config",
           "get_llama_config", "lm_loss", "remat_policy", "resize_token_embeddings", "stream",
           "stream_text"]
