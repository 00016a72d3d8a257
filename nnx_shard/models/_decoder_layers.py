"""The layers of the shared decoder (:class:`~nnx_shard.models.Decoder`): grouped-query
causal self-attention with rotary embeddings (:class:`DecoderAttention`) and the MLP
(:class:`DecoderMLP`, gated as Llama's, or a plain two-layer MLP for a family whose
record says ``gated_mlp=False``), with the helpers its blocks share (norms, biases,
sliding-window masks).

>>> from flax import nnx
>>> from nnx_shard.models._decoder_config import DecoderConfig
>>> DecoderMLP(DecoderConfig(), rngs=nnx.Rngs(0))(jnp.ones((1, 4, 32))).shape
(1, 4, 32)
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_shard._attention import attention
from nnx_shard.models import _kv_cache as kv_cache
from nnx_shard.models._config_bases import AttentionBiasConfig, MLPBiasConfig, WindowConfig
from nnx_shard.models._decoder_config import DecoderConfig
from nnx_shard.models._layers import ACTIVATION_FNS, RMSNorm, dense_init, new_param
from nnx_shard.models._layout import GATHERED, RESIDUAL, seq_names
from nnx_shard.models._masks import NO_EXTRAS, Extras
from nnx_shard.models._ops import constrain, project, whole
from nnx_shard.models._rotary import rotate

__all__ = ["CappedAttention", "DecoderAttention", "DecoderMLP", "norm_of"]


def norm_of(cfg: Any, size: int | tuple[int, ...], names: tuple[str, ...], rngs: nnx.Rngs
            ) -> RMSNorm:
    """An RMSNorm of the config's epsilon, dtypes and family's weight offset."""
    return RMSNorm(size, names, cfg.norm_eps, cfg.dtype, cfg.param_dtype, rngs=rngs,
                   offset=cfg.family.norm_offset)


def _bias(rngs: nnx.Rngs, on: bool, shape: tuple[int, ...], names: tuple[Any, ...],
          dt: Any) -> nnx.Param | None:
    return nnx.data(new_param(rngs, nnx.initializers.zeros, shape, names, dt) if on else None)


def _add(y: jax.Array, b: nnx.Param | None, dt: Any) -> jax.Array:
    # Biases are small: replicated where they meet activations (Explicit meshes).
    return y if b is None else y + whole(b[...]).astype(dt)


def _windowed(mask: jax.Array | None, window: int | None, length: int) -> jax.Array | None:
    """``mask`` (``[batch, 1, 1, length]`` key padding, or ``None``) with the sliding
    window's band: query ``i`` sees keys ``j > i - window`` (transformers'
    ``sliding_window_overlay``, on indices in the sequence, as its masks are)."""
    if window is None or window >= length:
        return mask
    i = np.arange(length)
    band = jnp.asarray((i[None, :] > i[:, None] - window)[None, None])
    return band if mask is None else mask & band


def _layer_mask(mask: jax.Array | None, window: int | None, length: int, local: Any
                ) -> jax.Array | None:
    """The mask of a layer: the window's band where ``local`` (``None``: the layers
    are alike, every one windowed when ``window`` is set; else a traced flag, the
    scanned layer's own, selecting between the banded and the plain mask)."""
    banded = _windowed(mask, window, length)
    if local is None or banded is mask or banded is None:
        return banded
    return jnp.where(local, banded, True if mask is None else mask)




