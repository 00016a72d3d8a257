"""The configuration of :class:`~nnx_shard.models.Llama`: :class:`LlamaConfig`
(sizes and options; :meth:`LlamaConfig.from_hf` reads a transformers
``config.json``, :meth:`LlamaConfig.to_hf` writes one) and the named
configurations :data:`LLAMA_CONFIGS` (read them with
:func:`nnx_shard.models.get_config`).

>>> LLAMA_CONFIGS["llama-tiny"].kv_heads
2
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from nnx_shard._errors import NnxShardError, UsageError, check_path, count, short
from nnx_shard._safetensors_io import described
from nnx_shard.models._rope import ROPE_TYPES as ROPE_TYPES
from nnx_shard.models._rope import checked
from nnx_shard.models._transformer_config import check_fields, check_kernel_and_remat

__all__ = ["LLAMA_CONFIGS", "LlamaConfig"]

#: ``config.json`` model types :meth:`LlamaConfig.from_hf` reads.
MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral", "gemma", "olmo2", "gemma2", "gemma3_text",
               "phi3")
#: MLP activations (transformers' ``hidden_act`` names) the model implements:
#: SwiGLU's SiLU, and Gemma's tanh approximation of GELU.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
#: The architectures :meth:`LlamaConfig.to_hf` names for each model type.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                 "gemma": "GemmaForCausalLM", "olmo2": "Olmo2ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                 "phi3": "Phi3ForCausalLM"}
_GEMMAS = ("gemma", "gemma2", "gemma3_text")
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and options of :class:`Llama` (frozen: derive variants with
    ``dataclasses.replace``). Field names follow
    :class:`~nnx_shard.models.TransformerConfig`; the Hugging Face names are
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
      qk_norm: RMSNorm of each query and key head before the rotation (Qwen3).
      attention_bias: biases on the q, k, v and o projections.
      qkv_bias: biases on the q, k and v projections only (Qwen2).
      activation: the gated MLP's activation, one of :data:`ACTIVATIONS`
        (``hidden_act``: ``"silu"``, or Gemma's ``"gelu_pytorch_tanh"``).
      embed_scale: multiply the token embeddings by ``sqrt(embed)`` (Gemma;
        the factor rounded to the parameters' dtype, as transformers does).
      norm_offset: every RMSNorm scales by ``1 + weight`` (Gemma; its weights
        start at 0).
      post_norms: each block normalizes the attention's and the MLP's outputs
        before adding them to the residual, and not their inputs (OLMo 2).
      qk_norm_full: with ``qk_norm``, one RMSNorm over all the heads' queries
        (keys) together rather than one per head (OLMo 2).
      sliding_window: ``None``, or the keys each query sees: itself and the
        ``sliding_window - 1`` before it (Mistral's ``sliding_window``, Qwen2's
        with ``use_sliding_window``), in every layer, or in the layers
        ``window_layers`` marks.
      window_layers: ``None`` (the window, if any, in every layer), or one flag per
        layer: which layers slide (Gemma 2 / 3's ``layer_types``; the others attend
        to every earlier key).
      rope_local_theta: ``None``, or the rotary base of the sliding layers (Gemma 3's
        ``rope_local_base_freq``; the others use ``rope_theta``).
      sandwich_norms: each block normalizes the attention's and the MLP's inputs and
        outputs (Gemma 2 / 3's four norms per block).
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
      model_type: one of :data:`MODEL_TYPES` (``"llama"``, ``"qwen3"``,
        ``"qwen2"``, ``"mistral"``): the ``config.json`` that :meth:`to_hf` writes.
      scan_layers, remat, attention, dtype, param_dtype: as in
        :class:`~nnx_shard.models.TransformerConfig` (``scan_layers=True``
        stacks the blocks on a leading ``layers`` axis: the pp presets need it;
        ``attention`` is the per-device kernel, ``"auto"`` by default: cuDNN's
        fused kernel on GPUs where it applies, else blockwise; ``"dense"`` keeps
        the float32 ``[batch, heads, seq, seq]`` probabilities). Grouped-query
        attention never repeats K/V, in any kernel.

    >>> cfg = LlamaConfig(vocab=64, embed=16, heads=4, kv_heads=2, head_dim=4, mlp=32, layers=1)
    >>> cfg.num_params
    4400
    >>> LlamaConfig(heads=4, kv_heads=3)
    Traceback (most recent call last):
    ...
    ValueError: LlamaConfig: kv_heads=3 must divide heads=4 (grouped-query attention shares each key/value head among heads / kv_heads query heads).
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
    qk_norm: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    norm_offset: bool = False
    post_norms: bool = False
    qk_norm_full: bool = False
    sliding_window: int | None = None
    window_layers: Any = None
    rope_local_theta: float | None = None
    sandwich_norms: bool = False
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    max_length: int = 2048
    model_type: str = "llama"
    scan_layers: bool = False
    remat: str = "none"
    attention: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        check_fields(self, ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers",
                            "max_length"), positive=("rope_theta", "norm_eps"),
                     flags=("tie_embeddings", "qk_norm", "attention_bias", "mlp_bias",
                            "qkv_bias", "embed_scale", "norm_offset", "post_norms", "qk_norm_full",
                            "sandwich_norms", "scan_layers"))
        for name in ("rope_local_theta", "query_scale", "attn_softcap", "final_softcap"):
            _optional_real(self, name)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"LlamaConfig.activation={self.activation!r}; valid: "
                             f"{', '.join(ACTIVATIONS)}.")
        if self.sliding_window is not None:
            count(self.sliding_window, "LlamaConfig.sliding_window",
                  fix="None (full attention) or the window in tokens, e.g. 4096")
        if self.heads % self.kv_heads:
            raise ValueError(
                f"LlamaConfig: kv_heads={self.kv_heads} must divide heads={self.heads} "
                "(grouped-query attention shares each key/value head among heads / kv_heads "
                "query heads)."
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim} must be even (the rotary "
                             "embedding rotates pairs of features).")
        check_kernel_and_remat(self)
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"LlamaConfig.model_type={self.model_type!r}; valid: "
                             f"{', '.join(MODEL_TYPES)}.")
        # Hashable (the config is static metadata of the module's graph).
        object.__setattr__(self, "rope_scaling", _scaling(self.rope_scaling, self.head_dim))
        object.__setattr__(self, "window_layers", _window_layers(self))

    @property
    def num_params(self) -> int:
        """Parameter count, computed from the sizes (tied embeddings counted once).

        >>> round(LLAMA_CONFIGS["llama3-8b"].num_params / 1e9, 2)
        8.03
        """
        e, h, g, d, m = self.embed, self.heads, self.kv_heads, self.head_dim, self.mlp
        attn = 2 * e * h * d + 2 * e * g * d
        if self.attention_bias or self.qkv_bias:
            attn += h * d + 2 * g * d
        if self.attention_bias:
            attn += e
        if self.qk_norm:
            attn += (h * d + g * d) if self.qk_norm_full else 2 * d
        ffn = 3 * e * m + ((2 * m + e) if self.mlp_bias else 0)
        block = attn + ffn + (4 if self.sandwich_norms else 2) * e
        unembed = 0 if self.tie_embeddings else e * self.vocab
        return self.vocab * e + self.layers * block + e + unembed

    @classmethod
    def from_hf(cls, config: str | os.PathLike[str] | Mapping[str, Any],
                **overrides: Any) -> LlamaConfig:
        """The configuration of a transformers ``config.json`` (a dict, the file,
        or the directory holding it) of model type ``llama`` or ``qwen3``;
        ``overrides`` replace fields (e.g. ``scan_layers=True``,
        ``param_dtype=jnp.bfloat16``). Parameters stay float32 unless overridden,
        whatever ``torch_dtype`` the file names: master weights for training.

        Reads ``rope_theta`` and ``rope_scaling`` as transformers 5 does:
        ``rope_scaling`` when set, else ``rope_parameters``, with ``rope_theta``
        inside it, else beside it, else 10000; ``rope_scaling`` of the types in
        :data:`ROPE_TYPES` (``linear``, ``dynamic``, ``yarn``, ``longrope``,
        ``llama3``) is implemented, any other type is an error, as are partial
        rotation and activations the model lacks. ``original_max_position_embeddings``
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

        >>> hf = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16,
        ...       "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...       "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
        ...       "rope_theta": 1e6, "tie_word_embeddings": True}
        >>> cfg = LlamaConfig.from_hf(hf, scan_layers=True)
        >>> cfg.head_dim, cfg.qk_norm, cfg.tie_embeddings, cfg.scan_layers
        (8, True, True, True)
        >>> LlamaConfig.from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
        ...     "original_max_position_embeddings": 32768}}).rope_scaling
        (('factor', 4.0), ('original_max_position_embeddings', 32768), ('rope_type', 'yarn'))
        >>> LlamaConfig.from_hf({**hf, "rope_scaling": {"rope_type": "ntk", "factor": 4.0}})
        Traceback (most recent call last):
        ...
        nnx_shard._errors.UsageError: config.json: rope_scaling of type 'ntk' is not implemented (implemented: 'default', 'linear', 'dynamic', 'yarn', 'longrope', 'llama3'). ...
        >>> LlamaConfig.from_hf({**hf, "num_key_value_heads": 0})
        Traceback (most recent call last):
        ...
        nnx_shard._errors.UsageError: config.json: num_key_value_heads must be a positive int, got 0. Fix: ...
        """
        hf, where = read_json(config)
        kind = hf.get("model_type")
        if kind not in MODEL_TYPES:
            raise UsageError(
                f"{where}: model_type {short(kind, 60)} is not a Llama-family model this reads "
                f"(supported: {', '.join(MODEL_TYPES)}). Fix: pass the config.json of a "
                "checkpoint of one of these types."
            )
        gemma = kind in _GEMMAS
        later = kind in ("gemma2", "gemma3_text")  # Gemma 2 and 3: four norms, windows
        act = (hf.get("hidden_activation") if later else None) or hf.get("hidden_act") or (
            "gelu_pytorch_tanh" if gemma else "silu")
        if gemma and act == "gelu":  # transformers' GemmaConfig reads the legacy name so
            act = "gelu_pytorch_tanh"
        if act not in ACTIVATIONS:
            raise UsageError(f"{where}: hidden_act={short(act, 60)}; the model implements the "
                             f"gated MLP with {' or '.join(repr(a) for a in ACTIVATIONS)}. Fix: "
                             "use a checkpoint of a model with one of those.")
        if _flag(hf, "use_bidirectional_attention", False, where):
            raise UsageError(f"{where}: use_bidirectional_attention is set; the model is a "
                             "causal decoder. Fix: use a causal checkpoint.")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in hf]
        if missing:
            raise UsageError(f"{where}: missing keys {missing}; a {kind} config.json names "
                             "every size. Fix: use the checkpoint's own config.json.")
        heads = _count(hf, "num_attention_heads", None, where)
        embed = _count(hf, "hidden_size", None, where)
        max_length = _count(hf, "max_position_embeddings", 2048, where)
        theta, scaling = _rope(hf, where, max_length)
        layers = _count(hf, "num_hidden_layers", None, where)
        window, window_layers = (_gemma_window(hf, kind, layers, where) if later
                                 else (_window(hf, kind, layers, where), None))
        fields: dict[str, Any] = dict(
            vocab=_count(hf, "vocab_size", None, where),
            embed=embed,
            heads=heads,
            # transformers' defaults for a null or absent value
            kv_heads=_count(hf, "num_key_value_heads", heads, where),
            head_dim=(embed // heads if kind == "phi3"  # Phi-3 has no head_dim key
                      else _count(hf, "head_dim", 256 if later else embed // heads, where)),
            mlp=_count(hf, "intermediate_size", None, where),
            layers=layers,
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=_real(hf.get("rms_norm_eps"), "rms_norm_eps", 1e-6, where),
            # transformers' defaults: Gemma ties the embeddings, the others do not
            tie_embeddings=_flag(hf, "tie_word_embeddings", gemma, where),
            qk_norm=kind in ("qwen3", "olmo2", "gemma3_text"),
            qk_norm_full=kind == "olmo2",
            post_norms=kind == "olmo2",
            # Qwen2 always has q/k/v biases and no o bias; the others read the flag.
            attention_bias=(_flag(hf, "attention_bias", False, where)
                            if kind in ("llama", "qwen3", "gemma", "olmo2", "gemma2",
                                        "gemma3_text") else False),
            qkv_bias=kind == "qwen2",
            activation=act,
            embed_scale=gemma,
            norm_offset=gemma,
            mlp_bias=_flag(hf, "mlp_bias", False, where) if kind == "llama" else False,
            sliding_window=window,
            window_layers=window_layers,
            rope_local_theta=_local_theta(hf, where) if kind == "gemma3_text" else None,
            sandwich_norms=later,
            query_scale=(_real(hf.get("query_pre_attn_scalar"), "query_pre_attn_scalar", 256.0,
                               where) if later else None),
            attn_softcap=_softcap(hf, "attn_logit_softcapping", kind, 50.0, where),
            final_softcap=_softcap(hf, "final_logit_softcapping", kind, 30.0, where),
            max_length=max_length,
            model_type=kind,
        )
        try:
            return cls(**(fields | overrides))
        except NnxShardError:
            raise
        except ValueError as e:  # sizes that do not fit together, e.g. kv_heads and heads
            raise UsageError(f"{where}: {e} Fix: use the config.json the checkpoint was saved "
                             "with" + (", and check the overrides" if overrides else "")
                             + ".") from None

    def local_layers(self) -> tuple[bool, ...]:
        """Which layers use the sliding window (every one with ``window_layers=None``
        and a window; none without a window).

        >>> LlamaConfig(layers=3, sliding_window=4, window_layers=(True, False, True)).local_layers()
        (True, False, True)
        """
        if self.sliding_window is None:
            return (False,) * self.layers
        return self.window_layers or (True,) * self.layers

    def to_hf(self) -> dict[str, Any]:
        """The transformers ``config.json`` of this configuration (what
        :func:`nnx_shard.hf.save_safetensors` writes next to the weights).

        >>> LLAMA_CONFIGS["qwen3-0.6b"].to_hf()["architectures"]
        ['Qwen3ForCausalLM']
        """
        dtype = {v: k for k, v in _DTYPES.items()}.get(self.param_dtype, "float32")
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab,
            "hidden_size": self.embed,
            "intermediate_size": self.mlp,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.activation,
            "max_position_embeddings": self.max_length,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": _hf_scaling(self.rope_scaling),
            "tie_word_embeddings": self.tie_embeddings,
            "attention_dropout": 0.0,
            "torch_dtype": dtype,
        }
        if self.model_type in ("llama", "qwen3", "gemma", "olmo2", "gemma2", "gemma3_text"):
            out["attention_bias"] = self.attention_bias
        if self.model_type in ("gemma2", "gemma3_text"):
            del out["hidden_act"]
            local = self.local_layers()
            out.update(hidden_activation=self.activation, sliding_window=self.sliding_window,
                       layer_types=["sliding_attention" if f else "full_attention"
                                    for f in local],
                       # transformers types it int (a float fails its config check)
                       query_pre_attn_scalar=(int(self.query_scale)
                                              if self.query_scale is not None
                                              and self.query_scale.is_integer()
                                              else self.query_scale),
                       attn_logit_softcapping=self.attn_softcap,
                       final_logit_softcapping=self.final_softcap)
        if self.model_type == "gemma3_text":
            global_rope = {"rope_type": "default", "rope_theta": self.rope_theta,
                           **(_hf_scaling(self.rope_scaling) or {})}
            out["rope_parameters"] = {
                "full_attention": global_rope,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": self.rope_local_theta or self.rope_theta}}
            del out["rope_theta"], out["rope_scaling"]
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        elif self.model_type in ("mistral", "phi3"):
            out["sliding_window"] = self.sliding_window
        if self.model_type == "phi3" and self.rope_scaling:
            # Phi3Config puts its own (default 4096) over the scaling's
            out["original_max_position_embeddings"] = dict(self.rope_scaling).get(
                "original_max_position_embeddings", self.max_length)
        if self.model_type == "phi3" and self.vocab <= 32000:
            # Phi3Config's default pad id (32000) must index the embedding.
            out["pad_token_id"] = None
        elif self.model_type in (*_GEMMAS, "olmo2"):
            pass
        else:  # qwen2 / qwen3: a window in every layer, or none
            out["use_sliding_window"] = self.sliding_window is not None
            out["sliding_window"] = self.sliding_window
            out["max_window_layers"] = 0 if self.sliding_window is not None else self.layers
        return out


_FIX_VALUE = "Fix: use the checkpoint's own config.json"


def read_json(config: Any) -> tuple[dict[str, Any], str]:
    """The config as a dict, and how messages name it (the file, or ``config.json``)."""
    if isinstance(config, Mapping):
        return dict(config), "config.json"
    if isinstance(config, bytes) or not isinstance(config, str | os.PathLike) or not str(config):
        raise UsageError(f"LlamaConfig.from_hf: config must be a dict, a config.json path or "
                         f"the directory holding it, got {type(config).__name__} "
                         f"{short(config, 60)}. Fix: e.g. LlamaConfig.from_hf('checkpoints/llama')")
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    check_path(path, "LlamaConfig.from_hf", want="file", expected="a config.json file",
               fix="pass the checkpoint directory, its config.json, or the dict.")
    fix = "Fix: download the checkpoint's config.json again."

    def constant(name: str) -> Any:
        raise UsageError(f"{path}: holds {name}, which is not JSON and no size. {fix}")

    with open(path, "rb") as f:
        raw = f.read()
    try:
        hf = json.loads(raw.decode("utf-8"), parse_constant=constant)
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: is not UTF-8 ({e.reason} at byte {e.start}). {fix}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}: is not JSON ({e.msg} at character {e.pos}). {fix}") from None
    except RecursionError:
        raise UsageError(f"{path}: is nested too deeply to be a config.json. {fix}") from None
    if not isinstance(hf, dict):
        raise UsageError(f"{path}: is {described(hf)}, not a JSON object of settings. {fix}")
    return hf, path


def _count(hf: Mapping[str, Any], key: str, default: int | None, where: str) -> int:
    """``hf[key]``, a whole count >= 1 (never a bool or a float: ``32.7`` or ``true``
    is no size); ``default`` when absent or null, where the key may be."""
    value = hf.get(key)
    if value is None and default is not None:
        return default
    return count(value, f"{where}: {key}", fix=f"{_FIX_VALUE}, whose {key} is a whole "
                 f"number, e.g. \"{key}\": 4")


def _real(value: Any, name: str, default: float | None, where: str, *,
          least: float = 0.0, strict: bool = True) -> float:
    """``value``, a finite number > ``least`` (>= with ``strict=False``); ``default``
    for null. Text, bools, NaN and infinities are refused."""
    if value is None and default is not None:
        return default
    try:
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value) and (value > least if strict else value >= least))
    except OverflowError:  # an int past float's range
        ok = False
    if not ok:
        bound = f"> {least:g}" if strict else f">= {least:g}"
        raise UsageError(f"{where}: {name} must be a finite number {bound}, got "
                         f"{short(value, 60)} ({type(value).__name__}). {_FIX_VALUE}.")
    return float(value)


def _flag(hf: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """``hf[key]``, a JSON true or false (``"false"`` is text, and text is truthy)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UsageError(f"{where}: {key} must be true or false, got {short(value, 60)} "
                         f"({type(value).__name__}). Fix: write \"{key}\": true or "
                         f"\"{key}\": false.")
    return value


