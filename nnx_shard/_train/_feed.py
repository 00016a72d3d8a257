"""Feeding fit: host batches grouped K at a time (cut at checkpoint steps), stacked
with one ``np.stack`` per leaf (or read as one window of a
:class:`~nnx_shard.Batches`) and handed to the compiled call with their shardings,
in the training thread right after the previous call is dispatched (:class:`Feed`).

Before a group is placed, the values of the batch fields the library gives a meaning
(``attention_mask``, ``targets``, ``positions``, token ids) are checked on the host
(:class:`BatchCheck`): inside the compiled call they are traced, so the checks a
direct model call makes cannot run there, and an id past the vocabulary or a mask
of 2 would train silently.

Why no prefetch thread: dispatch is asynchronous, so the training thread stacks the
next group while the device runs the calls in flight. A thread beside it fought the
dispatching thread for the GIL and added a queue hand-over per call: on one CPU
device, ``Trainer.fit`` on a list of per-step batches of ``nnx.Linear(4, 4)`` spent
half of its time waiting on that queue (benchmarks/fit_speed.py).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple, NoReturn, TypeGuard

import jax
import numpy as np

from nnx_shard._errors import UsageError
from nnx_shard._pack import IGNORE_INDEX
from nnx_shard._train._batches import Batches
from nnx_shard._train._placement import Placer, check_array_leaf
from nnx_shard._train._trees import fmt_shape, short_repr

__all__ = ["BatchCheck", "Feed", "Group", "Stacker", "group_sizes", "groups",
           "iter_group_sizes", "stacked_groups", "window_groups"]


class Group(NamedTuple):
    """One fused call's input: ``steps`` (K), ``data`` (the ``[K, batch, ...]``
    pytree: host arrays in one process, placed ones across processes), its leaves'
    ``shardings`` (a pytree, one object per layout) and the examples per step."""

    steps: int
    data: Any
    shardings: Any
    examples: int


# -- the values of the fields the library knows by name ---------------------------------

#: Batch keys with a meaning to :func:`nnx_shard.models.lm_loss`, the reference models
#: and transformers, whose integer values :class:`BatchCheck` reads. ``inputs`` (what
#: lm_loss hands the model) counts as token ids only for a model with a vocabulary: in
#: a user's batch it may be anything.
MASK_KEYS = ("attention_mask",)
POSITION_KEYS = ("positions", "position_ids")
TARGET_KEYS = ("targets", "labels")
TOKEN_KEYS = ("input_ids", "tokens")


class Field(NamedTuple):
    """One leaf :class:`BatchCheck` reads: ``leaf`` (its index among the batch's
    leaves), its path, what it is (``mask``, ``positions``, ``targets``, ``tokens``)
    and the values allowed: ``low .. high`` (``high`` None: no bound), or ``ignore``."""

    leaf: int
    path: str
    kind: str
    low: int
    high: int | None
    ignore: int | None = None


@dataclasses.dataclass(frozen=True)
class BatchCheck:
    """The host check of the values of the batch fields the library knows by name,
    run on each group of K batches before it enters the compiled call, where the
    values are traced and nothing can be checked: ``attention_mask`` 0 or 1;
    ``targets`` / ``labels`` token ids or :data:`~nnx_shard._pack.IGNORE_INDEX`
    (-100); ``positions`` from 0; token ids (``input_ids``, ``tokens``, and
    ``inputs`` when the model has a vocabulary) from 0. With ``vocab`` (the
    model's vocabulary size) ids and targets must be below it, with
    ``max_positions`` positions too. Only integer leaves are read (a bool mask is
    valid, a float ``targets`` is a regression target); one ``min`` and one
    ``max`` per field and group, a third pass only for targets that hold -100.

    >>> check = BatchCheck(vocab=10)
    >>> batch = {"inputs": np.zeros((2, 4, 8), np.int32), "targets": np.full((2, 4, 8), 3)}
    >>> [f.path for f in check.plan(batch)]
    ["batch['inputs']", "batch['targets']"]
    >>> batch["targets"][1, 0, 5] = 12
    >>> check(check.plan(batch), jax.tree.leaves(batch), first=6)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: Trainer.fit: batch 7 of data has batch['targets'] = 12 (at [0, 5]); targets are token ids 0 .. 9, or -100 ...
    """

    vocab: int | None = None
    max_positions: int | None = None

    @classmethod
    def of(cls, model: Any) -> BatchCheck:
        """The check for ``model``: its vocabulary and positions when it has a ``cfg``
        with ``vocab`` (``Decoder``), none otherwise."""
        vocab = getattr(getattr(model, "cfg", None), "vocab", None)
        if not _whole(vocab):
            return cls()
        try:
            positions = getattr(model, "max_length", None)
        except Exception:  # a user's property failing only costs the positions' bound
            positions = None
        return cls(int(vocab), int(positions) if _whole(positions) else None)

    def plan(self, batch: Any) -> tuple[Field, ...]:
        """The fields of ``batch`` (one batch or a stacked group) to check, once per layout."""
        fields = []
        token_keys = TOKEN_KEYS + (("inputs",) if self.vocab is not None else ())
        top = _last(self.vocab)
        for i, (path, x) in enumerate(jax.tree_util.tree_flatten_with_path(batch)[0]):
            key = path[-1] if path else None
            name = key.key if isinstance(key, jax.tree_util.DictKey) else None
            dtype = getattr(x, "dtype", None)
            if not isinstance(name, str) or dtype is None \
                    or not np.issubdtype(np.dtype(dtype), np.integer):
                continue
            where = f"batch{jax.tree_util.keystr(path)}"
            if name in MASK_KEYS:
                fields.append(Field(i, where, "mask", 0, 1))
            elif name in POSITION_KEYS:
                fields.append(Field(i, where, "positions", 0, _last(self.max_positions)))
            elif name in TARGET_KEYS:
                fields.append(Field(i, where, "targets", 0, top, IGNORE_INDEX))
            elif name in token_keys:
                fields.append(Field(i, where, "tokens", 0, top))
        return tuple(fields)

    def __call__(self, fields: tuple[Field, ...], leaves: list[Any], first: int) -> None:
        """Checks ``leaves`` (a group's, ``[K, batch, ...]``) whose batch 0 is batch
        ``first`` of the data; an error names the first bad batch, field and value."""
        for f in fields:
            x = leaves[f.leaf]
            if not np.size(x):
                continue
            lo, hi = x.min(), x.max()
            if f.high is not None and hi > f.high:
                self._fail(f, x, first)
            if lo >= f.low:
                continue
            if f.ignore is None or lo < f.ignore or ((x < f.low) & (x != f.ignore)).any():
                self._fail(f, x, first)

    @staticmethod
    def _fail(f: Field, x: Any, first: int) -> NoReturn:
        x = np.asarray(x)
        bad = (x < f.low) if f.ignore is None else (x < f.low) & (x != f.ignore)
        if f.high is not None:
            bad |= x > f.high
        at = np.argwhere(bad)[0]
        value = x[tuple(at)].item()
        inner = "[" + ", ".join(str(int(a)) for a in at[1:]) + "]"
        top = " or more" if f.high is None else f" .. {f.high}"
        rule, fix = {
            "mask": ("attention_mask holds 1 (a real token) and 0 (padding) only",
                     "pass the tokenizer's 0/1 attention_mask, e.g. "
                     "(tokens != pad_id).astype(np.int32)"),
            "positions": (f"positions are {f.low}{top}" + (
                "" if f.high is None else f" (the model's {f.high + 1} positions)"),
                "count positions from 0, restarting with each packed sequence "
                "(ns.pack writes them)"),
            "targets": (f"targets are token ids {f.low}{top}, or {IGNORE_INDEX} (ignored, the "
                        "only ignore index of lm_loss)" + (
                            "" if f.high is None else f"; the vocabulary has {f.high + 1} ids"),
                        f"mark targets to skip with {IGNORE_INDEX}, as transformers' labels do, "
                        "and encode with the model's tokenizer"),
            "tokens": (f"token ids are {f.low}{top}" + (
                "" if f.high is None else f" (the model's vocabulary of {f.high + 1})"),
                "encode with the model's tokenizer, and pad with a real id (e.g. 0) masked "
                "out by attention_mask"),
        }[f.kind]
        raise UsageError(
            f"Trainer.fit: batch {first + int(at[0])} of data has {f.path} = {value} (at "
            f"{inner}); {rule}. Inside the compiled step nothing checks it: it would train "
            f"silently. Fix: {fix}.")


def _whole(n: Any) -> TypeGuard[int | np.integer]:
    return isinstance(n, int | np.integer) and not isinstance(n, bool) and bool(n > 0)


def _last(count: int | None) -> int | None:
    """The largest of ``count`` ids (``None``: no bound)."""
    return None if count is None else count - 1


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
    data: Iterable[Any], sizes: Iterable[int], build: Callable[[list[Any], int], Any],
    stop: threading.Event, first: int = 0,
) -> Iterator[Any]:
    """Groups of K host batches from an iterable, each stacked by ``build(batches,
    index)``, ``index`` counting the batches from ``first``."""
    it = iter(data)
    for k in sizes:
        host = list(itertools.islice(it, k))
        if stop.is_set():
            return
        if host:
            yield build(host, first)
            first += len(host)
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

    def __init__(self, place: Placer, check: BatchCheck | None = None) -> None:
        self.place = place
        self.check = check if check is not None else BatchCheck()
        # Per layout: the fields whose values each group's check reads.
        self._checked: dict[Any, tuple[Field, ...]] = {}
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
                raise UsageError(
                    f"host batch {n} of this group has structure {td} but the first "
                    f"has {treedef}; every batch must have the same structure. Fix: let "
                    "data yield batches of one structure (the same keys and nesting).")
        if type(first) is dict:
            keys = tuple(sorted(first))
            if treedef == jax.tree.structure(dict.fromkeys(keys, 0)):  # type: ignore[operator]
                self._flat_dict = (treedef, keys)
        return treedef, [list(column) for column in zip(*(f[0] for f in flat), strict=True)]

    def __call__(self, host: list[Any], first: int = 0) -> Group:
        """The group of ``host``, batches ``first`` .. ``first + K - 1`` of the data."""
        treedef, columns = self._columns(host)
        try:
            stacked = [_stack(column) for column in columns]
        except ValueError:
            _ragged(host)
            raise
        key = (treedef, *((x.shape, x.dtype) for x in stacked))
        fields = self._checked.get(key)
        if fields is None:  # a new structure, shape or dtype
            _check_first(host[0])
            fields = self._checked[key] = self.check.plan(host[0])
        if fields:
            self.check(fields, stacked, first)
        data, shardings = self.place.host_leaves(stacked, treedef, key)
        examples = int(stacked[0].shape[1]) * self._processes if stacked else 0
        return Group(len(host), data, shardings, examples)


def build_group(host: list[Any], place: Placer) -> Group:
    """One fused call's input from K host batches (see :class:`Stacker`).

    >>> from nnx_shard._mesh import make_mesh
    >>> from nnx_shard._rules import as_rules
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
        raise UsageError(
            f"Trainer.fit: a batch from data is {short_repr(batch)}, which holds no "
            "arrays. Batches are pytrees of arrays with a leading batch axis. Fix: let "
            "data yield e.g. {'x': np.ndarray of shape (batch, ...), 'y': ...}."
        )
    for path, x in first[0]:
        check_array_leaf(path, x, "Trainer.fit")
        if np.ndim(x) == 0:
            raise UsageError(
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
                raise UsageError(
                    f"host batch {n} of this group has batch{jax.tree_util.keystr(path)} "
                    f"of shape {fmt_shape(x)}, but the first has {fmt_shape(x0)}. "
                    "Batches are stacked K at a time, so shapes must agree. Fix: drop "
                    "the last, smaller batch of an epoch (drop_last) or pad it."
                )


def window_groups(
    data: Batches, start: int, sizes: Iterable[int], place: Placer, stop: threading.Event,
    check: BatchCheck | None = None,
) -> Iterator[Any]:
    """Groups of K batches read from ``data`` as whole ``[K, batch, ...]`` windows:
    no per-step Python, no stacking (a window of a contiguous array is a view)."""
    pos = start
    examples = data.batch_size * jax.process_count()
    check = check if check is not None else BatchCheck()
    fields: tuple[Field, ...] = ()
    for k in sizes:
        window = data.window(pos, k) if not stop.is_set() else None
        if window is None:
            return
        leaves = jax.tree.leaves(window)
        n = int(np.shape(leaves[0])[0])
        if pos == start:  # one layout for the whole run: checked once
            for path, x in jax.tree_util.tree_flatten_with_path(window)[0]:
                check_array_leaf(path, x, "Trainer.fit")
            fields = check.plan(window)
        if fields:
            check(fields, leaves, pos)
        yield Group(n, *place.host(window), examples)
        pos += n
        if n < k:
            return


def groups(
    data: Any, sizes: Iterator[int], place: Placer, *, position: int, resumed: bool,
    check: BatchCheck | None = None,
) -> Callable[[threading.Event], Iterator[Any]]:
    """The generator of fused-call inputs (:class:`Group`), reading ``data`` from the
    data position ``position``; ``check`` (:class:`BatchCheck`) reads each group's
    known fields, naming a batch by its index in ``data`` (in the stream a callable
    ``data(position)`` continues)."""
    check = check if check is not None else BatchCheck()
    if isinstance(data, Batches):
        first = position if resumed else 0
        return functools.partial(window_groups, data, first, sizes, place, check=check)
    first = 0
    if callable(data) and not isinstance(data, Iterable):
        data, first = data(position), position
    elif resumed and position:
        data, first = itertools.islice(data, position, None), position
    return functools.partial(stacked_groups, data, sizes, Stacker(place, check), first=first)
