"""The model families :class:`~nnx_shard.models.Llama` serves, by ``config.json``'s
``model_type``: each :class:`Family` names its transformers architecture, its table of
Hugging Face tensor names, its fused tensors, its named configurations and the
:class:`~nnx_shard.models.LlamaConfig` options it fixes. :func:`family_of` finds a
family; :func:`register` adds one. The checkpoint readers and writers
(:mod:`nnx_shard.hf`) and ``config.json``'s reading (:meth:`LlamaConfig.from_hf`)
look a family up here, never guess it from the options.

The tables are plain data (regular expressions on the Hugging Face name -> model
path, or ``(model path, transform)``, or ``None`` to skip), so that this floor holds
them and :mod:`nnx_shard.hf` applies them.

>>> family_of("qwen3").architectures, family_of("qwen3").mapping is LLAMA_MAPPING
(('Qwen3ForCausalLM',), True)
>>> family_of("gpt2")
Traceback (most recent call last):
...
nnx_shard._errors.UsageError: model_type 'gpt2' is not a registered model family (known: llama, qwen3, qwen2, mistral, gemma, olmo2, gemma2, gemma3_text, phi3, mixtral, qwen3_moe). Fix: use a checkpoint or config of one of these, or register(Family(model_type='gpt2', ...)) for a new family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from nnx_shard._errors import UsageError, short

__all__ = ["GEMMA2_MAPPING", "LLAMA_MAPPING", "LLAMA_TIED_MAPPING", "MIXTRAL_MAPPING",
           "OLMO2_MAPPING", "QWEN3_MOE_MAPPING", "Family",
           "Fusion", "MappingValue", "family_of", "model_types", "register", "tied"]

MappingValue = str | tuple[str, str] | None

_L = r"model\.layers\.(\d+)\."
_HEAD = r"lm_head\.weight"
#: Hugging Face ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` names -> paths of
#: :class:`nnx_shard.models.Llama` (``blocks/<i>/...``: a model with
#: ``scan_layers`` takes layer ``i`` of its stacked ``blocks/...``).
LLAMA_MAPPING: dict[str, MappingValue] = {
    r"model\.embed_tokens\.weight": "token_embed",
    _L + r"input_layernorm\.weight": r"blocks/\1/attn_norm/scale",
    _L + r"self_attn\.(q|k|v)_proj\.weight": (r"blocks/\1/attn/\2", "heads_out"),
    _L + r"self_attn\.(q|k|v)_proj\.bias": (r"blocks/\1/attn/\2_bias", "heads_bias"),
    _L + r"self_attn\.(q|k)_norm\.weight": r"blocks/\1/attn/\2_norm/scale",
    _L + r"self_attn\.o_proj\.weight": (r"blocks/\1/attn/o", "heads_in"),
    _L + r"self_attn\.o_proj\.bias": r"blocks/\1/attn/o_bias",
    _L + r"post_attention_layernorm\.weight": r"blocks/\1/mlp_norm/scale",
    _L + r"mlp\.(gate|up|down)_proj\.weight": (r"blocks/\1/mlp/\2", "transpose"),
    _L + r"mlp\.(gate|up|down)_proj\.bias": r"blocks/\1/mlp/\2_bias",
    r"model\.norm\.weight": "final_norm/scale",
    _HEAD: ("unembed", "transpose"),
}
#: ``Olmo2ForCausalLM``: norms after attention and MLP (its
#: ``post_attention_layernorm`` is not Llama's pre-MLP norm) and one q/k norm over
#: all heads (``[heads * head_dim]`` in the file).
OLMO2_MAPPING: dict[str, MappingValue] = {
    **{k: v for k, v in LLAMA_MAPPING.items()
       if "layernorm" not in k and "_norm" not in k},
    _L + r"post_attention_layernorm\.weight": r"blocks/\1/attn_post_norm/scale",
    _L + r"post_feedforward_layernorm\.weight": r"blocks/\1/mlp_post_norm/scale",
    _L + r"self_attn\.(q|k)_norm\.weight": (r"blocks/\1/attn/\2_norm/scale", "heads_bias"),
}
#: ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``: four norms per block (before and
#: after attention and MLP); Gemma 3's per-head q/k norms as Qwen3's.
GEMMA2_MAPPING: dict[str, MappingValue] = {
    **{k: v for k, v in LLAMA_MAPPING.items() if "layernorm" not in k},
    _L + r"input_layernorm\.weight": r"blocks/\1/attn_norm/scale",
    _L + r"post_attention_layernorm\.weight": r"blocks/\1/attn_post_norm/scale",
    _L + r"pre_feedforward_layernorm\.weight": r"blocks/\1/mlp_norm/scale",
    _L + r"post_feedforward_layernorm\.weight": r"blocks/\1/mlp_post_norm/scale",
}
#: ``MixtralForCausalLM``: Llama's attention, and a sparse MoE MLP whose router is
#: ``block_sparse_moe.gate`` and whose experts' ``w1`` / ``w3`` / ``w2`` (gate, up,
#: down) stack into ``mlp/gate``, ``mlp/up``, ``mlp/down [experts, ...]``.
MIXTRAL_MAPPING: dict[str, MappingValue] = {
    **{k: v for k, v in LLAMA_MAPPING.items() if "mlp" not in k},
    _L + r"block_sparse_moe\.gate\.weight": (r"blocks/\1/mlp/router", "transpose"),
    _L + r"block_sparse_moe\.experts\.(\d+)\.w1\.weight": (r"blocks/\1/mlp/gate/\2",
                                                          "transpose"),
    _L + r"block_sparse_moe\.experts\.(\d+)\.w3\.weight": (r"blocks/\1/mlp/up/\2",
                                                          "transpose"),
    _L + r"block_sparse_moe\.experts\.(\d+)\.w2\.weight": (r"blocks/\1/mlp/down/\2",
                                                          "transpose"),
}
#: ``Qwen3MoeForCausalLM``: Qwen3's attention; MoE layers' router ``mlp.gate`` and
#: experts ``mlp.experts.<e>.{gate,up,down}_proj``, dense layers (``mlp_only_layers``)
#: Llama's MLP names.
QWEN3_MOE_MAPPING: dict[str, MappingValue] = {
    **LLAMA_MAPPING,
    _L + r"mlp\.gate\.weight": (r"blocks/\1/mlp/router", "transpose"),
    _L + r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight": (r"blocks/\1/mlp/\3/\2",
                                                              "transpose"),
}

# One tied table per table, made once: callers may compare tables by identity. Each entry
# keeps its table alive, so that its id is never another table's.
_TIED: dict[int, tuple[dict[str, MappingValue], dict[str, MappingValue]]] = {}


def tied(mapping: dict[str, MappingValue]) -> dict[str, MappingValue]:
    """``mapping`` for tied embeddings: a ``lm_head.weight`` in the file is skipped, as
    transformers ties it to the embedding (the same table for the same ``mapping``).

    >>> tied(LLAMA_MAPPING) is LLAMA_TIED_MAPPING, tied(LLAMA_MAPPING)[r"lm_head\\.weight"]
    (True, None)
    """
    entry = _TIED.get(id(mapping))
    if entry is None:
        entry = _TIED[id(mapping)] = (mapping, {**mapping, _HEAD: None})
    return entry[1]


#: :data:`LLAMA_MAPPING` for tied embeddings.
LLAMA_TIED_MAPPING: dict[str, MappingValue] = tied(LLAMA_MAPPING)


@dataclasses.dataclass(frozen=True)
class Fusion:
    """A per-layer checkpoint tensor ``fused`` (name after ``model.layers.<i>.``) that
    stacks ``parts`` of ``rows`` rows each, in that order."""

    fused: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]


def _phi3_fusions(cfg: Any) -> list[Fusion]:
    """Phi-3's ``qkv_proj`` and ``gate_up_proj``: q, k, v and gate, up stacked by rows."""
    h, g, d, m = cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp
    return [Fusion("self_attn.qkv_proj.weight", tuple(f"self_attn.{p}_proj.weight"
                                                      for p in "qkv"), (h * d, g * d, g * d)),
            Fusion("mlp.gate_up_proj.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
                   (m, m))]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family of :class:`~nnx_shard.models.Llama`.

    Attributes:
      model_type: ``config.json``'s ``model_type``.
      architectures: what :meth:`LlamaConfig.to_hf` writes as ``architectures``.
      mapping: its table of Hugging Face names (:func:`tied` derives the tied one).
      fused: the checkpoint tensors that stack several parameters, of a config
        (``None``: none).
      named_configs: the names in :data:`nnx_shard.models.CONFIGS` of this family.
      options: the :class:`LlamaConfig` options the family fixes, as
        :meth:`LlamaConfig.from_hf` sets them; an option left out is off. A
        structural option (``post_norms``, ``sandwich_norms``) is refused with a
        model type whose family does not have it.
      hf_flags: the true / false keys of its ``config.json`` read into the
        :class:`LlamaConfig` option of the same name and written back
        (``attention_bias``, ``mlp_bias``).
      tied_default: ``tie_word_embeddings`` when the file leaves it out.
      moe: a mixture-of-experts family's ``config.json`` keys and transformers'
        defaults for them (``num_local_experts`` or ``num_experts``,
        ``num_experts_per_tok``, ...); empty for a dense family.
    """

    model_type: str
    architectures: tuple[str, ...]
    mapping: dict[str, MappingValue]
    fused: Callable[[Any], list[Fusion]] | None = None
    named_configs: tuple[str, ...] = ()
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf_flags: tuple[str, ...] = ()
    tied_default: bool = False
    moe: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def table(self, tie_embeddings: bool) -> dict[str, MappingValue]:
        """Its mapping table, the tied one for tied embeddings.

        >>> family_of("gemma2").table(True)[r"lm_head\\.weight"] is None
        True
        """
        return tied(self.mapping) if tie_embeddings else self.mapping


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Adds ``family`` (replacing one of its ``model_type``); returns it.

    >>> register(family_of("llama")) is family_of("llama")
    True
    """
    if not isinstance(family, Family):
        raise UsageError(f"register: expected a Family, got {type(family).__name__} "
                         f"{short(family, 60)}. Fix: register(Family(model_type=..., "
                         "architectures=(...,), mapping={...})).")
    _FAMILIES[family.model_type] = family
    return family


