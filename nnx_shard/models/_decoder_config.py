"""The configuration of :class:`~nnx_shard.models.Decoder`: :class:`DecoderConfig`
(sizes, and the fields its family has; :meth:`DecoderConfig.from_hf` reads a
transformers ``config.json``, :meth:`DecoderConfig.to_hf` writes one). Each family's
module (:mod:`nnx_shard.models._family`) holds its named configurations (read them
with :func:`nnx_shard.models.get_config`).

>>> DecoderConfig(model_type="qwen3").family.qk_norm
'head'
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from nnx_shard._errors import NnxShardError, UsageError, count, short
from nnx_shard.models._families import OPTIONAL_FIELDS, Family, family_of, model_types
from nnx_shard.models._fields import check_fields, check_kernel_and_remat
from nnx_shard.models._grouped import check_kind
from nnx_shard.models._hf_config import ACTIVATIONS, hf_config, hf_fields, read_json
from nnx_shard.models._rope import ROPE_TYPES as ROPE_TYPES
from nnx_shard.models._rope import check_tables, checked

__all__ = ["BIG", "LLAMA31_ROPE", "DecoderConfig"]


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Sizes and options of :class:`Decoder` (frozen: derive variants with
    ``dataclasses.replace``). Field names follow
    :class:`~nnx_shard.models.ReferenceConfig`; the Hugging Face names are
    in :meth:`from_hf`.

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
      attention_bias: biases on the q, k, v and o projections (the families whose
        ``config.json`` has ``attention_bias``).
      activation: the gated MLP's activation, one of :data:`ACTIVATIONS`
        (``hidden_act``: ``"silu"``, or Gemma's ``"gelu_pytorch_tanh"``).
      sliding_window: ``None``, or the keys each query sees: itself and the
        ``sliding_window - 1`` before it (Mistral's ``sliding_window``, Qwen2's
        with ``use_sliding_window``), in every layer, or in the layers
        ``window_layers`` marks.
      window_layers: ``None`` (the window, if any, in every layer), or one flag per
        layer: which layers slide (Gemma 2 / 3's ``layer_types``; the others attend
        to every earlier key).
      rope_local_theta: ``None``, or the rotary base of the sliding layers (Gemma 3's
        ``rope_local_base_freq``; the others use ``rope_theta``).
      query_scale: ``None``, or the attention scores' divisor's square
        (``query_pre_attn_scalar``: scores are ``q.k / sqrt(query_scale)``, not
        ``/ sqrt(head_dim)``).
      attn_softcap: ``None``, or the attention logit soft-cap (Gemma 2's
        ``attn_logit_softcapping``): scores become ``cap * tanh(scores / cap)``.
      final_softcap: ``None``, or the output logits' soft-cap
        (``final_logit_softcapping``).
      mlp_bias: biases on the gate, up and down projections (Llama's ``mlp_bias``).
      max_length: ``max_position_embeddings`` (written back to ``config.json``;
        the rotation itself works at any length; ``dynamic`` scaling grows its
        base past it, and ``longrope`` / ``yarn`` without a ``factor`` take it
        over ``original_max_position_embeddings`` as theirs).
      model_type: one of the registered families (``"llama"``, ``"qwen3"``,
        ``"qwen2"``, ``"mistral"``, ``"gemma"``, ``"gemma2"``, ``"gemma3_text"``,
        ``"olmo2"``, ``"phi3"``, ``"mixtral"``, ``"qwen3_moe"``): the family (:mod:`nnx_shard.models._families`):
        the ``config.json`` that :meth:`to_hf` writes and the checkpoint's tensor
        names, and what its decoder is made of (its block, q/k norm, biases, norm
        and embedding scale). A field the family does not have (Gemma 2's soft-caps on
        a llama config, experts on a dense family) is refused, naming the families that have it.
      experts: ``0`` (a dense model), or the experts of each MoE layer (Mixtral's
        ``num_local_experts``, Qwen3-MoE's ``num_experts``): those layers' MLP is
        the sparse :class:`~nnx_shard.models._moe.DecoderMoE`.
      top_k: experts each token is routed to (``num_experts_per_tok``).
      moe_mlp: ``None`` (``mlp``), or each expert's hidden width (Qwen3-MoE's
        ``moe_intermediate_size``; ``mlp`` stays the dense layers' width).
      norm_topk_prob: renormalise the top-k routing weights to sum to 1 (Mixtral
        always; Qwen3-MoE's ``norm_topk_prob``).
      sparse_step, mlp_only_layers: Qwen3-MoE's ``decoder_sparse_step`` and
        ``mlp_only_layers``: layer ``i`` is a MoE layer unless listed, where ``(i + 1)``
        is a multiple of ``sparse_step`` (:meth:`moe_layers`).
      router_aux_loss_coef, output_router_logits: transformers' names: the
        load-balancing loss's weight, added to the training loss only with
        ``output_router_logits`` (:attr:`aux_loss_weight`).
      expert_matmul: how the experts' grouped matmuls run
        (:mod:`nnx_shard.models._grouped`): ``"tiles"`` (a loop over tiles of the
        tokens sorted by expert: the active experts' FLOPs on every backend),
        ``"ragged_dot"`` (``jax.lax.ragged_dot``: a grouped kernel on TPU, every
        expert for every token on XLA's CPU and GPU backends), or ``"auto"`` (the
        default: ``ragged_dot`` on TPU, ``tiles`` elsewhere). Not in ``config.json``.
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
    attention_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    sliding_window: int | None = None
    window_layers: Any = None
    rope_local_theta: float | None = None
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    max_length: int = 2048
    model_type: str = "llama"
    experts: int = 0
    top_k: int = 2
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    expert_matmul: str = "auto"
    scan_layers: bool = False
    remat: str = "none"
    attention: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __new__(cls, *args: Any, **kwargs: Any) -> DecoderConfig:
        # DecoderConfig(model_type=...) builds the config class the family registers (a
        # family with fields of its own declares them on a subclass), so that every
        # caller, from_hf and dataclasses.replace included, gets that family's fields.
        if cls is DecoderConfig and not args:
            try:
                cls = family_of(kwargs.get("model_type", "llama")).config or cls
            except UsageError:
                pass  # __post_init__ names the valid model types
        names = {f.name for f in dataclasses.fields(cls)}
        for name in kwargs:
            if name not in names:
                raise UsageError(_not_a_field(cls, name, kwargs.get("model_type", cls.model_type)))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        check_fields(self, ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers",
                            "max_length"), positive=("rope_theta", "norm_eps"),
                     flags=("tie_embeddings", "attention_bias", "mlp_bias", "scan_layers"))
        for name in ("rope_local_theta", "query_scale", "attn_softcap", "final_softcap"):
            _optional_real(self, name)
        if self.activation not in ACTIVATIONS:
            raise UsageError(f"DecoderConfig.activation={self.activation!r}; valid: "
                             f"{', '.join(ACTIVATIONS)}. Fix: e.g. activation='silu'.")
        if self.sliding_window is not None:
            count(self.sliding_window, "DecoderConfig.sliding_window",
                  fix="None (full attention) or the window in tokens, e.g. 4096")
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
        check_kernel_and_remat(self)
        if self.model_type not in model_types():
            raise UsageError(f"DecoderConfig.model_type={short(self.model_type, 40)}; valid: "
                             f"{', '.join(model_types())}. Fix: e.g. model_type='llama'.")
        _check_class(self)
        _check_experts(self)
        _check_family(self)
        # Hashable (the config is static metadata of the module's graph).
        object.__setattr__(self, "rope_scaling", _scaling(self.rope_scaling, self.head_dim))
        # Fields that each pass can still give non-finite rotary tables together.
        check_tables(self)
        object.__setattr__(self, "window_layers", _window_layers(self))

    @property
    def num_params(self) -> int:
        """Parameter count, computed from the sizes (tied embeddings counted once).

        >>> from nnx_shard.models import get_config
        >>> round(get_config("llama3-8b").num_params / 1e9, 2)
        8.03
        """
        e, h, g, d, m = self.embed, self.heads, self.kv_heads, self.head_dim, self.mlp
        family = self.family
        attn = 2 * e * h * d + 2 * e * g * d
        if self.attention_bias or family.qkv_bias:
            attn += h * d + 2 * g * d
        if self.attention_bias:
            attn += e
        attn += {None: 0, "head": 2 * d, "all": h * d + g * d}[family.qk_norm]
        ffn = 3 * e * m + ((2 * m + e) if self.mlp_bias else 0)
        block = attn + ffn + family.block.norms * e
        unembed = 0 if self.tie_embeddings else e * self.vocab
        sparse = sum(self.moe_layers())
        moe = e * self.experts + 3 * e * self.expert_mlp * self.experts - ffn
        return self.vocab * e + self.layers * block + sparse * moe + e + unembed

    @property
    def family(self) -> Family:
        """The registered family of :attr:`model_type`
        (:func:`~nnx_shard.models._families.family_of`): what the decoder is built of.

        >>> from nnx_shard.models import get_config
        >>> get_config("qwen3-tiny").family.qk_norm
        'head'
        """
        return family_of(self.model_type)

    @property
    def active_params(self) -> int:
        """Parameters each token computes with: :attr:`num_params` less the experts it
        is not routed to (``experts - top_k`` per MoE layer); ``num_params`` for a dense
        model.

        >>> from nnx_shard.models import get_config
        >>> get_config("qwen3-30b-a3b").active_params    # the published 3.3B
        3353032704
        """
        idle = 3 * self.embed * self.expert_mlp * max(self.experts - self.top_k, 0)
        return self.num_params - sum(self.moe_layers()) * idle

    @property
    def expert_mlp(self) -> int:
        """Each expert's hidden width: ``mlp`` (a family whose experts have a width of
        their own, Qwen3-MoE's ``moe_mlp``, says so in its config class)."""
        return self.mlp

    @property
    def norm_topk_prob(self) -> bool:
        """Whether the router renormalises the top-k weights to sum to 1 (Mixtral does;
        Qwen3-MoE's config class makes it a field, ``norm_topk_prob``)."""
        return True

    @property
    def aux_loss_weight(self) -> float:
        """The load-balancing loss's weight in :func:`nnx_shard.models.lm_loss`:
        ``router_aux_loss_coef`` with ``output_router_logits``, else 0 (as transformers)."""
        return self.router_aux_loss_coef if self.output_router_logits else 0.0

    def moe_layers(self) -> tuple[bool, ...]:
        """Which layers have the sparse MoE MLP: every one with experts, none without
        (Qwen3-MoE's config class keeps some dense).

        >>> from nnx_shard.models import DecoderConfig
        >>> DecoderConfig(layers=3, experts=4, model_type="mixtral").moe_layers()
        (True, True, True)
        >>> DecoderConfig(layers=3, experts=4, mlp_only_layers=(1,), model_type="qwen3_moe").moe_layers()
        (True, False, True)
        """
        return (bool(self.experts),) * self.layers

    @classmethod
    def from_hf(cls, config: str | os.PathLike[str] | Mapping[str, Any],
                **overrides: Any) -> DecoderConfig:
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
        fields = hf_fields(hf, where)
        try:
            return cls(**(fields | overrides))
        except UsageError as e:  # sizes that do not fit together, e.g. kv_heads and heads
            problem = str(e).partition(" Fix: ")[0]
            raise UsageError(f"{where}: {problem} Fix: use the config.json the checkpoint was "
                             "saved with" + (", and check the overrides" if overrides else "")
                             + ".") from None

    def local_layers(self) -> tuple[bool, ...]:
        """Which layers use the sliding window (every one with ``window_layers=None``
        and a window; none without a window).

        >>> from nnx_shard.models import DecoderConfig
        >>> DecoderConfig(layers=3, sliding_window=4, window_layers=(True, False, True),
        ...             model_type="gemma2").local_layers()
        (True, False, True)
        """
        if self.sliding_window is None:
            return (False,) * self.layers
        return self.window_layers or (True,) * self.layers

    def to_hf(self) -> dict[str, Any]:
        """The transformers ``config.json`` of this configuration (what
        :func:`nnx_shard.hf.save_safetensors` writes next to the weights).

        >>> from nnx_shard.models import get_config
        >>> get_config("qwen3-0.6b").to_hf()["architectures"]
        ['Qwen3ForCausalLM']
        """
        return hf_config(self)


