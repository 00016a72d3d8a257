"""The rotary position tables of the Llama-family decoder: the inverse frequencies of a
config (its ``rope_scaling`` applied by :mod:`nnx_shard.models._rope`), the ``cos`` /
``sin`` tables of a static length, of a traced decode position or of per-token
positions, and the rotation itself in transformers' half-split convention. The
sliding layers of a family with their own rotary base (``rope_local_theta``) take
``local=True``.

>>> from nnx_shard.models import get_config
>>> cos, sin = rotary_tables(get_config("llama-tiny"), 4)
>>> cos.shape, float(cos[0, 0])
((4, 8), 1.0)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard.models import _rope as rope
from nnx_shard.models._decoder_config import DecoderConfig
from nnx_shard.models._layout import GATHERED, seq_names
from nnx_shard.models._ops import constrain

__all__ = ["own_local_rotation", "rope_frequencies", "rotary_at", "rotary_of", "rotary_tables",
           "rotate", "scaled", "scaled_at", "times"]


def rope_frequencies(cfg: DecoderConfig, local: bool = False, seq_len: int | None = None
                     ) -> np.ndarray:
    """The rotary inverse frequencies ``[head_dim / 2]`` (float32) of a sequence of
    ``seq_len`` positions, with the config's ``rope_scaling`` applied as transformers
    computes it (:func:`nnx_shard.models._rope.frequencies`); ``local``: the sliding
    layers' (base ``rope_local_theta`` when the config has one, never scaled, as
    Gemma 3's).

    >>> from nnx_shard.models import get_config
    >>> rope_frequencies(get_config("llama-tiny"))[:2]
    array([1.  , 0.1], dtype=float32)
    """
    return scaled(cfg, local, seq_len)[0]


def own_local_rotation(cfg: DecoderConfig) -> bool:
    """Whether the sliding layers rotate by a base of their own (Gemma 3's
    ``rope_local_theta``), so that they need tables apart from the global layers'.

    >>> from nnx_shard.models import DecoderConfig
    >>> own_local_rotation(DecoderConfig.for_model("gemma3_text", rope_local_theta=1e4))
    True
    """
    return bool(cfg.local_theta())


def scaled(cfg: DecoderConfig, local: bool, seq_len: int | None = None
            ) -> tuple[np.ndarray, float]:
    """``(inv_freq, attention_factor)``: the factor scales cos and sin."""
    if local and own_local_rotation(cfg):
        return rope.default(cfg, cfg.local_theta())
    return rope.frequencies(cfg, seq_len)


def scaled_at(cfg: DecoderConfig, local: bool, seq_len: Any) -> tuple[jax.Array, float]:
    """:func:`scaled` for a traced sequence length (``dynamic`` / ``longrope``
    choose their frequencies by it)."""
    if local and own_local_rotation(cfg):
        inv, factor = scaled(cfg, True)
        return jnp.asarray(inv), factor
    return rope.frequencies_at(cfg, seq_len)


def rotary_tables(cfg: DecoderConfig, length: int, local: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    # Host constants (the positions are static): nothing traced is closed over
    # by the scanned or pipelined layer body. The sequence length is ``length``.
    inv, factor = scaled(cfg, local, length)
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return ((np.cos(emb) * np.float32(factor)).astype(np.float32),
            (np.sin(emb) * np.float32(factor)).astype(np.float32))


def rotary_at(cfg: DecoderConfig, index: jax.Array, steps: int, local: bool = False
               ) -> tuple[jax.Array, jax.Array]:
    """The rotary tables of positions ``index .. index + steps - 1`` (``index``
    traced: the decode step's position; the sequence length ``index + steps``),
    computed as :func:`rotary_tables`."""
    inv, factor = scaled_at(cfg, local, index + steps)
    positions = (index + jnp.arange(steps, dtype=jnp.int32)).astype(jnp.float32)
    freqs = positions[:, None] * inv[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return times(jnp.cos(emb), factor), times(jnp.sin(emb), factor)


def times(table: jax.Array, factor: float) -> jax.Array:
    return table if factor == 1.0 else table * jnp.float32(factor)


def rotary_of(cfg: DecoderConfig, positions: jax.Array, local: bool = False
               ) -> tuple[jax.Array, jax.Array]:
    """The rotary tables ``[batch, length, head_dim]`` of per-token ``positions
    [batch, length]`` (the sequence length: the highest position + 1), computed as
    :func:`rotary_tables`, laid out like the queries they rotate (whole sequence;
    split under context parallelism)."""
    inv, factor = scaled_at(cfg, local, jnp.max(positions) + 1)
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return (constrain(times(jnp.cos(emb), factor), seq_names(GATHERED)),
            constrain(times(jnp.sin(emb), factor), seq_names(GATHERED)))


def rotate(x: jax.Array, cos: Any, sin: Any) -> jax.Array:
    """Rotary embedding of ``x [batch, length, heads, head_dim]`` in transformers'
    half-split convention (its checkpoints store q/k rows in that order); the tables
    are ``[length, head_dim]`` (shared by the batch) or ``[batch, length, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    c = jnp.asarray(cos, x.dtype)
    s = jnp.asarray(sin, x.dtype)
    c, s = (c[None, :, None, :], s[None, :, None, :]) if c.ndim == 2 else \
        (c[:, :, None, :], s[:, :, None, :])
    return x * c + rotated * s