def _window(hf: Mapping[str, Any], kind: str, layers: int, where: str) -> int | None:
    """The sliding window of every layer (``None``: full attention), read as each
    family's transformers config reads it: Mistral's ``sliding_window`` applies to
    every layer (its model ignores ``layer_types``); Qwen2/Qwen3 slide where
    ``use_sliding_window`` is set, in the layers from ``max_window_layers`` on
    (or as ``layer_types`` says); Llama has no window. A window in some layers
    only is refused: the model applies one to all."""
    fix = "Fix: e.g. \"sliding_window\": 4096, or null for full attention."
    if kind in ("mistral", "phi3"):  # their models slide in every layer
        size = hf.get("sliding_window")
        return None if size is None else _count(hf, "sliding_window", None, where)
    layer_types = hf.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list) and all(
            t in ("full_attention", "sliding_attention") for t in layer_types)):
        raise UsageError(f"{where}: layer_types must be a list of \"full_attention\" / "
                         f"\"sliding_attention\" (or null), got {short(layer_types, 60)}. Fix: "
                         "e.g. \"layer_types\": [\"full_attention\", \"full_attention\"].")
    use = _flag(hf, "use_sliding_window", False, where)
    size = None
    if kind in ("qwen2", "qwen3") and use and hf.get("sliding_window") is not None:
        size = _count(hf, "sliding_window", None, where)
    if layer_types is None:
        first = hf.get("max_window_layers", 28)
        first = first if isinstance(first, int) and not isinstance(first, bool) else 28
        layer_types = ["sliding_attention" if size is not None and i >= first
                       else "full_attention" for i in range(layers)]
    sliding = [t == "sliding_attention" for t in layer_types]
    if kind in ("llama", "gemma", "olmo2") and (use or any(sliding)):
        raise UsageError(f"{where}: sliding-window attention layers (use_sliding_window / "
                         "layer_types) are not part of a {kind} model. Fix: use the "
                         "checkpoint's own config.json, or model_type \"mistral\".")
    if size is None or not any(sliding):
        return None
    if not all(sliding):
        raise UsageError(f"{where}: sliding-window attention in some layers only "
                         f"({sum(sliding)} of {len(sliding)}, from use_sliding_window / "
                         "max_window_layers / layer_types) is not implemented: the model "
                         "applies one window to every layer. Fix: use a checkpoint with the "
                         "window in every layer or in none. " + fix)
    return size