def _check_family(cfg: DecoderConfig) -> None:
    """Refuses a field the family of ``cfg.model_type`` does not have (its value other
    than the one meaning "not there"), naming the families that have it."""
    family = cfg.family
    for name, absent in OPTIONAL_FIELDS.items():
        if name in family.fields or getattr(cfg, name) == absent:
            continue
        has = [t for t in model_types() if name in family_of(t).fields]
        raise UsageError(f"DecoderConfig: {name}={short(getattr(cfg, name), 40)} is not part of "
                         f"model_type={cfg.model_type!r} (its checkpoints have no such thing; "
                         f"{', '.join(has)} have it). Fix: model_type={has[0]!r}, or leave "
                         f"{name} out ({name}={absent!r}).")


def _not_a_field(cls: type, name: str, model_type: Any) -> str:
    """The error for a keyword that is not a field of the config class ``cls``."""
    has = [t for t in model_types() if (c := family_of(t).config) is not None
           and name in {f.name for f in dataclasses.fields(c)}]
    if has:
        owner = family_of(has[0]).config.__name__
        return (f"{cls.__name__}: {name} is not part of model_type={model_type!r} (its "
                f"checkpoints have no such thing; {owner}, model_type "
                f"{', '.join(map(repr, has))}, has it). Fix: model_type={has[0]!r}, or leave "
                f"{name} out.")
    fields = ", ".join(f.name for f in dataclasses.fields(cls))
    return (f"{cls.__name__} has no field {name!r} (fields: {fields}). Fix: one of those, "
            "spelled as listed.")