def model_types() -> tuple[str, ...]:
    """The registered ``model_type`` values, in the order they were registered.

    >>> model_types()[:3]
    ('llama', 'qwen3', 'qwen2')
    """
    return tuple(_FAMILIES)


def family_of(model_type: Any) -> Family:
    """The family of ``config.json``'s ``model_type`` (see the module example).

    Raises:
      UsageError: an unknown ``model_type``, listing the known ones.
    """
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UsageError(
            f"model_type {short(model_type, 60)} is not a registered model family (known: "
            f"{', '.join(_FAMILIES)}). Fix: use a checkpoint or config of one of these, or "
            f"register(Family(model_type={short(model_type, 40)}, ...)) for a new family.")
    return family


# -- the families ---------------------------------------------------------------------
# Gemma's families tie the embeddings by default and scale them, and offset their norms.
_GEMMA = {"embed_scale": True, "norm_offset": True}
_BIASES = ("attention_bias",)

register(Family("llama", ("LlamaForCausalLM",), LLAMA_MAPPING,
                named_configs=("llama-tiny", "llama3-8b", "llama3-70b", "llama3-405b"),
                hf_flags=("attention_bias", "mlp_bias")))
register(Family("qwen3", ("Qwen3ForCausalLM",), LLAMA_MAPPING,
                named_configs=("qwen3-tiny", "qwen3-0.6b"), options={"qk_norm": True},
                hf_flags=_BIASES))
