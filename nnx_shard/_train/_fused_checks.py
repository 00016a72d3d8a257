"""The checks of the fused call's arguments (:mod:`._fused`), made on the host before
anything compiles or runs: :func:`~nnx_shard.multistep`'s
options, the data's leading steps axis K (one K for every leaf, none split over
devices) and each device's rows splitting into the microbatches. The messages name
the step's own parameters (:class:`ArgNames`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from nnx_shard._errors import ShardingError, UsageError, count, short
from nnx_shard._train._microbatch import check_device_rows, spec_axes
from nnx_shard._train._trees import is_node

__all__ = ["ArgNames", "check_microbatch_rows", "check_options", "check_steps_axis", "steps"]


def _arg_names(fn: Callable[..., Any], n: int) -> list[str]:
    """Names of fn's first n positional parameters (``args[i]`` where unknown)."""
    names = [f"args[{i}]" for i in range(n)]
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return names
    for i, p in enumerate(params[:n]):
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names[i] = p.name
        elif p.kind == p.VAR_POSITIONAL:
            break
    return names


class ArgNames:
    """The names errors give the step's ``n`` positional arguments: its parameters'
    (``args[i]`` where unknown), read from its signature once per ``n``, when a
    message first needs them.

    >>> def step(model, optimizer, batch): ...
    >>> ArgNames(step)(4)
    ['model', 'optimizer', 'batch', 'args[3]']
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._by_count: dict[int, list[str]] = {}

    def __call__(self, n: int) -> list[str]:
        names = self._by_count.get(n) or _arg_names(self.fn, n)
        self._by_count[n] = names
        return names


def steps(args: tuple[Any, ...], node_pos: tuple[int, ...], names: ArgNames) -> int:
    """The number of steps K: the leading axis every leaf of the data arguments (those
    not at ``node_pos``) shares; a :class:`UsageError` listing each leaf's where they
    disagree or there is none."""
    ks: set[int | None] = set()
    for i, a in enumerate(args):
        if i not in node_pos:
            ks.update(np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(a))
    if len(ks) == 1 and None not in ks and 0 not in ks:
        check_steps_axis(args, node_pos, names)
        return ks.pop()  # type: ignore[return-value]
    named = names(len(args))
    seen: list[tuple[str, Any, int | None]] = []
    for i, a in enumerate(args):
        if i in node_pos:
            continue
        for path, x in jax.tree_util.tree_flatten_with_path(a)[0]:
            shape = np.shape(x)
            seen.append((named[i] + jax.tree_util.keystr(path), shape, shape[0] if shape else None))
    if not seen:
        raise UsageError(
            "multistep needs at least one array argument with a leading steps axis K "
            "(e.g. a batch shaped [K, batch, ...]) to know how many steps to run. Fix: "
            "pass the step batches stacked [K, batch, ...], e.g. fused(model, optimizer, "
            "np.stack(step_batches))."
        )
    listing = "; ".join(
        f"{p} has shape {s} -> K={k if k is not None else 'none (scalar)'}" for p, s, k in seen
    )
    raise UsageError(
        "batch leaves disagree on the number of steps K (their leading axis): "
        f"{listing}. Every leaf of the data arguments needs the same leading steps "
        "axis, laid out [K, batch, ...] (not [batch, K, ...]). Fix: stack the K step "
        "batches with np.stack, or use shard_batch(..., steps=True)."
    )


def check_steps_axis(args: tuple[Any, ...], node_pos: tuple[int, ...], names: ArgNames) -> None:
    """The leading axis K is scanned over, so every device holds all K steps: a leaf
    whose leading axis is split over devices is a batch without its K axis (e.g.
    one step's batch from ``shard_batch``, whose rows would be taken as steps)."""
    for i, a in enumerate(args):
        if i in node_pos:
            continue
        for path, x in jax.tree_util.tree_flatten_with_path(a)[0]:
            if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
                continue
            if x.sharding.shard_shape(x.shape)[0] == x.shape[0]:
                continue
            raise ShardingError(
                f"multistep: {names(len(args))[i] + jax.tree_util.keystr(path)} has shape "
                f"{tuple(x.shape)} with its leading axis split over devices "
                f"({x.sharding.spec if hasattr(x.sharding, 'spec') else x.sharding}), so "
                "it is not the steps axis K, which every device holds whole: this looks "
                "like one step's batch, whose rows would be run as steps. Fix: lay the "
                "data out [K, batch, ...], e.g. shard_batch(np.stack(step_batches), mesh, "
                "rules, steps=True)")


def check_microbatch_rows(args: tuple[Any, ...], data_shardings: tuple[Any, ...] | None,
                          microbatches: int, names: ArgNames, checked: set[Any]) -> None:
    """Each device's rows of every [K, batch, ...] leaf must split into the
    ``microbatches``. Checked on the host from the arrays' shardings (or
    ``data_shardings``, one pytree per data argument, for host data), so Auto
    meshes (whose array types carry no sharding) get the same message as
    Explicit ones; once per layout (shapes and shardings), ``checked`` holding
    the layouts seen."""
    data = [(i, a) for i, a in enumerate(args) if not is_node(a)]
    leaves = [jax.tree_util.tree_flatten_with_path(a)[0] for _, a in data]
    given = ([jax.tree.leaves(d) for d in data_shardings] if data_shardings is not None
             else [[getattr(x, "sharding", None) for _, x in f] for f in leaves])
    layout = tuple((np.shape(x), s) for f, g in zip(leaves, given, strict=True)
                   for (_, x), s in zip(f, g, strict=True))
    if layout in checked:
        return
    named = names(len(args))
    for (i, _), flat, shardings in zip(data, leaves, given, strict=True):
        for (path, x), sharding in zip(flat, shardings, strict=True):
            if np.ndim(x) < 2 or not isinstance(sharding, NamedSharding):
                continue
            axes, devices = spec_axes(sharding, 1)
            if devices > 1:  # rows on one device: _split_microbatches says it plainly
                where = named[i] + jax.tree_util.keystr(path)
                check_device_rows(where, np.shape(x)[1:], axes, devices, microbatches)
    checked.add(layout)


def check_options(step_fn: Any, microbatches: Any, max_in_flight: Any, unroll: Any,
                  owner: str = "multistep") -> None:
    """The checks of :func:`~nnx_shard.multistep`'s arguments
    (made by :class:`~nnx_shard._train._fused.Fused` itself, so a Fused built directly,
    and :class:`~nnx_shard.Trainer` on it, get them too), the message naming ``owner``,
    the call that took them."""
    if not callable(step_fn):
        raise UsageError(f"multistep expects a callable step function (step_fn), got "
                         f"{short(step_fn, 60)}. Fix: pass the function itself, e.g. "
                         "multistep(train_step), not train_step(...).")
    count(microbatches, f"{owner}: microbatches", fix="e.g. microbatches=2, or 1 for no split")
    if max_in_flight is not None and (
        not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1
    ):
        raise UsageError(
            f"{owner}: max_in_flight must be a positive int or None (unbounded), got "
            f"{max_in_flight!r}. Fix: e.g. max_in_flight=2 (the default)."
        )
    if not isinstance(unroll, int) or isinstance(unroll, bool) or unroll < 1:
        raise UsageError(
            f"{owner}: unroll must be a positive int (steps per loop iteration), got "
            f"{unroll!r}. Fix: e.g. unroll=1 (the default, a rolled loop) or 2."
        )
