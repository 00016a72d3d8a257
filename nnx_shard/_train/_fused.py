"""The fused call: :func:`multistep` turns an ordinary NNX train step into one
compiled call that runs it K times (a ``jax.lax.scan``), carrying the model, the
optimizer and any other NNX object passed, updating them in place like ``nnx.jit``.

Why a ``jax.lax.scan`` over split state rather than ``nnx.scan``: the carry is
plain arrays (so it can be donated and pinned to its input shardings), NNX's
Python bookkeeping runs once per call instead of once per step (and on the host
only as a cached pytree flatten, see :class:`_Plan`), and none of the
``nnx.scan`` pitfalls apply (``in_axes=None`` silently freezing the model,
closures across trace levels). The step knows no parallel op: each registers
what it checks in :mod:`nnx_shard._parallel.registry`.

This module is the host side (the compiled calls by argument layout, the state
read from and written back to the NNX objects, the bounded dispatch);
:mod:`._traced` builds the function each call compiles, and :mod:`._fused_checks`
checks its options and arguments.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from nnx_shard._errors import (
    UsageError,
    flag,
    is_sharding_type_error,
    sharding_type_error,
    sharding_types,
)
from nnx_shard._mesh import current, watching
from nnx_shard._offload import arrive, is_host, owns_moves, to_host
from nnx_shard._train._fused_checks import ArgNames, check_microbatch_rows, check_options, steps
from nnx_shard._train._precision import Precision, as_precision
from nnx_shard._train._stream import APPLIED, arrive_params, not_applied
from nnx_shard._train._traced import build_run, pack
from nnx_shard._train._trees import is_node

__all__ = ["Carry", "Fused", "multistep"]


class _Cache:
    """The compiled calls by key. A model's static attributes are part of its graphdef,
    and so of the key; users store unhashable ones (a plain ``@dataclass`` config), which
    ``nnx.jit`` accepts: such keys are found by equality instead of by hash.

    >>> c = _Cache()
    >>> c.put(({"n": 1},), "a"); c.put((2,), "b")
    >>> c.get(({"n": 1},)), c.get((2,)), c.get(({"n": 2},))
    ('a', 'b', None)
    """

    def __init__(self) -> None:
        self._hashed: dict[Any, Any] = {}
        self._unhashable: list[tuple[Any, Any]] = []

    def get(self, key: Any) -> Any:
        try:
            return self._hashed.get(key)
        except TypeError:
            return next((v for k, v in self._unhashable if _equal(k, key)), None)

    def put(self, key: Any, value: Any) -> None:
        try:
            self._hashed[key] = value
        except TypeError:
            self._unhashable.append((key, value))


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. arrays among static attributes: no truth value
        return a is b


def _mesh_of(trees: Sequence[Any]) -> Mesh | AbstractMesh | None:
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
    objects as pytrees (much cheaper than ``nnx.split``) then gives the
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
    run: Any = None  # the function ``jitted`` compiles (see Fused._data_jit)


class _Stepwise:
    """The :class:`~nnx_shard._train._traced.StepOwner` of a fused call on state given
    in host memory (shardings with ``memory_kind="pinned_host"``, as a strategy's
    ``offload`` places it): the K-step loop carries that state in host memory, and
    each step moves it to device memory and back at its end (:func:`_stepwise`), so
    the outputs keep the input shardings and the next call is given the state the
    same way. The device holds the offloaded state only inside a step, where the
    step uses it: not across the loop, nor between calls. The options and the trace
    count are the :class:`Fused`'s."""

    def __init__(self, fused: Fused, placed: tuple[Any, ...], node_pos: tuple[int, ...]) -> None:
        self._fused = fused
        self.microbatches, self.precision, self.unroll, self.stream_offload = (
            fused.microbatches, fused.precision, fused.unroll, fused.stream_offload)
        self.step_fn = _stepwise(fused.step_fn, placed, node_pos, fused.stream_offload)
        self.finish = None if fused.finish is None else _finish_moved(fused.finish, placed)

    @property
    def traces(self) -> int:
        return self._fused.traces

    @traces.setter
    def traces(self, value: int) -> None:
        self._fused.traces = value


