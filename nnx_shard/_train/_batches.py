"""Whole arrays as a stream of batches, read K steps at a time without per-step Python.

:class:`Batches` wraps a pytree of arrays that share a leading example axis
(NumPy arrays, ``np.memmap`` files, or anything else NumPy can slice, such as
h5py or zarr arrays) and cuts it into consecutive batches of ``batch_size``
examples. Iterating gives one batch at a time, like any data loader; what
``Trainer.fit`` reads instead is :meth:`Batches.window`: K consecutive batches
at once, shaped ``[K, batch_size, ...]``. For a contiguous array that is a
reshaped slice, a view (no copy, no stacking), so the fused call's input goes
from the user's array to the devices in one transfer; a memmap reads just
those rows from disk.

Nothing here imports jax: windows are NumPy, ready for ``shard_batch(...,
steps=True)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from nnx_shard._errors import UsageError, count

__all__ = ["Batches"]


def _leaves(tree: Any, path: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) pairs of dicts / lists / tuples of arrays, dict keys sorted."""
    if isinstance(tree, dict):
        return [p for k in sorted(tree) for p in _leaves(tree[k], f"{path}[{k!r}]")]
    if isinstance(tree, list | tuple):
        return [p for i, x in enumerate(tree) for p in _leaves(x, f"{path}[{i}]")]
    return [(path, tree)]


def _rebuild(tree: Any, values: Iterator[Any]) -> Any:
    if isinstance(tree, dict):
        return {k: _rebuild(tree[k], values) for k in sorted(tree)}
    if isinstance(tree, list | tuple):
        items = [_rebuild(x, values) for x in tree]
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return next(values)


class Batches:
    """Consecutive batches of ``batch_size`` examples from whole arrays, ``epochs`` times.

    ``arrays`` is an array or a dict / list / tuple of them (nested), every leaf
    with the same number of examples along axis 0. Batch ``i`` holds examples
    ``[i * batch_size, (i + 1) * batch_size)`` of epoch ``i // len(self)``; a last
    partial batch of an epoch is dropped (every fused step needs the same shape).
    ``epochs=None`` repeats forever.

    Pass it to ``Trainer.fit`` where an iterable of batches goes: ``fit`` then
    takes K batches per fused call with :meth:`window` (a reshaped slice, no
    per-step Python), and on ``resume=True`` seeks to the data position instead
    of reading and dropping the batches already trained on.

    Args:
      arrays: an array, or a dict / list / tuple of them (nested), examples along axis 0.
      batch_size: examples per batch.
      epochs: passes over the arrays (``None``: forever).

    >>> import numpy as np
    >>> from nnx_shard import Batches
    >>> x = np.arange(20, dtype=np.float32).reshape(10, 2)
    >>> data = Batches({"x": x, "y": np.arange(10)}, batch_size=4, epochs=2)
    >>> len(data), data.total
    (2, 4)
    >>> [b["y"].tolist() for b in data]
    [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]]
    >>> w = data.window(1, 2)   # batches 1 and 2: [K, batch, ...]
    >>> w["x"].shape, w["y"].tolist()
    ((2, 4, 2), [[4, 5, 6, 7], [0, 1, 2, 3]])
    """

    def __init__(self, arrays: Any, batch_size: int, *, epochs: int | None = 1) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise UsageError(
                f"Batches: batch_size must be a positive int, got {batch_size!r}. Fix: e.g. "
                "Batches(arrays, batch_size=64)."
            )
        if epochs is not None and (
            isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1
        ):
            raise UsageError(
                f"Batches: epochs must be a positive int or None (repeat forever), got {epochs!r}. "
                "Fix: e.g. epochs=1, or epochs=None."
            )
        leaves = _leaves(arrays)
        for path, x in leaves:
            shape = getattr(x, "shape", None)
            if shape is None or not hasattr(x, "__getitem__") or getattr(x, "dtype", None) is None:
                raise UsageError(
                    f"Batches: arrays{path} is {type(x).__name__}, not an array. Fix: pass "
                    "NumPy arrays (np.memmap and other sliceable arrays with .shape and "
                    "dtype work too), e.g. Batches({'x': x, 'y': y}, batch_size=64)."
                )
            if len(shape) == 0:
                raise UsageError(
                    f"Batches: arrays{path} is a scalar; every leaf needs a leading example "
                    "axis (axis 0). Fix: give it one, e.g. x[None] or np.full((n,), value)."
                )
        counts = {int(x.shape[0]) for _, x in leaves}
        if len(counts) != 1:
            listing = ", ".join(f"arrays{p} has {x.shape[0]}" for p, x in leaves)
            raise UsageError(
                f"Batches: the arrays disagree on the number of examples (axis 0): {listing}. "
                "Fix: give every leaf the same number of rows."
            )
        examples = counts.pop()
        if examples < batch_size:
            raise UsageError(
                f"Batches: {examples} examples make no batch of batch_size={batch_size}. "
                "Fix: a smaller batch_size, or more data."
            )
        self.arrays = arrays
        self.batch_size = batch_size
        self.epochs = epochs
        self._tree = arrays
        self._arrays = [x for _, x in leaves]
        self._per_epoch = examples // batch_size

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._per_epoch

    @property
    def total(self) -> int | None:
        """Batches over all epochs (``None``: endless)."""
        return None if self.epochs is None else self._per_epoch * self.epochs

    def __repr__(self) -> str:
        return (f"Batches({len(self._arrays)} arrays, batch_size={self.batch_size}, "
                f"{self._per_epoch} batches per epoch, epochs={self.epochs})")

    def __iter__(self) -> Iterator[Any]:
        i = 0
        while self.total is None or i < self.total:
            yield self.window(i, 1, squeeze=True)
            i += 1

    def window(self, start: int, k: int, *, squeeze: bool = False) -> Any:
        """Batches ``start`` .. ``start + k - 1`` stacked to ``[k', batch_size, ...]``,
        ``k'`` fewer than ``k`` at the end of the data (0: ``None``). Within one epoch a
        view of contiguous arrays (no copy); across an epoch's end, a concatenation."""
        start = count(start, "Batches.window: start", least=0)
        k = count(k, "Batches.window: k", fix="the steps to stack, e.g. k=10")
        total = self.total
        if total is not None:
            k = min(k, total - start)
        if k <= 0:
            return None
        b, n = self.batch_size, self._per_epoch
        runs = []  # (first batch in epoch, batches) pieces, split at epoch ends
        pos, left = start, k
        while left:
            first = pos % n
            take = min(left, n - first)
            runs.append((first, take))
            pos, left = pos + take, left - take

        def cut(x: Any) -> np.ndarray:
            parts = [np.asarray(x[f * b:(f + t) * b]) for f, t in runs]
            rows = parts[0] if len(parts) == 1 else np.concatenate(parts)
            if squeeze:
                return rows
            return rows.reshape(k, b, *rows.shape[1:])

        return _rebuild(self._tree, iter([cut(x) for x in self._arrays]))
