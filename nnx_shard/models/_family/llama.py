"""Llama 2 / 3 (``LlamaForCausalLM``): the shared decoder as it is — pre-norm blocks,
grouped-query attention with rotary embeddings, a SwiGLU MLP; optional biases on the
attention (``attention_bias``) and the MLP (``mlp_bias``), the fields of its config
class, :class:`LlamaConfig` (a plain :class:`~nnx_shard.models.DecoderConfig` is a Llama
model without them).

>>> CONFIGS["llama3-8b"].num_params, type(CONFIGS["llama3-8b"]).__name__
(8030261248, 'LlamaConfig')
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from nnx_shard.models._config_bases import AttentionBiasConfig, MLPBiasConfig
from nnx_shard.models._decoder import DecoderBlock
from nnx_shard.models._decoder_config import BIG, LLAMA31_ROPE
from nnx_shard.models._families import LLAMA_MAPPING, Family, register
from nnx_shard.models._hf_config import no_window

__all__ = ["CONFIGS", "FAMILY", "LlamaConfig"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig(AttentionBiasConfig, MLPBiasConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of a Llama model, with its biases
    (``attention_bias``, ``mlp_bias``).

    >>> from nnx_shard.models import DecoderConfig
    >>> DecoderConfig.for_model("llama", mlp_bias=True).num_params - DecoderConfig().num_params
    320
    """


def read(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Nothing beyond the shared fields; a sliding window is refused (Llama has none)."""
    no_window(hf, "llama", where)
    return {}


FAMILY = register(Family(
    "llama", ("LlamaForCausalLM",), LLAMA_MAPPING,
    named_configs=("llama-tiny", "llama3-8b", "llama3-70b", "llama3-405b"),
    block=DecoderBlock, read=read, config=LlamaConfig))

#: ``llama-tiny`` (grouped-query, for tests) and the published shapes of Llama 3.1 8B /
#: 70B / 405B (Llama 3's 8B and 70B have the same shapes, without ``rope_scaling``),
#: with stacked layers and bfloat16 parameters, for planning.
CONFIGS = {
    "llama-tiny": LlamaConfig(max_length=64),
    "llama3-8b": LlamaConfig(
        vocab=128256, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE, norm_eps=1e-5, max_length=131072,
        **BIG),
    "llama3-70b": LlamaConfig(
        vocab=128256, embed=8192, heads=64, kv_heads=8, head_dim=128, mlp=28672, layers=80,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE, norm_eps=1e-5, max_length=131072,
        **BIG),
    "llama3-405b": LlamaConfig(
        vocab=128256, embed=16384, heads=128, kv_heads=8, head_dim=128, mlp=53248, layers=126,
        rope_theta=500000.0, rope_scaling=LLAMA31_ROPE, norm_eps=1e-5, max_length=131072,
        **BIG),
}
