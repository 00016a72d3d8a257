"""Host batches onto the devices, laid out by logical names: :func:`shard_batch` for
one batch, :class:`Placer` for a stream of them (the shardings resolved once per
layout)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from nnx_shard._errors import ShardingError, UsageError, flag, short
from nnx_shard._mesh import make_mesh
from nnx_shard._rules import Rules, as_rules

__all__ = ["LogicalNames", "Placer", "batch_shardings", "check_array_leaf",
           "host_sharding_types", "shard_batch"]

LogicalNames = Sequence[str | None]


def _is_names(x: Any) -> bool:
    return x is None or (
        isinstance(x, tuple | list) and all(n is None or isinstance(n, str) for n in x)
    )


_NAMES_FIX = (
    "names are the logical names of each leaf's leading dims, e.g. ('batch', 'length'), "
    "or a pytree prefix of the batch giving such a tuple per leaf, e.g. "
    "{'tokens': ('batch', 'length'), 'label': ('batch',)}"
)


def _check_names_prefix(names: Any, batch: Any) -> Any:
    """``names`` as a pytree prefix of ``batch`` whose leaves are name tuples, or a
    ShardingError saying what does not fit."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(names, is_leaf=_is_names)
    for path, leaf in flat:
        if not _is_names(leaf):
            where = f"names{jax.tree_util.keystr(path)}" if path else "names"
            raise ShardingError(
                f"shard_batch: {where} = {leaf!r} ({type(leaf).__name__}) is not a tuple of "
                f"logical names. Fix: {_NAMES_FIX}."
            )
    try:
        treedef.flatten_up_to(batch)  # type: ignore[attr-defined]
    except (ValueError, TypeError) as e:
        raise ShardingError(
            "shard_batch: names is a pytree prefix that does not match the batch: names has "
            f"structure {jax.tree.structure(names, is_leaf=_is_names)}, the batch "
            f"{jax.tree.structure(batch)} ({e}). Fix: {_NAMES_FIX}."
        ) from None
    return treedef


def check_array_leaf(path: Any, leaf: Any, who: str) -> None:
    """Batches are arrays with a leading batch axis: Python numbers (e.g. the items of a
    list of floats, which pytrees see as separate leaves) would become replicated scalars."""
    if isinstance(leaf, bool | int | float | complex):
        where = f"batch{jax.tree_util.keystr(path)}"
        inside = (
            " (an item of a Python list or tuple)"
            if path and isinstance(path[-1], jax.tree_util.SequenceKey) else ""
        )
        raise UsageError(
            f"{who}: {where} is a Python {type(leaf).__name__} ({leaf!r}){inside}: batches "
            "must be arrays (NumPy or jax.Array) with a leading batch axis, not Python "
            f"lists or numbers. Fix: convert it, e.g. np.asarray(values, np.float32)."
        )
    dtype = getattr(leaf, "dtype", None)
    if getattr(dtype, "kind", "") in ("O", "U", "S", "M"):
        raise UsageError(
            f"{who}: batch{jax.tree_util.keystr(path)} has dtype {dtype}: batches must be "
            "numeric arrays. Fix: encode it as numbers (e.g. token ids) before batching."
        )


