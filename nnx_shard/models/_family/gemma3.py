"""Gemma 3's text model (``Gemma3ForCausalLM``, ``model_type`` ``gemma3_text``): Gemma
2's decoder with per-head q/k norms and the sliding layers' own rotary base
(``rope_local_base_freq``).

>>> FAMILY.qk_norm, FAMILY.block.__name__
('head', 'SandwichBlock')
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from nnx_shard._errors import UsageError, short
from nnx_shard.models._decoder import SandwichBlock
from nnx_shard.models._families import Family, register
from nnx_shard.models._family import gemma2
from nnx_shard.models._family.gemma import scale_embeddings
from nnx_shard.models._family.gemma2 import (
    GEMMA2_MAPPING,
    TINY,
    Gemma2Config,
    hf_in,
    soft_capped,
)
from nnx_shard.models._hf_config import FIX_VALUE, hf_scaling, real_value

__all__ = ["CONFIGS", "FAMILY", "Gemma3Config", "local_theta", "read", "write"]


@dataclasses.dataclass(frozen=True)
class Gemma3Config(Gemma2Config):
    """:class:`Gemma2Config` of a Gemma 3 text model, with the sliding layers' own
    rotary base; no soft-caps when ``config.json`` leaves them out.

    Attributes:
      rope_local_theta: ``None``, or the rotary base of the sliding layers
        (``rope_local_base_freq``; ``None``: ``rope_theta``).

    >>> from nnx_shard.models import DecoderConfig
    >>> DecoderConfig.for_model("gemma3_text", rope_local_theta=1e4).local_theta()
    10000.0
    """

    model_type: str = "gemma3_text"
    rope_local_theta: float | None = None
    hf_defaults: ClassVar[Mapping[str, Any]] = {"tie_embeddings": True}

    def local_theta(self) -> float | None:
        """``rope_local_theta``."""
        return self.rope_local_theta


def local_theta(hf: Mapping[str, Any], where: str) -> float:
    """The rotary base of the sliding layers: ``rope_parameters``'
    ``sliding_attention`` entry, else ``rope_local_base_freq``, else 10000."""
    rope = hf.get("rope_parameters")
    local = rope.get("sliding_attention") if isinstance(rope, Mapping) else None
    if isinstance(local, Mapping):
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise UsageError(f"{where}: rope_parameters['sliding_attention'] of type "
                             f"{short(kind, 40)} is not implemented (the sliding layers rotate "
                             "with the default frequencies). " + FIX_VALUE + ".")
        if "rope_theta" in local:
            return real_value(local["rope_theta"], "rope_parameters['sliding_attention']"
                              "['rope_theta']", None, where)
    return real_value(hf.get("rope_local_base_freq"), "rope_local_base_freq", 10000.0, where)


def read(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's window with Gemma 3's default (all but every
    ``sliding_window_pattern``-th layer sliding, 6 when absent) and the sliding layers'
    rotary base."""
    return {**gemma2.window_fields(hf, where, fields, hf.get("sliding_window_pattern", 6)),
            "rope_local_theta": local_theta(hf, where)}


def write(cfg: Any, out: dict[str, Any]) -> None:
    """Gemma 2's keys, and the rotary settings of each layer type
    (``rope_parameters``) in place of ``rope_theta`` / ``rope_scaling``."""
    gemma2.write(cfg, out)
    global_rope = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                   **(hf_scaling(cfg.rope_scaling) or {})}
    out["rope_parameters"] = {
        "full_attention": global_rope,
        "sliding_attention": {"rope_type": "default",
                              "rope_theta": cfg.rope_local_theta or cfg.rope_theta}}
    del out["rope_theta"], out["rope_scaling"]


FAMILY = register(Family(
    "gemma3_text", ("Gemma3ForCausalLM",), GEMMA2_MAPPING, block=SandwichBlock,
    qk_norm="head", norm_offset=True, embed=scale_embeddings, logits=soft_capped,
    hf_in=hf_in, read=read, write=write, config=Gemma3Config, tiny=TINY))

CONFIGS: dict[str, Any] = {}
