"""Gemma 2 (``Gemma2ForCausalLM``): Gemma's embeddings and norms, four norms per block
(:class:`~nnx_shard.models._decoder.SandwichBlock`), soft-capped attention scores and
logits, ``query_pre_attn_scalar`` and sliding layers among global ones
(``layer_types``).

>>> CONFIGS["gemma2-9b"].num_params    # the published 9.24B
9241705984
"""

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from nnx_shard._errors import UsageError, count, short
from nnx_shard.models._decoder import SandwichBlock
from nnx_shard.models._decoder_config import BIG, DecoderConfig
from nnx_shard.models._families import (
    LAYER,
    LLAMA_MAPPING,
    Family,
    MappingValue,
    register,
)
from nnx_shard.models._family.gemma import gelu_tanh, scale_embeddings
from nnx_shard.models._hf_config import FIX_VALUE, count_key, real_value

__all__ = ["CONFIGS", "FAMILY", "FIELDS", "GEMMA2_MAPPING", "TINY", "hf_in", "read_later",
           "soft_capped", "window", "write"]

#: ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` names: four norms per block (before
#: and after attention and MLP); Gemma 3's per-head q/k norms as Qwen3's.
GEMMA2_MAPPING: dict[str, MappingValue] = {
    **{k: v for k, v in LLAMA_MAPPING.items() if "layernorm" not in k},
    LAYER + r"input_layernorm\.weight": r"blocks/\1/attn_norm/scale",
    LAYER + r"post_attention_layernorm\.weight": r"blocks/\1/attn_post_norm/scale",
    LAYER + r"pre_feedforward_layernorm\.weight": r"blocks/\1/mlp_norm/scale",
    LAYER + r"post_feedforward_layernorm\.weight": r"blocks/\1/mlp_post_norm/scale",
}

#: The config fields of Gemma 2 (Gemma 3 adds its local rotary base).
FIELDS = ("attention_bias", "sliding_window", "window_layers", "query_scale", "attn_softcap",
          "final_softcap")


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


def read_later(hf: Mapping[str, Any], where: str, fields: dict[str, Any], every: Any,
               softcaps: tuple[float | None, float | None]) -> dict[str, Any]:
    """The fields Gemma 2 and 3 share: window, ``query_pre_attn_scalar`` (256 when
    absent) and the soft-caps (``softcaps``: the defaults when a key is absent)."""
    size, layers = window(hf, fields["layers"], every, where)

    def cap(key: str, default: float | None) -> float | None:
        value = hf.get(key, default)
        return None if value is None else real_value(value, key, None, where)

    return dict(sliding_window=size, window_layers=layers,
                query_scale=real_value(hf.get("query_pre_attn_scalar"),
                                       "query_pre_attn_scalar", 256.0, where),
                attn_softcap=cap("attn_logit_softcapping", softcaps[0]),
                final_softcap=cap("final_logit_softcapping", softcaps[1]))


def read(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's fields: every other layer sliding from the first, soft-caps 50 / 30
    when absent."""
    return read_later(hf, where, fields, 2, (50.0, 30.0))


def write(cfg: Any, out: dict[str, Any]) -> None:
    """Gemma 2 / 3's keys: ``hidden_activation``, the window and ``layer_types``,
    ``query_pre_attn_scalar`` and the soft-caps."""
    del out["hidden_act"]
    out.update(hidden_activation=cfg.activation, sliding_window=cfg.sliding_window,
               layer_types=["sliding_attention" if f else "full_attention"
                            for f in cfg.local_layers()],
               # transformers types it int (a float fails its config check)
               query_pre_attn_scalar=(int(cfg.query_scale) if cfg.query_scale is not None
                                      and cfg.query_scale.is_integer() else cfg.query_scale),
               attn_logit_softcapping=cfg.attn_softcap,
               final_logit_softcapping=cfg.final_softcap)


#: A tiny checkpoint's window and query scale (the defaults, 4096 and 256, are sized
#: for the published model).
TINY = {"query_pre_attn_scalar": 8, "sliding_window": 16}

FAMILY = register(Family(
    "gemma2", ("Gemma2ForCausalLM",), GEMMA2_MAPPING, named_configs=("gemma2-9b",),
    block=SandwichBlock, norm_offset=True, embed=scale_embeddings, logits=soft_capped,
    fields=FIELDS, hf_in=hf_in, read=read, write=write, hf_flags=("attention_bias",),
    tied_default=True, tiny=TINY))

#: Gemma 2 9B's published shapes: soft-caps 50 (attention) / 30 (logits), a 4096-token
#: window in every other layer from the first, ``query_pre_attn_scalar`` 256, tied.
CONFIGS = {
    "gemma2-9b": DecoderConfig(
        vocab=256000, embed=3584, heads=16, kv_heads=8, head_dim=256, mlp=14336, layers=42,
        rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True, activation="gelu_pytorch_tanh",
        query_scale=256.0, attn_softcap=50.0, final_softcap=30.0, sliding_window=4096,
        window_layers=(True, False) * 21, max_length=8192, model_type="gemma2", **BIG),
}