class DecoderAttention(nnx.Module):
    """Grouped-query causal self-attention with rotary embeddings (and Qwen3's
    per-head q/k norm). Q/K/V split column-wise over ``heads`` / ``kv_heads``,
    O row-wise over ``heads``. Transformers' ``DecoderAttention``.

    >>> attn = DecoderAttention(DecoderConfig(), rngs=nnx.Rngs(0))
    >>> attn.q.shape, attn.k.shape       # [embed, heads, head_dim], [embed, kv_heads, head_dim]
    ((32, 4, 8), (32, 2, 8))
    """

    #: The kernels projected through ``project`` (where ``ns.lora`` adapters apply).
    lora_kernels = ("q", "k", "v", "o")
    #: The logical name of the key/value heads (a family without grouped-query
    #: attention names them as the query heads, ``heads``).
    kv_axis = "kv_heads"

    def __init__(self, cfg: DecoderConfig, *, rngs: nnx.Rngs) -> None:
        e, h, g, k, dt = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.param_dtype
        self.q = new_param(rngs, dense_init(e), (e, h, k), ("embed", "heads", "kv"), dt)
        self.k = new_param(rngs, dense_init(e), (e, g, k), ("embed", "kv_heads", "kv"), dt)
        self.v = new_param(rngs, dense_init(e), (e, g, k), ("embed", "kv_heads", "kv"), dt)
        self.o = new_param(rngs, dense_init(h * k), (h, k, e), ("heads", "kv", "embed"), dt)
        # Only the configs of the families with the field have attention biases.
        biased = isinstance(cfg, AttentionBiasConfig) and cfg.attention_bias
        bias = biased or cfg.family.qkv_bias
        self.q_bias = _bias(rngs, bias, (h, k), ("heads", "kv"), dt)
        self.k_bias = _bias(rngs, bias, (g, k), ("kv_heads", "kv"), dt)
        self.v_bias = _bias(rngs, bias, (g, k), ("kv_heads", "kv"), dt)
        self.o_bias = _bias(rngs, biased, (e,), ("embed",), dt)
        qk_norm = cfg.family.qk_norm

        def norm(n: int, name: str) -> RMSNorm | None:
            # OLMo 2 normalizes all heads' features together, Qwen3 each head's.
            return {None: lambda: None, "all": lambda: norm_of(cfg, (n, k), (name, "kv"), rngs),
                    "head": lambda: norm_of(cfg, k, ("kv",), rngs)}[qk_norm]()

        self.q_norm: RMSNorm | None = nnx.data(norm(h, "heads"))
        self.k_norm: RMSNorm | None = nnx.data(norm(g, "kv_heads"))
        self.kernel = cfg.attention
        flags = cfg.local_layers()
        size = cfg.sliding_window if isinstance(cfg, WindowConfig) else None
        # Alike layers apply their window (if any) statically; mixed ones get a flag.
        self.window = size if all(flags) or not any(flags) else None
        self.mixed_window = size if self.window is None else None
        self.softcap: float | None = None
        self.q_factor: float | None = None
        self.dtype = cfg.dtype

    def _scaled(self, q: jax.Array) -> jax.Array:
        return q if self.q_factor is None else q * jnp.asarray(self.q_factor, q.dtype)

    def __call__(self, x: jax.Array, cos: Any, sin: Any, extras: Extras = NO_EXTRAS,
                 local: Any = None) -> jax.Array:
        dt = self.dtype
        heads = seq_names(("batch", None, "heads", "kv"))
        kv_heads = seq_names(("batch", None, self.kv_axis, "kv"))
        q = _add(project("ble,ehk->blhk", x, self, "q", dt, heads, seq="l"), self.q_bias, dt)
        k = _add(project("ble,egk->blgk", x, self, "k", dt, kv_heads, seq="l"), self.k_bias, dt)
        v = _add(project("ble,egk->blgk", x, self, "v", dt, kv_heads, seq="l"), self.v_bias, dt)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # None: a family without rotary embeddings
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        # k, v keep their kv_heads: the op groups the query heads per key/value head.
        mask = (_windowed(extras.mask, self.window, q.shape[1]) if self.mixed_window is None
                else _layer_mask(extras.mask, self.mixed_window, q.shape[1], local))
        out = attention(self._scaled(q), k, v, causal=True, mask=mask,
                        segment_ids=extras.segment_ids, implementation=self.kernel,
                        softcap=self.softcap)
        return _add(project("blhk,hke->ble", out, self, "o", dt, RESIDUAL, seq="l",
                            reduce=seq_names(GATHERED)),
                    self.o_bias, dt)

    def init_cache(self, batch: int, length: int, layers: int | None = None) -> None:
        """Creates the key/value cache ``[batch, kv_heads, length, head_dim]``
        (``layers`` stacked in front for scanned blocks): grouped-query attention
        caches its ``kv_heads`` only, never the repeated ones."""
        kv_cache.init_attention(self, batch, length, layers)

    def decode(self, x: jax.Array, index: jax.Array, cos: jax.Array | None,
               sin: jax.Array | None, valid: jax.Array | None = None, local: Any = None
               ) -> jax.Array:
        """Attention of ``x [batch, T, embed]`` at positions ``index ..`` (their
        rotary tables ``cos``, ``sin``; ``None`` without rotation) against the cache, after storing its
        keys and values there (``valid``: which cache positions hold real keys,
        :func:`kv_cache.valid_keys`)."""
        dt = self.dtype
        heads, kv_heads = ("batch", None, "heads", "kv"), ("batch", None, self.kv_axis, "kv")
        off: dict[str, Any] = {"deterministic": True}  # no adapter dropout while decoding
        q = _add(project("ble,ehk->blhk", x, self, "q", dt, heads, **off), self.q_bias, dt)
        k = _add(project("ble,egk->blgk", x, self, "k", dt, kv_heads, **off), self.k_bias, dt)
        v = _add(project("ble,egk->blgk", x, self, "v", dt, kv_heads, **off), self.v_bias, dt)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # None: a family without rotary embeddings
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        window: Any = self.window
        if self.mixed_window is not None and local is not None:
            # A traced flag: a window past any position where the layer is global.
            window = jnp.where(local, self.mixed_window, jnp.iinfo(jnp.int32).max // 2)
        out = kv_cache.store_and_attend(self, self._scaled(q), k, v, index, valid,
                                        window=window, softcap=self.softcap)
        return _add(project("blhk,hke->ble", constrain(out, heads), self, "o", dt, RESIDUAL,
                            **off), self.o_bias, dt)


class CappedAttention(DecoderAttention):
    """Gemma 2 / 3's attention: :class:`DecoderAttention` with the scores soft-capped
    (``attn_softcap``) and scaled by ``query_pre_attn_scalar`` (``query_scale``), fields
    of their config class (:class:`~nnx_shard.models._decoder.SandwichBlock`'s
    attention)."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, rngs=rngs)
        k, scale = cfg.head_dim, cfg.query_scale
        self.softcap = cfg.attn_softcap
        # query_pre_attn_scalar: the kernels divide by sqrt(head_dim); the queries
        # carry the rest of the factor.
        self.q_factor = None if scale is None or scale == k else math.sqrt(k / scale)


class DecoderMLP(nnx.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` (GELU-tanh in place of SiLU for
    Gemma); gate and up split column-wise, down row-wise over ``mlp``. Transformers'
    ``DecoderMLP``. A family with ``gated_mlp=False`` (the reference model) has no
    ``gate``: ``down(act(up(x)))``.

    >>> mlp = DecoderMLP(DecoderConfig(), rngs=nnx.Rngs(0))
    >>> mlp(jnp.ones((1, 4, 32))).shape
    (1, 4, 32)
    """

    #: The kernels projected through ``project`` (where ``ns.lora`` adapters apply).
    lora_kernels = ("gate", "up", "down")

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs) -> None:
        e, m, dt = cfg.embed, cfg.mlp, cfg.param_dtype
        gated = cfg.family.gated_mlp
        self.gate: nnx.Param | None = nnx.data(
            new_param(rngs, dense_init(e), (e, m), ("embed", "mlp"), dt) if gated else None)
        self.up = new_param(rngs, dense_init(e), (e, m), ("embed", "mlp"), dt)
        self.down = new_param(rngs, dense_init(m), (m, e), ("mlp", "embed"), dt)
        bias = isinstance(cfg, MLPBiasConfig) and cfg.mlp_bias
        self.gate_bias = _bias(rngs, bias and gated, (m,), ("mlp",), dt)
        self.up_bias = _bias(rngs, bias, (m,), ("mlp",), dt)
        self.down_bias = _bias(rngs, bias, (e,), ("embed",), dt)
        self.activation = ACTIVATION_FNS[cfg.activation]
        self.dtype = cfg.dtype

    def __call__(self, x: jax.Array, deterministic: bool | None = None) -> jax.Array:
        """``deterministic=True``: no adapter dropout (decoding)."""
        dt = self.dtype
        off: dict[str, Any] = {"deterministic": deterministic}
        hidden = seq_names(("batch", None, "mlp"))
        g = None if self.gate is None else _add(
            project("ble,em->blm", x, self, "gate", dt, hidden, seq="l", **off),
            self.gate_bias, dt)
        u = _add(project("ble,em->blm", x, self, "up", dt, hidden, seq="l", **off),
                 self.up_bias, dt)
        h = self.activation(u) if g is None else self.activation(g) * u
        return _add(project("blm,me->ble", h, self, "down", dt, RESIDUAL, seq="l",
                            reduce=seq_names(GATHERED), **off),
                    self.down_bias, dt)