def _gemma_window(hf: Mapping[str, Any], kind: str, layers: int, where: str
                  ) -> tuple[int | None, tuple[bool, ...] | None]:
    """Gemma 2 / 3's window and its layers, as their configs read them: ``layer_types``,
    else every other layer sliding from the first (Gemma 2) or all but every
    ``sliding_window_pattern``-th (Gemma 3, 6 by default)."""
    if hf.get("sliding_window") is None:
        size = 4096 if "sliding_window" not in hf else None
    else:
        size = _count(hf, "sliding_window", None, where)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        every = 2 if kind == "gemma2" else hf.get("sliding_window_pattern", 6)
        every = count(every, f"{where}: sliding_window_pattern", fix="e.g. 6")
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention"
                       for i in range(layers)]
    if not (isinstance(layer_types, list) and len(layer_types) == layers and all(
            t in ("full_attention", "sliding_attention") for t in layer_types)):
        raise UsageError(f"{where}: layer_types must list \"full_attention\" / "
                         f"\"sliding_attention\" for each of the {layers} layers, got "
                         f"{short(layer_types, 80)}. {_FIX_VALUE}.")
    flags = tuple(t == "sliding_attention" for t in layer_types)
    if size is None or not any(flags):
        return None, None
    return size, (None if all(flags) else flags)


