"""Models annotated only with logical axis names, all built by one decoder class,
:class:`Decoder`, of a family's parts: the Hugging Face families (Llama 2/3, Qwen2,
Qwen3, Mistral, Gemma, Gemma 2, Gemma 3, OLMo 2, Phi-3, and the mixtures of experts
Mixtral and Qwen3-MoE; configured by :class:`DecoderConfig`, the fields every family
has, and each family's own config class, e.g. :class:`Qwen3MoeConfig`
(:meth:`DecoderConfig.for_model` builds one), built and filled from a checkpoint by
:func:`nnx_shard.hf.load_pretrained`) and the reference model (GPT-style, for tests,
demos and planning; configured by :class:`ReferenceConfig`), the configurations known by name (:func:`get_config`), their loss
(:func:`lm_loss`), remat policies, and the
attention op a model calls to be memory-efficient and context-parallel
(:func:`attention`, and :func:`attention_fn`, its adapter for
``nnx.MultiHeadAttention(attention_fn=...)``). Generation is
:mod:`nnx_shard.inference`.

Every family takes transformers' fine-tuning inputs, ``model(tokens, *,
attention_mask=None, positions=None, segment_ids=None)`` (padding masked out and,
on the left, shifting the positions; packed segments attending within
themselves), and :func:`lm_loss` skips ``-100`` targets.

>>> from flax import nnx
>>> from nnx_shard.models import CONFIGS, Decoder, get_config
>>> model = Decoder(get_config("tiny"), rngs=nnx.Rngs(0))
>>> sorted(CONFIGS)[:3]
['125m', '1b', '7b']
"""

from nnx_shard._attention import attention
from nnx_shard.models._adapters import attention_fn
from nnx_shard.models._decoder import Decoder, DecoderConfig
from nnx_shard.models._family.qwen3_moe import Qwen3MoeConfig
from nnx_shard.models._family.reference import ReferenceConfig
from nnx_shard.models._fields import REMAT_POLICIES, remat_policy
from nnx_shard.models._loss import lm_loss
from nnx_shard.models._named import CONFIGS, get_config
from nnx_shard.models._resize import resize_token_embeddings

__all__ = ["CONFIGS", "REMAT_POLICIES", "Decoder", "DecoderConfig", "Qwen3MoeConfig",
           "ReferenceConfig", "attention", "attention_fn", "get_config", "lm_loss",
           "remat_policy", "resize_token_embeddings"]