def _check_class(cfg: DecoderConfig) -> None:
    """Refuses a config class that is not the one its family registers (a subclass
    carrying another family's fields)."""
    want = cfg.family.config or DecoderConfig
    if type(cfg) is not want:
        raise UsageError(f"{type(cfg).__name__}: model_type={cfg.model_type!r} is configured "
                         f"by {want.__name__}. Fix: {want.__name__}(...), or "
                         f"DecoderConfig(model_type={cfg.model_type!r}, ...), which builds it.")


def _check_experts(cfg: DecoderConfig) -> None:
    """Checks the mixture-of-experts fields every MoE family has."""
    check_fields(cfg, ("top_k",), flags=("output_router_logits",))
    if not isinstance(cfg.experts, int) or isinstance(cfg.experts, bool) or cfg.experts < 0 \
            or (cfg.experts and cfg.top_k > cfg.experts):
        raise UsageError(f"DecoderConfig.experts={short(cfg.experts, 40)} must be 0 (dense) or a "
                         f"whole number >= top_k={cfg.top_k}. Fix: e.g. experts=8, top_k=2.")
    if cfg.family.moe and cfg.experts < 1:
        # 0 experts would be written as a dense model of a mixture-of-experts type, which
        # transformers reads without experts and no checkpoint of the family matches.
        key = next(k for k in cfg.family.moe if k in ("num_local_experts", "num_experts"))
        raise UsageError(f"{type(cfg).__name__}.experts={cfg.experts}: model_type="
                         f"{cfg.model_type!r} is a mixture-of-experts family: its models have "
                         f"experts (config.json's {key} >= 1). Fix: e.g. experts=8, "
                         "top_k=2, or the model_type of a dense family.")
    check_fields(cfg, (), finite=("router_aux_loss_coef",))
    check_kind(cfg.expert_matmul, "DecoderConfig.")
    object.__setattr__(cfg, "router_aux_loss_coef", float(cfg.router_aux_loss_coef))
    if cfg.scan_layers and len(set(cfg.moe_layers())) > 1:
        raise UsageError(f"{type(cfg).__name__}: scan_layers=True stacks alike blocks, but some "
                         "layers are MoE layers and some dense (moe_layers()). Fix: "
                         "scan_layers=False.")


