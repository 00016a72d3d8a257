"""The configuration of :class:`~nnx_shard.models.Decoder`: :class:`DecoderConfig`, the
fields every family has (sizes, rotary settings, norm, activation, layout), its checks by
field kind, and its building from a family's name or a ``config.json``; the bases a
family's own config class builds on where families share fields
(:class:`AttentionBiasConfig`, :class:`MLPBiasConfig`, :class:`WindowConfig`,
:class:`MoEConfig`) live in :mod:`nnx_shard.models._config_bases`. Each family's
module (:mod:`nnx_shard.models._family`) declares its config class with only its
fields and registers it; :meth:`DecoderConfig.for_model`
and :meth:`DecoderConfig.from_hf` build it. :meth:`DecoderConfig.to_hf` writes a
transformers ``config.json``; one table (:data:`~nnx_shard.models._hf_config.FIELDS`)
maps the fields to it and says how each is checked.

>>> cfg = DecoderConfig.for_model("qwen3", sliding_window=8)
>>> type(cfg).__name__, cfg.family.qk_norm, cfg.sliding_window
('Qwen3Config', 'head', 8)
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax.numpy as jnp

from nnx_shard._errors import UsageError, count, short
from nnx_shard.models._families import Family, family_of, model_types
from nnx_shard.models._fields import check_fields, check_kernel_and_remat
from nnx_shard.models._grouped import check_kind
from nnx_shard.models._hf_config import ACTIVATIONS, FIELDS, hf_config, hf_fields, read_json
from nnx_shard.models._hf_config import differences as differences
from nnx_shard.models._rope import ROPE_TYPES as ROPE_TYPES
from nnx_shard.models._rope import check_tables, checked

__all__ = ["BIG", "LLAMA31_ROPE", "DecoderConfig", "differences"]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes and options of :class:`Decoder` that every family has (frozen: derive
    variants with ``dataclasses.replace``). Field names follow
    :class:`~nnx_shard.models.ReferenceConfig`; the Hugging Face names are in
    :meth:`from_hf`. A family's own fields (biases, sliding window, soft-caps,
    experts, ...) are on its config class, a subclass declared in its module:
    :meth:`for_model` builds it (``DecoderConfig.for_model("mistral",
    sliding_window=4096)``), as :meth:`from_hf` does; ``DecoderConfig(...)`` itself is
    a model of the default family, ``llama``, without its optional biases.

    Attributes:
      vocab: vocabulary size (``vocab_size``).
      embed: width of the residual stream (``hidden_size``).
      heads: query heads (``num_attention_heads``).
      kv_heads: key/value heads (``num_key_value_heads``); must divide ``heads``.
      head_dim: width of each head (``head_dim``, else ``hidden_size / heads``).
      mlp: hidden width of the SwiGLU MLP (``intermediate_size``).
      layers: number of blocks (``num_hidden_layers``).
      rope_theta: base of the rotary frequencies.
      rope_scaling: ``None``, or the rotary frequency scaling as sorted
        ``(key, value)`` pairs (a dict is accepted, checked and converted; lists
        become tuples), of a type in :data:`ROPE_TYPES` (``linear``, ``dynamic``,
        ``yarn``, ``longrope``, ``llama3``; computed in
        :mod:`nnx_shard.models._rope` as transformers computes them), e.g.
        ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}`` or
        Qwen2.5's ``{"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 32768}``.
      norm_eps: epsilon of every RMSNorm (``rms_norm_eps``).
      tie_embeddings: reuse the token embedding as the output projection
        (``tie_word_embeddings``).
      activation: the gated MLP's activation, one of :data:`ACTIVATIONS`
        (``hidden_act``: ``"silu"``, or Gemma's ``"gelu_pytorch_tanh"``).
      max_length: ``max_position_embeddings`` (written back to ``config.json``;
        the rotation itself works at any length; ``dynamic`` scaling grows its
        base past it, and ``longrope`` / ``yarn`` without a ``factor`` take it
        over ``original_max_position_embeddings`` as theirs).
      model_type: one of the registered families (``"llama"``, ``"qwen3"``,
        ``"qwen2"``, ``"mistral"``, ``"gemma"``, ``"gemma2"``, ``"gemma3_text"``,
        ``"olmo2"``, ``"phi3"``, ``"mixtral"``, ``"qwen3_moe"``): the family
        (:mod:`nnx_shard.models._families`): its config class, the ``config.json``
        that :meth:`to_hf` writes and the checkpoint's tensor names, and what its
        decoder is made of (its block, q/k norm, biases, norm and embedding scale).
      scan_layers, remat, attention, dtype, param_dtype: as in
        :class:`~nnx_shard.models.ReferenceConfig` (``scan_layers=True``
        stacks the blocks on a leading ``layers`` axis: the pp presets need it;
        ``attention`` is the per-device kernel, ``"auto"`` by default: cuDNN's
        fused kernel on GPUs where it applies, else blockwise; ``"dense"`` keeps
        the float32 ``[batch, heads, seq, seq]`` probabilities). Grouped-query
        attention never repeats K/V, in any kernel.

    >>> from nnx_shard.models import DecoderConfig
    >>> cfg = DecoderConfig(vocab=64, embed=16, heads=4, kv_heads=2, head_dim=4, mlp=32, layers=1)
    >>> cfg.num_params
    4400
    >>> DecoderConfig(heads=4, kv_heads=3)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: DecoderConfig: kv_heads=3 must divide heads=4 (grouped-query attention shares each key/value head among heads / kv_heads query heads). Fix: e.g. kv_heads=2.
    """

    vocab: int = 128
    embed: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    mlp: int = 64
    layers: int = 2
    rope_theta: float = 10000.0
    rope_scaling: Any = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    activation: str = "silu"
    max_length: int = 2048
    model_type: str = "llama"
    scan_layers: bool = False
    remat: str = "none"
    attention: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    #: ``config.json``'s values for absent keys where the family's differ from the
    #: table's (:data:`~nnx_shard.models._hf_config.FIELDS`): Gemma's tied embeddings, ...
    hf_defaults: ClassVar[Mapping[str, Any]] = {}
    #: The ``config.json`` keys the family writes where they differ from the table's.
    hf_keys: ClassVar[Mapping[str, str]] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Only a check: a keyword the class lacks would be the generated __init__'s bare
        # TypeError; this names the families whose config has it. Builds ``cls`` itself.
        _check_names(cls, kwargs, kwargs.get("model_type", cls.model_type))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _check_by_table(self)
        if self.heads % self.kv_heads:
            fit = next(d for d in range(min(self.kv_heads, self.heads), 0, -1)
                       if self.heads % d == 0)
            raise UsageError(
                f"DecoderConfig: kv_heads={self.kv_heads} must divide heads={self.heads} "
                "(grouped-query attention shares each key/value head among heads / kv_heads "
                f"query heads). Fix: e.g. kv_heads={fit}."
            )
        if self.head_dim % 2:
            raise UsageError(f"DecoderConfig.head_dim={self.head_dim} must be even (the rotary "
                             "embedding rotates pairs of features). Fix: e.g. "
                             f"head_dim={self.head_dim + 1}.")
        check_kernel_and_remat(self, "DecoderConfig")
        if self.model_type not in model_types():
            raise UsageError(f"DecoderConfig.model_type={short(self.model_type, 40)}; valid: "
                             f"{', '.join(model_types())}. Fix: e.g. model_type='llama'.")
        _check_class(self)
        self._check_own()
        # Hashable (the config is static metadata of the module's graph).
        object.__setattr__(self, "rope_scaling", _scaling(self.rope_scaling, self.head_dim))
        # Fields that each pass can still give non-finite rotary tables together.
        check_tables(self)

    def _check_own(self) -> None:
        """The checks across fields of a family's own (none here: a base extends it)."""

    @property
    def num_params(self) -> int:
        """Parameter count, computed from the sizes (tied embeddings counted once).

        >>> from nnx_shard.models import get_config
        >>> round(get_config("llama3-8b").num_params / 1e9, 2)
        8.03
        """
        e, h, g, d, m = self.embed, self.heads, self.kv_heads, self.head_dim, self.mlp
        family = self.family
        attn = 2 * e * h * d + 2 * e * g * d + (h * d + 2 * g * d if family.qkv_bias else 0)
        attn += {None: 0, "head": 2 * d, "all": h * d + g * d}[family.qk_norm]
        block = attn + 3 * e * m + family.block.norms * e
        unembed = 0 if self.tie_embeddings else e * self.vocab
        return self.vocab * e + self.layers * block + e + unembed

    @property
    def active_params(self) -> int:
        """Parameters each token computes with: :attr:`num_params` for a dense model (a
        mixture of experts leaves out the experts a token is not routed to).

        >>> from nnx_shard.models import get_config
        >>> get_config("qwen3-30b-a3b").active_params    # the published 3.3B
        3353032704
        """
        return self.num_params

    @property
    def family(self) -> Family:
        """The registered family of :attr:`model_type`
        (:func:`~nnx_shard.models._families.family_of`): what the decoder is built of.

        >>> from nnx_shard.models import get_config
        >>> get_config("qwen3-tiny").family.qk_norm
        'head'
        """
        return family_of(self.model_type)

    def moe_layers(self) -> tuple[bool, ...]:
        """Which layers have the sparse MoE MLP: none (:class:`MoEConfig` has experts).

        >>> from nnx_shard.models import DecoderConfig
        >>> DecoderConfig(layers=2).moe_layers()
        (False, False)
        >>> DecoderConfig.for_model("qwen3_moe", layers=3, experts=4, mlp_only_layers=(1,)).moe_layers()
        (True, False, True)
        """
        return (False,) * self.layers

    def local_layers(self) -> tuple[bool, ...]:
        """Which layers use a sliding window: none (:class:`WindowConfig` has one).

        >>> from nnx_shard.models import DecoderConfig
        >>> DecoderConfig.for_model("gemma2", layers=3, sliding_window=4,
        ...                         window_layers=(True, False, True)).local_layers()
        (True, False, True)
        """
        return (False,) * self.layers

    def local_theta(self) -> float | None:
        """The rotary base of the sliding layers where it is their own (Gemma 3's
        ``rope_local_theta``); ``None``: every layer rotates by ``rope_theta``."""
        return None

    @classmethod
    def for_model(cls, model_type: str, **fields: Any) -> Any:
        """The config of family ``model_type`` (its registered class, e.g.
        ``MistralConfig`` for ``"mistral"``; :class:`~nnx_shard.models.ReferenceConfig`
        for ``"reference"``) with ``fields``, as transformers' ``AutoConfig.for_model``.

        Raises:
          UsageError: an unknown ``model_type``; a field the family does not have,
            naming the families that have it.

        >>> from nnx_shard.models import DecoderConfig
        >>> cfg = DecoderConfig.for_model("mixtral", experts=4, top_k=2)
        >>> type(cfg).__name__, cfg.moe_layers()
        ('MixtralConfig', (True, True))
        >>> DecoderConfig.for_model("llama", sliding_window=4)
        Traceback (most recent call last):
        ...
        nnx_shard._errors.UsageError: LlamaConfig: sliding_window=4 is not part of model_type='llama' (its checkpoints have no such thing; gemma2, gemma3_text, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe have it). Fix: DecoderConfig.for_model('gemma2', ...), or leave sliding_window out.
        """
        config = family_of(model_type).config or DecoderConfig
        if "model_type" in {f.name for f in dataclasses.fields(config)}:
            fields = {**fields, "model_type": model_type}
        return config(**fields)  # a field the class lacks: refused by its __new__

    def with_family(self, model_type: str, **changes: Any) -> Any:
        """This configuration's shared fields (:class:`DecoderConfig`'s: sizes, rotary
        settings, layout) as a config of family ``model_type``, with ``changes``
        (:meth:`for_model`'s fields); what ``dataclasses.replace`` cannot do across
        families' config classes.

        >>> from nnx_shard.models import get_config
        >>> cfg = get_config("llama-tiny").with_family("gemma2", final_softcap=30.0)
        >>> type(cfg).__name__, cfg.embed, cfg.final_softcap
        ('Gemma2Config', 32, 30.0)
        """
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(DecoderConfig)
                  if f.name != "model_type"}
        return DecoderConfig.for_model(model_type, **(shared | changes))

    @classmethod
    def from_hf(cls, config: str | os.PathLike[str] | Mapping[str, Any],
                **overrides: Any) -> Any:
        """The configuration of a transformers ``config.json`` (a dict, the file,
        or the directory holding it) of a registered family's model type
        (``llama``, ``qwen3``, ``qwen2``, ``mistral``, ``gemma``, ``gemma2``,
        ``gemma3_text``, ``olmo2``, ``phi3``, ``mixtral``, ``qwen3_moe``:
        :func:`~nnx_shard.models._families.family_of`
        finds it, and it fixes the family's options); ``overrides`` replace fields (e.g. ``scan_layers=True``,
        ``param_dtype=jnp.bfloat16``). Parameters stay float32 unless overridden,
        whatever ``torch_dtype`` the file names: master weights for training.

        Reads ``rope_theta`` and ``rope_scaling`` as transformers 5 does:
        ``rope_scaling`` when set, else ``rope_parameters``, with ``rope_theta``
        inside it, else beside it, else 10000; ``rope_scaling`` of the types in
        :data:`ROPE_TYPES` (``linear``, ``dynamic``, ``yarn``, ``longrope``,
        ``llama3``) is implemented, any other type is an error, as are partial
        rotation and activations the model lacks. Sliding windows are read as each
        family's transformers config reads them (Mistral's and Phi-3's in every layer,
        Qwen2/3's with ``use_sliding_window``, Gemma 2 / 3's ``layer_types``); a window
        in some layers only is refused for the families whose model has one in all.
        ``original_max_position_embeddings``
        defaults to ``max_position_embeddings`` for ``yarn``, ``longrope`` and
        ``llama3``; Phi-3's own top-level ``original_max_position_embeddings`` (4096
        when absent) overrides it, and its legacy ``yarn`` / ``su`` mean ``longrope``,
        as in transformers. Values are checked as
        transformers' config checks them: sizes are whole numbers >= 1 (never a bool
        or a float), ``num_key_value_heads`` divides ``num_attention_heads``, numbers
        are finite, flags are JSON ``true`` / ``false``, a scaling's ``factor`` is >= 1,
        llama3's ``high_freq_factor`` above its ``low_freq_factor``, longrope's
        ``short_factor`` / ``long_factor`` one number per rotary frequency. Each problem is a
        :class:`~nnx_shard._errors.UsageError` naming the file (or ``config.json``
        for a dict), the field, what was found and the fix.

        >>> from nnx_shard.models import DecoderConfig
        >>> hf = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16,
        ...       "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...       "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
        ...       "rope_theta": 1e6, "tie_word_embeddings": True}
        >>> cfg = DecoderConfig.from_hf(hf, scan_layers=True)
        >>> cfg.head_dim, cfg.family.qk_norm, cfg.tie_embeddings, cfg.scan_layers
        (8, 'head', True, True)
        >>> DecoderConfig.from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
        ...     "original_max_position_embeddings": 32768}}).rope_scaling
        (('factor', 4.0), ('original_max_position_embeddings', 32768), ('rope_type', 'yarn'))
        >>> DecoderConfig.from_hf({**hf, "rope_scaling": {"rope_type": "ntk", "factor": 4.0}})
        Traceback (most recent call last):
        ...
        nnx_shard._errors.UsageError: config.json: rope_scaling of type 'ntk' is not implemented (implemented: 'default', 'linear', 'dynamic', 'yarn', 'longrope', 'llama3'). ...
        >>> DecoderConfig.from_hf({**hf, "num_key_value_heads": 0})
        Traceback (most recent call last):
        ...
        nnx_shard._errors.UsageError: config.json: num_key_value_heads must be a positive int, got 0. Fix: ...
        """
        hf, where = read_json(config)
        config_class, fields = hf_fields(hf, where, DecoderConfig)
        try:
            return config_class(**(fields | overrides))
        except UsageError as e:  # sizes that do not fit together, e.g. kv_heads and heads
            problem = str(e).partition(" Fix: ")[0]
            raise UsageError(f"{where}: {problem} Fix: use the config.json the checkpoint was "
                             "saved with" + (", and check the overrides" if overrides else "")
                             + ".") from None

    def to_hf(self) -> dict[str, Any]:
        """The transformers ``config.json`` of this configuration (what
        :func:`nnx_shard.hf.save_safetensors` writes next to the weights).

        >>> from nnx_shard.models import get_config
        >>> get_config("qwen3-0.6b").to_hf()["architectures"]
        ['Qwen3ForCausalLM']
        """
        return hf_config(self)


