"""Fused multi-step training: K steps in one compiled call, batches sharded by logical names.

Three layers, each usable alone:

* :func:`multistep` turns an ordinary NNX train step into one compiled call
  that runs it K times (a ``jax.lax.scan``), carrying the model, the optimizer
  and any other NNX object passed, updating them in place like ``nnx.jit``.
* :func:`value_and_grad` is ``nnx.value_and_grad`` that can split the batch
  into microbatches and average the gradients (set per call, or by
  ``multistep(..., microbatches=M)``).
* :func:`shard_batch` turns host NumPy batches into global ``jax.Array`` s laid
  out by logical names; :class:`Trainer` puts the three together with
  prefetching, a progress bar and a NaN/Inf stop.

Why a ``jax.lax.scan`` over split state rather than ``nnx.scan``: the carry is
plain arrays (so it can be donated and pinned to its input shardings), NNX's
Python bookkeeping runs once per call instead of once per step (and on the host
only as a cached pytree flatten, see :class:`_Plan`), and none of the
``nnx.scan`` pitfalls apply (``in_axes=None`` silently freezing the model,
closures across trace levels).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import itertools
import os
import queue
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.nnx import graphlib
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard.annotate import path_str
from nnx_shard.batches import Batches
from nnx_shard.checkpoint import Checkpointer, restore_into
from nnx_shard.errors import ShardingError, sharding_types
from nnx_shard.mesh import apply_sharding, current, make_mesh, use
from nnx_shard.parallel.registry import checking_step, microbatch_owner
from nnx_shard.rules import Rules, as_rules

__all__ = ["Fused", "History", "Trainer", "multistep", "shard_batch", "value_and_grad"]

LogicalNames = Sequence[str | None]


# --------------------------------------------------------------------------- helpers


def _is_node(x: Any) -> bool:
    """True for arguments that are (or contain) NNX graph nodes: these are carried."""
    hit = False

    def leaf(y: Any) -> bool:
        nonlocal hit
        if graphlib.is_graph_node(y) or isinstance(y, nnx.Variable):
            hit = True
            return True
        return False

    jax.tree_util.tree_leaves(x, is_leaf=leaf)
    return hit


def _leaf_path(path: Sequence[Any]) -> str:
    # State leaves end in `.value` (the Variable's payload); users know the variable path.
    keys = [k for k in path if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")]
    return path_str(keys)


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


def _fmt_shape(x: Any) -> str:
    return str(tuple(np.shape(x)))


def _short_repr(x: Any, limit: int = 60) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --------------------------------------------------------------------------- microbatches


class _MicroFrames(threading.local):
    def __init__(self) -> None:
        # One [microbatches, used] frame per multistep body being traced.
        self.stack: list[list[Any]] = []


_micro = _MicroFrames()


def _spec_axes(sharding: Any, dim: int) -> tuple[tuple[str, ...], int]:
    """The mesh axes dimension ``dim`` is sharded over by ``sharding``, and how many
    devices that is; ``((), 1)`` when unsharded."""
    spec = getattr(sharding, "spec", None)
    if spec is None or dim >= len(spec) or spec[dim] is None:
        return (), 1
    entry = spec[dim]
    axes = (entry,) if isinstance(entry, str) else tuple(entry)
    if not all(isinstance(a, str) for a in axes):
        return (), 1
    sizes = dict(sharding.mesh.shape)
    return axes, int(np.prod([sizes[a] for a in axes]))


def _sharded_over(x: Any, dim: int) -> tuple[tuple[str, ...], int]:
    """:func:`_spec_axes` of ``x``'s type (Explicit axes put the sharding there)."""
    return _spec_axes(getattr(jax.typeof(x), "sharding", None), dim)


def _check_device_rows(
    where: str, shape: tuple[int, ...], axes: tuple[str, ...], devices: int, m: int
) -> None:
    """Microbatches split each device's own rows (see _split_microbatches): say so
    when a device holds a number of rows that ``m`` does not divide."""
    rows = shape[0] // devices
    if rows % m:
        raise ShardingError(
            f"microbatches={m} must divide each device's rows of the batch: "
            f"{where} has {shape[0]} rows (shape {tuple(shape)}) sharded over mesh axes "
            f"{', '.join(axes)} ({devices} devices), so {rows} row{'s' if rows != 1 else ''} "
            f"per device, which does not divide by {m}. Fix: a global batch that is a "
            f"multiple of {m} x {devices} = {m * devices}, or a number of microbatches that "
            f"divides {rows}."
        )


def _split_microbatches(batch: Any, m: int) -> Any:
    """[B, ...] -> [m, B/m, ...]; microbatch j holds rows j, j+m, j+2m, ...

    Strided rather than contiguous on purpose: a batch sharded over devices in
    contiguous blocks then gives every device the same share of every
    microbatch, so no data moves between devices. This is exactly optax's
    ``microbatching.reshape_batch_axis`` (which also keeps Explicit shardings on
    the rows), used here after our own checks, whose messages name the leaf.

    Why the loop around it (:func:`_accumulate`) is not ``optax.microbatch``:
    that gives the same numbers (tests/test_train.py compares them) but calls
    a pure function with the same arguments for every microbatch and only
    accumulates its outputs; NNX state used by the loss (an ``nnx.Rngs``
    stream drawing a new dropout mask per microbatch, batch statistics) must be
    carried from one microbatch to the next, which it cannot do.
    """

    def one(path: Any, x: Any) -> Any:
        if np.ndim(x) == 0 or x.shape[0] % m:
            raise ValueError(
                f"microbatches={m} must divide the batch dimension (axis 0) of every batch "
                f"leaf, but batch{jax.tree_util.keystr(path)} has shape {_fmt_shape(x)}. Fix: "
                f"use a batch size that is a multiple of {m}, or another number of microbatches."
            )
        x = jnp.asarray(x)
        # On Explicit axes the split would need rows of one device in several
        # microbatches: JAX refuses the reshape (a ShardingTypeError).
        _check_device_rows(f"batch{jax.tree_util.keystr(path)}", x.shape, *_sharded_over(x, 0), m)
        return optax.microbatching.reshape_batch_axis(x, x.shape[0] // m)

    return jax.tree_util.tree_map_with_path(one, batch)


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    microbatches: int | None = None,
    wrt: Any = nnx.Param,
) -> Callable[..., tuple[Any, Any]]:
    """``nnx.value_and_grad`` over the model (first argument) that can accumulate microbatches.

    The returned ``grad_fn(model, batch, *args)`` calls ``loss_fn(model, batch, *args)``.
    With M microbatches, every leaf of ``batch`` is split along axis 0 into M
    equal microbatches (rows ``j, j+M, j+2M, ...`` form microbatch ``j``), the
    loss and gradients are computed one microbatch at a time inside a
    ``jax.lax.scan`` (activations of one microbatch live at a time) and
    averaged: for a loss that is a mean over examples this equals the
    full-batch result up to float rounding. ``aux`` (with ``has_aux=True``) is
    averaged the same way. ``args`` are passed to every microbatch unchanged;
    NNX objects among them (e.g. ``nnx.Rngs``) are carried through. Under a
    pipeline strategy (``strategies.get("pp")``) the whole batch goes through
    one forward pass instead, and :func:`nnx_shard.pipeline.scan` runs the M
    microbatches through the stages.

    Args:
      loss_fn: ``loss_fn(model, batch, *args) -> loss`` (or ``(loss, aux)``).
      has_aux: ``loss_fn`` returns ``(loss, aux)``.
      microbatches: M. ``None`` (default) takes M from the enclosing
        ``multistep(..., microbatches=M)``, else 1 (no splitting).
      wrt: which Variables of the model to differentiate (an NNX filter).

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> batch = {"x": jnp.ones((8, 3)), "y": jnp.zeros((8, 1))}
    >>> mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> loss1, g1 = value_and_grad(mse)(model, batch)
    >>> loss4, g4 = value_and_grad(mse, microbatches=4)(model, batch)
    >>> bool(jnp.allclose(loss1, loss4)), bool(jnp.allclose(g1["kernel"][...], g4["kernel"][...]))
    (True, True)
    """
    if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
        raise ValueError(f"microbatches must be a positive int or None, got {microbatches!r}")
    if not callable(loss_fn):
        raise TypeError(f"value_and_grad: loss_fn must be callable, got {loss_fn!r}")
    vg = nnx.value_and_grad(_checked_loss(loss_fn, has_aux), argnums=nnx.DiffState(0, wrt),
                            has_aux=has_aux)

    @functools.wraps(loss_fn)
    def grad_fn(model: Any, batch: Any, *args: Any) -> tuple[Any, Any]:
        m = microbatches
        if _micro.stack:
            frame = _micro.stack[-1]
            frame[1] = True
            if m is None:
                m = frame[0]
        owner = microbatch_owner()
        if owner is not None:
            # A parallel op runs the microbatches itself (the pipeline: through its
            # stages inside one forward pass) instead of the accumulation loop.
            return owner.microbatched(vg, m or 1, model, batch, *args)  # type: ignore[misc]
        if m is None or m == 1:
            return vg(model, batch, *args)
        return _accumulate(vg, m, wrt, model, batch, args)

    return grad_fn


