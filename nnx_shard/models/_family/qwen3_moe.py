"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention and a sparse
mixture-of-experts MLP of its own width (``moe_intermediate_size``), the top-k
renormalised only with ``norm_topk_prob``; the layers of ``mlp_only_layers`` (and
those off ``decoder_sparse_step``) keep a dense MLP. These four are the fields of its
own config class, :class:`Qwen3MoeConfig`.

>>> cfg = CONFIGS["qwen3-30b-a3b"]
>>> type(cfg).__name__, cfg.num_params, cfg.active_params      # the published 30.5B, 3.3B
('Qwen3MoeConfig', 30532122624, 3353032704)
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_shard.models._config_bases import AttentionBiasConfig, MoEConfig, WindowConfig
from nnx_shard.models._decoder import DecoderBlock, DecoderMoEBlock
from nnx_shard.models._decoder_config import BIG
from nnx_shard.models._families import (
    LAYER,
    LLAMA_MAPPING,
    Family,
    MappingValue,
    register,
)
from nnx_shard.models._family import qwen2

__all__ = ["CONFIGS", "FAMILY", "QWEN3_MOE_MAPPING", "Qwen3MoeConfig"]


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(AttentionBiasConfig, WindowConfig, MoEConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of a Qwen3-MoE model: ``attention_bias``,
    its window, its experts (``experts`` >= 1, ``top_k``, ...) and the fields only this
    family has (``DecoderConfig.for_model("qwen3_moe", ...)`` builds one).

    Attributes:
      moe_mlp: each expert's hidden width (``moe_intermediate_size``); ``None``: ``mlp``.
      norm_topk_prob: renormalise the top-k routing weights to sum to 1.
      sparse_step: every ``sparse_step``-th layer is sparse (``decoder_sparse_step``).
      mlp_only_layers: indices of the layers that keep a dense MLP.

    >>> from nnx_shard.models import DecoderConfig
    >>> cfg = DecoderConfig.for_model("qwen3_moe", layers=3, experts=4, mlp_only_layers=(1,))
    >>> type(cfg).__name__, cfg.moe_layers(), cfg.expert_mlp
    ('Qwen3MoeConfig', (True, False, True), 64)
    """

    model_type: str = "qwen3_moe"
    moe_mlp: int | None = None
    norm_topk_prob: bool = True
    sparse_step: int = 1
    mlp_only_layers: Any = ()
    hf_defaults: ClassVar[Mapping[str, Any]] = {"experts": 128, "top_k": 8}
    hf_keys: ClassVar[Mapping[str, str]] = {"experts": "num_experts"}

    @property
    def expert_mlp(self) -> int:
        """Each expert's hidden width: ``moe_mlp``, else ``mlp``."""
        return self.mlp if self.moe_mlp is None else self.moe_mlp

    def moe_layers(self) -> tuple[bool, ...]:
        """Which layers are sparse: not in ``mlp_only_layers``, on ``sparse_step``."""
        return tuple(i not in self.mlp_only_layers and (i + 1) % self.sparse_step == 0
                     for i in range(self.layers))


#: ``Qwen3MoeForCausalLM``'s names: Qwen3's attention; the MoE layers' router
#: ``mlp.gate`` and experts ``mlp.experts.<e>.{gate,up,down}_proj``; dense layers
#: (``mlp_only_layers``) Llama's MLP names.
QWEN3_MOE_MAPPING: dict[str, MappingValue] = {
    **LLAMA_MAPPING,
    LAYER + r"mlp\.gate\.weight": (r"blocks/\1/mlp/router", "transpose"),
    LAYER + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight": (r"blocks/\1/mlp/\3/\2",
                                                                 "transpose"),
}

FAMILY = register(Family(
    "qwen3_moe", ("Qwen3MoeForCausalLM",), QWEN3_MOE_MAPPING, named_configs=("qwen3-30b-a3b",),
    block=DecoderBlock, moe_block=DecoderMoEBlock, qk_norm="head",
    read=qwen2.read, write=qwen2.write, config=Qwen3MoeConfig,
    tiny={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}))

#: Qwen3-30B-A3B's published shapes: 128 experts of width 768, top-8 renormalised.
CONFIGS = {
    "qwen3-30b-a3b": Qwen3MoeConfig(
        vocab=151936, embed=2048, heads=32, kv_heads=4, head_dim=128, mlp=6144, layers=48,
        rope_theta=1000000.0, norm_eps=1e-6, max_length=40960, experts=128, top_k=8,
        moe_mlp=768, norm_topk_prob=True, **BIG),
}