def _local_theta(hf: Mapping[str, Any], where: str) -> float:
    """Gemma 3's rotary base of the sliding layers: ``rope_parameters``'
    ``sliding_attention`` entry, else ``rope_local_base_freq``, else 10000."""
    rope = hf.get("rope_parameters")
    local = rope.get("sliding_attention") if isinstance(rope, Mapping) else None
    if isinstance(local, Mapping):
        kind = local.get("rope_type", "default")
        if kind != "default":
            raise UsageError(f"{where}: rope_parameters['sliding_attention'] of type "
                             f"{short(kind, 40)} is not implemented (the sliding layers rotate "
                             "with the default frequencies). " + _FIX_VALUE + ".")
        if "rope_theta" in local:
            return _real(local["rope_theta"], "rope_parameters['sliding_attention']"
                         "['rope_theta']", None, where)
    return _real(hf.get("rope_local_base_freq"), "rope_local_base_freq", 10000.0, where)


def _softcap(hf: Mapping[str, Any], key: str, kind: str, gemma2: float, where: str
             ) -> float | None:
    """A soft-cap of Gemma 2 / 3 (``None``: none); Gemma 2's configs default to
    ``gemma2``, Gemma 3's to none; the other families have none."""
    if kind not in ("gemma2", "gemma3_text"):
        return None
    if key not in hf:
        return gemma2 if kind == "gemma2" else None
    return None if hf[key] is None else _real(hf[key], key, None, where)


