"""Gemma (``GemmaForCausalLM``): Llama's decoder with a GELU-tanh MLP, token embeddings
scaled by ``sqrt(embed)`` and RMSNorms scaling by ``1 + weight``; tied embeddings by
default. Gemma 2 and 3 (:mod:`.gemma2`, :mod:`.gemma3`) reuse its embedding hook.

>>> import jax.numpy as jnp
>>> float(scale_embeddings(jnp.ones((1, 1, 16)), GemmaConfig(embed=16))[0, 0, 0])
4.0
"""

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from nnx_shard.models._config_bases import AttentionBiasConfig
from nnx_shard.models._decoder import DecoderBlock
from nnx_shard.models._families import LLAMA_MAPPING, Family, register
from nnx_shard.models._hf_config import no_window

__all__ = ["CONFIGS", "FAMILY", "GemmaConfig", "gelu_tanh", "scale_embeddings"]


@dataclasses.dataclass(frozen=True)
class GemmaConfig(AttentionBiasConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of a Gemma model: ``attention_bias``;
    tied embeddings when ``config.json`` leaves them out."""

    model_type: str = "gemma"
    hf_defaults: ClassVar[Mapping[str, Any]] = {"tie_embeddings": True}


def scale_embeddings(x: jax.Array, cfg: Any) -> jax.Array:
    """``x * sqrt(embed)``, the factor rounded to the parameters' dtype as transformers
    rounds it."""
    return x * jnp.asarray(math.sqrt(cfg.embed), cfg.param_dtype).astype(cfg.dtype)


def gelu_tanh(act: Any) -> Any:
    """Gemma's activation: GELU's tanh approximation when unnamed, and for the legacy
    ``"gelu"``, as transformers' Gemma configs read it."""
    return "gelu_pytorch_tanh" if act in (None, "gelu") else act


def hf_in(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """``hidden_act`` as Gemma reads it (:func:`gelu_tanh`)."""
    return {**hf, "hidden_act": gelu_tanh(hf.get("hidden_act"))}


def read(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Nothing beyond the shared fields; a sliding window is refused (Gemma has none)."""
    no_window(hf, "gemma", where)
    return {}


FAMILY = register(Family(
    "gemma", ("GemmaForCausalLM",), LLAMA_MAPPING, block=DecoderBlock, norm_offset=True,
    embed=scale_embeddings, hf_in=hf_in, read=read, config=GemmaConfig))

CONFIGS: dict[str, Any] = {}
