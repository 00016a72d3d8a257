"""The model families :class:`~nnx_shard.models.Decoder` serves, by ``config.json``'s
``model_type``. Each family is one module of :mod:`nnx_shard.models._family` that
registers one :class:`Family` record: its transformers architecture, its table of
Hugging Face tensor names and fused tensors, what its decoder is made of (the block
class, its q/k norm, biases, norms, and the hooks on the embeddings and logits), its
config class (a :class:`~nnx_shard.models.DecoderConfig` subclass holding its own fields),
the ``config.json`` spellings only it has and its named configurations. The shared decoder (:mod:`nnx_shard.models._decoder`), the
checkpoint readers and writers (:mod:`nnx_shard.hf`) and ``config.json``'s reading
(:meth:`DecoderConfig.from_hf`) look a family up here; none of them tests which family
it is.

The tables are plain data (regular expressions on the Hugging Face name -> model
path, or ``(model path, transform)``, or ``None`` to skip), so that this floor holds
them and :mod:`nnx_shard.hf` applies them.

>>> family_of("qwen3").architectures, family_of("qwen3").mapping is LLAMA_MAPPING
(('Qwen3ForCausalLM',), True)
>>> family_of("gpt2")
Traceback (most recent call last):
...
nnx_shard._errors.UsageError: model_type 'gpt2' is not a registered model family (known: gemma, gemma2, gemma3_text, llama, mistral, mixtral, olmo2, phi3, qwen2, qwen3, qwen3_moe). Fix: use a checkpoint or config of one of these, or register(Family(model_type='gpt2', ...)) for a new family.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from nnx_shard._errors import UsageError, short

__all__ = ["LAYER", "LLAMA_MAPPING", "LLAMA_TIED_MAPPING", "Family", "Fusion", "MappingValue",
           "family_of", "model_types", "register", "tied"]

MappingValue = str | tuple[str, str] | None

#: The prefix of a layer's tensors, capturing the layer index.
LAYER = r"model\.layers\.(\d+)\."
_L = LAYER
_HEAD = r"lm_head\.weight"
#: Hugging Face ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` names -> paths of
#: :class:`nnx_shard.models.Decoder` (``blocks/<i>/...``: a model with
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
# One tied table per table, made once: callers may compare tables by identity. Pairs found
# by identity (`is`), never by `id()`: the few tables are compared one by one, and each pair
# holds its table, so a freed table's address can never name another's tied one.
_TIED: list[tuple[dict[str, MappingValue], dict[str, MappingValue]]] = []


def tied(mapping: dict[str, MappingValue]) -> dict[str, MappingValue]:
    """``mapping`` for tied embeddings: a ``lm_head.weight`` in the file is skipped, as
    transformers ties it to the embedding (the same table for the same ``mapping``).

    >>> tied(LLAMA_MAPPING) is LLAMA_TIED_MAPPING, tied(LLAMA_MAPPING)[r"lm_head\\.weight"]
    (True, None)
    """
    for table, tied_table in _TIED:
        if table is mapping:
            return tied_table
    _TIED.append((mapping, {**mapping, _HEAD: None}))
    return _TIED[-1][1]


#: :data:`LLAMA_MAPPING` for tied embeddings.
LLAMA_TIED_MAPPING: dict[str, MappingValue] = tied(LLAMA_MAPPING)


@dataclasses.dataclass(frozen=True)
class Fusion:
    """A per-layer checkpoint tensor ``fused`` (name after ``model.layers.<i>.``) that
    stacks ``parts`` of ``rows`` rows each, in that order."""

    fused: str
    parts: tuple[str, ...]
    rows: tuple[int, ...]


def _same(x: Any, cfg: Any) -> Any:
    """The embeddings as looked up (most families)."""
    return x


def _float32(logits: Any, cfg: Any) -> Any:
    """The logits cast to float32 for the softmax and the loss (most families)."""
    return logits.astype("float32")


def _as_written(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``config.json`` already in the shared spelling (most families)."""
    return hf


def _nothing_more(hf: Mapping[str, Any], where: str, fields: dict[str, Any]) -> dict[str, Any]:
    """No fields beyond the shared ones."""
    return {}


