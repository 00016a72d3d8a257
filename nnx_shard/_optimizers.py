"""Optimizers by name, for the planner and the ``nnx-shard`` command: the optax
transformation whose state layout a plan, a report or a compile needs."""

from __future__ import annotations

from collections.abc import Callable

import optax

from nnx_shard._errors import UsageError

__all__ = ["NAMES", "get"]

_MAKERS: dict[str, Callable[[float], optax.GradientTransformation]] = {
    "adamw": optax.adamw, "adam": optax.adam, "sgd": optax.sgd,
}

#: The optimizer names :func:`get` knows.
NAMES: tuple[str, ...] = tuple(_MAKERS)


def get(name: str, learning_rate: float = 1e-3) -> optax.GradientTransformation:
    """The optax optimizer ``name`` (one of :data:`NAMES`) with ``learning_rate``.

    >>> get("sgd").init({"w": 1.0})
    (EmptyState(), EmptyState())
    >>> get("adagrad")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: unknown optimizer 'adagrad'. Fix: one of adamw, adam, sgd
    """
    if name not in _MAKERS:
        raise UsageError(f"unknown optimizer {name!r}. Fix: one of {', '.join(NAMES)}")
    return _MAKERS[name](learning_rate)
