"""Phi-3 (``Phi3ForCausalLM``): Llama's decoder; its checkpoints store q/k/v as one
``qkv_proj`` and gate/up as one ``gate_up_proj``, split into Llama's names on reading
and fused again on writing.

>>> [f.fused for f in fusions(Phi3Config())]
['self_attn.qkv_proj.weight', 'mlp.gate_up_proj.weight']
"""

import dataclasses
from collections.abc import Mapping
from typing import Any

from nnx_shard._errors import UsageError, short
from nnx_shard.models._config_bases import WindowConfig
from nnx_shard.models._decoder import DecoderBlock
from nnx_shard.models._families import LLAMA_MAPPING, Family, Fusion, register
from nnx_shard.models._family.mistral import read
from nnx_shard.models._hf_config import FIX_VALUE

__all__ = ["CONFIGS", "FAMILY", "Phi3Config", "fusions", "hf_in", "write"]


@dataclasses.dataclass(frozen=True)
class Phi3Config(WindowConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of a Phi-3 model: its window
    (``sliding_window``)."""

    model_type: str = "phi3"


def fusions(cfg: Any) -> list[Fusion]:
    """Phi-3's ``qkv_proj`` and ``gate_up_proj``: q, k, v and gate, up stacked by rows."""
    h, g, d, m = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp
    return [Fusion("self_attn.qkv_proj.weight", tuple(f"self_attn.{p}_proj.weight"
                                                      for p in "qkv"), (h * d, g * d, g * d)),
            Fusion("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                   (m, m))]


def hf_in(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Phi-3's spellings as Phi3Config reads them: no ``head_dim`` key (``hidden_size /
    heads``); its legacy rotary names ``su`` / ``yarn`` mean ``longrope``, the only
    scaling it has, whose pretraining context is its own top-level
    ``original_max_position_embeddings`` (4096 when absent)."""
    out = {k: v for k, v in hf.items() if k != "head_dim"}
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key)
    if not isinstance(rope, Mapping):
        return out
    rope = dict(rope)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("su", "yarn"):
        kind = rope["rope_type"] = "longrope"
    if kind not in ("default", "longrope"):
        raise UsageError(f"{where}: {key} of type {short(kind, 40)}: Phi-3 rotates with the "
                         "default or longrope frequencies only (as Phi3Config checks). "
                         f"{FIX_VALUE}.")
    if kind == "longrope":
        rope["original_max_position_embeddings"] = hf.get("original_max_position_embeddings",
                                                          4096)
    return {**out, key: rope}


def write(cfg: Any, out: dict[str, Any]) -> None:
    """Phi-3's own top-level pretraining context (over the scaling's), and no pad id
    where Phi3Config's default (32000) would not index the embedding."""
    if cfg.rope_scaling:
        out["original_max_position_embeddings"] = dict(cfg.rope_scaling).get(
            "original_max_position_embeddings", cfg.max_length)
    if cfg.vocab <= 32000:
        out["pad_token_id"] = None


FAMILY = register(Family(
    "phi3", ("Phi3ForCausalLM",), LLAMA_MAPPING, fused=fusions, block=DecoderBlock,
    hf_in=hf_in, read=read, write=write, config=Phi3Config))

CONFIGS: dict[str, Any] = {}
