"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention and a sparse
mixture-of-experts MLP of its own width (``moe_intermediate_size``), the top-k
renormalised only with ``norm_topk_prob``; the layers of ``mlp_only_layers`` (and
those off ``decoder_sparse_step``) keep a dense MLP.

>>> cfg = CONFIGS["qwen3-30b-a3b"]
>>> cfg.num_params, cfg.active_params      # the published 30.5B, 3.3B
(30532122624, 3353032704)
"""

from nnx_shard.models._families import (
    LAYER,
    LLAMA_MAPPING,
    MOE_FIELDS,
    Family,
    MappingValue,
    register,
)
from nnx_shard.models._family.qwen2 import read, write
from nnx_shard.models._llama import LlamaBlock, LlamaMoEBlock
from nnx_shard.models._llama_config import BIG, LlamaConfig

__all__ = ["CONFIGS", "FAMILY", "QWEN3_MOE_MAPPING"]

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
    block=LlamaBlock, moe_block=LlamaMoEBlock, qk_norm="head",
    fields=("attention_bias", "sliding_window", *MOE_FIELDS, "moe_mlp", "norm_topk_prob",
            "sparse_step", "mlp_only_layers"),
    read=read, write=write, hf_flags=("attention_bias",),
    moe={"num_experts": 128, "num_experts_per_tok": 8, "router_aux_loss_coef": 0.001,
         "output_router_logits": False, "moe_intermediate_size": 768,
         "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []},
    tiny={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}))

#: Qwen3-30B-A3B's published shapes: 128 experts of width 768, top-8 renormalised.
CONFIGS = {
    "qwen3-30b-a3b": LlamaConfig(
        vocab=151936, embed=2048, heads=32, kv_heads=4, head_dim=128, mlp=6144, layers=48,
        rope_theta=1000000.0, norm_eps=1e-6, max_length=40960, experts=128, top_k=8,
        moe_mlp=768, norm_topk_prob=True, model_type="qwen3_moe", **BIG),
}