def _no_keys(cfg: Any, out: dict[str, Any]) -> None:
    """No ``config.json`` keys beyond the shared ones."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family of :class:`~nnx_shard.models.Decoder`: what its module registers.

    Attributes:
      model_type: ``config.json``'s ``model_type``.
      architectures: what :meth:`DecoderConfig.to_hf` writes as ``architectures``.
      mapping: its table of Hugging Face names (:func:`tied` derives the tied one).
      fused: the checkpoint tensors that stack several parameters, of a config
        (``None``: none).
      named_configs: the names in :data:`nnx_shard.models.CONFIGS` of this family.
      block: the block class of its dense layers (pre-norm
        :class:`~nnx_shard.models._decoder.DecoderBlock`, or a post-norm or sandwich
        variant); ``moe_block`` the one of its mixture-of-experts layers.
      qk_norm: ``None``, ``"head"`` (an RMSNorm of each query and key head, Qwen3) or
        ``"all"`` (one over all heads' features, OLMo 2), before the rotation.
      qkv_bias: biases on q, k and v always, and none on o (Qwen2).
      norm_offset: its RMSNorms scale by ``1 + weight`` (Gemma).
      embed: ``(embeddings, cfg) -> embeddings`` after the lookup (Gemma scales them).
      logits: ``(logits, cfg) -> float32 logits`` (Gemma 2 soft-caps them).
      hf_in: ``(config.json dict, where) -> dict``: the family's own spellings of
        shared keys made the shared ones (Gemma's ``hidden_activation``, Phi-3's rotary
        names), before the shared reading.
      read: ``(config.json dict, where, fields read so far) -> fields``: the fields whose
        reading is the family's own (its sliding window, Gemma 3's local rotary base),
        each checked; the others are read from the field table
        (:data:`~nnx_shard.models._hf_config.FIELDS`).
      write: ``(cfg, config.json dict) -> None``: the keys only the family writes
        (Qwen's ``use_sliding_window``, Gemma 2's ``layer_types``, ...), after the table's.
      tiny: the ``config.json`` keys a tiny checkpoint of the family sets beyond the
        shared tiny sizes (:func:`nnx_shard.hf.tiny_checkpoint`: its experts, Gemma 2's
        window and query scale sized for it).
      config: the family's config class: a frozen dataclass subclassing
        :class:`~nnx_shard.models.DecoderConfig` with the fields only the family has,
        declared in the family's module (``LlamaConfig``, ``Gemma2Config``,
        :class:`~nnx_shard.models.Qwen3MoeConfig`, ...; the reference family's
        :class:`~nnx_shard.models.ReferenceConfig`; ``None``: ``DecoderConfig`` itself).
        ``DecoderConfig.for_model`` and ``DecoderConfig.from_hf`` build it.
      gated_mlp: its MLPs (dense and experts) are gated, ``down(act(gate(x)) * up(x))``;
        ``False``: ``down(act(up(x)))`` (the reference model's).
      learned_positions: a learned position table (``pos_embed [max_length, embed]``)
        added to the token embeddings, in place of rotary embeddings (the reference
        model's).
    """

    model_type: str
    architectures: tuple[str, ...]
    mapping: dict[str, MappingValue]
    fused: Callable[[Any], list[Fusion]] | None = None
    named_configs: tuple[str, ...] = ()
    block: Any = None
    moe_block: Any = None
    qk_norm: str | None = None
    qkv_bias: bool = False
    norm_offset: bool = False
    embed: Callable[[Any, Any], Any] = _same
    logits: Callable[[Any, Any], Any] = _float32
    hf_in: Callable[[dict[str, Any], str], dict[str, Any]] = _as_written
    read: Callable[[Mapping[str, Any], str, dict[str, Any]], dict[str, Any]] = _nothing_more
    write: Callable[[Any, dict[str, Any]], None] = _no_keys
    tiny: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    config: Any = None
    gated_mlp: bool = True
    learned_positions: bool = False

    def __post_init__(self) -> None:
        if self.qk_norm not in (None, "head", "all"):
            raise UsageError(f"Family({self.model_type!r}): qk_norm={self.qk_norm!r} is not "
                             "None, 'head' or 'all'. Fix: qk_norm=None, 'head' or 'all'.")

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
    """The registered ``model_type`` values of Hugging Face families (those with an
    architecture), sorted.

    >>> model_types()[:3]
    ('gemma', 'gemma2', 'gemma3_text')
    """
    return tuple(sorted(t for t, f in _FAMILIES.items() if f.architectures))


def family_of(model_type: Any) -> Family:
    """The family of ``config.json``'s ``model_type`` (see the module example).

    Raises:
      UsageError: an unknown ``model_type``, listing the known ones.
    """
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise UsageError(
            f"model_type {short(model_type, 60)} is not a registered model family (known: "
            f"{', '.join(model_types())}). Fix: use a checkpoint or config of one of these, or "
            f"register(Family(model_type={short(model_type, 40)}, ...)) for a new family.")
    return family
