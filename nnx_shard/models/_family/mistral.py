"""Mistral (``MistralForCausalLM``): Llama's decoder with a sliding window in every
layer (a band in the attention mask, and in the cache's when decoding).

>>> CONFIGS["mistral-7b"].sliding_window
4096
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from nnx_shard.models._config_bases import WindowConfig
from nnx_shard.models._decoder import DecoderBlock
from nnx_shard.models._decoder_config import BIG
from nnx_shard.models._families import LLAMA_MAPPING, Family, register
from nnx_shard.models._hf_config import every_layer_window

__all__ = ["CONFIGS", "FAMILY", "MistralConfig", "read"]


@dataclasses.dataclass(frozen=True)
class MistralConfig(WindowConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of a Mistral model: its window
    (``sliding_window``)."""

    model_type: str = "mistral"


def read(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The window, in every layer (the model ignores ``layer_types``)."""
    return {"sliding_window": every_layer_window(hf, where)}


FAMILY = register(Family(
    "mistral", ("MistralForCausalLM",), LLAMA_MAPPING, named_configs=("mistral-7b",),
    block=DecoderBlock, read=read, config=MistralConfig))

#: Mistral-7B-v0.1's published shapes: a 4096-token window in every layer.
CONFIGS = {
    "mistral-7b": MistralConfig(
        vocab=32000, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32,
        rope_theta=10000.0, norm_eps=1e-5, sliding_window=4096, max_length=32768,
        model_type="mistral", **BIG),
}