def _optional_real(cfg: DecoderConfig, name: str) -> None:
    value = getattr(cfg, name)
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        example = {"attn_softcap": "50.0 (Gemma 2's attention soft-cap)",
                   "final_softcap": "30.0 (Gemma 2's logit soft-cap)",
                   "query_scale": "256.0 (Gemma 2's query_pre_attn_scalar)",
                   "rope_local_theta": "10000.0 (Gemma 3's local rotary base)"}[name]
        raise UsageError(f"DecoderConfig.{name}={short(value, 60)} must be None or a finite "
                         f"number > 0 ({type(value).__name__} given). Fix: e.g. {name}="
                         f"{example}, or None to leave it out.")
    object.__setattr__(cfg, name, float(value))


def _window_layers(cfg: DecoderConfig) -> tuple[bool, ...] | None:
    """``cfg.window_layers`` as a tuple of bools (hashable), checked against the layers."""
    value = cfg.window_layers
    if value is None:
        return None
    flags = tuple(value) if isinstance(value, list | tuple) else None
    if flags is None or len(flags) != cfg.layers or not all(isinstance(f, bool) for f in flags):
        raise UsageError(f"DecoderConfig.window_layers={short(value, 60)} must be None or one "
                         f"True/False per layer ({cfg.layers}). Fix: e.g. window_layers="
                         "(True, False) * (layers // 2) for Gemma 2's alternation.")
    if cfg.sliding_window is None:
        raise UsageError("DecoderConfig.window_layers is set but sliding_window is None: no "
                         "window to apply. Fix: set sliding_window=4096 (say), or "
                         "window_layers=None.")
    return None if all(flags) else flags


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