def shard_batch(
    batch: Any,
    mesh: Mesh | str | Mapping[str, int],
    rules: Rules | Mapping[str, Any],
    names: LogicalNames | Any = ("batch",),
    *,
    steps: bool = False,
) -> Any:
    """Host (NumPy) batch -> global ``jax.Array`` s laid out by logical names.

    ``names`` gives the logical names of each leaf's leading dimensions, e.g.
    ``("batch", "length")``: a leaf of higher rank has its trailing dimensions
    replicated, a leaf of lower rank uses only the first names (so labels
    ``[B]`` and tokens ``[B, L]`` can share one ``names``). ``names`` may also
    be a pytree prefix of ``batch`` giving names per leaf. With ``steps=True``
    every leaf has a leading steps axis ``[K, ...]``, left unsharded, before
    the named dimensions (the layout :func:`multistep` scans over).

    Each leaf is resolved with ``rules.spec`` (so a batch dimension that does
    not divide by its mesh axes is a ``ShardingError`` naming the leaf) and
    built with ``jax.make_array_from_process_local_data``: on several hosts each
    process passes its own slice of the batch.

    Args:
      batch: a pytree of host (NumPy) arrays, the global batch (on several hosts, this process's
        slice).
      mesh: a ``Mesh`` or a spec for :func:`nnx_shard.make_mesh`.
      rules: the logical-to-mesh table (:class:`~nnx_shard.Rules` or a dict).
      names: the logical names of each leaf's leading dimensions, or a pytree prefix of ``batch`` of
        them.
      steps: every leaf has a leading, unsharded ``[K, ...]`` steps axis.

    >>> import numpy as np
    >>> from nnx_shard import Rules, shard_batch
    >>> rules = Rules({"batch": "data", "length": None})
    >>> batch = {"tokens": np.zeros((8, 16), np.int32), "label": np.zeros((8,), np.int32)}
    >>> out = shard_batch(batch, "data=8", rules, ("batch", "length"))
    >>> out["tokens"].sharding.spec, out["label"].sharding.spec
    (P('data', None), P('data',))
    >>> shard_batch({"x": np.zeros((5, 8, 3))}, "data=8", rules, steps=True)["x"].sharding.spec
    P(None, 'data', None)
    """
    mesh = make_mesh(mesh)
    rules = as_rules(rules)
    flag(steps, "shard_batch: steps")
    single = jax.process_count() == 1

    def one(path: Any, leaf: Any, leaf_names: Any) -> jax.Array:
        check_array_leaf(path, leaf, "shard_batch")
        arr = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
        sharding = _leaf_sharding(path, arr, leaf_names, mesh, rules, steps, single)
        return jax.make_array_from_process_local_data(sharding, arr)

    return _map_names(one, names, batch)


def batch_shardings(
    batch: Any,
    mesh: Mesh,
    rules: Rules,
    names: LogicalNames | Any = ("batch",),
    *,
    steps: bool = False,
) -> Any:
    """The shardings :func:`shard_batch` gives ``batch``'s leaves, without placing
    anything: ``batch`` may hold ``jax.ShapeDtypeStruct`` s (shapes and dtypes are
    all that is read), with the same checks.

    >>> rules = Rules({"batch": "data"})
    >>> x = jax.ShapeDtypeStruct((5, 8, 3), np.float32)
    >>> batch_shardings({"x": x}, make_mesh("data=8"), rules, steps=True)["x"].spec
    P(None, 'data', None)
    """
    single = jax.process_count() == 1

    def one(path: Any, leaf: Any, leaf_names: Any) -> NamedSharding:
        return _leaf_sharding(path, leaf, leaf_names, mesh, rules, steps, single)

    return _map_names(one, names, batch)


def _map_names(one: Any, names: Any, batch: Any) -> Any:
    """``one(path, leaf, leaf_names)`` over ``batch``, ``names`` a tuple for every
    leaf or a pytree prefix of the batch."""
    if _is_names(names):
        return jax.tree_util.tree_map_with_path(lambda p, x: one(p, x, names), batch)
    _check_names_prefix(names, batch)

    def prefix(path: Any, leaf_names: Any, sub: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda p, x: one((*path, *p), x, leaf_names), sub
        )

    return jax.tree_util.tree_map_with_path(prefix, names, batch, is_leaf=_is_names)


def _leaf_sharding(path: Any, arr: Any, leaf_names: Any, mesh: Mesh, rules: Rules,
                   steps: bool, single: bool) -> NamedSharding:
    """The sharding of one leaf (an array or a ``jax.ShapeDtypeStruct``)."""
    where = f"batch{jax.tree_util.keystr(path)}"
    lead: tuple[None, ...] = (None,) if steps else ()
    if np.dtype(arr.dtype).kind in "OUSMm":  # text, objects, dates: no device array holds them
        raise ShardingError(
            f"shard_batch: {where} has dtype {arr.dtype} ({short(arr, 60)}); batches are "
            "numbers or bools. Fix: encode it first, e.g. token ids as np.int32")
    ndim = len(arr.shape)
    if ndim <= len(lead):
        what = "is a scalar" if ndim == 0 else f"has shape {tuple(arr.shape)}"
        raise ShardingError(
            f"{where} {what}, but steps=True expects a leading "
            "steps axis and a batch axis [K, batch, ...] on every leaf. Fix: stack the "
            "per-step batches, e.g. np.stack(batches)."
        )
    rest = ndim - len(lead)
    given = tuple(leaf_names or ())[:rest]
    full = (*lead, *given, *(None,) * (rest - len(given)))
    # Across processes the global shape is inferred by JAX; only one process
    # knows its local shape, so divisibility is checked by JAX there.
    spec = rules.spec(full, shape=tuple(arr.shape) if single else None, mesh=mesh, path=where)
    return NamedSharding(mesh, spec)