def _back_to_host(nodes: Any, placed: tuple[Any, ...]) -> None:
    """Inside ``jit``: the leaves of ``nnx.state(nodes)`` (in the order of the fused
    call's state, ``placed``'s) whose call-input sharding is a host one moved back
    into it, layout included."""
    leaves, treedef = jax.tree.flatten(nnx.state(nodes))
    nnx.update(nodes, jax.tree.unflatten(treedef, to_host(leaves, placed)))


def _stepwise(step_fn: Callable[..., Any], placed: tuple[Any, ...],
              node_pos: tuple[int, ...], stream: bool = False) -> Callable[..., Any]:
    """``step_fn`` on host-memory state: it moves the offloaded Variables of its NNX
    arguments to device memory at its start (unless ``step_fn`` moves them itself,
    :func:`~nnx_shard._offload.moves_offloaded`: the Trainer's steps bring the
    optimizer state in only once the gradients exist) and back at its end. With
    ``stream`` (``multistep(..., stream_offload=True)``) the model (first argument)
    and the optimizer (second) are left for the step to move: the parameters that are
    not stacked arrive at its start, the stacked ones stream through the scanned
    layers, the optimizer state arrives in
    :func:`~nnx_shard._train._stream.apply_gradients`."""
    own = owns_moves(step_fn)

    def step(*args: Any) -> Any:
        nodes = tuple(args[i] for i in node_pos)
        if not stream:
            if not own:
                arrive(nodes)
            metrics = step_fn(*args)
        else:
            model, optimizer = _model_and_optimizer(step_fn, args, node_pos)
            arrive_params(model, optimizer)
            arrive(tuple(n for n in nodes if n is not model and n is not optimizer))
            with watching() as calls:
                try:
                    metrics = step_fn(*args)
                except ValueError as e:
                    # JAX refuses arithmetic across memory kinds: an update that read
                    # the host state without apply_gradients moving it in.
                    if "memory_space" in str(e) and APPLIED not in calls:
                        raise not_applied(getattr(step_fn, "__name__", "step_fn")) from e
                    raise
        _back_to_host(nodes, placed)
        return metrics

    return functools.wraps(step_fn)(step)


def _model_and_optimizer(step_fn: Callable[..., Any], args: tuple[Any, ...],
                         node_pos: tuple[int, ...]) -> tuple[Any, nnx.Optimizer]:
    """The ``(model, optimizer)`` a streaming step is given first, or a UsageError."""
    model, optimizer = (args[0], args[1]) if len(args) > 1 else (None, None)
    if (0, 1) != tuple(node_pos[:2]) or not isinstance(model, nnx.Module) or not isinstance(
            optimizer, nnx.Optimizer):
        name = getattr(step_fn, "__name__", "step_fn")
        got = ", ".join(type(a).__name__ for a in args[:2])
        raise UsageError(
            f"multistep(..., stream_offload=True): {name} was given ({got}) first; a "
            "streaming step takes the model and its nnx.Optimizer as its first two "
            f"arguments, {name}(model, optimizer, batch, ...), so the call knows which "
            "parameters the update streams. Fix: pass them first, or drop "
            "stream_offload.")
    return model, optimizer


def _finish_moved(finish: Callable[[Any, Any, Any], Any],
                  placed: tuple[Any, ...]) -> Callable[[Any, Any, Any], Any]:
    """The call's ``finish`` (the Trainer's check of the call) on device copies of the
    offloaded state before and after the K steps (unless ``finish`` reads the host
    arrays itself, :func:`~nnx_shard._offload.moves_offloaded`), the state after
    moved back."""

    own = owns_moves(finish)

    def moved(before: Any, after: Any, metrics: Any) -> Any:
        if not own:
            arrive(before)
            arrive(after)
        metrics = finish(before, after, metrics)
        _back_to_host(after, placed)
        return metrics

    return moved


