"""A Llama-family decoder (Llama 2/3, Qwen3) annotated only with logical names.

The architecture of Hugging Face's ``LlamaForCausalLM`` and ``Qwen3ForCausalLM``:
token embedding, ``layers`` pre-norm blocks (RMSNorm, grouped-query attention
with rotary position embeddings, RMSNorm, SwiGLU MLP), a final RMSNorm and an
output projection (optionally tied to the embedding). Qwen3 adds an RMSNorm of
each query and key head before the rotation and an explicit ``head_dim``.
:meth:`LlamaConfig.from_hf` reads a transformers ``config.json``;
:func:`nnx_shard.load_safetensors` fills the parameters from a Hugging Face
checkpoint.

Parameters carry the logical names of :class:`nnx_shard.models.Transformer`
(``vocab``, ``embed``, ``heads``, ``kv``, ``mlp``, ``layers``) plus
``kv_heads``, the key/value heads of grouped-query attention (``kv`` is the
width of one head, as in the reference model). Activations are constrained at
the same points as in the reference model, so every preset applies unchanged:
dp, zero1, fsdp, tp, fsdp_tp, sp, async_tp, cp, fsdp_cp, and pp / pp_fsdp /
pp_tp with ``scan_layers=True``. The ``ep`` preset shards experts; this model
has none, so under ``ep`` it trains as plain data parallelism over both mesh
axes (nothing is split over ``expert``).

Tensor-parallel presets split ``kv_heads`` over the model axis where it
divides, and replicate the key/value projections where it does not (e.g. 8
key/value heads on a model axis of 16): the rule is ``[model, None]``.

>>> from flax import nnx
>>> cfg = get_llama_config("tiny")
>>> model = Llama(cfg, rngs=nnx.Rngs(0))
>>> model(jnp.zeros((2, 16), jnp.int32)).shape
(2, 16, 128)
>>> model.blocks[0].attn.k.get_metadata("out_sharding")
('embed', 'kv_heads', 'kv')
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_shard.blockwise import KERNELS
from nnx_shard.errors import short
from nnx_shard.mesh import option
from nnx_shard.models import kv_cache
from nnx_shard.models._ops import constrain, einsum, lookup, whole
from nnx_shard.models.transformer import (
    GATHERED,
    REMAT_POLICIES,
    RESIDUAL,
    _block_input,
    _check_fields,
    _dense_init,
    _param,
    _seq,
    remat_policy,
)
from nnx_shard.parallel import pipeline
from nnx_shard.parallel.collective_matmul import check_tokens
from nnx_shard.parallel.ring import attention

__all__ = ["LLAMA_CONFIGS", "Llama", "LlamaConfig", "get_llama_config"]

#: ``config.json`` model types :meth:`LlamaConfig.from_hf` reads.
MODEL_TYPES = ("llama", "qwen3")
#: ``rope_scaling`` types the model implements (``"default"``: none).
ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")
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
      rope_scaling: ``None``, or the ``llama3`` frequency scaling as sorted
        ``(key, value)`` pairs (a dict is accepted and converted), e.g.
        ``{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}``.
      norm_eps: epsilon of every RMSNorm (``rms_norm_eps``).
      tie_embeddings: reuse the token embedding as the output projection
        (``tie_word_embeddings``).
      qk_norm: RMSNorm of each query and key head before the rotation (Qwen3).
      attention_bias: biases on the q, k, v and o projections.
      mlp_bias: biases on the gate, up and down projections (Llama's ``mlp_bias``).
      max_length: ``max_position_embeddings`` (written back to ``config.json``;
        the rotation itself works at any length).
      model_type: ``"llama"`` or ``"qwen3"``: the ``config.json`` that
        :meth:`to_hf` writes.
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
    max_length: int = 2048
    model_type: str = "llama"
    scan_layers: bool = False
    remat: str = "none"
    attention: str = "auto"
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32

    def __post_init__(self) -> None:
        _check_fields(self, ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers",
                            "max_length"), positive=("rope_theta", "norm_eps"),
                     flags=("tie_embeddings", "qk_norm", "attention_bias", "mlp_bias",
                            "scan_layers"))
        if self.heads % self.kv_heads:
            raise ValueError(
                f"LlamaConfig: kv_heads={self.kv_heads} must divide heads={self.heads} "
                "(grouped-query attention shares each key/value head among heads / kv_heads "
                "query heads)."
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim} must be even (the rotary "
                             "embedding rotates pairs of features).")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(
                f"LlamaConfig.remat={self.remat!r} is not a remat policy; valid: "
                + ", ".join(repr(k) for k in REMAT_POLICIES) + "."
            )
        if self.attention not in KERNELS:
            raise ValueError(
                f"LlamaConfig.attention={self.attention!r} is not an attention kernel; "
                "valid: " + ", ".join(repr(k) for k in KERNELS) + "."
            )
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"LlamaConfig.model_type={self.model_type!r}; valid: "
                             f"{', '.join(MODEL_TYPES)}.")
        # Hashable (the config is static metadata of the module's graph).
        object.__setattr__(self, "rope_scaling", _scaling(self.rope_scaling))

    @property
    def num_params(self) -> int:
        """Parameter count, computed from the sizes (tied embeddings counted once).

        >>> round(get_llama_config("llama3-8b").num_params / 1e9, 2)
        8.03
        """
        e, h, g, d, m = self.embed, self.heads, self.kv_heads, self.head_dim, self.mlp
        attn = 2 * e * h * d + 2 * e * g * d
        if self.attention_bias:
            attn += h * d + 2 * g * d + e
        if self.qk_norm:
            attn += 2 * d
        ffn = 3 * e * m + ((2 * m + e) if self.mlp_bias else 0)
        block = attn + ffn + 2 * e
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

        Reads ``rope_theta`` and ``rope_scaling`` (or transformers 5's
        ``rope_parameters``); ``rope_scaling`` of type ``llama3`` is implemented,
        any other type is a ``ValueError``, as are sliding-window attention and
        activations other than SiLU.

        >>> hf = {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 16,
        ...       "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        ...       "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6,
        ...       "rope_theta": 1e6, "tie_word_embeddings": True}
        >>> cfg = LlamaConfig.from_hf(hf, scan_layers=True)
        >>> cfg.head_dim, cfg.qk_norm, cfg.tie_embeddings, cfg.scan_layers
        (8, True, True, True)
        >>> LlamaConfig.from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
        Traceback (most recent call last):
        ...
        ValueError: config.json: rope_scaling of type 'yarn' is not implemented (implemented: 'default', 'llama3'). ...
        """
        hf = _read_json(config)
        kind = hf.get("model_type")
        if kind not in MODEL_TYPES:
            raise ValueError(
                f"config.json: model_type {kind!r} is not a Llama-family model this reads "
                f"(supported: {', '.join(MODEL_TYPES)}). Fix: pass the config.json of a "
                "LlamaForCausalLM or Qwen3ForCausalLM checkpoint."
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act={act!r}; the model implements SwiGLU "
                             "with 'silu' only.")
        if hf.get("use_sliding_window") or any(
                t != "full_attention" for t in hf.get("layer_types") or ()):
            raise ValueError("config.json: sliding-window attention layers are not implemented "
                             "(use_sliding_window / layer_types). Fix: use a checkpoint with "
                             "full attention in every layer.")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in hf]
        if missing:
            raise ValueError(f"config.json: missing keys {missing}; a {kind} config.json "
                             "names every size.")
        theta, scaling = _rope(hf)
        heads = int(hf["num_attention_heads"])
        fields: dict[str, Any] = dict(
            vocab=int(hf["vocab_size"]),
            embed=int(hf["hidden_size"]),
            heads=heads,
            kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            mlp=int(hf["intermediate_size"]),
            layers=int(hf["num_hidden_layers"]),
            rope_theta=theta,
            rope_scaling=scaling,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qk_norm=kind == "qwen3",
            attention_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)) if kind == "llama" else False,
            max_length=int(hf.get("max_position_embeddings", 2048)),
            model_type=kind,
        )
        return cls(**(fields | overrides))

    def to_hf(self) -> dict[str, Any]:
        """The transformers ``config.json`` of this configuration (what
        :func:`nnx_shard.save_safetensors` writes next to the weights).

        >>> get_llama_config("qwen3-0.6b").to_hf()["architectures"]
        ['Qwen3ForCausalLM']
        """
        dtype = {v: k for k, v in _DTYPES.items()}.get(self.param_dtype, "float32")
        out: dict[str, Any] = {
            "architectures": ["Qwen3ForCausalLM" if self.model_type == "qwen3"
                              else "LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab,
            "hidden_size": self.embed,
            "intermediate_size": self.mlp,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_length,
            "rms_norm_eps": self.norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "torch_dtype": dtype,
        }
        if self.model_type == "llama":
            out["mlp_bias"] = self.mlp_bias
        else:
            out["use_sliding_window"] = False
        return out


def _read_json(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"LlamaConfig.from_hf: no config.json at {path}. Fix: pass the "
                                "checkpoint directory, its config.json, or the dict.")
    with open(path) as f:
        return json.load(f)


def _rope(hf: Mapping[str, Any]) -> tuple[float, Any]:
    params = hf.get("rope_parameters")  # transformers >= 5
    if isinstance(params, Mapping) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = dict(params)
        scaling.pop("rope_theta")
    else:
        theta = float(hf.get("rope_theta", 10000.0))
        scaling = dict(hf.get("rope_scaling") or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(
            f"config.json: rope_scaling of type {kind!r} is not implemented (implemented: "
            f"{', '.join(repr(t) for t in ROPE_TYPES)}). Fix: use a checkpoint without that "
            "scaling, or add it to nnx_shard.models.llama.rope_frequencies."
        )
    if kind == "default":
        return theta, None
    missing = [k for k in _LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ValueError(f"config.json: rope_scaling of type 'llama3' lacks {missing}.")
    return theta, {"rope_type": "llama3", **{k: scaling[k] for k in _LLAMA3_KEYS}}


def _scaling(value: Any) -> tuple[tuple[str, Any], ...] | None:
    if not value:
        return None
    items = dict(value)
    kind = items.get("rope_type", items.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"LlamaConfig.rope_scaling: type {kind!r} is not implemented "
                         f"(implemented: {', '.join(repr(t) for t in ROPE_TYPES)}).")
    missing = [k for k in _LLAMA3_KEYS if k not in items]
    if missing:
        raise ValueError(f"LlamaConfig.rope_scaling of type 'llama3' lacks {missing}.")
    items["rope_type"] = "llama3"
    items.pop("type", None)
    return tuple(sorted(items.items()))


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
    """The rotary inverse frequencies ``[head_dim / 2]`` (float32), with the
    ``llama3`` scaling applied when the config has it, computed in float32 as
    transformers does.

    >>> rope_frequencies(get_llama_config("tiny"))[:2]
    array([1.  , 0.1], dtype=float32)
    """
    d = cfg.head_dim
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv = (np.float32(1.0) / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    if cfg.rope_scaling is None:
        return inv
    s = dict(cfg.rope_scaling)
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _rotary_tables(cfg: LlamaConfig, length: int) -> tuple[np.ndarray, np.ndarray]:
    # Host constants (the positions are static): nothing traced is closed over
    # by the scanned or pipelined layer body.
    inv = rope_frequencies(cfg)
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _rotary_at(cfg: LlamaConfig, index: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
    """The rotary tables of positions ``index .. index + steps - 1`` (``index``
    traced: the decode step's position), computed as :func:`_rotary_tables`."""
    inv = jnp.asarray(rope_frequencies(cfg))
    positions = (index + jnp.arange(steps, dtype=jnp.int32)).astype(jnp.float32)
    freqs = positions[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _rotate(x: jax.Array, cos: Any, sin: Any) -> jax.Array:
    """Rotary embedding of ``x [batch, length, heads, head_dim]`` in transformers'
    half-split convention (its checkpoints store q/k rows in that order)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c = jnp.asarray(cos, x.dtype)[None, :, None, :]
    s = jnp.asarray(sin, x.dtype)[None, :, None, :]
    return x * c + rotated * s


class RMSNorm(nnx.Module):
    """Root-mean-square norm with a learned scale, computed in float32 (as
    transformers' ``LlamaRMSNorm``)."""

    def __init__(self, size: int, names: tuple[str, ...], eps: float, dtype: Any,
                 param_dtype: Any, *, rngs: nnx.Rngs) -> None:
        self.scale = _param(rngs, nnx.initializers.ones, (size,), names, param_dtype)
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (whole(self.scale[...]).astype(jnp.float32) * x32).astype(self.dtype)


def _bias(rngs: nnx.Rngs, on: bool, shape: tuple[int, ...], names: tuple[Any, ...],
          dt: Any) -> nnx.Param | None:
    return nnx.data(_param(rngs, nnx.initializers.zeros, shape, names, dt) if on else None)


def _add(y: jax.Array, b: nnx.Param | None, dt: Any) -> jax.Array:
    # Biases are small: replicated where they meet activations (Explicit meshes).
    return y if b is None else y + whole(b[...]).astype(dt)


class Attention(nnx.Module):
    """Grouped-query causal self-attention with rotary embeddings (and Qwen3's
    per-head q/k norm). Q/K/V split column-wise over ``heads`` / ``kv_heads``,
    O row-wise over ``heads``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        e, h, g, k, dt = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.param_dtype
        self.q = _param(rngs, _dense_init(e), (e, h, k), ("embed", "heads", "kv"), dt)
        self.k = _param(rngs, _dense_init(e), (e, g, k), ("embed", "kv_heads", "kv"), dt)
        self.v = _param(rngs, _dense_init(e), (e, g, k), ("embed", "kv_heads", "kv"), dt)
        self.o = _param(rngs, _dense_init(h * k), (h, k, e), ("heads", "kv", "embed"), dt)
        bias = cfg.attention_bias
        self.q_bias = _bias(rngs, bias, (h, k), ("heads", "kv"), dt)
        self.k_bias = _bias(rngs, bias, (g, k), ("kv_heads", "kv"), dt)
        self.v_bias = _bias(rngs, bias, (g, k), ("kv_heads", "kv"), dt)
        self.o_bias = _bias(rngs, bias, (e,), ("embed",), dt)
        def norm() -> RMSNorm | None:
            return RMSNorm(k, ("kv",), cfg.norm_eps, cfg.dtype, dt, rngs=rngs) if cfg.qk_norm \
                else None

        self.q_norm: RMSNorm | None = nnx.data(norm())
        self.k_norm: RMSNorm | None = nnx.data(norm())
        self.kernel = cfg.attention
        self.dtype = cfg.dtype

    def __call__(self, x: jax.Array, cos: np.ndarray, sin: np.ndarray) -> jax.Array:
        dt = self.dtype
        heads = _seq(("batch", None, "heads", "kv"))
        kv_heads = _seq(("batch", None, "kv_heads", "kv"))
        q = _add(einsum("ble,ehk->blhk", x, self.q[...].astype(dt), heads, seq="l"),
                 self.q_bias, dt)
        k = _add(einsum("ble,egk->blgk", x, self.k[...].astype(dt), kv_heads, seq="l"),
                 self.k_bias, dt)
        v = _add(einsum("ble,egk->blgk", x, self.v[...].astype(dt), kv_heads, seq="l"),
                 self.v_bias, dt)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # k, v keep their kv_heads: the op groups the query heads per key/value head.
        out = attention(q, k, v, causal=True, implementation=self.kernel)
        return _add(einsum("blhk,hke->ble", out, self.o[...].astype(dt), RESIDUAL, seq="l"),
                    self.o_bias, dt)

    def init_cache(self, batch: int, length: int, layers: int | None = None) -> None:
        """Creates the key/value cache ``[batch, length, kv_heads, head_dim]``
        (``layers`` stacked in front for scanned blocks): grouped-query attention
        caches its ``kv_heads`` only, never the repeated ones."""
        shape = (batch, length, *self.k.shape[-2:])
        self.cached_key = kv_cache.new(shape, self.dtype, layers)
        self.cached_value = kv_cache.new(shape, self.dtype, layers)

    def decode(self, x: jax.Array, index: jax.Array, cos: jax.Array,
               sin: jax.Array) -> jax.Array:
        """Attention of ``x [batch, T, embed]`` at positions ``index ..`` (their
        rotary tables ``cos``, ``sin``) against the cache, after storing its
        keys and values there."""
        dt = self.dtype
        heads, kv_heads = ("batch", None, "heads", "kv"), ("batch", None, "kv_heads", "kv")
        q = _add(einsum("ble,ehk->blhk", x, self.q[...].astype(dt), heads), self.q_bias, dt)
        k = _add(einsum("ble,egk->blgk", x, self.k[...].astype(dt), kv_heads), self.k_bias, dt)
        v = _add(einsum("ble,egk->blgk", x, self.v[...].astype(dt), kv_heads), self.v_bias, dt)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        self.cached_key[...] = kv_cache.write(self.cached_key[...], k, index)
        self.cached_value[...] = kv_cache.write(self.cached_value[...], v, index)
        out = kv_cache.attend(q, self.cached_key[...], self.cached_value[...], index)
        return _add(einsum("blhk,hke->ble", constrain(out, heads), self.o[...].astype(dt),
                           RESIDUAL), self.o_bias, dt)


class MLP(nnx.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))``; gate and up split column-wise,
    down row-wise over ``mlp``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        e, m, dt = cfg.embed, cfg.mlp, cfg.param_dtype
        self.gate = _param(rngs, _dense_init(e), (e, m), ("embed", "mlp"), dt)
        self.up = _param(rngs, _dense_init(e), (e, m), ("embed", "mlp"), dt)
        self.down = _param(rngs, _dense_init(m), (m, e), ("mlp", "embed"), dt)
        self.gate_bias = _bias(rngs, cfg.mlp_bias, (m,), ("mlp",), dt)
        self.up_bias = _bias(rngs, cfg.mlp_bias, (m,), ("mlp",), dt)
        self.down_bias = _bias(rngs, cfg.mlp_bias, (e,), ("embed",), dt)
        self.dtype = cfg.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        dt = self.dtype
        hidden = _seq(("batch", None, "mlp"))
        g = _add(einsum("ble,em->blm", x, self.gate[...].astype(dt), hidden, seq="l"),
                 self.gate_bias, dt)
        u = _add(einsum("ble,em->blm", x, self.up[...].astype(dt), hidden, seq="l"),
                 self.up_bias, dt)
        return _add(einsum("blm,me->ble", jax.nn.silu(g) * u, self.down[...].astype(dt),
                           RESIDUAL, seq="l"), self.down_bias, dt)


class Block(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        def norm() -> RMSNorm:
            return RMSNorm(cfg.embed, ("embed",), cfg.norm_eps, cfg.dtype, cfg.param_dtype,
                           rngs=rngs)

        self.attn_norm = norm()
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, cos: np.ndarray, sin: np.ndarray) -> jax.Array:
        x = x + self.attn(constrain(self.attn_norm(x), _block_input()), cos, sin)
        x = constrain(x, RESIDUAL)
        y = self.mlp(constrain(self.mlp_norm(x), _block_input()))
        return constrain(x + y, RESIDUAL)

    def decode(self, x: jax.Array, index: jax.Array, cos: jax.Array,
               sin: jax.Array) -> jax.Array:
        """The block on new positions ``index ..`` only, attending through the cache."""
        x = x + self.attn.decode(constrain(self.attn_norm(x), GATHERED), index, cos, sin)
        x = constrain(x, RESIDUAL)
        y = self.mlp(constrain(self.mlp_norm(x), GATHERED))
        return constrain(x + y, RESIDUAL)


def _block_runner(cfg: LlamaConfig, cos: np.ndarray, sin: np.ndarray) -> Any:
    def call(block: Block, x: jax.Array) -> jax.Array:
        return block(x, cos, sin)

    if cfg.remat == "none":
        return call
    # As in the reference transformer: scan's loop boundary already prevents CSE.
    return nnx.remat(call, policy=remat_policy(cfg.remat), prevent_cse=not cfg.scan_layers)


class Llama(nnx.Module):
    """Llama-family decoder LM (Llama 2/3, Qwen3): ``int32 [batch, length] ->
    float32 logits [batch, length, vocab]``.

    Parameter paths (``blocks/<i>/...``, or ``blocks/...`` stacked on a leading
    ``layers`` axis with ``scan_layers``): ``token_embed [vocab, embed]``,
    ``attn_norm/scale``, ``attn/q [embed, heads, head_dim]``, ``attn/k`` and
    ``attn/v [embed, kv_heads, head_dim]``, ``attn/o [heads, head_dim, embed]``
    (``attn/q_norm/scale``, ``attn/k_norm/scale`` for Qwen3; ``attn/*_bias``
    with ``attention_bias``), ``mlp_norm/scale``, ``mlp/gate``, ``mlp/up [embed,
    mlp]``, ``mlp/down [mlp, embed]``, ``final_norm/scale``, ``unembed [embed,
    vocab]`` (absent when tied). :data:`nnx_shard.hf.LLAMA_MAPPING` maps them to
    Hugging Face names.

    :func:`nnx_shard.models.lm_loss` trains it (next-token cross-entropy).

    >>> cfg = get_llama_config("tiny_qwen3")
    >>> model = Llama(cfg, rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((2, 16), jnp.int32)).shape, model.unembed is None
    ((2, 16, 128), True)
    >>> model.blocks[0].attn.q_norm.scale.get_metadata("out_sharding")
    ('kv',)
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        if not isinstance(cfg, LlamaConfig):
            raise TypeError(f"Llama: cfg must be a LlamaConfig, got {type(cfg).__name__} "
                            f"{short(cfg, 60)}. Fix: e.g. Llama(get_llama_config('llama3-8b'), "
                            "rngs=nnx.Rngs(0)), or LlamaConfig.from_hf(path)")
        self.cfg = cfg
        remat_policy(cfg.remat)  # an unsupported policy fails here, not at the first step
        e, dt = cfg.embed, cfg.param_dtype
        self.token_embed = _param(rngs, nnx.initializers.normal(1.0), (cfg.vocab, e),
                                  ("vocab", "embed"), dt)
        if cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def make(r: nnx.Rngs) -> Block:
                return Block(cfg, rngs=r)

            self.blocks: Any = make(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.layers)])
        self.final_norm = RMSNorm(e, ("embed",), cfg.norm_eps, cfg.dtype, dt, rngs=rngs)
        self.unembed: nnx.Param | None = nnx.data(
            None if cfg.tie_embeddings
            else _param(rngs, _dense_init(e), (e, cfg.vocab), ("embed", "vocab"), dt)
        )

    def forward(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(logits, 0.0)``: the logits and a zero auxiliary loss, the
        interface :func:`nnx_shard.models.lm_loss` reads.

        >>> model = Llama(get_llama_config("tiny"), rngs=nnx.Rngs(0))
        >>> logits, aux = model.forward(jnp.zeros((1, 8), jnp.int32))
        >>> logits.dtype, float(aux)
        (dtype('float32'), 0.0)
        """
        cfg = self.cfg
        if option("collective_matmul", False):
            check_tokens(tokens.shape)
        cos, sin = _rotary_tables(cfg, tokens.shape[1])
        x = lookup(self.token_embed[...].astype(cfg.dtype), tokens, RESIDUAL)
        run = _block_runner(cfg, cos, sin)
        if cfg.scan_layers:
            graphdef, state = nnx.split(self.blocks)

            def body(h: Any, layer: Any) -> tuple[Any, None]:
                return run(nnx.merge(graphdef, layer), h), None

            # The plain scan, or a pipeline under a pp strategy (nnx_shard.pipeline).
            x, _ = pipeline.scan(body, x, state)
        else:
            for block in self.blocks:
                x = run(block, x)
        return self._logits(x), jnp.zeros((), jnp.float32)

    def _logits(self, x: jax.Array) -> jax.Array:
        cfg = self.cfg
        x = constrain(self.final_norm(x), _seq(GATHERED))
        names = _seq(("batch", None, "vocab"))
        if self.unembed is None:
            logits = einsum("ble,ve->blv", x, self.token_embed[...].astype(cfg.dtype), names)
        else:
            logits = einsum("ble,ev->blv", x, self.unembed[...].astype(cfg.dtype), names)
        # The product comes out in the compute dtype and is cast up for the softmax and
        # the loss (as MaxText does by default): asking the matmul for float32 output
        # (preferred_element_type) made XLA's partitioner all-gather the unembedding's
        # float32 gradient under fsdp (1.12x the gathered bytes of casting after).
        return logits.astype(jnp.float32)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.forward(tokens)[0]

    @property
    def max_length(self) -> int:
        """The context: the most positions a sequence can have (``cfg.max_length``,
        transformers' ``max_position_embeddings``)."""
        return self.cfg.max_length

    def init_cache(self, batch: int, length: int) -> None:
        """Creates an empty key/value cache for ``batch`` sequences of up to
        ``length`` positions (what :func:`nnx_shard.models.generate` calls inside
        its compiled prefill): ``cached_key`` and ``cached_value [batch, length,
        kv_heads, head_dim]`` on every attention layer, named ``cache_batch``,
        ``cache_length``, ``cache_kv_heads``, ``cache_head_dim`` (``layers`` first
        for stacked blocks), and the position of the next token, ``cache_index``.

        >>> model = Llama(get_llama_config("tiny"), rngs=nnx.Rngs(0))
        >>> model.init_cache(batch=2, length=16)
        >>> model.blocks[0].attn.cached_value.shape    # 2 key/value heads of 8
        (2, 16, 2, 8)
        """
        layers = self.cfg.layers if self.cfg.scan_layers else None
        if layers is None:
            for block in self.blocks:
                block.attn.init_cache(batch, length)
        else:
            self.blocks.attn.init_cache(batch, length, layers)
        self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

    def decode(self, tokens: jax.Array) -> jax.Array:
        """Logits ``[batch, T, vocab]`` of ``tokens [batch, T]`` placed after the
        ones already in the cache (from :meth:`init_cache`), whose keys and values
        it stores. The logits equal those of :meth:`__call__` on the whole
        sequence at these positions (up to float rounding).

        >>> model = Llama(get_llama_config("tiny_qwen3"), rngs=nnx.Rngs(0))
        >>> tokens = jnp.arange(6, dtype=jnp.int32)[None]
        >>> model.init_cache(batch=1, length=8)
        >>> first, last = model.decode(tokens[:, :5]), model.decode(tokens[:, 5:])
        >>> bool(jnp.allclose(last[:, 0], model(tokens)[:, 5], atol=1e-4))
        True
        """
        cfg = self.cfg
        index = self.cache_index[...]
        steps = tokens.shape[1]
        cos, sin = _rotary_at(cfg, index, steps)
        x = lookup(self.token_embed[...].astype(cfg.dtype), tokens, RESIDUAL)
        x = kv_cache.decode_layers(self.blocks, cfg.scan_layers, x,
                                   lambda block, h: block.decode(h, index, cos, sin))
        self.cache_index[...] = index + steps
        return self._logits(x)


_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
_BIG = dict(scan_layers=True, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)

#: Named configurations. ``tiny`` (grouped-query Llama) and ``tiny_qwen3``
#: (q/k norm, ``head_dim`` != ``embed / heads``, tied embeddings) are for tests;
#: the others carry the published shapes of Llama 3.1 8B / 70B / 405B and
#: Qwen3-0.6B (from their ``config.json``; Llama 3's 8B and 70B have the same
#: shapes, without ``rope_scaling``), with stacked layers and bfloat16
#: parameters, for planning with :func:`nnx_shard.abstract_init`.
LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(max_length=64),
    "tiny_qwen3": LlamaConfig(head_dim=16, qk_norm=True, tie_embeddings=True,
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
}


def get_llama_config(name: str) -> LlamaConfig:
    """A named :class:`LlamaConfig` from :data:`LLAMA_CONFIGS`: ``tiny``,
    ``tiny_qwen3`` (tests), ``llama3-8b``, ``llama3-70b``, ``llama3-405b``,
    ``qwen3-0.6b`` (published shapes; plan them with
    :func:`nnx_shard.abstract_init`, nothing is allocated).

    >>> get_llama_config("llama3-70b").kv_heads
    8
    >>> get_llama_config("llama-8b")
    Traceback (most recent call last):
    ...
    ValueError: unknown Llama config 'llama-8b'. Did you mean 'llama3-8b'? Known: tiny, tiny_qwen3, llama3-8b, llama3-70b, llama3-405b, qwen3-0.6b
    """
    try:
        return LLAMA_CONFIGS[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, LLAMA_CONFIGS, n=1)
        mean = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown Llama config {name!r}.{mean} Known: {', '.join(LLAMA_CONFIGS)}"
        ) from None
