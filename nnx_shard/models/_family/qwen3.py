"""Qwen3 (``Qwen3ForCausalLM``): Llama's decoder with an RMSNorm of each query and key
head before the rotation and an explicit ``head_dim``; a sliding window with
``use_sliding_window``.

>>> CONFIGS["qwen3-tiny"].family.qk_norm
'head'
"""

import dataclasses

from nnx_shard.models._config_bases import AttentionBiasConfig, WindowConfig
from nnx_shard.models._decoder import DecoderBlock
from nnx_shard.models._decoder_config import BIG
from nnx_shard.models._families import LLAMA_MAPPING, Family, register
from nnx_shard.models._family.qwen2 import read, write

__all__ = ["CONFIGS", "FAMILY", "Qwen3Config"]


@dataclasses.dataclass(frozen=True)
class Qwen3Config(AttentionBiasConfig, WindowConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of a Qwen3 model: ``attention_bias`` and
    its window (``sliding_window``)."""

    model_type: str = "qwen3"


FAMILY = register(Family(
    "qwen3", ("Qwen3ForCausalLM",), LLAMA_MAPPING, named_configs=("qwen3-tiny", "qwen3-0.6b"),
    block=DecoderBlock, qk_norm="head", read=read, write=write, config=Qwen3Config))

#: ``qwen3-tiny`` (q/k norm, ``head_dim`` != ``embed / heads``, tied embeddings; for
#: tests) and Qwen3-0.6B's published shapes.
CONFIGS = {
    "qwen3-tiny": Qwen3Config(head_dim=16, tie_embeddings=True, norm_eps=1e-6, rope_theta=1e6,
                              max_length=64, model_type="qwen3"),
    "qwen3-0.6b": Qwen3Config(
        vocab=151936, embed=1024, heads=16, kv_heads=8, head_dim=128, mlp=3072, layers=28,
        rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, max_length=40960,
        model_type="qwen3", **BIG),
}
