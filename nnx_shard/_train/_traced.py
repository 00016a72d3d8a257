"""The traced side of the fused call (:mod:`._fused`): the function its ``jax.jit``
compiles, K calls of the train step in a ``jax.lax.scan`` over the split NNX state,
with the checks of what the step returns and changes, and the call's metrics
packed into one byte vector (:class:`Packed`) so the host reads one array back."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from nnx_shard._errors import UsageError
from nnx_shard._mesh import apply_sharding
from nnx_shard._parallel.registry import checking_step, prepare_step
from nnx_shard._train._microbatch import TAKEN, tracing_step
from nnx_shard._train._precision import Precision
from nnx_shard._train._stream import APPLIED, not_applied
from nnx_shard._train._trees import leaf_path

__all__ = ["Packed", "StepOwner", "build_run", "check_metrics", "pack", "unpack_rows"]


class StepOwner(Protocol):
    """What :func:`build_run` reads of the :class:`~nnx_shard._train._fused.Fused`
    that compiles it (and the trace count it keeps there)."""

    step_fn: Callable[..., Any]
    microbatches: int
    precision: Precision | None
    unroll: int
    finish: Callable[[Any, Any, Any], Any] | None
    traces: int
    stream_offload: bool


def check_metrics(metrics: Any, fn_name: str) -> Any:
    """``metrics`` (what the step ``fn_name`` returned) with every leaf an array: a
    NumPy array or a Python number becomes one, anything else is a UsageError naming
    the leaf."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(metrics)
    out = []
    for path, x in flat:
        if isinstance(x, jax.Array):  # tracers included
            out.append(x)
        elif (isinstance(x, np.ndarray | np.generic) and x.dtype.kind in "biufc") or isinstance(
            x, bool | int | float | complex
        ):
            out.append(jnp.asarray(x))
        else:
            where = f"metrics{jax.tree_util.keystr(path)}" if path else "the metrics"
            raise UsageError(
                f"{fn_name} returned {where} = {x!r} ({type(x).__name__}), which is not an "
                "array. The fused call stacks every metric to [K, ...], so metrics must be "
                "arrays or numbers, e.g. return {'loss': loss}. Fix: drop Python objects "
                "from the returned metrics (compute them outside, from the stacked arrays)."
            )
    return jax.tree.unflatten(treedef, out)


@jax.tree_util.register_pytree_node_class
class Packed:
    """A call's metrics as one byte vector (``buf``) and how to cut it back into
    them (``spec``: the metrics' treedef and each leaf's dtype and shape, static,
    so it comes back with every call's output). Reading one array back costs a
    fixed ~7 us of Python whatever its size: a call's 4 metrics (loss, gradient
    norm, guard flags) read as one cost a quarter.

    >>> m = {"loss": jnp.array([0.5, 0.25]), "ok": jnp.array([True, False])}
    >>> p = pack(m)
    >>> p.buf.dtype, p.buf.shape
    (dtype('uint8'), (10,))
    >>> out = p.unpack()
    >>> out["loss"].tolist(), out["ok"].tolist()
    ([0.5, 0.25], [True, False])
    """

    def __init__(self, buf: Any, spec: Any) -> None:
        self.buf = buf
        self.spec = spec

    def tree_flatten(self) -> tuple[tuple[Any], Any]:
        return (self.buf,), self.spec

    @classmethod
    def tree_unflatten(cls, spec: Any, children: Any) -> Packed:
        return cls(children[0], spec)

    def unpack(self) -> Any:
        """The metrics, NumPy arrays (read back first: ``jax.device_get``)."""
        return unpack_rows(self.spec, np.asarray(self.buf)[None], 0)

    def rows_of(self, others: Sequence[Packed]) -> Any:
        """The metrics of calls of the same spec (``others``, read back), each leaf
        stacked over the calls: one cut of a ``[calls, bytes]`` array per metric."""
        rows = np.stack([np.asarray(p.buf) for p in others])
        return unpack_rows(self.spec, rows, None)


@functools.lru_cache(maxsize=256)
def _cuts(spec: Any) -> tuple[tuple[Any, int, int, tuple[int, ...], bool], ...]:
    """Where each leaf of a packed spec lies: (dtype, first byte, bytes, shape, bool)."""
    out, offset = [], 0
    for dtype_name, shape in spec[1]:
        is_bool = dtype_name == "bool"  # packed as one uint8 each
        dtype = np.dtype(np.uint8) if is_bool else np.dtype(jnp.dtype(dtype_name))
        nbytes = math.prod(shape) * dtype.itemsize
        out.append((dtype, offset, nbytes, tuple(shape), is_bool))
        offset += nbytes
    return tuple(out)


def unpack_rows(spec: Any, rows: np.ndarray, row: int | None) -> Any:
    """The leaves of packed metrics from ``rows`` (``[calls, bytes]``): of one row,
    or with ``row=None`` of all, each leaf then stacked over the calls."""
    leaves = []
    for dtype, offset, nbytes, shape, is_bool in _cuts(spec):
        cut = rows[:, offset:offset + nbytes] if row is None else rows[row, offset:offset + nbytes]
        x = np.ascontiguousarray(cut).view(dtype)
        x = x.reshape(shape if row is not None else (len(rows), *shape))
        leaves.append(x.astype(bool) if is_bool else x)
    return jax.tree.unflatten(spec[0], leaves)