def _rope(hf: Mapping[str, Any], where: str, max_length: int) -> tuple[float, Any]:
    """``(rope_theta, rope_scaling)`` read as transformers 5 reads them: ``rope_scaling``
    when set, else ``rope_parameters`` (its own spelling; a set for each layer type in
    files that nest them); ``rope_theta`` inside it, else beside it, else 10000."""
    for key in ("rope_scaling", "rope_parameters"):
        value = hf.get(key)
        if value is not None and not isinstance(value, Mapping):
            raise UsageError(f"{where}: {key} must be an object (or null), got "
                             f"{short(value, 60)} ({type(value).__name__}). {_FIX_VALUE}, e.g. "
                             f"\"{key}\": {{\"rope_type\": \"default\"}}.")
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = dict(hf.get(key) or {})
    if isinstance(rope.get("full_attention"), Mapping):
        rope = dict(rope["full_attention"])
    name = f"{where}: {key}"
    if "rope_theta" in rope:
        theta = _real(rope["rope_theta"], f"{key}['rope_theta']", None, where)
    else:
        theta = _real(hf.get("rope_theta"), "rope_theta", 10000.0, where)
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1:
        raise UsageError(f"{where}: partial_rotary_factor={short(partial, 60)} rotates only part "
                         "of each head, which the model does not implement. Fix: use a "
                         "checkpoint that rotates every feature (partial_rotary_factor 1.0).")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if hf.get("model_type") == "phi3" and kind in ("su", "yarn"):
        kind = rope["rope_type"] = "longrope"  # Phi3Config's legacy names
    if hf.get("model_type") == "phi3" and kind not in ("default", "longrope"):
        raise UsageError(f"{name} of type {short(kind, 40)}: Phi-3 rotates with the default "
                         f"or longrope frequencies only (as Phi3Config checks). {_FIX_VALUE}.")
    if kind in ("llama3", "yarn", "longrope"):
        # transformers fills a scaling's pretraining context from max_position_embeddings,
        # Phi-3 from its own top-level value
        if hf.get("model_type") == "phi3":
            rope["original_max_position_embeddings"] = hf.get(
                "original_max_position_embeddings", 4096)
        rope.setdefault("original_max_position_embeddings", max_length)
    return theta, checked(rope, where, key)