def _check_names(cls: type, fields: Mapping[str, Any], model_type: Any) -> None:
    """Refuses a key of ``fields`` that is not a field of the config class ``cls``."""
    names = {f.name for f in dataclasses.fields(cls)}
    for name, value in fields.items():
        if name not in names:
            raise UsageError(_not_a_field(cls, name, value, model_type))


def _not_a_field(cls: type, name: str, value: Any, model_type: Any) -> str:
    """The error for a field ``name`` (given ``value``) that the config class ``cls`` (of
    ``model_type``) does not have, naming the families whose classes have it."""
    has = [t for t in model_types() if name in {f.name for f in dataclasses.fields(
        family_of(t).config or DecoderConfig)}]
    if has:
        return (f"{cls.__name__}: {name}={short(value, 40)} is not part of model_type="
                f"{model_type!r} (its checkpoints have no such thing; {', '.join(has)} have "
                f"it). Fix: DecoderConfig.for_model({has[0]!r}, ...), or leave {name} out.")
    fields = ", ".join(f.name for f in dataclasses.fields(cls))
    return (f"{cls.__name__} has no field {name!r} (fields: {fields}). Fix: one of those, "
            "spelled as listed.")


def _check_class(cfg: DecoderConfig) -> None:
    """Refuses a config class that is not the one its family registers (a plain
    :class:`DecoderConfig` is one of the default family, without its biases)."""
    want = cfg.family.config or DecoderConfig
    plain = type(cfg) is DecoderConfig and cfg.model_type == DecoderConfig.model_type
    if type(cfg) is not want and not plain:
        raise UsageError(f"{type(cfg).__name__}: model_type={cfg.model_type!r} is configured "
                         f"by {want.__name__}. Fix: DecoderConfig.for_model("
                         f"{cfg.model_type!r}, ...), which builds it (or, from another "
                         f"config, cfg.with_family({cfg.model_type!r}, ...)).")