class Fused:
    """The compiled K-step function made by :func:`multistep`; call it like the step.

    ``fused(*args)``: arguments that are NNX objects (modules, optimizers, Rngs,
    metrics, or containers of them) are carried across steps and updated in
    place; every other argument is a pytree of arrays whose leaves all have the
    same leading axis K, scanned over. Returns the step's metrics stacked to
    ``[K, ...]``.

    Besides :func:`multistep`'s arguments, a caller that builds its own loop on it
    (``Trainer.fit``) gives:

    * ``finish(nodes_before, nodes_after, metrics) -> metrics``: run once per call
      after the K steps, inside the compiled call, updating ``nodes_after`` in
      place (the Trainer's NaN guard checks the call's result there, not every
      step);
    * ``entry``: the call error messages name (default ``multistep(step_fn)(...)``);
    * ``owner``: the constructor its option errors name (``"Trainer"``): the same
      checks, word for word, whichever of the two took the options;
    * ``pack_metrics=False``: the metrics of a call on host data come back as they
      are, not packed into one byte vector (packing gathers leaves laid out over a
      mesh axis: a DiLoCo's per-replica losses would cross its replicas every call).

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
        finish: Callable[[Any, Any, Any], Any] | None = None,
        entry: str | None = None,
        precision: Precision | None = None,
        owner: str = "multistep",
        pack_metrics: bool = True,
        stream_offload: bool = False,
    ) -> None:
        check_options(step_fn, microbatches, max_in_flight, unroll, owner)
        flag(donate, f"{owner}: donate")
        flag(stream_offload, f"{owner}: stream_offload")
        self.stream_offload = stream_offload
        self.precision = as_precision(precision, f"{owner}: precision")
        self.step_fn = step_fn
        self.donate = donate
        self.microbatches = microbatches
        self.max_in_flight = max_in_flight
        self.unroll = unroll
        self.traces = 0
        # One small output per call not yet known to be finished, oldest first.
        self._in_flight: collections.deque[jax.Array] = collections.deque()
        self._jitted = _Cache()
        # The compiled calls that place host data themselves, by (call, data shardings).
        self._data_jits: dict[Any, Any] = {}
        self._packed: dict[int, Any] = {}
        self._plans: dict[tuple[tuple[int, ...], int], _Plan] = {}
        self._names = ArgNames(step_fn)
        # Data layouts (shapes, shardings) whose rows per device were checked.
        self._rows_checked: set[Any] = set()
        self.finish = finish
        self.entry = entry
        self.pack_metrics = pack_metrics
        functools.update_wrapper(self, step_fn)

    def __repr__(self) -> str:
        name = getattr(self.step_fn, "__qualname__", repr(self.step_fn))
        precision = f", precision={self.precision!r}" if self.precision is not None else ""
        stream = ", stream_offload=True" if self.stream_offload else ""
        return (
            f"multistep({name}, donate={self.donate}, microbatches={self.microbatches}, "
            f"max_in_flight={self.max_in_flight}, unroll={self.unroll}{precision}{stream}, "
            f"traces={self.traces})"
        )

    # -- host side ------------------------------------------------------------

    def _prepare(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        node_pos = tuple(i for i, a in enumerate(args) if is_node(a))
        if not node_pos:
            raise UsageError(
                "multistep: no NNX object among the arguments. Fix: call the fused step like "
                "the step itself, e.g. fused(model, optimizer, batch)."
            )
        steps(args, node_pos, self._names)
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
        # Abstract values (Trainer.lower on abstract_init) keep the layout they name, as
        # the concrete arrays fit runs on would: left unspecified, XLA would choose the
        # outputs' layout (e.g. zero1's updated parameters sharded like the update).
        shardings = tuple(
            x.sharding if (isinstance(x, jax.Array) and x.committed) or (
                isinstance(x, jax.ShapeDtypeStruct) and isinstance(x.sharding, NamedSharding))
            else None for x in values
        )
        # Where each value lives, abstract ones (Trainer.lower on abstract_init) included:
        # host memory (offload) is moved to the devices inside the call.
        placed = tuple(getattr(x, "sharding", None) for x in values)
        key = (graphdef, state_def, shardings, tuple(map(is_host, placed)), node_pos, nargs,
               context)
        built = self._jitted.get(key)
        if built is None:
            if any(map(is_host, placed)):
                # Host state stays in host memory in the loop's carry (not pinned to a
                # device layout there); each step moves it in and out (_Stepwise).
                run = build_run(_Stepwise(self, placed, node_pos), graphdef, state_def,
                                node_pos, nargs,
                                tuple(None if is_host(p) else s
                                      for s, p in zip(shardings, placed, strict=True)))
            else:
                run = build_run(self, graphdef, state_def, node_pos, nargs, shardings)
            built = (self._jit(run, shardings, None), run)
            self._jitted.put(key, built)
        plan = _Plan(built[0], state_def, shardings, context, run=built[1])
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

    def _jit(self, run: Any, shardings: tuple[Any, ...], data_shardings: Any) -> Any:
        return jax.jit(
            run,
            in_shardings=None if data_shardings is None else (None, data_shardings),
            donate_argnums=(0,) if self.donate else (),
            out_shardings=(list(shardings), None, None),
        )

    def _data_jit(self, plan: _Plan, data_shardings: tuple[Any, ...]) -> Any:
        """``plan``'s call with the data arguments' shardings given (``in_shardings``):
        host (NumPy) data is then copied to the devices by the call's own C++ dispatch,
        with no ``jax.device_put`` (which costs ~0.1 ms of Python per call). Data
        passed this way must be host arrays or arrays with exactly these shardings;
        one trace per layout, as for placed data. Its metrics come back
        :class:`~nnx_shard._train._traced.Packed` (one array to read back per call)."""
        leaves, treedef = jax.tree.flatten(data_shardings)
        key = (id(plan.jitted), treedef, tuple(leaves))
        jitted = self._data_jits.get(key)
        if jitted is None:
            run = plan.run

            def packed(values: list[Any], data: tuple[Any, ...]) -> Any:
                new_values, metrics, count = run(values, data)
                return new_values, pack(metrics) if self.pack_metrics else metrics, count

            # The same function for every layout, so that a layout seen before (e.g.
            # lowered by Trainer.lower) finds its trace.
            packed = self._packed.setdefault(id(plan.jitted), packed)
            jitted = self._data_jits[key] = self._jit(packed, plan.shardings, data_shardings)
        return jitted

    def _entry(self, what: str) -> str:
        # Error messages name the call the user made (Trainer.fit gives its own).
        return self.entry or f"multistep({getattr(self.step_fn, '__name__', 'step_fn')}){what}"

    def _check_microbatches(self, args: tuple[Any, ...],
                            data_shardings: tuple[Any, ...] | None = None) -> None:
        """Each device's rows of every [K, batch, ...] leaf split into the microbatches
        (:func:`~nnx_shard._train._fused_checks.check_microbatch_rows`), once per layout."""
        check_microbatch_rows(args, data_shardings, self.microbatches, self._names,
                              self._rows_checked)

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
            # (docs/architecture.md: 2 or 8 calls in flight ran 3,000 calls, 32 aborted).
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
        return self._lower(args, None)

    def _lower(self, args: tuple[Any, ...], data_shardings: tuple[Any, ...] | None
               ) -> jax.stages.Lowered:
        """:meth:`lower`; with ``data_shardings`` (one pytree per data argument), the
        call :class:`Carry` runs on host data with those shardings."""
        plan, _, _, values, data = self._prepare(args)
        if self.microbatches > 1:
            self._check_microbatches(args, data_shardings)
        jitted = plan.jitted if data_shardings is None else self._data_jit(plan, data_shardings)
        with sharding_types(self._entry(".lower(...)")):
            return jitted.lower(values, data)


class Carry:
    """Calls of one :class:`Fused` in a loop that owns its NNX arguments (``Trainer.fit``),
    with the carried state kept as the flat list of arrays the compiled call takes
    and returns, between calls: fit's steady state is a loop over pure pytrees.

    :meth:`Fused.__call__` finds the state in the NNX objects and writes it back on
    every call (a pytree flatten of the objects, a check of the cached plan, one
    write per Variable). Here that happens once: the first call after a
    :meth:`sync` reads the objects (:meth:`Fused._prepare`); each call then passes
    the flat list straight to the jitted function (jax's C++ dispatch path), with
    host data and its shardings (``data_shardings``) placed by the call itself
    (:meth:`Fused._data_jit`). The Variables receive the current arrays only in
    :meth:`sync`, which the loop calls before anything looks at the model (a
    callback, a checkpoint, a replay, an error, its end). Until then the
    Variables hold the arrays of the last sync, which donation has deleted.

    ``done`` is the last call's step count, a scalar ready when the call is (for
    bounding the calls in flight without reading the metrics).
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
        self.done: jax.Array | None = None
        # The compiled call of the last data layout, and that layout (compared by
        # identity: Placer.host hands out one shardings object per layout).
        self._jitted: Any = None
        self._layout: tuple[Any, ...] | None = None

    def __call__(self, *args: Any, data_shardings: tuple[Any, ...] | None = None) -> Any:
        f = self.fused
        if self.values is None:
            plan, self.variables, self.nodes, self.values, data = f._prepare(args)
            self.data_pos = tuple(i for i, a in enumerate(args) if not is_node(a))
            if plan is not self.plan:
                self.plan, self._layout = plan, None
        else:
            data = tuple(args[i] for i in self.data_pos)
        layout = self._layout
        if (data_shardings is None or layout is None or len(layout) != len(data_shardings)
                or any(a is not b for a, b in zip(layout, data_shardings, strict=True))):
            self._new_layout(args, data_shardings)
        try:
            self.values, metrics, self.done = self._jitted(self.values, data)
        except Exception as e:
            if is_sharding_type_error(e):
                raise sharding_type_error(f._entry("(...)"), e) from e
            raise
        return metrics

    def _new_layout(self, args: tuple[Any, ...], data_shardings: tuple[Any, ...] | None
                    ) -> None:
        """The compiled call and the once-per-layout checks for a new data layout."""
        f, plan = self.fused, self.plan
        assert plan is not None
        self._jitted = plan.jitted if data_shardings is None else f._data_jit(plan, data_shardings)
        self._layout = data_shardings
        if f.microbatches > 1:
            f._check_microbatches(args, data_shardings)

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
    precision: Precision | None = None,
    stream_offload: bool = False,
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
        accumulating the gradients so that the step is the one of the whole
        batch: a loss declared with :func:`~nnx_shard.mean_over` (e.g.
        ``lm_loss``, over its kept targets) weighs each microbatch by its items,
        any other has them averaged. ``step_fn`` must compute its gradients with
        :func:`value_and_grad` (the batch is split there).
      max_in_flight: how many calls may run unfinished (default 2); ``None``
        never waits (unbounded dispatch: only when the caller bounds it
        itself, e.g. by reading each call's metrics).
      unroll: steps per iteration of the compiled loop (``jax.lax.scan``'s
        ``unroll``). The rolled default compiles fastest; a small model's
        loop can gain a little from 2, at a longer compile (``benchmarks/unroll.py``;
        its figures are in docs/benchmarks.md, "Fused training").
      precision: a :class:`~nnx_shard.Precision` (e.g. float32 parameters,
        bfloat16 compute): :func:`value_and_grad` inside the step reads the
        model's float parameters in the compute dtype where they are used; the
        parameters, the optimizer state and the gradients stay in theirs. The
        step must take its gradients with :func:`value_and_grad`.
      stream_offload: with state a strategy's ``offload`` keeps in host memory,
        let the step move it in a layer at a time rather than whole at its start
        (the default): the parameters that are not stacked arrive at the step's
        start, a scanned model's stacked parameters stream through its layer loop
        (their gradients come back in host memory) and
        :func:`~nnx_shard.apply_gradients` streams the update, so the device holds
        one layer's offloaded state at a time (as ``Trainer``'s steps do). The step
        must take ``(model, optimizer, ...)`` first and apply its update with
        :func:`~nnx_shard.apply_gradients`.

    >>> from nnx_shard import multistep
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
    return Fused(step_fn, donate=donate, microbatches=microbatches, max_in_flight=max_in_flight,
                 unroll=unroll, precision=precision, stream_offload=stream_offload)

