"""Feeding fit: host batches grouped K at a time (cut at checkpoint steps), stacked
with one ``np.stack`` per leaf (or read as one window of a
:class:`~nnx_shard.Batches`) and handed to the compiled call with their shardings,
in the training thread right after the previous call is dispatched (:class:`Feed`).

Why no prefetch thread: dispatch is asynchronous, so the training thread stacks the
next group while the device runs the calls in flight. A thread beside it fought the
dispatching thread for the GIL and added a queue hand-over per call: on one CPU
device, ``Trainer.fit`` on a list of per-step batches of ``nnx.Linear(4, 4)`` spent
half of its time waiting on that queue (benchmarks/fit_speed.py).
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from nnx_shard.train.batches import Batches
from nnx_shard.train.placement import Placer, check_array_leaf
from nnx_shard.train.trees import fmt_shape, short_repr

__all__ = ["Feed", "Group", "Stacker", "group_sizes", "groups", "iter_group_sizes",
           "stacked_groups", "window_groups"]


class Group(NamedTuple):
    """One fused call's input: ``steps`` (K), ``data`` (the ``[K, batch, ...]``
    pytree: host arrays in one process, placed ones across processes), its leaves'
    ``shardings`` (a pytree, one object per layout) and the examples per step."""

    steps: int
    data: Any
    shardings: Any
    examples: int


def iter_group_sizes(start: int, count: int, k: int, every: int | None) -> Iterator[int]:
    """Steps per fused call for ``count`` steps from step ``start``: K at a time, cut
    at the multiples of ``every`` (the checkpoint steps). Lazy: ``fit(data,
    num_steps=10**12)`` on finite data must not plan 10**11 calls up front.

    >>> list(iter_group_sizes(0, 60, 10, 25))
    [10, 10, 5, 10, 10, 5, 10]
    >>> next(iter_group_sizes(0, 10**12, 10, None))
    10
    """
    pos, end = start, start + count
    while pos < end:
        nxt = min(pos + k, end)
        if every:
            nxt = min(nxt, (pos // every + 1) * every)
        yield nxt - pos
        pos = nxt


def group_sizes(start: int, count: int, k: int, every: int | None) -> list[int]:
    """:func:`iter_group_sizes` as a list (for small plans).

    >>> group_sizes(0, 60, 10, 25)
    [10, 10, 5, 10, 10, 5, 10]
    """
    return list(iter_group_sizes(start, count, k, every))


def stacked_groups(
    data: Iterable[Any], sizes: Iterable[int], build: Callable[[list[Any]], Any],
    stop: threading.Event,
) -> Iterator[Any]:
    """Groups of K host batches from an iterable, each stacked by ``build``."""
    it = iter(data)
    for k in sizes:
        host = list(itertools.islice(it, k))
        if stop.is_set():
            return
        if host:
            yield build(host)
        if len(host) < k:
            return


class Feed:
    """What fit reads its groups from, in the training thread: ``get()`` gives the
    next :class:`Group` (``None`` when the data ends), ``close()`` stops reading.
    ``groups(stop)`` is a generator of groups; it may check ``stop`` (an Event set
    when training ends) to give up early."""

    def __init__(self, groups: Callable[[threading.Event], Iterator[Any]]) -> None:
        self._stop = threading.Event()
        self._groups = groups(self._stop)

    def get(self) -> Group | None:
        return next(self._groups, None)

    def close(self) -> None:
        self._stop.set()
        self._groups.close()  # type: ignore[attr-defined]  # a generator


def _stack(column: list[Any]) -> np.ndarray:
    # One step: a copy with a new leading axis (np.stack's Python costs far more). A
    # copy, not a view: a loader may reuse its buffers while the call still reads them.
    return np.stack(column) if len(column) > 1 else np.array(column[0])[None]


class Stacker:
    """Builds groups from K host batches each: one ``np.stack`` per leaf, placed by
    ``place`` (:meth:`Placer.host`). The batches' structure and leaves are checked
    in full for the first group of each layout; after that a batch costs one pytree
    flatten and a comparison of its structure with the first's (a shape that
    differs is found by ``np.stack``, and explained then)."""

    def __init__(self, place: Placer) -> None:
        self.place = place
        self._checked: set[Any] = set()
        self._processes = jax.process_count()
        # The keys (sorted, as pytrees order them) of a flat dict of arrays, the
        # usual batch, whose columns are read by key: no flatten per batch.
        self._flat_dict: tuple[Any, tuple[Any, ...]] | None = None

    def _columns(self, host: list[Any]) -> tuple[Any, list[list[Any]]]:
        first = host[0]
        if type(first) is dict and self._flat_dict is not None:
            treedef, keys = self._flat_dict
            if first.keys() == set(keys) and all(
                    type(b) is dict and b.keys() == first.keys() for b in host):
                return treedef, [[b[k] for b in host] for k in keys]
        flat = [jax.tree.flatten(b) for b in host]
        treedef = flat[0][1]
        for n, (_, td) in enumerate(flat[1:], start=1):
            if td != treedef:  # type: ignore[operator]
                raise ValueError(
                    f"host batch {n} of this group has structure {td} but the first "
                    f"has {treedef}; every batch must have the same structure.")
        if type(first) is dict:
            keys = tuple(sorted(first))
            if treedef == jax.tree.structure(dict.fromkeys(keys, 0)):  # type: ignore[operator]
                self._flat_dict = (treedef, keys)
        return treedef, [list(column) for column in zip(*(f[0] for f in flat), strict=True)]

    def __call__(self, host: list[Any]) -> Group:
        treedef, columns = self._columns(host)
        try:
            stacked = [_stack(column) for column in columns]
        except ValueError:
            _ragged(host)
            raise
        key = (treedef, *((x.shape, x.dtype) for x in stacked))
        if key not in self._checked:  # a new structure, shape or dtype
            _check_first(host[0])
            self._checked.add(key)
        data, shardings = self.place.host_leaves(stacked, treedef, key)
        examples = int(stacked[0].shape[1]) * self._processes if stacked else 0
        return Group(len(host), data, shardings, examples)


def build_group(host: list[Any], place: Placer) -> Group:
    """One fused call's input from K host batches (see :class:`Stacker`).

    >>> from nnx_shard.mesh import make_mesh
    >>> from nnx_shard.rules import as_rules
    >>> place = Placer(make_mesh("data=8"), as_rules({"batch": "data"}), ("batch",))
    >>> g = build_group([{"x": np.full((8, 2), i, np.float32)} for i in range(3)], place)
    >>> g.steps, g.data["x"].shape, g.shardings["x"].spec, g.examples
    (3, (3, 8, 2), P(None, 'data', None), 8)
    """
    return Stacker(place)(host)


def _check_first(batch: Any) -> None:
    """The checks of a group's first batch: arrays (not Python numbers, not text),
    each with a leading batch axis."""
    first = jax.tree_util.tree_flatten_with_path(batch)
    if not first[0]:
        raise TypeError(
            f"Trainer.fit: a batch from data is {short_repr(batch)}, which holds no "
            "arrays. Batches are pytrees of arrays with a leading batch axis, e.g. "
            "{'x': np.ndarray of shape (batch, ...), 'y': ...}."
        )
    for path, x in first[0]:
        check_array_leaf(path, x, "Trainer.fit")
        if np.ndim(x) == 0:
            raise TypeError(
                f"Trainer.fit: batch{jax.tree_util.keystr(path)} is a scalar (shape ()): "
                "every leaf of a batch needs a leading batch axis. Fix: give it one, "
                "e.g. np.full((batch,), value)."
            )


def _ragged(host: list[Any]) -> None:
    """Names the first batch of a group whose leaf shapes differ from the first's."""
    first = jax.tree_util.tree_flatten_with_path(host[0])[0]
    for n, batch in enumerate(host[1:], start=1):
        for (path, x), (_, x0) in zip(jax.tree_util.tree_flatten_with_path(batch)[0], first,
                                      strict=True):
            if np.shape(x) != np.shape(x0):
                raise ValueError(
                    f"host batch {n} of this group has batch{jax.tree_util.keystr(path)} "
                    f"of shape {fmt_shape(x)}, but the first has {fmt_shape(x0)}. "
                    "Batches are stacked K at a time, so shapes must agree. Fix: drop "
                    "the last, smaller batch of an epoch (drop_last) or pad it."
                )