def pack(metrics: Any) -> Packed | Any:
    """``metrics`` as one :class:`Packed` byte vector (traced, or eager), or as they
    are where a leaf cannot be packed (a complex number, a sharded leaf)."""
    leaves, treedef = jax.tree.flatten(metrics)
    parts, spec = [], []
    for x in leaves:
        x = jnp.asarray(x)
        spec_of = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None) or ()
        if jnp.issubdtype(x.dtype, jnp.complexfloating) or any(e is not None for e in spec_of):
            return metrics  # a sharded leaf would be gathered (or refused on Explicit axes)
        if x.dtype == jnp.bool_:
            b = x.astype(jnp.uint8)
        else:
            b = jax.lax.bitcast_convert_type(x, jnp.uint8)
        parts.append(b.reshape(-1))
        spec.append((jnp.dtype(x.dtype).name, tuple(x.shape)))
    buf = jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.uint8)
    return Packed(buf, (treedef, tuple(spec)))


def _structure_diff(before: Any, after: Any) -> str:
    a = {leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(before)[0]}
    b = {leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(after)[0]}
    parts = []
    if b - a:
        parts.append("added " + ", ".join(sorted(b - a)))
    if a - b:
        parts.append("removed " + ", ".join(sorted(a - b)))
    return "; ".join(parts) or "the Variable types or metadata changed"


def build_run(
    owner: StepOwner,
    graphdef: Any,
    state_def: Any,
    node_pos: tuple[int, ...],
    nargs: int,
    shardings: tuple[Any, ...],
) -> Callable[..., Any]:
    """The compiled call's function (``jax.jit`` of it in ``Fused._jit``):
    ``run(values, data) -> (new_values, metrics, count)`` scans ``owner.step_fn``
    over the leading axis of ``data`` with the split state ``values`` as the carry,
    pinned to ``shardings``; ``owner.traces`` counts its traces."""
    step_fn = owner.step_fn
    fn_name = getattr(step_fn, "__name__", "step_fn")
    m, precision = owner.microbatches, owner.precision

    def pin(values: list[Any]) -> list[Any]:
        # Keeps the carry in its input layout at every step, so the loop never
        # reshards mid-way and the output matches the input exactly.
        return [
            apply_sharding(x, s) if isinstance(s, NamedSharding) else x
            for x, s in zip(values, shardings, strict=True)
        ]

    def body(values: list[Any], xs: tuple[Any, ...]) -> tuple[list[Any], Any]:
        nodes = nnx.merge(graphdef, jax.tree.unflatten(state_def, values))
        prepare_step(nodes)  # on this traced copy only: the caller's model is untouched
        it_nodes, it_xs = iter(nodes), iter(xs)
        call_args = [next(it_nodes) if i in node_pos else next(it_xs) for i in range(nargs)]
        # Registered parallel ops check the traced step (checking_step); value_and_grad
        # inside it takes the microbatches from the context and records that it ran.
        with tracing_step(m, precision) as calls, checking_step(fn_name):
            metrics = step_fn(*call_args)
        if (m > 1 or (precision is not None and precision.casts)) and TAKEN not in calls:
            what = (f"microbatches={m}" if m > 1 else f"precision={precision!r}")
            where = ("the batch is split into microbatches" if m > 1
                     else "the parameters are read in the compute dtype")
            raise UsageError(
                f"multistep(..., {what}): {fn_name} never called "
                f"nnx_shard.value_and_grad, where {where}. "
                "Fix: compute gradients with ns.value_and_grad(loss_fn)(model, batch) "
                "instead of nnx.value_and_grad."
            )
        if owner.stream_offload and APPLIED not in calls:
            raise not_applied(fn_name)
        metrics = check_metrics(metrics, fn_name)
        _, new_state = nnx.split(nodes)
        new_values, new_def = jax.tree.flatten(new_state)
        if new_def != state_def:
            raise UsageError(
                f"{fn_name} changed the structure of the NNX objects it was given "
                f"({_structure_diff(jax.tree.unflatten(state_def, values), new_state)}). "
                "State carried across fused steps must keep its structure. Fix: create "
                "every Variable before the first call (e.g. build metrics and optimizer "
                "state up front)."
            )
        return pin(new_values), metrics

    def counted(carry: tuple[list[Any], jax.Array], xs: Any) -> Any:
        values, count = carry
        values, metrics = body(values, xs)
        return (values, count + 1), metrics

    def run(values: list[Any], data: tuple[Any, ...]) -> tuple[list[Any], Any, jax.Array]:
        owner.traces += 1
        # The step count is a by-product of the loop, so it is ready only when the
        # call is: a scalar the host can wait on (never donated, unlike the state).
        (new_values, count), metrics = jax.lax.scan(
            counted, (values, jnp.zeros((), jnp.int32)), data, unroll=owner.unroll
        )
        if owner.finish is not None:
            before = nnx.merge(graphdef, jax.tree.unflatten(state_def, values))
            after = nnx.merge(graphdef, jax.tree.unflatten(state_def, new_values))
            metrics = owner.finish(before, after, metrics)
            new_values = pin(jax.tree.leaves(nnx.split(after)[1]))
        return new_values, metrics, count

    return run