def _field_owner(cfg: DecoderConfig, name: str) -> str:
    """How messages name a field: ``DecoderConfig.<name>`` for a shared field, else
    the config class's."""
    return "DecoderConfig" if name in _SHARED else type(cfg).__name__


def _check_by_table(cfg: DecoderConfig) -> None:
    """Each field of ``cfg`` checked as its kind in the field table says
    (:data:`~nnx_shard.models._hf_config.FIELDS`)."""
    kinds: dict[str, list[str]] = {}
    for f in dataclasses.fields(cfg):
        if f.name in FIELDS:  # a subclass's own extra fields are its own to check
            kinds.setdefault(FIELDS[f.name].kind, []).append(f.name)
    for where in dict.fromkeys(("DecoderConfig", type(cfg).__name__)):
        mine = {k: tuple(n for n in names if _field_owner(cfg, n) == where)
                for k, names in kinds.items()}
        check_fields(cfg, mine.get("count", ()), positive=mine.get("real", ()),
                     finite=mine.get("finite", ()), flags=mine.get("flag", ()), where=where)
    for kind, names in kinds.items():
        for name in names:
            check = _CHECKS.get(kind)
            if check is not None:
                check(cfg, name, _field_owner(cfg, name))


def _activation(cfg: Any, name: str, where: str) -> None:
    if cfg.activation not in ACTIVATIONS:
        raise UsageError(f"{where}.activation={cfg.activation!r}; valid: "
                         f"{', '.join(ACTIVATIONS)}. Fix: e.g. activation='silu'.")