# The fields that decide what a checkpoint computes (not how it is run: layout,
# remat, kernel, dtypes, context length), with their config.json names.
_SHAPE_FIELDS = {
    "model_type": "model_type", "vocab": "vocab_size", "embed": "hidden_size",
    "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "mlp": "intermediate_size", "layers": "num_hidden_layers",
    "rope_theta": "rope_theta", "rope_scaling": "rope_scaling", "norm_eps": "rms_norm_eps",
    "activation": "hidden_act", "tie_embeddings": "tie_word_embeddings",
    "attention_bias": "attention_bias",
    "mlp_bias": "mlp_bias", "sliding_window": "sliding_window",
    "window_layers": "layer_types (which layers slide)",
    "rope_local_theta": "rope_local_base_freq",
    "query_scale": "query_pre_attn_scalar", "attn_softcap": "attn_logit_softcapping",
    "final_softcap": "final_logit_softcapping",
    "experts": "num_local_experts / num_experts", "top_k": "num_experts_per_tok",
    "moe_mlp": "moe_intermediate_size", "norm_topk_prob": "norm_topk_prob",
    "sparse_step": "decoder_sparse_step", "mlp_only_layers": "mlp_only_layers",
}
# What a config.json that does not parse as a model type here is compared on.
_RAW_KEYS = ("model_type", "hidden_act", "hidden_activation", "vocab_size", "hidden_size",
             "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "tie_word_embeddings", "sliding_window",
             "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")


def differences(config: str | os.PathLike[str] | Mapping[str, Any], cfg: DecoderConfig
                ) -> list[str]:
    """What the checkpoint ``config`` (a ``config.json``, its directory or the dict)
    describes differently from ``cfg``, one ``"field: checkpoint X, model Y"`` line
    per field that changes what the model computes (model type, activation, norm,
    sizes, biases, rotary and window settings); ``[]`` when they agree. Layout,
    remat, kernel, dtypes and the context length are not compared.

    >>> tiny = DecoderConfig(max_length=64)
    >>> differences(tiny.to_hf(), tiny)
    []
    >>> differences({**tiny.to_hf(), "model_type": "gemma", "hidden_act": "gelu"}, tiny)[:2]
    ["model_type: checkpoint 'gemma', model 'llama'", "hidden_act: checkpoint 'gelu_pytorch_tanh', model 'silu'"]
    >>> differences({**tiny.to_hf(), "model_type": "gpt2", "hidden_act": "gelu"}, tiny)
    ["model_type: checkpoint 'gpt2', model 'llama'", "hidden_act: checkpoint 'gelu', model 'silu'"]
    """
    hf, _ = read_json(config)
    try:
        theirs = DecoderConfig.from_hf(hf)
    except NnxShardError:
        theirs = None
    if theirs is not None:
        # A field of one family's config class is absent (None) from another's.
        return [f"{name}: checkpoint {getattr(theirs, f, None)!r}, model "
                f"{getattr(cfg, f, None)!r}" for f, name in _SHAPE_FIELDS.items()
                if getattr(theirs, f, None) != getattr(cfg, f, None)]
    # Not a model this reads (another family, or a value from_hf refuses): compare
    # what the file states against what the model's own config.json would.
    ours = cfg.to_hf()
    ours.setdefault("hidden_activation", ours.get("hidden_act"))
    ours.setdefault("hidden_act", ours["hidden_activation"])
    return [f"{key}: checkpoint {short(hf[key], 60)}, model {ours[key]!r}"
            for key in _RAW_KEYS if key in hf and key in ours and hf[key] != ours[key]]


#: Llama 3.1's rotary scaling (``rope_scaling`` of its ``config.json``).
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
#: The layout of the published shapes, for planning: stacked layers, bfloat16.
BIG: dict[str, Any] = dict(scan_layers=True, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
