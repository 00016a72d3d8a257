"""OLMo 2 (``Olmo2ForCausalLM``): norms after attention and MLP, not before
(:class:`~nnx_shard.models._decoder.PostNormBlock`), and one q/k norm over all heads'
features (``[heads * head_dim]`` in the file).

>>> FAMILY.block.__name__, FAMILY.qk_norm
('PostNormBlock', 'all')
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from nnx_shard.models._config_bases import AttentionBiasConfig
from nnx_shard.models._decoder import PostNormBlock
from nnx_shard.models._families import (
    LAYER,
    LLAMA_MAPPING,
    Family,
    MappingValue,
    register,
)
from nnx_shard.models._hf_config import no_window

__all__ = ["CONFIGS", "FAMILY", "OLMO2_MAPPING", "Olmo2Config"]


@dataclasses.dataclass(frozen=True)
class Olmo2Config(AttentionBiasConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of an OLMo 2 model: ``attention_bias``."""

    model_type: str = "olmo2"


#: ``Olmo2ForCausalLM``'s names: its ``post_attention_layernorm`` is the norm after
#: attention (not Llama's pre-MLP norm), and its q/k norms span all heads.
OLMO2_MAPPING: dict[str, MappingValue] = {
    **{k: v for k, v in LLAMA_MAPPING.items() if "layernorm" not in k and "_norm" not in k},
    LAYER + r"post_attention_layernorm\.weight": r"blocks/\1/attn_post_norm/scale",
    LAYER + r"post_feedforward_layernorm\.weight": r"blocks/\1/mlp_post_norm/scale",
    LAYER + r"self_attn\.(q|k)_norm\.weight": (r"blocks/\1/attn/\2_norm/scale", "heads_bias"),
}


def read(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Nothing beyond the shared fields; a sliding window is refused (OLMo 2 has none)."""
    no_window(hf, "olmo2", where)
    return {}


FAMILY = register(Family(
    "olmo2", ("Olmo2ForCausalLM",), OLMO2_MAPPING, block=PostNormBlock, qk_norm="all",
    read=read, config=Olmo2Config))

CONFIGS: dict[str, Any] = {}
