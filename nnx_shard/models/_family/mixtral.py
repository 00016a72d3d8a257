"""Mixtral (``MixtralForCausalLM``): Llama's attention and a sparse mixture-of-experts
MLP in every layer (:class:`~nnx_shard.models._decoder.DecoderMoEBlock`): softmax over
the router's logits, the top-k renormalised; a sliding window where the file sets one.

>>> cfg = CONFIGS["mixtral-8x7b"]
>>> cfg.num_params, round(cfg.active_params / 1e9, 1)     # the published 46.7B, 12.9B
(46702792704, 12.9)
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_shard.models._config_bases import MoEConfig, WindowConfig
from nnx_shard.models._decoder import DecoderBlock, DecoderMoEBlock
from nnx_shard.models._decoder_config import BIG
from nnx_shard.models._families import (
    LAYER,
    LLAMA_MAPPING,
    Family,
    MappingValue,
    register,
)
from nnx_shard.models._family.mistral import read

__all__ = ["CONFIGS", "FAMILY", "MIXTRAL_MAPPING", "MixtralConfig"]


@dataclasses.dataclass(frozen=True)
class MixtralConfig(WindowConfig, MoEConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of a Mixtral model: its window and
    experts (``experts`` >= 1, ``top_k``, ...); the router always renormalises the
    top-k weights.

    >>> from nnx_shard.models import DecoderConfig
    >>> DecoderConfig.for_model("mixtral", experts=4).norm_topk_prob
    True
    """

    model_type: str = "mixtral"
    #: Mixtral renormalises the top-k routing weights (not a field: one value).
    norm_topk_prob: ClassVar[bool] = True
    hf_defaults: ClassVar[Mapping[str, Any]] = {"experts": 8, "top_k": 2}


#: ``MixtralForCausalLM``'s names: the router is ``block_sparse_moe.gate``; the experts'
#: ``w1`` / ``w3`` / ``w2`` (gate, up, down) stack into ``mlp/gate``, ``mlp/up``,
#: ``mlp/down [experts, ...]``.
MIXTRAL_MAPPING: dict[str, MappingValue] = {
    **{k: v for k, v in LLAMA_MAPPING.items() if "mlp" not in k},
    LAYER + r"block_sparse_moe\.gate\.weight": (r"blocks/\1/mlp/router", "transpose"),
    LAYER + r"block_sparse_moe\.experts\.(\d+)\.w1\.weight": (r"blocks/\1/mlp/gate/\2",
                                                             "transpose"),
    LAYER + r"block_sparse_moe\.experts\.(\d+)\.w3\.weight": (r"blocks/\1/mlp/up/\2",
                                                             "transpose"),
    LAYER + r"block_sparse_moe\.experts\.(\d+)\.w2\.weight": (r"blocks/\1/mlp/down/\2",
                                                             "transpose"),
}

FAMILY = register(Family(
    "mixtral", ("MixtralForCausalLM",), MIXTRAL_MAPPING, named_configs=("mixtral-8x7b",),
    block=DecoderBlock, moe_block=DecoderMoEBlock, read=read, config=MixtralConfig,
    tiny={"num_local_experts": 4, "num_experts_per_tok": 2}))

#: Mixtral-8x7B-v0.1's published shapes: 8 experts, top-2.
CONFIGS = {
    "mixtral-8x7b": MixtralConfig(
        vocab=32000, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32,
        rope_theta=1000000.0, norm_eps=1e-5, max_length=32768, experts=8, top_k=2,
        router_aux_loss_coef=0.02, model_type="mixtral", **BIG),
}