def _checked_loss(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``loss_fn``, with its output checked (at trace time) against ``has_aux``: JAX's
    own error for a tuple loss does not mention ``has_aux``."""
    name = getattr(loss_fn, "__name__", "loss_fn")

    @functools.wraps(loss_fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = loss_fn(*args, **kwargs)
        if has_aux:
            if not (isinstance(out, tuple | list) and len(out) == 2):
                raise TypeError(
                    f"{name} returned {_describe_value(out)}, but "
                    "has_aux=True expects a pair (loss, aux), e.g. return loss, {'acc': acc}. "
                    "Fix: return the pair, or drop has_aux=True."
                )
            loss = out[0]
        elif isinstance(out, tuple | list):
            raise TypeError(
                f"{name} returned a {type(out).__name__} of {len(out)} values, not one scalar "
                "loss. Fix: if it returns (loss, aux), pass has_aux=True (Trainer(..., "
                "has_aux=True) or ns.value_and_grad(loss_fn, has_aux=True)); else return "
                "only the loss."
            )
        else:
            loss = out
        if np.ndim(loss) != 0:
            raise TypeError(
                f"{name} returned a loss of shape {_fmt_shape(loss)}, not a scalar. Fix: "
                "reduce it over the examples, e.g. jnp.mean(per_example_loss)."
            )
        return out

    return checked


def _describe_value(x: Any) -> str:
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)} values"
    if hasattr(x, "shape"):
        return f"an array of shape {_fmt_shape(x)}"
    return f"{_short_repr(x)} ({type(x).__name__})"


def _accumulate(
    vg: Callable[..., Any], m: int, wrt: Any, model: Any, batch: Any, args: tuple[Any, ...]
) -> tuple[Any, Any]:
    micro = _split_microbatches(batch, m)
    node_pos = [i for i, a in enumerate(args) if _is_node(a)]
    graphdef, state = nnx.split((model, *(args[i] for i in node_pos)))
    zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, wrt))
    grads_def: list[Any] = []

    def body(carry: Any, mb: Any) -> Any:
        state, acc = carry
        nodes = nnx.merge(graphdef, state)
        call_args = list(args)
        for i, node in zip(node_pos, nodes[1:], strict=True):
            call_args[i] = node
        out, grads = vg(nodes[0], mb, *call_args)
        # Accumulate flat leaves: grads may carry Variable metadata that differs
        # from the zeros' (the structure is the same array for array).
        g_leaves, g_def = jax.tree.flatten(grads)
        grads_def.append(g_def)
        acc = [a + g for a, g in zip(acc, g_leaves, strict=True)]
        _, state = nnx.split(nodes)
        return (state, acc), out

    (state, acc), outs = jax.lax.scan(body, (state, jax.tree.leaves(zeros)), micro)
    nnx.update((model, *(args[i] for i in node_pos)), state)
    grads = jax.tree.unflatten(grads_def[0], [a / m for a in acc])
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), outs), grads


# --------------------------------------------------------------------------- multistep


def _check_metrics(metrics: Any, fn_name: str) -> Any:
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
            raise TypeError(
                f"{fn_name} returned {where} = {x!r} ({type(x).__name__}), which is not an "
                "array. The fused call stacks every metric to [K, ...], so metrics must be "
                "arrays or numbers, e.g. return {'loss': loss}. Fix: drop Python objects "
                "from the returned metrics (compute them outside, from the stacked arrays)."
            )
    return jax.tree.unflatten(treedef, out)


def _structure_diff(before: Any, after: Any) -> str:
    a = {_leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(before)[0]}
    b = {_leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(after)[0]}
    parts = []
    if b - a:
        parts.append("added " + ", ".join(sorted(b - a)))
    if a - b:
        parts.append("removed " + ", ".join(sorted(a - b)))
    return "; ".join(parts) or "the Variable types or metadata changed"


def _mesh_of(trees: Sequence[Any]) -> Mesh | None:
    for tree in trees:
        for x in jax.tree.leaves(tree):
            sharding = getattr(x, "sharding", None)
            if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
                return sharding.mesh
    return None


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


@dataclasses.dataclass
class _Plan:
    """What one layout of arguments compiles to, and how to read and write its state fast.

    ``perm[i]`` is the position, among the Variables of ``jax.tree.flatten(nodes)``,
    of the i-th Variable of ``nnx.split(nodes)``'s state. Flattening the NNX
    objects as pytrees (about 10x cheaper than ``nnx.split``) then gives the
    state without a graph traversal, as long as the pytree structure (which
    holds every static attribute, e.g. ``deterministic`` after ``model.eval()``)
    is unchanged and no Variable is shared (pytrees do not see sharing).
    """

    jitted: Any
    state_def: Any
    shardings: tuple[Any, ...]
    context: Any
    node_def: Any = None
    perm: tuple[int, ...] | None = None


class Fused:
    """The compiled K-step function made by :func:`multistep`; call it like the step.

    ``fused(*args)``: arguments that are NNX objects (modules, optimizers, Rngs,
    metrics, or containers of them) are carried across steps and updated in
    place; every other argument is a pytree of arrays whose leaves all have the
    same leading axis K, scanned over. Returns the step's metrics stacked to
    ``[K, ...]``.

    Attributes:
      traces: how many times the step was traced (one per compilation).

    >>> def train_step(model, optimizer, batch): ...
    >>> multistep(train_step, microbatches=2)
    multistep(train_step, donate=True, microbatches=2, max_in_flight=2, unroll=1, traces=0)
    """

    def __init__(
        self,
        step_fn: Callable[..., Any],
        *,
        donate: bool,
        microbatches: int,
        max_in_flight: int | None = 2,
        unroll: int = 1,
    ) -> None:
        self.step_fn = step_fn
        self.donate = donate
        self.microbatches = microbatches
        self.max_in_flight = max_in_flight
        self.unroll = unroll
        self.traces = 0
        # One small output per call not yet known to be finished, oldest first.
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._jitted: dict[Any, Any] = {}
        self._plans: dict[tuple[tuple[int, ...], int], _Plan] = {}
        self._names: dict[int, list[str]] = {}
        # Data layouts (shapes, shardings) whose rows per device were checked.
        self._rows_checked: set[Any] = set()
        # Runs once per call after the K steps, in the compiled call:
        # finish(nodes_before, nodes_after, metrics) -> metrics, updating nodes_after in
        # place (Trainer's NaN guard checks the call's result there, not every step).
        self._finish: Callable[[Any, Any, Any], Any] | None = None
        functools.update_wrapper(self, step_fn)

    def __repr__(self) -> str:
        name = getattr(self.step_fn, "__qualname__", repr(self.step_fn))
        return (
            f"multistep({name}, donate={self.donate}, microbatches={self.microbatches}, "
            f"max_in_flight={self.max_in_flight}, unroll={self.unroll}, traces={self.traces})"
        )

    # -- host side ------------------------------------------------------------

    def _steps(self, args: tuple[Any, ...], node_pos: tuple[int, ...]) -> int:
        ks: set[int | None] = set()
        for i, a in enumerate(args):
            if i not in node_pos:
                ks.update(np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(a))
        if len(ks) == 1 and None not in ks and 0 not in ks:
            return ks.pop()  # type: ignore[return-value]
        names = self._names.get(len(args)) or _arg_names(self.step_fn, len(args))
        self._names[len(args)] = names
        seen: list[tuple[str, Any, int | None]] = []
        for i, a in enumerate(args):
            if i in node_pos:
                continue
            for path, x in jax.tree_util.tree_flatten_with_path(a)[0]:
                shape = np.shape(x)
                seen.append((names[i] + jax.tree_util.keystr(path), shape, shape[0] if shape else None))
        if not seen:
            raise ValueError(
                "multistep needs at least one array argument with a leading steps axis K "
                "(e.g. a batch shaped [K, batch, ...]) to know how many steps to run."
            )
        listing = "; ".join(
            f"{p} has shape {s} -> K={k if k is not None else 'none (scalar)'}" for p, s, k in seen
        )
        raise ValueError(
            "batch leaves disagree on the number of steps K (their leading axis): "
            f"{listing}. Every leaf of the data arguments needs the same leading steps "
            "axis, laid out [K, batch, ...] (not [batch, K, ...]). Fix: stack the K step "
            "batches with np.stack, or use shard_batch(..., steps=True)."
        )

    def _prepare(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        node_pos = tuple(i for i, a in enumerate(args) if _is_node(a))
        if not node_pos:
            raise TypeError(
                "multistep: no NNX object among the arguments. Call the fused step like the "
                "step itself, e.g. fused(model, optimizer, batch)."
            )
        self._steps(args, node_pos)
        nodes = tuple(args[i] for i in node_pos)
        data = tuple(a for i, a in enumerate(args) if i not in node_pos)
        context = current()
        variables, node_def = jax.tree.flatten(nodes, is_leaf=_is_variable)
        plan = self._plans.get((node_pos, len(args)))
        if (
            plan is not None
            and plan.perm is not None
            and plan.context == context
            and node_def == plan.node_def
            and len({id(v) for v in variables}) == len(variables)
        ):
            values = [variables[p].get_raw_value() for p in plan.perm]
            if all(
                isinstance(x, jax.Array)
                and (x.committed and x.sharding == s if s is not None else not x.committed)
                for x, s in zip(values, plan.shardings, strict=True)
            ):
                return plan, variables, nodes, values, data
        plan, values = self._slow_plan(nodes, data, variables, node_def, node_pos, len(args))
        self._plans[(node_pos, len(args))] = plan
        return plan, variables, nodes, values, data

    def _slow_plan(
        self,
        nodes: tuple[Any, ...],
        data: tuple[Any, ...],
        variables: list[Any],
        node_def: Any,
        node_pos: tuple[int, ...],
        nargs: int,
    ) -> tuple[_Plan, list[Any]]:
        graphdef, state = nnx.split(nodes)
        values, state_def = jax.tree.flatten(state)
        context = current()
        mesh = _mesh_of((values, data))
        if mesh is None and context is not None:
            mesh = context[0]
        if mesh is not None:
            # Fresh eager values (uncommitted, one device) join the mesh replicated, once:
            # committing them keeps the input shardings, and so the compile cache, stable.
            rep = NamedSharding(mesh, PartitionSpec())
            values = [
                jax.device_put(x, rep) if isinstance(x, jax.Array) and not x.committed else x
                for x in values
            ]
        # None (unspecified) for values still uncommitted (no mesh in sight): they stay
        # uncommitted, so a later call under a mesh can still replicate them onto it.
        shardings = tuple(
            x.sharding if isinstance(x, jax.Array) and x.committed else None for x in values
        )
        key = (graphdef, state_def, shardings, node_pos, nargs, context)
        jitted = self._jitted.get(key)
        if jitted is None:
            jitted = self._build(graphdef, state_def, node_pos, nargs, shardings)
            self._jitted[key] = jitted
        plan = _Plan(jitted, state_def, shardings, context)
        split_vars = jax.tree.leaves(state, is_leaf=_is_variable)
        index = {id(v): i for i, v in enumerate(variables)}
        if (
            len(split_vars) == len(values)
            and len(index) == len(variables)
            and all(id(v) in index for v in split_vars)
        ):
            plan.node_def = node_def
            plan.perm = tuple(index[id(v)] for v in split_vars)
        return plan, values

    def _entry(self, what: str) -> str:
        # Error messages name the call the user made (Trainer.fit sets its own).
        name = getattr(self, "entry", None)
        return name or f"multistep({getattr(self.step_fn, '__name__', 'step_fn')}){what}"

    def _check_microbatches(self, args: tuple[Any, ...]) -> None:
        """Each device's rows of every [K, batch, ...] leaf must split into the
        microbatches. Checked on the host from the arrays' shardings, so Auto meshes
        (whose array types carry no sharding) get the same message as Explicit ones."""
        data = [(i, a) for i, a in enumerate(args) if not _is_node(a)]
        leaves = [jax.tree_util.tree_flatten_with_path(a)[0] for _, a in data]
        layout = tuple((np.shape(x), getattr(x, "sharding", None)) for f in leaves for _, x in f)
        if layout in self._rows_checked:
            return
        names = self._names.get(len(args)) or _arg_names(self.step_fn, len(args))
        self._names[len(args)] = names
        for (i, _), flat in zip(data, leaves, strict=True):
            for path, x in flat:
                sharding = getattr(x, "sharding", None)
                if np.ndim(x) < 2 or not isinstance(sharding, NamedSharding):
                    continue
                axes, devices = _spec_axes(sharding, 1)
                if devices > 1:  # rows on one device: _split_microbatches says it plainly
                    where = names[i] + jax.tree_util.keystr(path)
                    _check_device_rows(where, np.shape(x)[1:], axes, devices, self.microbatches)
        self._rows_checked.add(layout)

    def __call__(self, *args: Any) -> Any:
        plan, variables, nodes, values, data = self._prepare(args)
        if self.microbatches > 1:
            self._check_microbatches(args)
        with sharding_types(self._entry("(...)")):
            new_values, metrics, done = plan.jitted(values, data)
        if plan.perm is not None:
            for p, x in zip(plan.perm, new_values, strict=True):
                variables[p].set_raw_value(x)
        else:
            nnx.update(nodes, jax.tree.unflatten(plan.state_def, new_values))
        if self.max_in_flight is not None:
            # Bounded asynchronous dispatch: with many calls queued, the devices of
            # XLA's CPU client can miss each other's collectives and abort the process
            # (DESIGN.md: 2 or 8 calls in flight ran 3,000 calls, 32 aborted).
            self._in_flight.append(done)
            while len(self._in_flight) > self.max_in_flight:
                self._in_flight.popleft().block_until_ready()
        return metrics

    def lower(self, *args: Any) -> jax.stages.Lowered:
        """Lowers the fused call for these arguments without running it (for
        ``.compile().memory_analysis()`` or ``.as_text()``).

        >>> import jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> def step(model, opt, x):
        ...     loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        ...     opt.update(model, grads)
        ...     return loss
        >>> mem = multistep(step).lower(model, opt, jnp.ones((10, 4, 3))).compile().memory_analysis()
        >>> mem.temp_size_in_bytes >= 0
        True
        """
        plan, _, _, values, data = self._prepare(args)
        if self.microbatches > 1:
            self._check_microbatches(args)
        with sharding_types(self._entry(".lower(...)")):
            return plan.jitted.lower(values, data)

    # -- traced side ----------------------------------------------------------

    def _build(
        self,
        graphdef: Any,
        state_def: Any,
        node_pos: tuple[int, ...],
        nargs: int,
        shardings: tuple[Any, ...],
    ) -> Any:
        step_fn = self.step_fn
        fn_name = getattr(step_fn, "__name__", "step_fn")
        m = self.microbatches

        def pin(values: list[Any]) -> list[Any]:
            # Keeps the carry in its input layout at every step, so the loop never
            # reshards mid-way and the output matches the input exactly.
            return [
                apply_sharding(x, s) if isinstance(s, NamedSharding) else x
                for x, s in zip(values, shardings, strict=True)
            ]

        def body(values: list[Any], xs: tuple[Any, ...]) -> tuple[list[Any], Any]:
            nodes = nnx.merge(graphdef, jax.tree.unflatten(state_def, values))
            it_nodes, it_xs = iter(nodes), iter(xs)
            call_args = [next(it_nodes) if i in node_pos else next(it_xs) for i in range(nargs)]
            frame = [m, False]
            _micro.stack.append(frame)
            try:
                with checking_step(fn_name):
                    metrics = step_fn(*call_args)
            finally:
                _micro.stack.pop()
            if m > 1 and not frame[1]:
                raise ValueError(
                    f"multistep(..., microbatches={m}): {fn_name} never called "
                    "nnx_shard.value_and_grad, where the batch is split into microbatches. "
                    "Fix: compute gradients with ns.value_and_grad(loss_fn)(model, batch) "
                    "instead of nnx.value_and_grad."
                )
            metrics = _check_metrics(metrics, fn_name)
            _, new_state = nnx.split(nodes)
            new_values, new_def = jax.tree.flatten(new_state)
            if new_def != state_def:
                raise ValueError(
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
            self.traces += 1
            # The step count is a by-product of the loop, so it is ready only when the
            # call is: a scalar the host can wait on (never donated, unlike the state).
            (new_values, count), metrics = jax.lax.scan(
                counted, (values, jnp.zeros((), jnp.int32)), data, unroll=self.unroll
            )
            if self._finish is not None:
                before = nnx.merge(graphdef, jax.tree.unflatten(state_def, values))
                after = nnx.merge(graphdef, jax.tree.unflatten(state_def, new_values))
                metrics = self._finish(before, after, metrics)
                new_values = pin(jax.tree.leaves(nnx.split(after)[1]))
            return new_values, metrics, count

        return jax.jit(
            run,
            donate_argnums=(0,) if self.donate else (),
            out_shardings=(list(shardings), None, None),
        )


class _Carry:
    """Calls of one :class:`Fused` in a loop that owns its NNX arguments (``Trainer.fit``),
    with the carried state kept as the flat list of arrays the compiled call takes
    and returns, between calls.

    :meth:`Fused.__call__` finds the state in the NNX objects and writes it back on
    every call (a pytree flatten of the objects, a check of the cached plan, one
    write per Variable: about a tenth of a millisecond of Python, per call). Here
    that happens once; a call then passes a flat list straight to the jitted
    function (jax's C++ dispatch path), and the Variables receive the current
    arrays only in :meth:`sync`, which the loop calls before anything looks at
    the model (a callback, a checkpoint, a replay, its end). Until then the
    Variables hold the arrays of the last sync, which donation has deleted.
    """

    def __init__(self, fused: Fused) -> None:
        self.fused = fused
        self.plan: _Plan | None = None
        self.variables: list[Any] = []
        self.nodes: tuple[Any, ...] = ()
        self.data_pos: tuple[int, ...] = ()
        # The current state, or None when the Variables hold it (before the first
        # call and after a sync).
        self.values: list[Any] | None = None

    def __call__(self, *args: Any) -> Any:
        f = self.fused
        if self.values is None:
            plan, self.variables, self.nodes, self.values, data = f._prepare(args)
            self.plan = plan
            self.data_pos = tuple(i for i, a in enumerate(args) if not _is_node(a))
        else:
            data = tuple(args[i] for i in self.data_pos)
        if f.microbatches > 1:
            f._check_microbatches(args)
        with sharding_types(f._entry("(...)")):
            self.values, metrics, _ = self.plan.jitted(self.values, data)  # type: ignore[union-attr]
        return metrics

    def sync(self) -> None:
        """Writes the current state into the NNX Variables (the next call reads it
        back from them, so changes made to the objects in between are seen)."""
        if self.values is None or self.plan is None:
            return
        values, self.values = self.values, None
        if self.plan.perm is not None:
            for p, x in zip(self.plan.perm, values, strict=True):
                self.variables[p].set_raw_value(x)
        else:
            nnx.update(self.nodes, jax.tree.unflatten(self.plan.state_def, values))


def multistep(
    step_fn: Callable[..., Any],
    *,
    donate: bool = True,
    microbatches: int = 1,
    max_in_flight: int | None = 2,
    unroll: int = 1,
) -> Fused:
    """Fuses K calls of an NNX train step into one compiled call (a ``jax.lax.scan``).

    ``step_fn(model, optimizer, batch, *others) -> metrics`` is ordinary NNX
    code, as you would put under ``nnx.jit``. ``fused(model, optimizer,
    batches, *others)`` runs it once per entry of the leading axis K of every
    leaf of ``batches`` (shaped ``[K, batch, ...]``, e.g. from
    ``shard_batch(..., steps=True)``), carrying every NNX argument (model,
    optimizer, metrics objects, ``nnx.Rngs``) from step to step, updating them
    in place, and returns ``metrics`` stacked to ``[K, ...]``.

    - One compilation per (K, shapes, shardings); calling again with the same
      ones never recompiles (``fused.traces`` counts them).
    - Shardings of the carried state are the same after the call as before.
      Values fresh from eager init (uncommitted, on one device) are first
      replicated over the mesh of the sharded arguments (or of the active
      ``ns.use``); with no mesh in sight they stay uncommitted.
    - With ``donate=True`` the old state buffers are reused for the new state:
      arrays taken from the model before the call (``nnx.state(model)``) are
      deleted by it. Copy them (``jax.tree.map(jnp.copy, ...)``) to keep them.
    - Data arguments are read, never donated.
    - Inside ``ns.use(mesh, rules)`` the step is traced with that context (so
      ``ns.constrain`` applies); another context traces again.
    - With a replicated model and a batch sharded over devices, nothing else
      is needed for data parallelism: XLA inserts the all-reduce that averages
      the gradients (what ``pmean`` did under ``pmap``).
    - Calls are dispatched asynchronously, but at most ``max_in_flight`` of
      them are unfinished when a call returns: the call waits for the one
      ``max_in_flight`` calls back to finish. So a plain unblocked Python loop
      of fused calls is safe (many calls queued with collectives can abort the
      process in XLA's CPU rendezvous on simulated devices) and the device
      still has the next call queued while the host prepares another.

    Args:
      step_fn: the train step; it must return arrays or numbers (a dict of them).
      donate: reuse the state buffers for the new state.
      microbatches: split each step's batch into this many microbatches,
        averaging the gradients. ``step_fn`` must compute its gradients with
        :func:`value_and_grad` (the batch is split there).
      max_in_flight: how many calls may run unfinished (default 2); ``None``
        never waits (unbounded dispatch: only when the caller bounds it
        itself, e.g. by reading each call's metrics).
      unroll: steps per iteration of the compiled loop (``jax.lax.scan``'s
        ``unroll``). The rolled default compiles fastest; a small model's
        loop can gain a little from 2 (``benchmarks/unroll.py``: 1.03x steps/s
        on an MLP at 1.4x the compile time; 0.7x at 10).

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> def step(model, opt, batch):
    ...     mse = lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2)
    ...     loss, grads = nnx.value_and_grad(mse)(model)
    ...     opt.update(model, grads)
    ...     return {"loss": loss}
    >>> fused = multistep(step)
    >>> batches = {"x": jnp.ones((5, 4, 3)), "y": jnp.zeros((5, 4, 1))}   # K=5 steps
    >>> metrics = fused(model, opt, batches)
    >>> metrics["loss"].shape, int(opt.step[...]), fused.traces
    ((5,), 5, 1)
    """
    if not callable(step_fn):
        raise TypeError(f"multistep expects a callable step function, got {step_fn!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    if max_in_flight is not None and (
        not isinstance(max_in_flight, int) or isinstance(max_in_flight, bool) or max_in_flight < 1
    ):
        raise ValueError(
            f"multistep: max_in_flight must be a positive int or None (unbounded), got "
            f"{max_in_flight!r}. Fix: e.g. max_in_flight=2 (the default)."
        )
    if not isinstance(unroll, int) or isinstance(unroll, bool) or unroll < 1:
        raise ValueError(
            f"unroll must be a positive int (steps per loop iteration), got "
            f"{unroll!r}. Fix: e.g. unroll=1 (the default, a rolled loop) or 2."
        )
    return Fused(step_fn, donate=donate, microbatches=microbatches, max_in_flight=max_in_flight,
                 unroll=unroll)


# --------------------------------------------------------------------------- shard_batch


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
    TypeError / ValueError saying what does not fit."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(names, is_leaf=_is_names)
    for path, leaf in flat:
        if not _is_names(leaf):
            where = f"names{jax.tree_util.keystr(path)}" if path else "names"
            raise TypeError(
                f"shard_batch: {where} = {leaf!r} ({type(leaf).__name__}) is not a tuple of "
                f"logical names. Fix: {_NAMES_FIX}."
            )
    try:
        treedef.flatten_up_to(batch)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "shard_batch: names is a pytree prefix that does not match the batch: names has "
            f"structure {jax.tree.structure(names, is_leaf=_is_names)}, the batch "
            f"{jax.tree.structure(batch)} ({e}). Fix: {_NAMES_FIX}."
        ) from None
    return treedef


def _check_array_leaf(path: Any, leaf: Any, who: str) -> None:
    """Batches are arrays with a leading batch axis: Python numbers (e.g. the items of a
    list of floats, which pytrees see as separate leaves) would become replicated scalars."""
    if isinstance(leaf, bool | int | float | complex):
        where = f"batch{jax.tree_util.keystr(path)}"
        inside = (
            " (an item of a Python list or tuple)"
            if path and isinstance(path[-1], jax.tree_util.SequenceKey) else ""
        )
        raise TypeError(
            f"{who}: {where} is a Python {type(leaf).__name__} ({leaf!r}){inside}: batches "
            "must be arrays (NumPy or jax.Array) with a leading batch axis, not Python "
            f"lists or numbers. Fix: convert it, e.g. np.asarray(values, np.float32)."
        )
    dtype = getattr(leaf, "dtype", None)
    if getattr(dtype, "kind", "") in ("O", "U", "S", "M"):
        raise TypeError(
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

    >>> import numpy as np
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
    single = jax.process_count() == 1
    lead: tuple[None, ...] = (None,) if steps else ()

    def one(path: Any, leaf: Any, leaf_names: Any) -> jax.Array:
        where = f"batch{jax.tree_util.keystr(path)}"
        _check_array_leaf(path, leaf, "shard_batch")
        arr = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
        if arr.ndim < len(lead):
            raise ShardingError(
                f"{where} is a scalar, but steps=True expects a leading steps axis [K, ...] "
                "on every leaf. Fix: stack the per-step batches, e.g. np.stack(batches)."
            )
        rest = arr.ndim - len(lead)
        given = tuple(leaf_names or ())[:rest]
        full = (*lead, *given, *(None,) * (rest - len(given)))
        # Across processes the global shape is inferred by JAX; only one process
        # knows its local shape, so divisibility is checked by JAX there.
        spec = rules.spec(full, shape=arr.shape if single else None, mesh=mesh, path=where)
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), arr)

    if _is_names(names):
        return jax.tree_util.tree_map_with_path(lambda p, x: one(p, x, names), batch)
    _check_names_prefix(names, batch)

    def prefix(path: Any, leaf_names: Any, sub: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda p, x: one((*path, *p), x, leaf_names), sub
        )

    return jax.tree_util.tree_map_with_path(prefix, names, batch, is_leaf=_is_names)


class _Placer:
    """``shard_batch(batch, mesh, rules, names, steps=True)`` for a stream of batches:
    the shardings are resolved (and checked) once per layout, after which a batch
    is one ``jax.device_put`` of its leaves (about a quarter of the host time).

    >>> place = _Placer(make_mesh("data=8"), as_rules({"batch": "data"}), ("batch",))
    >>> first = place({"x": np.zeros((5, 8, 3), np.float32)})   # resolved by shard_batch
    >>> again = place({"x": np.ones((5, 8, 3), np.float32)})    # placed with its shardings
    >>> again["x"].sharding == first["x"].sharding, again["x"].sharding.spec
    (True, P(None, 'data', None))
    """

    def __init__(self, mesh: Mesh, rules: Rules, names: Any) -> None:
        self.mesh, self.rules, self.names = mesh, rules, names
        self._layouts: dict[Any, list[Any]] = {}
        self._single = jax.process_count() == 1

    def __call__(self, batch: Any) -> Any:
        leaves, treedef = jax.tree.flatten(batch)
        key = (treedef, *(np.shape(x) for x in leaves))
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


# --------------------------------------------------------------------------- Trainer


class _Guard(nnx.Module):
    """A device flag carried across fused calls: False once a step was not finite."""

    def __init__(self) -> None:
        self.ok = nnx.Variable(jnp.array(True))

    def raise_(self) -> None:
        """Sets the flag up again, keeping its placement: a fresh (uncommitted) value
        would make the next fused call take its slow path to place it (~1 ms)."""
        old = self.ok.get_raw_value()
        if isinstance(old, jax.Array) and old.committed:
            self.ok.set_raw_value(jax.device_put(np.array(True), old.sharding))
        else:
            self.ok.set_value(jnp.array(True))


def _select(ok: jax.Array, new: Any, old: Any) -> Any:
    def pick(a: jax.Array, b: jax.Array) -> jax.Array:
        # On Explicit meshes an update can change an array's sharding type (ZeRO-1:
        # a replicated parameter plus a data-sharded update is data-sharded); the
        # state keeps the layout it had before the step (the all-gather ZeRO-1 implies).
        want = jax.typeof(b).sharding
        if (
            isinstance(want, NamedSharding)
            and not want.mesh.empty
            and jax.typeof(a).sharding.spec != want.spec
        ):
            a = apply_sharding(a, want)
        return jnp.where(ok, a, b)

    return jax.tree.map(pick, new, old)


# Gradient leaves up to this many elements are summed as one concatenated vector.
_SMALL_LEAF = 1 << 16


def _known_replicated(x: jax.Array, replicated: bool) -> bool:
    """Whether ``x`` (traced) is replicated: seen in its type on Explicit axes, else
    ``replicated`` (what the host saw of the parameters' shardings)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None) or ()
    if any(entry is not None for entry in spec):
        return False
    mesh = getattr(sharding, "mesh", None)
    explicit = (mesh is not None and not mesh.empty
                and all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types))
    return explicit or replicated


def _grad_norm(grads: Any, replicated: bool = False) -> jax.Array:
    """``optax.tree.norm(grads)``, with the small replicated leaves summed as one vector.

    XLA's CPU backend runs every reduction as a kernel of its own, and for the
    small leaves of a small model that fixed cost dominates: one reduction per
    leaf took ~25% of an MLP's step; one over the concatenated small leaves
    (a copy of at most ``_SMALL_LEAF`` elements each) ~5%. Sharded leaves keep
    their own reduction (a concatenation would gather them).

    >>> g = {"b": jnp.ones((3,)), "w": jnp.full((2, 2), 2.0)}
    >>> bool(_grad_norm(g) == optax.tree.norm(g)), round(float(_grad_norm(g)) ** 2, 4)
    (True, 19.0)
    """
    whole, joined = _join_small(
        jax.tree.leaves(grads), replicated, lambda x: jnp.issubdtype(x.dtype, jnp.floating))
    sums = [jnp.sum(jnp.real(x * jnp.conj(x))) for x in whole]
    sums += [jnp.sum(flat * flat) for flat in joined]
    return jnp.sqrt(sum(sums)) if sums else jnp.zeros(())


# The key under which fit's fused step hands each device's share of the squared
# gradient norm to the end of the call (see _grad_sq_shares).
_GRAD_SQ = "grad_norm/shares"


def _typed_spec(x: jax.Array) -> PartitionSpec | None:
    """``x``'s spec from its traced type, where the type holds it (all axes Explicit)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.are_all_axes_explicit:
        return None
    return sharding.spec


def _grad_sq_shares(
    grads: Any, specs: Sequence[PartitionSpec] | None, mesh: Mesh | None
) -> jax.Array | None:
    """Each device's share of the squared gradient norm: a ``[mesh.size]`` vector,
    sharded one entry per device, whose sum is ``optax.tree.norm(grads) ** 2``.

    Summing sharded leaves to one scalar takes a cross-device reduction; inside a
    fused call that is one more collective every step. Here every device sums the
    squares of its own blocks (a block held by several devices counted once, on
    the first of them), and the K steps' shares are summed across devices once,
    at the end of the call. On 8 simulated CPU devices under fsdp that took the
    small transformer's call from 1.16x to 1.07x of a bare scan's
    (``benchmarks/fit_call_cost.py``). ``specs`` are the gradient leaves' specs
    on ``mesh`` (the parameters', read on the host; Explicit axes give their
    own). None where it does not apply: one device, a layout not known, or every
    leaf replicated (then nothing is sharded and :func:`_grad_norm` needs no
    collective).

    >>> mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    >>> w = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, PartitionSpec("data")))
    >>> g = {"w": w, "b": jnp.ones(3)}
    >>> shares = _grad_sq_shares(g, [PartitionSpec(), PartitionSpec("data")], mesh)
    >>> shares.shape, float(shares.sum()), float(optax.tree.norm(g) ** 2)
    ((2,), 17.0, 17.0)
    """
    leaves = jax.tree.leaves(grads)
    if mesh is None or mesh.size == 1 or specs is None or len(specs) != len(leaves):
        return None
    specs = [_typed_spec(x) or spec for x, spec in zip(leaves, specs, strict=True)]
    used = [{a for entry in spec if entry is not None
             for a in (entry if isinstance(entry, tuple) else (entry,))} for spec in specs]
    if not any(used):
        return None
    axes = tuple(mesh.axis_names)

    def local(*blocks: jax.Array) -> jax.Array:
        # Blocks replicated over the same axes are summed together, then kept only
        # on the devices at index 0 of those axes.
        groups: dict[tuple[str, ...], list[jax.Array]] = collections.defaultdict(list)
        for x, on in zip(blocks, used, strict=True):
            if jnp.issubdtype(x.dtype, jnp.inexact):
                groups[tuple(a for a in axes if a not in on)].append(
                    jnp.sum(jnp.real(x * jnp.conj(x))))
        total = jnp.zeros((), jnp.float32)
        for over, sums in groups.items():
            part = sum(sums)
            if over:
                first = functools.reduce(jnp.logical_and,
                                         [jax.lax.axis_index(a) == 0 for a in over])
                part = jnp.where(first, part, jnp.zeros_like(part))
            total = total + part
        return total[None]

    return jax.shard_map(local, mesh=mesh, in_specs=tuple(specs),
                         out_specs=PartitionSpec(axes), check_vma=False)(*leaves)


def _join_small(
    leaves: Sequence[Any], replicated: bool, joinable: Callable[[Any], bool]
) -> tuple[list[Any], list[jax.Array]]:
    """``leaves`` split into those kept whole and one flat vector per dtype of the
    small replicated ones ``joinable`` accepts (a copy of at most ``_SMALL_LEAF``
    elements each): what :func:`_grad_norm` and :func:`_all_finite` reduce."""
    whole, small = [], collections.defaultdict(list)
    for x in leaves:
        if joinable(x) and x.size <= _SMALL_LEAF and _known_replicated(x, replicated):
            small[x.dtype].append(x.reshape(-1))
        else:
            whole.append(x)
    return whole, [parts[0] if len(parts) == 1 else jnp.concatenate(parts)
                   for parts in small.values()]


def _finite_flags(tree: Any) -> tuple[list[str], list[jax.Array]]:
    """Paths and all-finite flags of the inexact (float/complex) leaves of ``tree``:
    one reduction per leaf; integer leaves (step counts) and RNG keys cannot be NaN."""
    paths, flags = [], []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact):
            paths.append(_leaf_path(path))
            flags.append(jnp.all(jnp.isfinite(x)))
    return paths, flags


def _make_step(
    loss_fn: Callable[..., Any], has_aux: bool, replicated: list[bool]
) -> Callable[..., Any]:
    grad_fn = value_and_grad(loss_fn, has_aux=has_aux)
    # Filled while tracing: the leaves the guard checks after the update, in the order
    # of the step's "nonfinite" metric (an index into this list).
    checked: list[tuple[str, str]] = []

    def train_step(model: Any, optimizer: Any, batch: Any, guard: _Guard) -> dict[str, Any]:
        # Copies of the Variable wrappers (the arrays are shared, nothing is copied):
        # the state to fall back to if this step is not finite.
        before = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))
        out, grads = grad_fn(model, batch)
        loss, aux = out if has_aux else (out, {})
        optimizer.update(model, grads)
        grad_norm = _grad_norm(grads, replicated[0])
        # Finite gradients can still give non-finite parameters or optimizer state
        # (an infinite learning rate, an overflowing second moment): the updated state
        # itself is checked too, so a non-finite value is never kept, nor saved.
        model_paths, model_flags = _finite_flags(nnx.state(model))
        opt_paths, opt_flags = _finite_flags(nnx.state(optimizer))
        checked[:] = [("model", p) for p in model_paths] + [("optimizer", p) for p in opt_paths]
        flags = jnp.stack([*model_flags, *opt_flags, jnp.array(True)])
        state_ok = jnp.all(flags)
        nonfinite = jnp.where(state_ok, -1, jnp.argmin(flags)).astype(jnp.int32)
        ok = guard.ok[...] & jnp.all(jnp.isfinite(loss)) & jnp.isfinite(grad_norm) & state_ok
        # A non-finite step (and every later one) is not applied, inside the compiled
        # call: the state stays the last finite one without a host round trip.
        nnx.update((model, optimizer), _select(ok, nnx.state((model, optimizer)), before))
        guard.ok[...] = ok
        if not isinstance(aux, Mapping):
            aux = {"aux": aux}
        return {"loss": loss, "grad_norm": grad_norm, **aux, "applied": ok,
                "nonfinite": nonfinite}

    train_step.checked = checked  # type: ignore[attr-defined]
    return train_step


def _make_fast_step(
    loss_fn: Callable[..., Any], has_aux: bool, replicated: list[bool],
    layout: list[tuple[Sequence[PartitionSpec], Mesh] | None] | None = None,
) -> Callable[..., Any]:
    """The step fit runs normally: no per-step guard, :func:`_guard_call` checks the call.

    The guard of :func:`_make_step` costs a pass over the whole state per step (the
    finiteness reductions and the select): on a small MLP it halved the steps/s. Here
    the check runs once per fused call; a call that fails is undone in the compiled
    call and replayed with the per-step guard (see ``Trainer.fit``), which finds the
    exact step and leaf. With sharded gradients (``layout``: their specs and mesh,
    set by fit) the step hands on each device's share of the squared gradient
    norm, summed across devices at the end of the call (:func:`_grad_sq_shares`).
    """
    grad_fn = value_and_grad(loss_fn, has_aux=has_aux)

    def train_step(model: Any, optimizer: Any, batch: Any, guard: _Guard) -> dict[str, Any]:
        out, grads = grad_fn(model, batch)
        loss, aux = out if has_aux else (out, {})
        optimizer.update(model, grads)
        if not isinstance(aux, Mapping):
            aux = {"aux": aux}
        shares = _grad_sq_shares(grads, *layout[0]) if layout and layout[0] else None
        if shares is not None:
            return {"loss": loss, _GRAD_SQ: shares, **aux}
        return {"loss": loss, "grad_norm": _grad_norm(grads, replicated[0]), **aux}

    return train_step


def _all_finite(leaves: Sequence[Any], replicated: bool = False) -> jax.Array:
    """One flag: every inexact (float/complex) leaf is finite.

    As in :func:`_grad_norm`, the small replicated leaves are checked as one
    concatenated vector per dtype: a check per leaf costs XLA's CPU backend a few
    kernels each (an MLP's 19 state leaves took ~60 per fused call); sharded and
    large leaves keep their own.

    >>> bool(_all_finite([jnp.ones(3), jnp.array([1.0, jnp.inf]), jnp.arange(2)]))
    False
    >>> bool(_all_finite([jnp.ones(3), jnp.zeros((2, 2), jnp.bfloat16), jnp.arange(2)]))
    True
    """
    inexact = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    whole, joined = _join_small(inexact, replicated, lambda x: True)
    flags = [jnp.all(jnp.isfinite(x)) for x in [*whole, *joined]]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def _guard_call(
    before: Any, after: Any, metrics: dict[str, Any], replicated: Sequence[bool] = (False,),
    undo: bool = True,
) -> dict[str, Any]:
    """The NaN guard, once per fused call of :func:`_make_fast_step`: the call is kept
    only if the guard was up, every step's loss and gradient norm are finite and the
    final state is; else the state goes back to the one before the call and the guard
    drops (so calls already queued behind it change nothing either). Which leaf was
    not finite is left to the per-step replay: here one flag is enough.

    ``undo=False`` (only for ``benchmarks/fit_call_cost.py``, which prices the undo)
    checks without selecting the state back: then the state before the call need
    not be kept, and a failed call's state is not finite."""
    model0, opt0, guard0 = before
    model, opt, guard = after
    if _GRAD_SQ in metrics:  # [K, devices] shares -> [K] norms: one reduction per call
        metrics = {("grad_norm" if key == _GRAD_SQ else key):
                   (jnp.sqrt(jnp.sum(v, axis=-1)) if key == _GRAD_SQ else v)
                   for key, v in metrics.items()}
    checked = [metrics["loss"], metrics["grad_norm"], *jax.tree.leaves(nnx.state((model, opt)))]
    ok = guard0.ok[...] & _all_finite(checked, replicated[0])
    if undo:
        nnx.update((model, opt), _select(ok, nnx.state((model, opt)), nnx.state((model0, opt0))))
    guard.ok[...] = ok
    # One flag for the call (a call is kept whole or not at all): fit reads it with
    # the metrics, and the per-step replay gives per-step flags when it is False.
    return {**metrics, "applied": ok}


def _why_not_finite(host: Mapping[str, np.ndarray], i: int, checked: Sequence[tuple[str, str]]) -> str:
    """Which check of the NaN guard failed at index ``i`` of a call's metrics."""
    bad = [key for key in ("loss", "grad_norm") if not np.all(np.isfinite(host[key][i]))]
    if bad:
        return " and ".join(f"{key} is {host[key][i]}" for key in bad)
    index = int(host["nonfinite"][i])
    if 0 <= index < len(checked):
        owner, path = checked[index]
        what = "updated parameters are" if owner == "model" else "updated optimizer state is"
        return f"{what} not finite (first: {path}; loss and grad_norm were finite)"
    return "the step was not finite"


@dataclasses.dataclass
class History:
    """What :meth:`Trainer.fit` ran: per-step metrics (NumPy, one entry per applied
    step, ``"step"`` numbering them), why it stopped early (``None`` if it did
    not) and the wall time.

    >>> h = History({"step": np.array([1, 2]), "loss": np.array([0.5, 0.25])}, 2, None, 0.1)
    >>> h["loss"][-1], len(h)
    (np.float64(0.25), 2)
    """

    metrics: dict[str, np.ndarray]
    steps: int
    stop_reason: str | None
    seconds: float

    def __getitem__(self, key: str) -> np.ndarray:
        return self.metrics[key]

    def __len__(self) -> int:
        return self.steps


class _LogLines:
    """A log file (not a terminal) seen by tqdm: each redraw becomes its own line.

    tqdm redraws with ``\\r``, which a log file or CI console keeps as one ever
    longer line; here every redraw is written as one line instead.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.open = False  # a status line written, its newline not yet

    def write(self, s: str) -> None:
        text = s.replace("\r", "").rstrip(" ")
        if not text:
            return
        if self.open:  # the previous redraw's line ends here
            self.stream.write("\n")
            self.open = False
        if text != "\n":
            self.stream.write(text)
            self.open = True

    def flush(self) -> None:
        self.stream.flush()


# Seconds between redraws of a bar written to a log rather than a terminal: a
# day-long job writes ~3,000 lines, not one per fused call.
LOG_INTERVAL_S = 30.0


class _Progress:
    """One tqdm bar per job (process 0): steps, loss, steps/s, examples/s.

    A terminal gets a bar redrawn at most 10 times a second; a notebook a widget
    (``tqdm.auto``, when ipywidgets is installed); any other stream (a log file,
    CI output) one line at the start, one every :data:`LOG_INTERVAL_S` seconds
    and one at the end.
    """

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None) -> None:
        self.bar: Any = None
        # One bar per job: with several processes, only process 0 reports.
        if not enabled or jax.process_index() != 0:
            return
        from tqdm import std
        from tqdm.auto import tqdm
        from tqdm.notebook import tqdm_notebook

        if stream is None and issubclass(tqdm, tqdm_notebook):  # a notebook with ipywidgets
            self.bar = tqdm(total=total, unit="step", bar_format=_BAR)
            return
        isatty = getattr(stream if stream is not None else sys.stderr, "isatty", None)
        # A notebook without ipywidgets renders stderr's \r redraws in place, like a terminal.
        tty = bool(isatty is not None and isatty()) or (
            stream is None and "ipykernel.zmqshell" in sys.modules)
        stream = stream if stream is not None else sys.stderr
        shape: dict[str, Any] = {"dynamic_ncols": True}
        if tty:
            with contextlib.suppress(AttributeError, OSError, ValueError):
                if 0 in os.get_terminal_size(stream.fileno()):
                    # A terminal that reports no size (docker exec, some CI runners):
                    # tqdm would take it as zero rows and draw nothing.
                    shape = {"ncols": 100, "nrows": 20}
        self.bar = std.tqdm(
            total=total, unit="step", bar_format=_BAR,
            file=stream if tty else _LogLines(stream),
            mininterval=0.1 if tty else LOG_INTERVAL_S, miniters=1,
            ascii=None if tty else True, **(shape if tty else {}),
        )

    def update(self, step: int, loss: float, steps_s: float, examples_s: float) -> None:
        if self.bar is None:
            return
        self.bar.set_postfix_str(
            f"loss {loss:.4g}, {steps_s:,.1f} steps/s, {examples_s:,.0f} examples/s",
            refresh=False,
        )
        self.bar.update(step - self.bar.n)  # the last state is drawn by close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# tqdm's own rate counts wall time since the start, compilation included: the
# postfix carries the rate of the last fused call instead.
_BAR = "{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]"


def _iter_group_sizes(start: int, count: int, k: int, every: int | None) -> Iterator[int]:
    """Steps per fused call for ``count`` steps from step ``start``: K at a time, cut
    at the multiples of ``every`` (the checkpoint steps). Lazy: ``fit(data,
    num_steps=10**12)`` on finite data must not plan 10**11 calls up front.

    >>> list(_iter_group_sizes(0, 60, 10, 25))
    [10, 10, 5, 10, 10, 5, 10]
    >>> next(_iter_group_sizes(0, 10**12, 10, None))
    10
    """
    pos, end = start, start + count
    while pos < end:
        nxt = min(pos + k, end)
        if every:
            nxt = min(nxt, (pos // every + 1) * every)
        yield nxt - pos
        pos = nxt


def _group_sizes(start: int, count: int, k: int, every: int | None) -> list[int]:
    """:func:`_iter_group_sizes` as a list (for small plans).

    >>> _group_sizes(0, 60, 10, 25)
    [10, 10, 5, 10, 10, 5, 10]
    """
    return list(_iter_group_sizes(start, count, k, every))


def _stacked_groups(
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


class _Prefetcher:
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


class _Inline:
    """:class:`_Prefetcher`'s interface without the thread, for windows of a
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
        self._groups.close()


class _FitRun:
    """One call of :meth:`Trainer.fit` after its set-up: dispatching fused calls,
    reading each one's metrics (replaying it if the NaN guard undid it) and running
    the callbacks on them, until the data ends or a callback stops training."""

    def __init__(self, trainer: Trainer, callbacks: Sequence[Callable[..., Any]],
                 depth: int) -> None:
        self.trainer = trainer
        self.callbacks = callbacks
        self.depth = depth
        self.start = time.perf_counter()
        self.hist: dict[str, list[np.ndarray]] = collections.defaultdict(list)
        self.done = 0  # steps applied by this fit
        self.stop_reason: str | None = None
        self.nonfinite = False
        # (steps, examples per step, metrics, batch, replays when dispatched)
        self.pending: collections.deque[tuple[int, int, Any, Any, int]] = collections.deque()
        self.replays = 0  # calls replayed with the per-step guard so far
        self.examples = 0  # examples per step of the last call read
        self.failure: str | None = None  # why the last call read was cut short
        # The model and optimizer state between calls; synced into the NNX objects
        # before anything reads them (see _Carry).
        self.carry = _Carry(trainer._fused)

    def dispatch(self, prefetch: _Prefetcher | _Inline, checkpointer: Checkpointer | None) -> None:
        t = self.trainer
        dispatched = t.step  # the step counter once every dispatched call is applied
        while self.stop_reason is None:
            # Calls queued behind a replayed one changed nothing: they are replayed
            # (in order) before anything new runs on the state.
            while self.pending and self.pending[0][4] < self.replays and not self.stop_reason:
                self.finish_one()
            if self.stop_reason is not None:
                break
            group = prefetch.get()
            if group is None:
                break
            n, batch, examples = group
            metrics = self.carry(t.model, t.optimizer, batch, t._guard)
            self.pending.append((n, examples, metrics, batch, self.replays))
            dispatched += n
            if checkpointer is not None and checkpointer.should_save(dispatched):
                # Drained before the next call is dispatched: it would donate
                # (overwrite) exactly the state the save callback writes.
                while self.pending:
                    self.finish_one()
            elif len(self.pending) >= self.depth:
                self.finish_one()
        while self.pending:
            self.finish_one()

    def _read(self, metrics: Any) -> dict[str, np.ndarray]:
        return {key: np.asarray(v) for key, v in jax.device_get(metrics).items()}

    def finish_one(self) -> None:
        t = self.trainer
        n, examples, metrics, batch, generation = self.pending.popleft()
        if self.stop_reason is not None:
            return  # in flight when training stopped: it applied nothing
        host = self._read(metrics)
        if generation < self.replays or not host["applied"].all():
            # This call failed the guard and was undone, or was queued behind one
            # that did (then it changed nothing): run it again, every step checked.
            self.carry.sync()
            self.replays += 1
            t._guard.raise_()
            host = self._read(t._careful(t.model, t.optimizer, batch, t._guard))
        applied = host.pop("applied")  # one flag (the call's check) or one per step
        nonfinite_at = host.pop("nonfinite", None)
        good = n if applied.all() else int(np.argmin(applied))
        step0 = t.step
        for key, v in host.items():
            self.hist[key].append(v[:good])
        self.hist["step"].append(np.arange(step0 + 1, step0 + good + 1))
        t.step += good
        t.data_position += good
        self.done += good
        self.examples = examples
        self.failure = None
        if good < n:
            what = _why_not_finite({**host, "nonfinite": nonfinite_at}, good, t._checked)
            kept = f"from after step {step0 + good}" if step0 + good else "from before it"
            self.failure = (
                f"{what} at step {step0 + good + 1}; stopped without applying it, keeping "
                f"the model and optimizer state {kept}, the last finite one"
            )
        seen = host if good == n else {key: v[:good] for key, v in host.items()}
        for cb in self.callbacks:
            if getattr(cb, "reads_model", True):
                # The user's callbacks run with no other call in flight (depth 1), so
                # the carried state is exactly the one after this call.
                self.carry.sync()
            if cb(t.step, seen) is True:
                name = getattr(cb, "__name__", repr(cb))
                self.stop_reason = cb.stop_reason if isinstance(cb, _NanStop) else (
                    f"callback {name} asked to stop at step {t.step}")
                return

    def history(self, num_steps: int) -> History:
        if self.stop_reason is None and self.done < num_steps:
            self.stop_reason = f"data ran out after {self.done} of {num_steps} steps"
        metrics = {key: np.concatenate(v) for key, v in self.hist.items()}
        if not metrics:
            metrics = {"step": np.zeros((0,), np.int64)}
        return History(metrics, self.done, self.stop_reason, time.perf_counter() - self.start)


class _ProgressCallback:
    """fit's progress bar as a callback: steps, the last loss, and the rates of the
    last fused call."""

    reads_model = False

    def __init__(self, progress: _Progress) -> None:
        self.progress = progress
        self.run: _FitRun | None = None
        self.last_t = time.perf_counter()

    def __call__(self, step: int, metrics: Mapping[str, np.ndarray]) -> None:
        now = time.perf_counter()
        good = len(metrics["loss"])
        rate = good / max(now - self.last_t, 1e-9)
        self.last_t = now
        if good and self.run is not None:
            self.progress.update(self.run.done, float(metrics["loss"][-1]), rate,
                                 rate * self.run.examples)


class _NanStop:
    """fit's NaN stop as a callback: stops (with a ``RuntimeWarning`` naming the
    check, the first non-finite leaf and the step) after a call the guard cut short."""

    __name__ = "nan_stop"
    reads_model = False

    def __init__(self) -> None:
        self.stop_reason: str | None = None
        self.run: _FitRun | None = None

    def __call__(self, step: int, metrics: Mapping[str, np.ndarray]) -> bool:
        run = self.run
        if run is None or run.failure is None:
            return False
        self.stop_reason = run.failure
        run.nonfinite = True
        # Points at the user's fit call: fit -> dispatch -> finish_one -> here.
        warnings.warn(f"Trainer.fit: {run.failure}.", RuntimeWarning, stacklevel=5)
        return True


class _SaveCallback:
    """fit's checkpoints as a callback: saves at every save step (fit drains the
    calls in flight there first) and, with :meth:`save_last`, after the last step."""

    __name__ = "checkpoint"
    # It syncs the model itself, only when it saves (then no call is in flight).
    reads_model = False

    def __init__(self, trainer: Trainer, checkpointer: Checkpointer) -> None:
        self.trainer = trainer
        self.checkpointer = checkpointer
        self.last_saved = trainer.step
        self.run: _FitRun | None = None

    def __call__(self, step: int, metrics: Mapping[str, np.ndarray]) -> None:
        if self.checkpointer.should_save(step) and step > self.last_saved:
            self.save_last()

    def save_last(self) -> None:
        t = self.trainer
        if t.step > self.last_saved:
            if self.run is not None:
                self.run.carry.sync()
            self.checkpointer.save(
                t.step, model=t.model, optimizer=t.optimizer,
                extra={"step": t.step, "data_position": t.data_position},
            )
            self.last_saved = t.step


class Trainer:
    """Trains a (sharded) model: K steps per compiled call, batches sharded, prefetched.

    ``loss_fn(model, batch) -> loss`` (or ``(loss, aux_dict)`` with
    ``has_aux=True``) is differentiated with :func:`value_and_grad`; each step
    applies ``optimizer.update(model, grads)``. :meth:`fit` pulls host
    batches (pytrees of NumPy arrays with a leading batch axis) from any
    iterable, stacks ``steps_per_call`` of them, shards them with
    :func:`shard_batch` (``batch_names`` name the leading dims), and runs
    them in one fused call while the next group is prepared on a thread.

    Args:
      model, optimizer: NNX model and ``nnx.Optimizer``, already laid out
        (e.g. by ``sharded_init`` / ``sharded_optimizer``); updated in place.
      loss_fn: the loss, a mean over the examples of the batch.
      mesh, rules: where batches go (``rules`` maps ``batch_names``).
      steps_per_call: K, steps per compiled call.
      microbatches: split each step's batch into this many, averaging gradients.
      batch_names: logical names of the leading dims of every batch leaf.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; aux metrics go to the history.
      donate: reuse state buffers across calls (see :func:`multistep`).
      unroll: steps per iteration of the compiled loop (see :func:`multistep`).

    >>> import numpy as np, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> trainer = Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"},
    ...                   steps_per_call=4)
    >>> data = ({"x": np.ones((8, 3), np.float32), "y": np.zeros((8, 1), np.float32)}
    ...         for _ in range(10))
    >>> history = trainer.fit(data, num_steps=6, progress=False)
    >>> history["step"].tolist(), history["loss"].shape, int(opt.step[...])
    ([1, 2, 3, 4, 5, 6], (6,), 6)
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: nnx.Optimizer,
        loss_fn: Callable[..., Any],
        *,
        mesh: Mesh | str | Mapping[str, int],
        rules: Rules | Mapping[str, Any],
        steps_per_call: int = 10,
        microbatches: int = 1,
        batch_names: LogicalNames = ("batch",),
        has_aux: bool = False,
        donate: bool = True,
        unroll: int = 1,
    ) -> None:
        if not isinstance(model, nnx.Module):
            raise TypeError(
                f"Trainer: model must be an nnx.Module, got {type(model).__name__} "
                f"({_short_repr(model)}). Fix: pass the Flax NNX model itself, e.g. "
                "ns.sharded_init(lambda: MyModel(rngs=nnx.Rngs(0)), mesh, rules)."
            )
        if not isinstance(optimizer, nnx.Optimizer):
            given = (
                "an optax transformation" if isinstance(optimizer, optax.GradientTransformation)
                else f"{type(optimizer).__name__} ({_short_repr(optimizer)})"
            )
            raise TypeError(
                f"Trainer: optimizer must be an nnx.Optimizer holding the optimizer state, got "
                f"{given}. Fix: ns.sharded_optimizer(model, optax.adamw(1e-3), mesh, rules), "
                "or nnx.Optimizer(model, tx, wrt=nnx.Param)."
            )
        if not callable(loss_fn):
            raise TypeError(
                f"Trainer: loss_fn must be callable as loss_fn(model, batch), got "
                f"{_short_repr(loss_fn)}."
            )
        if not isinstance(steps_per_call, int) or steps_per_call < 1:
            raise ValueError(f"steps_per_call must be a positive int, got {steps_per_call!r}")
        self.model = model
        self.optimizer = optimizer
        self.mesh = make_mesh(mesh)
        self.rules = as_rules(rules)
        self.steps_per_call = steps_per_call
        self.batch_names = tuple(batch_names)
        self.step = 0
        # Batches consumed by applied steps, across fit calls: where a resumed
        # run's data continues (saved in checkpoints, see fit).
        self.data_position = 0
        self._guard = _Guard()
        # Whether the whole model and optimizer state is replicated, as under dp (read
        # at trace time by _grad_norm and the NaN guard; set by fit from the arrays, as
        # Auto mesh axes hide it from the traced types).
        self._replicated = [False]
        # The parameters' specs and mesh when some are sharded on the trainer's mesh
        # (set by fit; read at trace time by the fast step, see _grad_sq_shares).
        self._grad_layout: list[tuple[Sequence[PartitionSpec], Mesh] | None] = [None]
        step = _make_step(loss_fn, has_aux, self._replicated)
        self._checked: list[tuple[str, str]] = step.checked  # type: ignore[attr-defined]
        # fit bounds the calls in flight itself (it reads each call's metrics), so the
        # fused call does not block on top of that. fit runs _fused, whose NaN guard
        # checks each call once; a call that fails it is undone and replayed with
        # _careful, which checks every step (it compiles only when that happens).
        self._fused = multistep(
            _make_fast_step(loss_fn, has_aux, self._replicated, self._grad_layout), donate=donate,
            microbatches=microbatches,
            max_in_flight=None,
            unroll=unroll,
        )
        self._fused._finish = functools.partial(_guard_call, replicated=self._replicated)
        self._careful = multistep(
            step, donate=donate, microbatches=microbatches, max_in_flight=None
        )
        for fused in (self._fused, self._careful):
            fused.entry = "Trainer.fit"

    @property
    def traces(self) -> int:
        """Compilations of the fused step so far (one per distinct K and batch shape;
        the per-step guard that replays a non-finite call compiles apart, only then)."""
        return self._fused.traces

    def _build_group(self, host: list[Any], place: _Placer) -> tuple[int, Any, int]:
        first = jax.tree_util.tree_flatten_with_path(host[0])
        if not first[0]:
            raise TypeError(
                f"Trainer.fit: a batch from data is {_short_repr(host[0])}, which holds no "
                "arrays. Batches are pytrees of arrays with a leading batch axis, e.g. "
                "{'x': np.ndarray of shape (batch, ...), 'y': ...}."
            )
        for path, x in first[0]:
            _check_array_leaf(path, x, "Trainer.fit")
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
            if treedef != first[1]:
                raise ValueError(
                    f"host batch {n} of this group has structure {treedef} but the first "
                    f"has {first[1]}; every batch must have the same structure."
                )
            for column, x, shape in zip(columns, leaves, shapes, strict=True):
                if getattr(x, "shape", None) != shape:
                    self._ragged(n, b, first[0])
                column.append(x)
        stacked = jax.tree.unflatten(first[1], [np.stack(c) for c in columns])
        leaves = first[0]
        examples = int(np.shape(leaves[0][1])[0]) * jax.process_count() if leaves else 0
        return len(host), place(stacked), examples

    @staticmethod
    def _ragged(n: int, batch: Any, first: list[tuple[Any, Any]]) -> None:
        for (path, x), (_, x0) in zip(jax.tree_util.tree_flatten_with_path(batch)[0], first,
                                      strict=True):
            if np.shape(x) != np.shape(x0):
                raise ValueError(
                    f"host batch {n} of this group has batch{jax.tree_util.keystr(path)} "
                    f"of shape {_fmt_shape(x)}, but the first has {_fmt_shape(x0)}. "
                    "Batches are stacked K at a time, so shapes must agree. Fix: drop "
                    "the last, smaller batch of an epoch (drop_last) or pad it."
                )

    def _window_groups(
        self, data: Batches, start: int, sizes: Iterable[int], stop: threading.Event
    ) -> Iterator[Any]:
        """Groups of K batches read from ``data`` as whole ``[K, batch, ...]`` windows:
        no per-step Python, no stacking (a window of a contiguous array is a view)."""
        pos = start
        examples = data.batch_size * jax.process_count()
        place = _Placer(self.mesh, self.rules, self.batch_names)
        for k in sizes:
            window = data.window(pos, k) if not stop.is_set() else None
            if window is None:
                return
            n = int(np.shape(jax.tree.leaves(window)[0])[0])
            if pos == start:  # one layout for the whole run: checked once
                for path, x in jax.tree_util.tree_flatten_with_path(window)[0]:
                    _check_array_leaf(path, x, "Trainer.fit")
            yield n, place(window), examples
            pos += n
            if n < k:
                return

    def fit(
        self,
        data: Iterable[Any] | Callable[[int], Iterable[Any]],
        num_steps: int,
        *,
        progress: bool = True,
        callbacks: Sequence[Callable[[int, dict[str, np.ndarray]], bool | None]] = (),
        checkpointer: Checkpointer | None = None,
        resume: bool = False,
    ) -> History:
        """Runs up to ``num_steps`` steps on batches from ``data``; returns the :class:`History`.

        Stops early, keeping the model and optimizer at the last finite state,
        when a step is not finite: its loss, its gradient norm, the updated
        parameters (any float Variable of the model) or the updated optimizer
        state hold a NaN/Inf (that step is not applied, nor saved; a
        ``RuntimeWarning`` and ``stop_reason`` name the check, the first
        non-finite leaf and the step); when ``data`` runs out (so with finite
        data a huge ``num_steps`` means "until the data ends": steps are
        planned lazily); or when a callback returns ``True``. ``callback(step, metrics)`` runs after every fused call with
        that call's per-step metrics (NumPy) and the model exactly as of
        ``step``. A final group smaller than ``steps_per_call`` compiles once
        more. With ``progress=True``, process 0 shows a tqdm bar (steps, loss,
        steps/s, examples/s): redrawn on a terminal, a widget in a notebook,
        and on stderr that is a log file a line at the start, every 30 s and
        at the end; ``progress=False`` shows nothing. With several
        processes, each one's ``data`` yields only its own rows of every global
        batch (``ns.distributed.process_slice``); all of them call ``fit``.

        Checkpoints: with ``checkpointer=ns.Checkpointer(directory, every=N,
        keep=K)`` the model, the optimizer and ``extra={"step": ...,
        "data_position": ...}`` are saved each time the step counter reaches a
        multiple of N (fused calls are cut at those steps, so an N that is not
        a multiple of ``steps_per_call`` costs one more compilation), and after
        the last step unless a non-finite step stopped training. Saves are
        written in the background while training goes on; ``fit`` returns once
        they are on disk. ``resume=True`` first restores the latest checkpoint
        in place (parameters, optimizer state and step, RNG state held in the
        model, the step counter and the data position), then trains until the
        step counter reaches ``num_steps``: with ``resume=True``, ``num_steps``
        is the run's total, so rerunning the same command continues where it
        stopped. Without ``resume``, a directory that already holds a step
        later than the current one is an error (the runs would mix).

        Data: ``data`` is an iterable of host batches, or a callable
        ``data(position)`` returning one that starts at batch ``position``,
        the number of batches consumed by applied steps so far
        (``trainer.data_position``; batches prefetched but not applied, e.g.
        after an early stop, do not count). ``fit`` calls it with the current
        position. On resume, an iterable is taken to start at the beginning of
        the stream and the batches the restored steps consumed are skipped
        (read and dropped); a callable can seek there instead. An
        :class:`~nnx_shard.Batches` over whole arrays is read K steps at a time
        as one ``[K, batch, ...]`` window (no per-step Python, no stacking), in
        the calling thread while the previous call runs, and seeks to the data
        position on resume; any other iterable is read and stacked on a
        prefetch thread.

        NaN guard cost: the check runs once per fused call on values the call
        computes anyway (each step's loss and gradient norm, the final state); a
        call that fails it is undone on the device and run again with every
        step checked (that per-step variant compiles only then), which finds
        the step and the leaf.

        >>> import numpy as np, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        >>> opt = nnx.Optimizer(model, optax.sgd(1e30), wrt=nnx.Param)   # diverges
        >>> mse = lambda m, b: jnp.mean((m(b) - 1.0) ** 2)
        >>> trainer = Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"},
        ...                   steps_per_call=5)
        >>> import warnings
        >>> with warnings.catch_warnings(record=True):
        ...     h = trainer.fit([np.ones((8, 2), np.float32)] * 10, 10, progress=False)
        >>> print(h.stop_reason)
        loss is inf and grad_norm is inf at step 2; stopped without applying it, keeping ... after step 1, ...
        >>> bool(jnp.isfinite(model.kernel[...]).all()), len(h)
        (True, 1)
        """
        if not isinstance(num_steps, int) or num_steps < 0:
            raise ValueError(f"num_steps must be a non-negative int, got {num_steps!r}")
        if resume and checkpointer is None:
            raise ValueError(
                "fit(resume=True) needs the checkpointer to resume from, e.g. "
                "checkpointer=ns.Checkpointer(directory, every=1000)."
            )
        num_steps, resumed = self._resume(checkpointer, resume, num_steps)
        every = checkpointer.every if checkpointer is not None else None
        sizes = _iter_group_sizes(self.step, num_steps, self.steps_per_call, every)
        groups = self._grouping(data, resumed, sizes)
        self._guard.raise_()
        self._record_layout()
        bar = _ProgressCallback(_Progress(num_steps, progress))
        # Built in, run like the user's callbacks and before them: progress, the NaN
        # stop, checkpoints (the user's see only finite steps, and a save never
        # follows a non-finite step).
        # (The bar only when it shows: each callback costs a little on every call.)
        builtin: list[Callable[..., Any]] = [bar] if bar.progress.bar is not None else []
        builtin.append(_NanStop())
        if checkpointer is not None:
            builtin.append(_SaveCallback(self, checkpointer))
        # Two calls in flight keep the device busy while the host reads the previous
        # metrics; never more (DESIGN.md: deeper queues deadlock XLA's CPU rendezvous).
        # The user's callbacks see the model as of their step, so with them: one at a time.
        run = _FitRun(self, [*builtin, *callbacks], depth=1 if callbacks else 2)
        for cb in builtin:
            cb.run = run  # type: ignore[attr-defined]
        prefetch = (_Inline if isinstance(data, Batches) else _Prefetcher)(groups)
        try:
            with use(self.mesh, self.rules):
                run.dispatch(prefetch, checkpointer)
                if checkpointer is not None and not run.nonfinite:
                    builtin[-1].save_last()  # type: ignore[attr-defined]
        finally:
            run.carry.sync()
            prefetch.close()
            bar.progress.close()
            if checkpointer is not None:
                checkpointer.wait()
        return run.history(num_steps)

    def lower(self, batch: Any) -> jax.stages.Lowered:
        """Lowers the compiled call :meth:`fit` makes for one group of K steps, NaN guard
        included, without running it: ``.compile().memory_analysis()`` gives the
        per-device bytes ``fit`` needs (the guard keeps the state from before the
        call, one more copy of the model and optimizer state than a bare
        :func:`multistep`). ``batch`` is one group as ``fit`` places it: a pytree of
        ``[K, batch, ...]`` arrays, or ``jax.ShapeDtypeStruct`` with their shardings;
        the model and optimizer may be abstract (:func:`~nnx_shard.abstract_init`).

        >>> import jax, jax.numpy as jnp, optax
        >>> from flax import nnx
        >>> model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        >>> mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
        >>> trainer = Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"})
        >>> batch = {"x": jax.ShapeDtypeStruct((10, 8, 3), jnp.float32),
        ...          "y": jax.ShapeDtypeStruct((10, 8, 1), jnp.float32)}
        >>> mem = trainer.lower(batch).compile().memory_analysis()
        >>> mem.temp_size_in_bytes > 0
        True
        """
        self._record_layout()
        with use(self.mesh, self.rules):
            return self._fused.lower(self.model, self.optimizer, batch, self._guard)

    # -- the phases of fit --------------------------------------------------------

    def _record_layout(self) -> None:
        """Records, for the fast step's trace, whether the whole model and optimizer
        state is replicated and the parameters' specs when all are laid out on the trainer's mesh (Auto
        mesh axes hide both from the traced types)."""
        def replicated(x: Any) -> bool:
            return bool(getattr(getattr(x, "sharding", None), "is_fully_replicated", False))

        params = jax.tree.leaves(nnx.state(self.model, nnx.Param))
        # Replicated parameters with a sharded optimizer state (zero1) do not count:
        # XLA reduce-scatters the gradients to the state's shards and computes the
        # update there, so joining gradients or updated parameters into one vector
        # (for the norm, for the NaN check) would gather them back.
        self._replicated[0] = all(
            replicated(x) for x in jax.tree.leaves(nnx.state((self.model, self.optimizer))))
        shardings = [getattr(x, "sharding", None) for x in params]
        self._grad_layout[0] = (
            ([s.spec for s in shardings], self.mesh)
            if all(isinstance(s, NamedSharding) and s.mesh == self.mesh for s in shardings)
            else None
        )

    def _resume(
        self, checkpointer: Checkpointer | None, resume: bool, num_steps: int
    ) -> tuple[int, bool]:
        """Restores the latest checkpoint for ``resume=True``; refuses a directory that
        is ahead of this trainer otherwise. Returns the steps left to run and whether
        a checkpoint was restored."""
        resumed = False
        if checkpointer is None:
            return num_steps, resumed
        latest = checkpointer.latest_step()
        if resume and latest is not None:
            checkpointer.wait()
            step, extra = restore_into(checkpointer.directory, self.model, self.optimizer)
            self.step = int(extra.get("step", step))
            self.data_position = int(extra.get("data_position", self.step))
            resumed = True
        elif latest is not None and latest > self.step:
            raise ValueError(
                f"fit: {checkpointer.directory} already holds a checkpoint for step "
                f"{latest}, later than this trainer's step {self.step}. Fix: pass "
                "resume=True to continue from it, or use another directory."
            )
        if resume:
            num_steps = max(num_steps - self.step, 0)
        return num_steps, resumed

    def _grouping(
        self, data: Any, resumed: bool, sizes: Iterator[int]
    ) -> Callable[[threading.Event], Iterator[Any]]:
        """The generator of fused-call inputs ``(steps, sharded batch, examples per
        step)``, reading ``data`` from the data position (on the prefetch thread,
        or for :class:`~nnx_shard.Batches` in the training thread)."""
        if isinstance(data, Batches):
            first = self.data_position if resumed else 0
            return functools.partial(self._window_groups, data, first, sizes)
        if callable(data) and not isinstance(data, Iterable):
            data = data(self.data_position)
        elif resumed and self.data_position:
            data = itertools.islice(data, self.data_position, None)
        place = _Placer(self.mesh, self.rules, self.batch_names)
        return functools.partial(_stacked_groups, data, sizes,
                                 functools.partial(self._build_group, place=place))
