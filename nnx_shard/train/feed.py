"""Feeding fit: host batches grouped K at a time (cut at checkpoint steps), stacked
and placed on the devices, on a prefetch thread (:class:`Prefetcher`) or, for
windows of a :class:`~nnx_shard.Batches`, in the training thread (:class:`Inline`)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from nnx_shard.train.batches import Batches
from nnx_shard.train.placement import Placer, check_array_leaf
from nnx_shard.train.trees import fmt_shape, short_repr

__all__ = ["Inline", "Prefetcher", "build_group", "feeder", "group_sizes", "groups",
           "iter_group_sizes", "stacked_groups", "window_groups"]


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
        host = []
        for _ in range(k):
            try:
                host.append(next(it))
            except StopIteration:
                break
            if stop.is_set():
                return
        if host:
            yield build(host)
        if len(host) < k:
            return


class Prefetcher:
    """Builds the next groups of K steps (stack + shard) on a thread while the
    current fused call runs. At most two groups wait, so host memory stays bounded.

    ``groups(stop)`` is a generator of built groups; it may check ``stop`` (an
    Event set when training ends) to give up early."""

    def __init__(self, groups: Callable[[threading.Event], Iterator[Any]]) -> None:
        self._q: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(groups,), daemon=True, name="nnx_shard-prefetch",
        )
        self._thread.start()

    def _run(self, groups: Callable[[threading.Event], Iterator[Any]]) -> None:
        try:
            for group in groups(self._stop):
                if not self._put(("ok", group)):
                    return
            self._put(("end", None))
        except BaseException as e:  # re-raised in the training thread
            self._put(("error", e))

    def _put(self, item: tuple[str, Any]) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Any:
        kind, value = self._q.get()
        if kind == "error":
            raise value
        return value if kind == "ok" else None

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                self._q.get_nowait()
        self._thread.join(timeout=5)


class Inline:
    """:class:`Prefetcher`'s interface without the thread, for windows of a
    :class:`~nnx_shard.Batches`: reading one is a slice and a single copy to the
    devices, which the training thread does while the previous call runs. Handing
    it over from a thread cost more than it hid: on the 1-device MLP of
    benchmarks/fit_speed.py (2 shared cores) fit ran at 0.85x the hand-written
    scan with the thread, 0.89-0.92x without."""

    def __init__(self, groups: Callable[[threading.Event], Iterator[Any]]) -> None:
        self._stop = threading.Event()
        self._groups = groups(self._stop)

    def get(self) -> Any:
        return next(self._groups, None)

    def close(self) -> None:
        self._stop.set()
        self._groups.close()  # type: ignore[attr-defined]  # a generator


def build_group(host: list[Any], place: Placer) -> tuple[int, Any, int]:
    """One fused call's input from K host batches: ``(K, the stacked batches placed
    by ``place``, examples per step)``, with the batches checked."""
    first = jax.tree_util.tree_flatten_with_path(host[0])
    if not first[0]:
        raise TypeError(
            f"Trainer.fit: a batch from data is {short_repr(host[0])}, which holds no "
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
    # Per batch only a plain flatten and a shape comparison (this runs K times per
    # fused call, on a thread beside XLA's): paths are worked out for errors only.
    shapes = [np.shape(x) for _, x in first[0]]
    columns: list[list[Any]] = [[x] for _, x in first[0]]
    for n, b in enumerate(host[1:], start=1):
        leaves, treedef = jax.tree.flatten(b)
        if treedef != first[1]:  # type: ignore[operator]
            raise ValueError(
                f"host batch {n} of this group has structure {treedef} but the first "
                f"has {first[1]}; every batch must have the same structure."
            )
        for column, x, shape in zip(columns, leaves, shapes, strict=True):
            if getattr(x, "shape", None) != shape:
                _ragged(n, b, first[0])
            column.append(x)
    stacked = jax.tree.unflatten(first[1], [np.stack(c) for c in columns])
    leaves = first[0]
    examples = int(np.shape(leaves[0][1])[0]) * jax.process_count() if leaves else 0
    return len(host), place(stacked), examples

def _ragged(n: int, batch: Any, first: list[tuple[Any, Any]]) -> None:
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
        yield n, place(window), examples
        pos += n
        if n < k:
            return


def groups(
    data: Any, sizes: Iterator[int], place: Placer, *, position: int, resumed: bool
) -> Callable[[threading.Event], Iterator[Any]]:
    """The generator of fused-call inputs ``(steps, sharded batch, examples per
    step)``, reading ``data`` from the data position ``position`` (on the prefetch
    thread, or for :class:`~nnx_shard.Batches` in the training thread)."""
    if isinstance(data, Batches):
        first = position if resumed else 0
        return functools.partial(window_groups, data, first, sizes, place)
    if callable(data) and not isinstance(data, Iterable):
        data = data(position)
    elif resumed and position:
        data = itertools.islice(data, position, None)
    return functools.partial(stacked_groups, data, sizes,
                             functools.partial(build_group, place=place))


def feeder(
    data: Any, groups: Callable[[threading.Event], Iterator[Any]]
) -> Prefetcher | Inline:
    """What fit reads its groups from: :class:`Inline` for a
    :class:`~nnx_shard.Batches`, else a :class:`Prefetcher` thread."""
    return (Inline if isinstance(data, Batches) else Prefetcher)(groups)