def host_sharding_types(mesh: Mesh) -> bool:
    """True where arrays on ``mesh`` carry their sharding in their traced type (any
    Explicit axis): host data given to a jitted call with ``in_shardings`` is traced
    without it, so such a mesh needs placed arrays.

    >>> host_sharding_types(make_mesh("data=8"))
    False
    """
    return any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ()))


class Placer:
    """``shard_batch(batch, mesh, rules, names, steps=True)`` for a stream of batches:
    the shardings are resolved (and checked) once per layout (structure, shapes and
    dtypes), after which placing a batch is one ``jax.device_put`` of its leaves.
    :meth:`host` resolves without placing, for a compiled call that places its host
    arguments itself (``jax.jit`` with ``in_shardings``, as ``Trainer.fit`` runs).

    >>> place = Placer(make_mesh("data=8"), as_rules({"batch": "data"}), ("batch",))
    >>> first = place({"x": np.zeros((5, 8, 3), np.float32)})   # resolved by shard_batch
    >>> again = place({"x": np.ones((5, 8, 3), np.float32)})    # placed with its shardings
    >>> again["x"].sharding == first["x"].sharding, again["x"].sharding.spec
    (True, P(None, 'data', None))
    >>> data, shardings = place.host({"x": np.ones((5, 8, 3), np.float32)})
    >>> type(data["x"]).__name__, shardings["x"] == first["x"].sharding
    ('ndarray', True)
    """

    def __init__(self, mesh: Mesh, rules: Rules, names: Any) -> None:
        self.mesh, self.rules, self.names = mesh, rules, names
        self._layouts: dict[Any, list[Any]] = {}
        self._trees: dict[Any, Any] = {}
        self._single = jax.process_count() == 1
        # Host data only where the traced types do not carry shardings: on Explicit
        # axes a batch's type holds its sharding, which only a placed array gives.
        self.host_data = self._single and not host_sharding_types(mesh)

    def _key(self, leaves: list[Any], treedef: Any) -> Any:
        return (treedef, *((np.shape(x), getattr(x, "dtype", None)) for x in leaves))

    def __call__(self, batch: Any) -> Any:
        leaves, treedef = jax.tree.flatten(batch)
        key = self._key(leaves, treedef)
        shardings = self._layouts.get(key)
        if shardings is None:
            out = shard_batch(batch, self.mesh, self.rules, self.names, steps=True)
            self._layouts[key] = [x.sharding for x in jax.tree.leaves(out)]
            return out
        if self._single:
            placed = jax.device_put(
                [x if isinstance(x, jax.Array) else np.asarray(x) for x in leaves], shardings)
        else:  # as shard_batch does: each process gives its own rows
            placed = [jax.make_array_from_process_local_data(
                s, x if isinstance(x, jax.Array) else np.asarray(x))
                for x, s in zip(leaves, shardings, strict=True)]
        return jax.tree.unflatten(treedef, placed)

    def host(self, batch: Any) -> tuple[Any, Any]:
        """``(data, shardings)``: the batch as the compiled call takes it and the
        pytree of its leaves' shardings, the same object for every batch of one
        layout (callers cache on its identity). In one process ``data`` is the
        host batch itself (``jax.jit`` with these ``in_shardings`` copies it to the
        devices in its C++ dispatch, far cheaper than ``jax.device_put``);
        across processes, or on a mesh with Explicit axes (see
        :func:`host_sharding_types`), it is placed."""
        leaves, treedef = jax.tree.flatten(batch)
        return self.host_leaves(leaves, treedef, self._key(leaves, treedef))

    def host_leaves(self, leaves: list[Any], treedef: Any, key: Any) -> tuple[Any, Any]:
        """:meth:`host` for a batch given as its leaves, treedef and layout key
        (``(treedef, *((shape, dtype) per leaf))``), which the caller has at hand."""
        tree = self._trees.get(key)
        batch = jax.tree.unflatten(treedef, leaves)
        if tree is None:
            if key not in self._layouts:
                self(batch)  # resolved and checked by shard_batch, once per layout
            tree = self._trees[key] = jax.tree.unflatten(treedef, self._layouts[key])
        return (batch if self.host_data else self(batch)), tree