def _window(cfg: Any, name: str, where: str) -> None:
    if cfg.sliding_window is not None:
        count(cfg.sliding_window, f"{where}.sliding_window",
              fix="None (full attention) or the window in tokens, e.g. 4096")


def _optional_count(cfg: Any, name: str, where: str) -> None:
    if getattr(cfg, name) is not None:
        count(getattr(cfg, name), f"{where}.{name}", fix=f"None or a width, e.g. {name}=768")


def _experts(cfg: Any, name: str, where: str) -> None:
    experts = cfg.experts
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        # 0 experts would be written as a dense model of a mixture-of-experts type, which
        # transformers reads without experts and no checkpoint of the family matches.
        key = type(cfg).hf_keys.get("experts", FIELDS["experts"].hf[0])
        raise UsageError(f"{where}.experts={short(experts, 40)}: model_type="
                         f"{cfg.model_type!r} is a mixture-of-experts family: its models have "
                         f"experts (config.json's {key} >= 1). Fix: e.g. experts=8, "
                         "top_k=2, or the model_type of a dense family.")


def _matmul(cfg: Any, name: str, where: str) -> None:
    check_kind(cfg.expert_matmul, f"{where}.")


def _layer_list(cfg: Any, name: str, where: str) -> None:
    only = getattr(cfg, name)
    if not isinstance(only, list | tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.layers
            for i in only):
        raise UsageError(f"{where}.{name}={short(only, 60)} must list layer indices below "
                         f"layers={cfg.layers}. Fix: e.g. {name}=() .")
    object.__setattr__(cfg, name, tuple(only))


