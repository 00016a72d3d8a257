"""Qwen3 (``Qwen3ForCausalLM``): Llama's decoder with an RMSNorm of each query and key
head before the rotation and an explicit ``head_dim``; a sliding window with
``use_sliding_window``.

>>> CONFIGS["qwen3-tiny"].family.qk_norm
'head'
"""

from collections.abc import Mapping
from typing import Any

from nnx_shard.models._families import LLAMA_MAPPING, Family, register
from nnx_shard.models._hf_config import qwen_window
from nnx_shard.models._llama import LlamaBlock
from nnx_shard.models._llama_config import BIG, LlamaConfig

__all__ = ["CONFIGS", "FAMILY", "read", "write"]

def read(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The window of ``use_sliding_window`` (:func:`~nnx_shard.models._hf_config.qwen_window`)."""
    return {"sliding_window": qwen_window(hf, fields["layers"], where)}


def write(cfg: Any, out: dict[str, Any]) -> None:
    """The window as Qwen's configs state it: in every layer, or in none."""
    out.update(use_sliding_window=cfg.sliding_window is not None,
               sliding_window=cfg.sliding_window,
               max_window_layers=0 if cfg.sliding_window is not None else cfg.layers)


FAMILY = register(Family(
    "qwen3", ("Qwen3ForCausalLM",), LLAMA_MAPPING, named_configs=("qwen3-tiny", "qwen3-0.6b"),
    block=LlamaBlock, qk_norm="head", fields=("attention_bias", "sliding_window"),
    read=read, write=write, hf_flags=("attention_bias",)))

#: ``qwen3-tiny`` (q/k norm, ``head_dim`` != ``embed / heads``, tied embeddings; for
#: tests) and Qwen3-0.6B's published shapes.
CONFIGS = {
    "qwen3-tiny": LlamaConfig(head_dim=16, tie_embeddings=True, norm_eps=1e-6, rope_theta=1e6,
                              max_length=64, model_type="qwen3"),
    "qwen3-0.6b": LlamaConfig(
        vocab=151936, embed=1024, heads=16, kv_heads=8, head_dim=128, mlp=3072, layers=28,
        rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, max_length=40960,
        model_type="qwen3", **BIG),
}
