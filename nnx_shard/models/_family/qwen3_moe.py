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
from typing import Any

from nnx_shard._errors import UsageError, count, short
from nnx_shard.models._decoder import DecoderBlock, DecoderMoEBlock
from nnx_shard.models._decoder_config import BIG, DecoderConfig
from nnx_shard.models._families import (
    LAYER,
    LLAMA_MAPPING,
    MOE_FIELDS,
    Family,
    MappingValue,
    register,
)
from nnx_shard.models._family import qwen2
from nnx_shard.models._fields import check_fields
from nnx_shard.models._hf_config import FIX_VALUE, count_key, flag_key

__all__ = ["CONFIGS", "FAMILY", "QWEN3_MOE_MAPPING", "Qwen3MoeConfig"]


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(DecoderConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of a Qwen3-MoE model, with the fields
    only this family has (``DecoderConfig(model_type="qwen3_moe", ...)`` builds one).

    Attributes:
      moe_mlp: each expert's hidden width (``moe_intermediate_size``); ``None``: ``mlp``.
      norm_topk_prob: renormalise the top-k routing weights to sum to 1.
      sparse_step: every ``sparse_step``-th layer is sparse (``decoder_sparse_step``).
      mlp_only_layers: indices of the layers that keep a dense MLP.

    >>> from nnx_shard.models import DecoderConfig
    >>> cfg = DecoderConfig(layers=3, experts=4, mlp_only_layers=(1,), model_type="qwen3_moe")
    >>> type(cfg).__name__, cfg.moe_layers(), cfg.expert_mlp
    ('Qwen3MoeConfig', (True, False, True), 64)
    """

    model_type: str = "qwen3_moe"
    moe_mlp: int | None = None
    norm_topk_prob: bool = True  # a field here; DecoderConfig fixes it True
    sparse_step: int = 1
    mlp_only_layers: Any = ()

    def __post_init__(self) -> None:
        check_fields(self, ("sparse_step",), flags=("norm_topk_prob",))
        if self.moe_mlp is not None:
            count(self.moe_mlp, "Qwen3MoeConfig.moe_mlp", fix="None (mlp) or a width, e.g. 768")
        only = self.mlp_only_layers
        if not isinstance(only, list | tuple) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.layers
                for i in only):
            raise UsageError(f"Qwen3MoeConfig.mlp_only_layers={short(only, 60)} must list layer "
                             f"indices below layers={self.layers}. Fix: e.g. mlp_only_layers=() .")
        object.__setattr__(self, "mlp_only_layers", tuple(only))
        super().__post_init__()  # its checks read moe_layers(), this class's

    @property
    def expert_mlp(self) -> int:
        """Each expert's hidden width: ``moe_mlp``, else ``mlp``."""
        return self.mlp if self.moe_mlp is None else self.moe_mlp

    def moe_layers(self) -> tuple[bool, ...]:
        """Which layers are sparse: not in ``mlp_only_layers``, on ``sparse_step``."""
        return tuple(bool(self.experts) and i not in self.mlp_only_layers
                     and (i + 1) % self.sparse_step == 0 for i in range(self.layers))


def read(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Qwen's window, and the four keys of :class:`Qwen3MoeConfig` with transformers'
    defaults."""
    only = hf.get("mlp_only_layers")
    if only is None:  # transformers' default; a 0 or "" is no list of layers
        only = []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                             for i in only):
        raise UsageError(f"{where}: mlp_only_layers must be a list of layer indices, got "
                         f"{short(only, 60)}. {FIX_VALUE}.")
    return qwen2.read(hf, where, fields) | dict(
        moe_mlp=count_key(hf, "moe_intermediate_size", 768, where),
        norm_topk_prob=flag_key(hf, "norm_topk_prob", False, where),
        sparse_step=count_key(hf, "decoder_sparse_step", 1, where),
        mlp_only_layers=tuple(only))


def write(cfg: Any, out: dict[str, Any]) -> None:
    """Qwen's window keys and the four of :class:`Qwen3MoeConfig`."""
    qwen2.write(cfg, out)
    out.update(moe_intermediate_size=cfg.expert_mlp, norm_topk_prob=cfg.norm_topk_prob,
               decoder_sparse_step=cfg.sparse_step, mlp_only_layers=list(cfg.mlp_only_layers))


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
    fields=("attention_bias", "sliding_window", *MOE_FIELDS),
    read=read, write=write, hf_flags=("attention_bias",), config=Qwen3MoeConfig,
    moe={"num_experts": 128, "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001,
         "output_router_logits": False},
    tiny={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}))

#: Qwen3-30B-A3B's published shapes: 128 experts of width 768, top-8 renormalised.
CONFIGS = {
    "qwen3-30b-a3b": Qwen3MoeConfig(
        vocab=151936, embed=2048, heads=32, kv_heads=4, head_dim=128, mlp=6144, layers=48,
        rope_theta=1000000.0, norm_eps=1e-6, max_length=40960, experts=128, top_k=8,
        moe_mlp=768, norm_topk_prob=True, **BIG),
}