def _layer_flags(cfg: Any, name: str, where: str) -> None:
    """``window_layers`` as a tuple of bools (hashable), checked against the layers;
    ``None`` when every layer slides."""
    value = getattr(cfg, name)
    if value is None:
        return
    flags = tuple(value) if isinstance(value, list | tuple) else None
    if flags is None or len(flags) != cfg.layers or not all(isinstance(f, bool) for f in flags):
        raise UsageError(f"{where}.{name}={short(value, 60)} must be None or one "
                         f"True/False per layer ({cfg.layers}). Fix: e.g. {name}="
                         "(True, False) * (layers // 2) for Gemma 2's alternation.")
    if cfg.sliding_window is None:
        raise UsageError(f"{where}.{name} is set but sliding_window is None: no "
                         "window to apply. Fix: set sliding_window=4096 (say), or "
                         f"{name}=None.")
    object.__setattr__(cfg, name, None if all(flags) else flags)


def _optional_real(cfg: Any, name: str, where: str) -> None:
    value = getattr(cfg, name)
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        example = {"attn_softcap": "50.0 (Gemma 2's attention soft-cap)",
                   "final_softcap": "30.0 (Gemma 2's logit soft-cap)",
                   "query_scale": "256.0 (Gemma 2's query_pre_attn_scalar)",
                   "rope_local_theta": "10000.0 (Gemma 3's local rotary base)"}[name]
        raise UsageError(f"{where}.{name}={short(value, 60)} must be None or a finite "
                         f"number > 0 ({type(value).__name__} given). Fix: e.g. {name}="
                         f"{example}, or None to leave it out.")
    object.__setattr__(cfg, name, float(value))


