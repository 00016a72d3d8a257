"""What every model config shares: the remat policies it names
(:data:`REMAT_POLICIES`, :func:`remat_policy`) and the checks of its fields
(:func:`check_fields`, :func:`check_kernel_and_remat`)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnx_shard._attention import KERNELS
from nnx_shard._errors import UsageError, short

__all__ = ["REMAT_POLICIES", "check_fields", "check_kernel_and_remat", "remat_policy"]


REMAT_POLICIES: dict[str, str] = {
    "none": "keep every intermediate of each block for the backward pass (no remat)",
    "full": "save only each block's input; recompute the rest of the block in the backward "
            "pass (jax.checkpoint_policies.nothing_saveable)",
    "dots": "save matmul outputs without batch dimensions, recompute the rest "
            "(jax.checkpoint_policies.dots_with_no_batch_dims_saveable)",
    "offload": "as 'dots', but move the saved matmul outputs to pinned host memory "
               "(jax.checkpoint_policies.offload_dot_with_no_batch_dims)",
}


def check_fields(cfg: Any, counts: tuple[str, ...], *, whole0: tuple[str, ...] = (),
                 positive: tuple[str, ...] = (), finite: tuple[str, ...] = (),
                 flags: tuple[str, ...] = (), where: str | None = None) -> None:
    """A config's fields checked by kind, each failure a ``UsageError`` naming the
    field: ``counts`` whole numbers >= 1, ``whole0`` whole numbers (their range is
    checked by the config), ``positive`` finite numbers > 0, ``finite`` finite
    numbers, ``flags`` bools; ``dtype`` and ``param_dtype`` NumPy/JAX dtypes (when the
    config has them). A bool is no count and ``"128"`` no size: both would fail deep
    inside a layer. Messages name ``where`` (default: the config's class) ``.field``."""
    where = where or type(cfg).__name__

    def bad(f: str, want: str) -> UsageError:
        return UsageError(f"{where}.{f} must be {want}, got {short(getattr(cfg, f), 60)} "
                          f"({type(getattr(cfg, f)).__name__}). Fix: e.g. "
                          f"{where}({f}={getattr(type(cfg), f, 4)!r})")

    def is_int(v: Any) -> bool:
        return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)

    def is_real(v: Any) -> bool:
        return isinstance(v, int | float | np.integer | np.floating) and not isinstance(
            v, bool | np.bool_) and math.isfinite(v)

    for f in counts:
        if not is_int(getattr(cfg, f)) or getattr(cfg, f) < 1:
            raise bad(f, ">= 1 (a whole count)")
    for f in whole0:
        if not is_int(getattr(cfg, f)):
            raise bad(f, "a whole number")
    for f in positive:
        if not is_real(getattr(cfg, f)) or getattr(cfg, f) <= 0:
            raise bad(f, "a finite number > 0")
    for f in finite:
        if not is_real(getattr(cfg, f)):
            raise bad(f, "a finite number")
    for f in flags:
        if not isinstance(getattr(cfg, f), bool):
            raise bad(f, "True or False")
    _check_dtypes(cfg, where)


def check_kernel_and_remat(cfg: Any, where: str | None = None) -> None:
    """``cfg.attention`` names an attention kernel and ``cfg.remat`` a remat policy
    (shared by every model config; messages name ``where``, default: its class)."""
    where = where or type(cfg).__name__
    if cfg.attention not in KERNELS:
        raise UsageError(
            f"{where}.attention={cfg.attention!r} is not an attention kernel; "
            "valid: " + ", ".join(repr(k) for k in KERNELS) + ". Fix: e.g. "
            f"{where}(attention='auto')."
        )
    if cfg.remat not in REMAT_POLICIES:
        raise UsageError(
            f"{where}.remat={cfg.remat!r} is not a remat policy; valid: "
            + ", ".join(repr(k) for k in REMAT_POLICIES) + f". Fix: e.g. {where}(remat='full')."
        )


def _check_dtypes(cfg: Any, where: str) -> None:
    for f in ("dtype", "param_dtype"):
        try:
            jnp.dtype(getattr(cfg, f))
        except TypeError:
            raise UsageError(f"{where}.{f} must be a dtype, got {short(getattr(cfg, f), 60)}. "
                             f"Fix: e.g. {f}=jnp.float32 or {f}='bfloat16'") from None



def remat_policy(name: str) -> Any:
    """The ``jax.checkpoint`` policy of a :data:`REMAT_POLICIES` name: ``None``
    for ``"none"`` (no remat at all), else the callable ``nnx.remat`` gets.

    ``"offload"`` needs host memory on the default backend and raises a
    :class:`~nnx_shard.UsageError` naming the alternatives where there is none.

    Args:
      name: one of :data:`REMAT_POLICIES` (``none``, ``full``, ``dots``, ``offload``).

    >>> import jax
    >>> from nnx_shard.models import remat_policy
    >>> remat_policy("none") is None
    True
    >>> remat_policy("full") is jax.checkpoint_policies.nothing_saveable
    True
    >>> remat_policy("everything")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: unknown remat policy 'everything'; valid: 'none', 'full', 'dots', 'offload'. Fix: e.g. remat='full'.
    """
    if name not in REMAT_POLICIES:
        raise UsageError(f"unknown remat policy {name!r}; valid: "
                         + ", ".join(repr(k) for k in REMAT_POLICIES) + ". Fix: e.g. remat='full'.")
    cp = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":
        return cp.nothing_saveable
    if name == "dots":
        return cp.dots_with_no_batch_dims_saveable
    device = jax.devices()[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
        raise UsageError(
            f"remat='offload' moves saved activations to pinned host memory, but the "
            f"{device.platform} backend ({device.device_kind}) has no 'pinned_host' memory "
            f"(its memories: {', '.join(sorted(kinds))}). Fix: use remat='dots' (same "
            "activations kept on the device) or remat='full' (least memory)."
        )
    return cp.offload_dot_with_no_batch_dims("device", "pinned_host")

