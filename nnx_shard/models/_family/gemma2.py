"""Gemma 2 (``Gemma2ForCausalLM``): Gemma's embeddings and norms, four norms per block
(:class:`~nnx_shard.models._decoder.SandwichBlock`), soft-capped attention scores and
logits, ``query_pre_attn_scalar`` and sliding layers among global ones
(``layer_types``).

>>> CONFIGS["gemma2-9b"].num_params    # the published 9.24B
9241705984
"""

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from nnx_shard._errors import UsageError, count, short
from nnx_shard.models._config_bases import AttentionBiasConfig, WindowConfig
from nnx_shard.models._decoder import SandwichBlock
from nnx_shard.models._decoder_config import BIG
from nnx_shard.models._families import (
    LAYER,
    LLAMA_MAPPING,
    Family,
    MappingValue,
    register,
)
from nnx_shard.models._family.gemma import gelu_tanh, scale_embeddings
from nnx_shard.models._hf_config import FIX_VALUE, count_key

__all__ = ["CONFIGS", "FAMILY", "GEMMA2_MAPPING", "TINY", "Gemma2Config", "hf_in",
           "soft_capped", "window", "window_fields", "write"]


@dataclasses.dataclass(frozen=True)
class Gemma2Config(AttentionBiasConfig, WindowConfig):
    """:class:`~nnx_shard.models.DecoderConfig` of a Gemma 2 model: ``attention_bias``,
    its window, and the fields of Gemma 2 / 3's attention and logits
    (:class:`~nnx_shard.models._decoder.SandwichBlock`'s attention reads them).

    Attributes:
      window_layers: ``None`` (the window, if any, in every layer), or one flag per
        layer: which layers slide (``layer_types``; the others attend to every
        earlier key).
      query_scale: ``None``, or the attention scores' divisor's square
        (``query_pre_attn_scalar``: scores are ``q.k / sqrt(query_scale)``, not
        ``/ sqrt(head_dim)``).
      attn_softcap: ``None``, or the attention logit soft-cap
        (``attn_logit_softcapping``): scores become ``cap * tanh(scores / cap)``.
      final_softcap: ``None``, or the output logits' soft-cap
        (``final_logit_softcapping``).

    >>> from nnx_shard.models import DecoderConfig
    >>> DecoderConfig.for_model("gemma2", layers=2, sliding_window=4,
    ...                         window_layers=(True, False)).local_layers()
    (True, False)
    """

    model_type: str = "gemma2"
    window_layers: Any = None
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    hf_defaults: ClassVar[Mapping[str, Any]] = {"tie_embeddings": True, "attn_softcap": 50.0, "final_softcap": 30.0}
    hf_keys: ClassVar[Mapping[str, str]] = {"activation": "hidden_activation"}

    def local_layers(self) -> tuple[bool, ...]:
        """The layers ``window_layers`` marks (every one with ``None``), with a window."""
        if self.sliding_window is None:
            return (False,) * self.layers
        return self.window_layers or (True,) * self.layers


#: ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` names: four norms per block (before
#: and after attention and MLP); Gemma 3's per-head q/k norms as Qwen3's.
GEMMA2_MAPPING: dict[str, MappingValue] = {
    **{k: v for k, v in LLAMA_MAPPING.items() if "layernorm" not in k},
    LAYER + r"input_layernorm\.weight": r"blocks/\1/attn_norm/scale",
    LAYER + r"post_attention_layernorm\.weight": r"blocks/\1/attn_post_norm/scale",
    LAYER + r"pre_feedforward_layernorm\.weight": r"blocks/\1/mlp_norm/scale",
    LAYER + r"post_feedforward_layernorm\.weight": r"blocks/\1/mlp_post_norm/scale",
}

def soft_capped(logits: jax.Array, cfg: Any) -> jax.Array:
    """``final_softcap * tanh(logits / final_softcap)`` in float32, as transformers
    computes it (the float32 logits when ``final_softcap`` is None)."""
    logits = logits.astype(jnp.float32)
    cap = cfg.final_softcap
    return logits if cap is None else cap * jnp.tanh(logits / cap)