#: The checks of the kinds of field :func:`check_fields` does not cover (the table's
#: ``kind``); ``model_type``, ``rope_scaling``, kernels, remat and dtypes are checked by
#: :class:`DecoderConfig` itself.
_CHECKS: dict[str, Callable[[Any, str, str], None]] = {
    "activation": _activation, "window": _window, "optional_real": _optional_real,
    "optional_count": _optional_count, "experts": _experts, "expert_matmul": _matmul,
    "layers": _layer_list, "layer_flags": _layer_flags,
}
#: The fields every family has.
_SHARED = frozenset(f.name for f in dataclasses.fields(DecoderConfig))


def _scaling(value: Any, head_dim: int) -> tuple[tuple[str, Any], ...] | None:
    if not value:
        return None
    if not isinstance(value, Mapping | tuple | list):
        raise UsageError(f"DecoderConfig.rope_scaling must be None or a dict, got "
                         f"{short(value, 60)} ({type(value).__name__}). Fix: e.g. "
                         f"rope_scaling={LLAMA31_ROPE}")
    try:
        items = dict(value)
    except (TypeError, ValueError):
        raise UsageError(f"DecoderConfig.rope_scaling must be None or a dict, got "
                         f"{short(value, 60)}. Fix: e.g. rope_scaling={LLAMA31_ROPE}") from None
    out = checked(items, "DecoderConfig", "rope_scaling", head_dim)
    return None if out is None else tuple(sorted(out.items()))


#: Llama 3.1's rotary scaling (``rope_scaling`` of its ``config.json``).
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
#: The layout of the published shapes, for planning: stacked layers, bfloat16.
BIG: dict[str, Any] = dict(scan_layers=True, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