def _optional_real(cfg: LlamaConfig, name: str) -> None:
    value = getattr(cfg, name)
    if value is None:
        return
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        example = {"attn_softcap": "50.0 (Gemma 2's attention soft-cap)",
                   "final_softcap": "30.0 (Gemma 2's logit soft-cap)",
                   "query_scale": "256.0 (Gemma 2's query_pre_attn_scalar)",
                   "rope_local_theta": "10000.0 (Gemma 3's local rotary base)"}[name]
        raise UsageError(f"LlamaConfig.{name}={short(value, 60)} must be None or a finite "
                         f"number > 0 ({type(value).__name__} given). Fix: e.g. {name}="
                         f"{example}, or None to leave it out.")
    object.__setattr__(cfg, name, float(value))


def _window_layers(cfg: LlamaConfig) -> tuple[bool, ...] | None:
    """``cfg.window_layers`` as a tuple of bools (hashable), checked against the layers."""
    value = cfg.window_layers
    if value is None:
        return None
    flags = tuple(value) if isinstance(value, list | tuple) else None
    if flags is None or len(flags) != cfg.layers or not all(isinstance(f, bool) for f in flags):
        raise UsageError(f"LlamaConfig.window_layers={short(value, 60)} must be None or one "
                         f"True/False per layer ({cfg.layers}). Fix: e.g. window_layers="
                         "(True, False) * (layers // 2) for Gemma 2's alternation.")
    if cfg.sliding_window is None:
        raise UsageError("LlamaConfig.window_layers is set but sliding_window is None: no "
                         "window to apply. Fix: set sliding_window=4096 (say), or "
                         "window_layers=None.")
    return None if all(flags) else flags