def hf_in(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """Gemma 2 / 3's spellings: the activation is ``hidden_activation`` (else
    ``hidden_act``, as Gemma's), ``head_dim`` 256 when absent."""
    act = gelu_tanh(hf.get("hidden_activation") or hf.get("hidden_act"))
    return {**hf, "hidden_act": act,
            "head_dim": 256 if hf.get("head_dim") is None else hf["head_dim"]}


def window(hf: Mapping[str, Any], layers: int, every: Any, where: str
           ) -> tuple[int | None, tuple[bool, ...] | None]:
    """The window and which layers slide, as Gemma 2 / 3's configs read them:
    ``layer_types``, else all but every ``every``-th layer sliding (``sliding_window``
    4096 when the key is absent, none when null)."""
    if hf.get("sliding_window") is None:
        size = 4096 if "sliding_window" not in hf else None
    else:
        size = count_key(hf, "sliding_window", None, where)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        every = count(every, f"{where}: sliding_window_pattern", fix="e.g. 6")
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                       for i in range(layers)]
    if not (isinstance(layer_types, list) and len(layer_types) == layers and all(
            t in ("full_attention", "sliding_attention") for t in layer_types)):
        raise UsageError(f"{where}: layer_types must list \"full_attention\" / "
                         f"\"sliding_attention\" for each of the {layers} layers, got "
                         f"{short(layer_types, 80)}. {FIX_VALUE}.")
    flags = tuple(t == "sliding_attention" for t in layer_types)
    if size is None or not any(flags):
        return None, None
    return size, (None if all(flags) else flags)


def window_fields(hf: Mapping[str, Any], where: str, fields: dict[str, Any], every: Any
                  ) -> dict[str, Any]:
    """``sliding_window`` and ``window_layers`` as Gemma 2 / 3 read them (:func:`window`);
    the table reads their other fields (query scale, soft-caps)."""
    size, layers = window(hf, fields["layers"], every, where)
    return dict(sliding_window=size, window_layers=layers)


def read(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's window: every other layer sliding from the first."""
    return window_fields(hf, where, fields, 2)


def write(cfg: Any, out: dict[str, Any]) -> None:
    """Gemma 2 / 3's ``layer_types``, and ``query_pre_attn_scalar`` as transformers
    types it."""
    out.update(layer_types=["sliding_attention" if f else "full_attention"
                            for f in cfg.local_layers()],
               # transformers types it int (a float fails its config check)
               query_pre_attn_scalar=(int(cfg.query_scale) if cfg.query_scale is not None
                                      and cfg.query_scale.is_integer() else cfg.query_scale))


#: A tiny checkpoint's window and query scale (the defaults, 4096 and 256, are sized
#: for the published model).
TINY = {"query_pre_attn_scalar": 8, "sliding_window": 16}

FAMILY = register(Family(
    "gemma2", ("Gemma2ForCausalLM",), GEMMA2_MAPPING, named_configs=("gemma2-9b",),
    block=SandwichBlock, norm_offset=True, embed=scale_embeddings, logits=soft_capped,
    hf_in=hf_in, read=read, write=write, config=Gemma2Config, tiny=TINY))

#: Gemma 2 9B's published shapes: soft-caps 50 (attention) / 30 (logits), a 4096-token
#: window in every other layer from the first, ``query_pre_attn_scalar`` 256, tied.
CONFIGS = {
    "gemma2-9b": Gemma2Config(
        vocab=256000, embed=3584, heads=16, kv_heads=8, head_dim=256, mlp=14336, layers=42,
        rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True, activation="gelu_pytorch_tanh",
        query_scale=256.0, attn_softcap=50.0, final_softcap=30.0, sliding_window=4096,
        window_layers=(True, False) * 21, max_length=8192, model_type="gemma2", **BIG),
}
