"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): Llama's decoder with biases on q, k and v
(none on o); a sliding window with ``use_sliding_window``.

>>> CONFIGS["qwen2.5-7b"].family.qkv_bias
True
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from nnx_shard.models._config_bases import WindowConfig
from nnx_shard.models._decoder import DecoderBlock
from nnx_shard.models._decoder_config import BIG
from nnx_shard.models._families import LLAMA_MAPPING, Family, register
from nnx_shard.models._hf_config import qwen_window

__all__ = ["CONFIGS", "FAMILY", "Qwen2Config", "read", "write"]


@dataclasses.dataclass(frozen=True)
class Qwen2Config(WindowConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of a Qwen2 / Qwen2.5 model: its window
    (``sliding_window``); its q/k/v biases are the family's, not a field."""

    model_type: str = "qwen2"


def read(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The window of ``use_sliding_window`` (:func:`~nnx_shard.models._hf_config.qwen_window`),
    as Qwen2 / Qwen3 read it."""
    return {"sliding_window": qwen_window(hf, fields["layers"], where)}


def write(cfg: Any, out: dict[str, Any]) -> None:
    """The window as Qwen's configs state it: in every layer, or in none."""
    out.update(use_sliding_window=cfg.sliding_window is not None,
               max_window_layers=0 if cfg.sliding_window is not None else cfg.layers)


FAMILY = register(Family(
    "qwen2", ("Qwen2ForCausalLM",), LLAMA_MAPPING, named_configs=("qwen2.5-7b",),
    block=DecoderBlock, qkv_bias=True, read=read, write=write, config=Qwen2Config))

#: Qwen2.5-7B's published shapes (no window: ``use_sliding_window`` false).
CONFIGS = {
    "qwen2.5-7b": Qwen2Config(
        vocab=152064, embed=3584, heads=28, kv_heads=4, head_dim=128, mlp=18944, layers=28,
        rope_theta=1000000.0, norm_eps=1e-6, max_length=131072, model_type="qwen2", **BIG),
}