def _scaling(value: Any, head_dim: int) -> tuple[tuple[str, Any], ...] | None:
    if not value:
        return None
    if not isinstance(value, Mapping | tuple | list):
        raise UsageError(f"LlamaConfig.rope_scaling must be None or a dict, got "
                         f"{short(value, 60)} ({type(value).__name__}). Fix: e.g. "
                         f"rope_scaling={_LLAMA31_ROPE}")
    try:
        items = dict(value)
    except (TypeError, ValueError):
        raise UsageError(f"LlamaConfig.rope_scaling must be None or a dict, got "
                         f"{short(value, 60)}. Fix: e.g. rope_scaling={_LLAMA31_ROPE}") from None
    out = checked(items, "LlamaConfig", "rope_scaling", head_dim)
    return None if out is None else tuple(sorted(out.items()))


def _hf_scaling(scaling: Any) -> dict[str, Any] | None:
    """``rope_scaling`` as config.json spells it (longrope's factors as lists)."""
    if not scaling:
        return None
    return {k: list(v) if isinstance(v, tuple) else v for k, v in scaling}


_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_BIG = dict(scan_layers=True, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)

#: Named configurations. ``llama-tiny`` (grouped-query Llama) and ``qwen3-tiny``
#: (q/k norm, ``head_dim`` != ``embed / heads``, tied embeddings) are for tests;
#: the others carry the published shapes of Llama 3.1 8B / 70B / 405B,
#: Qwen3-0.6B, Mistral-7B-v0.1, Qwen2.5-7B and Gemma 2 9B (from their ``config.json``; Llama 3's 8B and 70B have the same
#: shapes, without ``rope_scaling``), with stacked layers and bfloat16
#: parameters, for planning with :func:`nnx_shard.abstract_init`.
LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "llama-tiny": LlamaConfig(max_length=64),
    "qwen3-tiny": LlamaConfig(head_dim=16, qk_norm=True, tie_embeddings=True,
                              norm_eps=1e-6, rope_theta=1e6, max_length=64,
                              model_type="qwen3"),
    "llama3-8b": LlamaConfig(
        vocab=128256, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32,
        rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, norm_eps=1e-5, max_length=131072,
        **_BIG),
    "llama3-70b": LlamaConfig(
        vocab=128256, embed=8192, heads=64, kv_heads=8, head_dim=128, mlp=28672, layers=80,
        rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, norm_eps=1e-5, max_length=131072,
        **_BIG),
    "llama3-405b": LlamaConfig(
        vocab=128256, embed=16384, heads=128, kv_heads=8, head_dim=128, mlp=53248, layers=126,
        rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, norm_eps=1e-5, max_length=131072,
        **_BIG),
    "qwen3-0.6b": LlamaConfig(
        vocab=151936, embed=1024, heads=16, kv_heads=8, head_dim=128, mlp=3072, layers=28,
        rope_theta=1000000.0, norm_eps=1e-6, tie_embeddings=True, qk_norm=True,
        max_length=40960, model_type="qwen3", **_BIG),
    # Mistral-7B-v0.1: a 4096-token window in every layer.
    "mistral-7b": LlamaConfig(
        vocab=32000, embed=4096, heads=32, kv_heads=8, head_dim=128, mlp=14336, layers=32,
        rope_theta=10000.0, norm_eps=1e-5, sliding_window=4096, max_length=32768,
        model_type="mistral", **_BIG),
    # Qwen2.5-7B: q/k/v biases, no window (use_sliding_window false).
    "qwen2.5-7b": LlamaConfig(
        vocab=152064, embed=3584, heads=28, kv_heads=4, head_dim=128, mlp=18944, layers=28,
        rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True, max_length=131072,
        model_type="qwen2", **_BIG),
    # Gemma 2 9B: four norms per block, soft-caps 50 (attention) / 30 (logits), a
    # 4096-token window in every other layer from the first, query_pre_attn_scalar 256,
    # tied. 9,241,705,984 parameters (the published 9.24B).
    "gemma2-9b": LlamaConfig(
        vocab=256000, embed=3584, heads=16, kv_heads=8, head_dim=256, mlp=14336, layers=42,
        rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=True,
        activation="gelu_pytorch_tanh", embed_scale=True, norm_offset=True,
        sandwich_norms=True, query_scale=256.0, attn_softcap=50.0, final_softcap=30.0,
        sliding_window=4096, window_layers=(True, False) * 21, max_length=8192,
        model_type="gemma2", **_BIG),
}