def window_groups(
    data: Batches, start: int, sizes: Iterable[int], place: Placer, stop: threading.Event
) -> Iterator[Any]:
    """Groups of K batches read from ``data`` as whole ``[K, batch, ...]`` windows:
    no per-step Python, no stacking (a window of a contiguous array is a view)."""
    pos = start
    examples = data.batch_size * jax.process_count()
    for k in sizes:
        window = data.window(pos, k) if not stop.is_set() else None
        if window is None:
            return
        n = int(np.shape(jax.tree.leaves(window)[0])[0])
        if pos == start:  # one layout for the whole run: checked once
            for path, x in jax.tree_util.tree_flatten_with_path(window)[0]:
                check_array_leaf(path, x, "Trainer.fit")
        yield Group(n, *place.host(window), examples)
        pos += n
        if n < k:
            return


def groups(
    data: Any, sizes: Iterator[int], place: Placer, *, position: int, resumed: bool
) -> Callable[[threading.Event], Iterator[Any]]:
    """The generator of fused-call inputs (:class:`Group`), reading ``data`` from the
    data position ``position``."""
    if isinstance(data, Batches):
        first = position if resumed else 0
        return functools.partial(window_groups, data, first, sizes, place)
    if callable(data) and not isinstance(data, Iterable):
        data = data(position)
    elif resumed and position:
        data = itertools.islice(data, position, None)
    return functools.partial(stacked_groups, data, sizes, Stacker(place))
