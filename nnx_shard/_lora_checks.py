"""The checks of :func:`~nnx_shard.lora`'s arguments (:mod:`nnx_shard._low_rank`), made
before the model is looked at: the rank, alpha and dropout, the ``targets`` regex, the
seed and the factors' dtype (the quantization options are
:func:`~nnx_shard._quantized.check_quantize`'s). Each refusal is a
:class:`~nnx_shard._errors.UsageError` naming the argument and a value that works.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_shard._errors import UsageError, count, short

__all__ = ["as_rngs", "check_dtype", "check_scalars", "check_targets"]


def check_scalars(rank: Any, alpha: Any, dropout: Any) -> tuple[int, float, float]:
    """``(rank, alpha, dropout)`` checked: a positive int rank, a finite alpha and a
    dropout in ``[0, 1)``, the last two as floats.

    >>> check_scalars(8, 16, 0)
    (8, 16.0, 0.0)
    """
    r = count(rank, "lora rank", fix="e.g. ns.lora(model, rank=8, alpha=16)")
    if isinstance(alpha, bool | np.bool_) or not isinstance(alpha, int | float | np.number) \
            or not math.isfinite(float(alpha)):
        raise UsageError(f"lora alpha must be a finite number, got {short(alpha, 60)} "
                         f"({type(alpha).__name__}). Fix: e.g. alpha=16 (the update is "
                         "scaled by alpha / rank, as PEFT does)")
    if isinstance(dropout, bool | np.bool_) or not isinstance(dropout, int | float | np.number) \
            or not 0.0 <= float(dropout) < 1.0:
        raise UsageError(
            f"lora dropout must be a number in [0, 1), got {short(dropout, 60)} "
            f"({type(dropout).__name__}): the probability of dropping each input of the "
            "adapter while training. Fix: e.g. dropout=0.05, or 0.0 for none")
    return r, float(alpha), float(dropout)


def check_targets(targets: Any) -> re.Pattern[str]:
    """The ``targets`` regex, compiled.

    >>> check_targets("attn/(q|v)$").search("blocks/0/attn/q") is not None
    True
    """
    if not isinstance(targets, str):
        raise UsageError(f"lora targets must be a regex string, got {short(targets, 60)} "
                         f"({type(targets).__name__}). Fix: e.g. targets=r'attn/(q|v)$'")
    try:
        return re.compile(targets)
    except re.error as e:
        raise UsageError(f"lora targets {targets!r} is not a regex ({e}). "
                         "Fix: e.g. targets=r'attn/(q|v)$'") from e


def as_rngs(rngs: Any) -> nnx.Rngs:
    """``rngs`` as an ``nnx.Rngs`` (an int is its seed)."""
    if isinstance(rngs, int) and not isinstance(rngs, bool):
        rngs = nnx.Rngs(rngs)
    if not isinstance(rngs, nnx.Rngs):
        raise UsageError(f"lora rngs must be an nnx.Rngs or an int seed, got {short(rngs, 60)}. "
                         "Fix: e.g. rngs=0")
    return rngs


def check_dtype(dtype: Any) -> np.dtype[Any]:
    """The factors' dtype, a float type.

    >>> check_dtype("bfloat16")
    dtype(bfloat16)
    """
    try:
        dt = jnp.dtype(dtype)
    except TypeError as e:
        raise UsageError(f"lora dtype {short(dtype, 60)} is not a dtype. "
                         "Fix: e.g. dtype=jnp.float32") from e
    if not jnp.issubdtype(dt, jnp.floating):
        raise UsageError(f"lora dtype must be a float type, got {dt}. Fix: dtype=jnp.float32")
    return dt