# The fields that decide what a checkpoint computes (not how it is run: layout,
# remat, kernel, dtypes, context length), with their config.json names.
_SHAPE_FIELDS = {
    "model_type": "model_type", "vocab": "vocab_size", "embed": "hidden_size",
    "heads": "num_attention_heads", "kv_heads": "num_key_value_heads",
    "head_dim": "head_dim", "mlp": "intermediate_size", "layers": "num_hidden_layers",
    "rope_theta": "rope_theta", "rope_scaling": "rope_scaling", "norm_eps": "rms_norm_eps",
    "activation": "hidden_act", "embed_scale": "embedding scale (sqrt(hidden_size))",
    "norm_offset": "RMSNorm scale (1 + weight)",
    "post_norms": "norms after attention / MLP (post_feedforward_layernorm)",
    "qk_norm_full": "q/k norm over all heads",
    "tie_embeddings": "tie_word_embeddings", "qk_norm": "qk_norm (q_norm / k_norm)",
    "attention_bias": "attention_bias", "qkv_bias": "q/k/v biases",
    "mlp_bias": "mlp_bias", "sliding_window": "sliding_window",
    "window_layers": "layer_types (which layers slide)",
    "rope_local_theta": "rope_local_base_freq", "sandwich_norms":
    "norms before and after attention / MLP (pre/post_feedforward_layernorm)",
    "query_scale": "query_pre_attn_scalar", "attn_softcap": "attn_logit_softcapping",
    "final_softcap": "final_logit_softcapping",
}
# What a config.json that does not parse as a model type here is compared on.
_RAW_KEYS = ("model_type", "hidden_act", "hidden_activation", "vocab_size", "hidden_size",
             "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "tie_word_embeddings", "sliding_window",
             "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")


def differences(config: str | os.PathLike[str] | Mapping[str, Any], cfg: LlamaConfig
                ) -> list[str]:
    """What the checkpoint ``config`` (a ``config.json``, its directory or the dict)
    describes differently from ``cfg``, one ``"field: checkpoint X, model Y"`` line
    per field that changes what the model computes (model type, activation, norm,
    sizes, biases, rotary and window settings); ``[]`` when they agree. Layout,
    remat, kernel, dtypes and the context length are not compared.

    >>> tiny = LLAMA_CONFIGS["llama-tiny"]
    >>> differences(tiny.to_hf(), tiny)
    []
    >>> differences({**tiny.to_hf(), "model_type": "gemma", "hidden_act": "gelu"}, tiny)[:2]
    ["model_type: checkpoint 'gemma', model 'llama'", "hidden_act: checkpoint 'gelu_pytorch_tanh', model 'silu'"]
    >>> differences({**tiny.to_hf(), "model_type": "gpt2", "hidden_act": "gelu"}, tiny)
    ["model_type: checkpoint 'gpt2', model 'llama'", "hidden_act: checkpoint 'gelu', model 'silu'"]
    """
    hf, _ = read_json(config)
    try:
        theirs = LlamaConfig.from_hf(hf)
    except NnxShardError:
        theirs = None
    if theirs is not None:
        return [f"{name}: checkpoint {getattr(theirs, f)!r}, model {getattr(cfg, f)!r}"
                for f, name in _SHAPE_FIELDS.items() if getattr(theirs, f) != getattr(cfg, f)]
    # Not a model this reads (another family, or a value from_hf refuses): compare
    # what the file states against what the model's own config.json would.
    ours = cfg.to_hf()
    ours.setdefault("hidden_activation", ours.get("hidden_act"))
    ours.setdefault("hidden_act", ours["hidden_activation"])
    return [f"{key}: checkpoint {short(hf[key], 60)}, model {ours[key]!r}"
            for key in _RAW_KEYS if key in hf and key in ours and hf[key] != ours[key]]
