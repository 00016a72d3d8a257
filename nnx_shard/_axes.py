"""Mesh axis sizes, read from any form of mesh and written as text, in one place.

Meshes reach nnx_shard as a ``jax.sharding.Mesh``, an ``AbstractMesh``, a
``"data=4,model=2"`` string or a ``{"data": 4, "model": 2}`` mapping; messages,
reports and the command line show them as ``data=4,model=2`` (what
:func:`nnx_shard.make_mesh` reads back) or, inside prose, ``data=4, model=2``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from nnx_shard._errors import ShardingError, short

__all__ = ["axes_entry", "entry_axes", "mesh_sizes", "sizes_str"]

_FIX = ("Fix: e.g. mesh={'data': 4, 'model': 2}, or a mesh from "
        "nnx_shard.make_mesh('data=4,model=2').")


def mesh_sizes(mesh: Any) -> dict[str, int]:
    """Axis name -> size of a Mesh / AbstractMesh (anything with a ``shape``
    mapping) or a mapping; ``None`` gives ``{}``. Strings are parsed by
    :func:`nnx_shard._mesh.parse_axes`, not here. Anything else, an axis name that is not a
    non-empty string or a size that is not an int >= 1 is a ``ShardingError``.

    >>> import jax
    >>> mesh_sizes(jax.sharding.AbstractMesh((2, 4), ("data", "model")))
    {'data': 2, 'model': 4}
    >>> mesh_sizes({"data": 8})
    {'data': 8}
    """
    if mesh is None:
        return {}
    shape = getattr(mesh, "shape", mesh)
    if isinstance(shape, Mapping):
        out = {}
        for k, v in shape.items():
            # A bool is an int and 2.5 or NaN would truncate or fail deep inside a
            # divisibility check: a size is a whole device count.
            if not isinstance(k, str) or not k:
                raise ShardingError(f"mesh axis names must be non-empty strings, got "
                                    f"{short(k)}. {_FIX}")
            if isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer) or v < 1:
                raise ShardingError(f"mesh axis {short(k)} has size {short(v)} "
                                    f"({type(v).__name__}); mesh sizes are ints >= 1. {_FIX}")
            out[k] = int(v)
        return out
    raise ShardingError(f"mesh must be a jax.sharding.Mesh or a mapping of axis name to size, "
                        f"got {type(mesh).__name__} {short(mesh)}. Fix: build one with "
                        "nnx_shard.make_mesh('data=4,model=2').")


def sizes_str(mesh: Any, sep: str = ",", empty: str = "") -> str:
    """``"data=4,model=2"`` (``sep=", "`` for prose); ``empty`` when there are no axes.

    >>> sizes_str({"data": 4, "model": 2}), sizes_str({"data": 4, "model": 2}, ", ")
    ('data=4,model=2', 'data=4, model=2')
    >>> sizes_str({}, ", ", "no axes")
    'no axes'
    """
    return sep.join(f"{k}={v}" for k, v in mesh_sizes(mesh).items()) or empty


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes one ``PartitionSpec`` entry names: ``None`` gives ``()``, a name
    a one-axis tuple, a tuple of names itself.

    >>> entry_axes(None), entry_axes("data"), entry_axes(("data", "model"))
    ((), ('data',), ('data', 'model'))
    """
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def axes_entry(axes: Sequence[str]) -> Any:
    """The ``PartitionSpec`` entry for mesh ``axes``, the inverse of :func:`entry_axes`:
    ``None`` for none, the name for one, the tuple for more.

    >>> axes_entry(()), axes_entry(("data",)), axes_entry(("data", "model"))
    (None, 'data', ('data', 'model'))
    """
    return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def abstract_mesh(sizes: Mapping[str, int]) -> Any:
    """A ``jax.sharding.AbstractMesh`` of ``sizes``: shardings for any device count,
    no devices needed (``explain`` and the planners lay models out on it).

    >>> dict(abstract_mesh({"data": 64, "model": 8}).shape)
    {'data': 64, 'model': 8}
    """
    from jax.sharding import AbstractMesh

    return AbstractMesh(tuple(sizes.values()), tuple(sizes))