# Qwen2 always has q/k/v biases and no o bias.
register(Family("qwen2", ("Qwen2ForCausalLM",), LLAMA_MAPPING,
                named_configs=("qwen2.5-7b",), options={"qkv_bias": True}))
register(Family("mistral", ("MistralForCausalLM",), LLAMA_MAPPING,
                named_configs=("mistral-7b",)))
register(Family("gemma", ("GemmaForCausalLM",), LLAMA_MAPPING, options=_GEMMA,
                hf_flags=_BIASES, tied_default=True))
register(Family("olmo2", ("Olmo2ForCausalLM",), OLMO2_MAPPING,
                options={"qk_norm": True, "qk_norm_full": True, "post_norms": True},
                hf_flags=_BIASES))
register(Family("gemma2", ("Gemma2ForCausalLM",), GEMMA2_MAPPING,
                named_configs=("gemma2-9b",), options={**_GEMMA, "sandwich_norms": True},
                hf_flags=_BIASES, tied_default=True))
register(Family("gemma3_text", ("Gemma3ForCausalLM",), GEMMA2_MAPPING,
                options={**_GEMMA, "sandwich_norms": True, "qk_norm": True},
                hf_flags=_BIASES, tied_default=True))
# Phi-3 stores q/k/v and gate/up fused; split into Llama's names on reading.
register(Family("phi3", ("Phi3ForCausalLM",), LLAMA_MAPPING, fused=_phi3_fusions))
# Mixture-of-experts families: per-expert tensors stack into [experts, ...] parameters.
_MOE = {"num_experts_per_tok": 2, "router_aux_loss_coef": 0.001, "output_router_logits": False}
register(Family("mixtral", ("MixtralForCausalLM",), MIXTRAL_MAPPING,
                named_configs=("mixtral-8x7b",),
                moe={"num_local_experts": 8, **_MOE}))
register(Family("qwen3_moe", ("Qwen3MoeForCausalLM",), QWEN3_MOE_MAPPING,
                named_configs=("qwen3-30b-a3b",), options={"qk_norm": True}, hf_flags=_BIASES,
                moe={"num_experts": 128, **_MOE, "num_experts_per_tok": 8,
                     "moe_intermediate_size": 768, "norm_topk_prob": False,
                     "decoder_sparse_step": 1, "mlp_only_layers": []}))
