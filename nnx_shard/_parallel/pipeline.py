"""The pipeline's execution: :func:`scan` runs a stacked layer loop as a GPipe or
circular pipeline over ``stage`` when the rules carry the option ``pipeline``
(documented where it is public, :mod:`nnx_shard.pipeline`)."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from nnx_shard._errors import ShardingError, ShardingWarning, count
from nnx_shard._mesh import called, context, current, entered, option, watching
from nnx_shard._offload import traced_host, traced_on_device
from nnx_shard._parallel.registry import ParallelOp, register
from nnx_shard._parallel.schedule import (
    NO_STACK_FIX,
    OPTION,
    Schedule,
    bubble,
    check_layers,
    work,
)

__all__ = ["OPTION", "run", "scan"]

_U = PartitionSpec.UNCONSTRAINED


# --------------------------------------------------------------------------- microbatches


def no_stack_error(m: int) -> ShardingError:
    """The error for a pipeline strategy whose model never called :func:`scan`."""
    return ShardingError(
        f"pipeline strategy with microbatches={m}: the model has no stacked layer axis "
        "(its forward pass never called nnx_shard.pipeline.scan), so there is nothing to "
        f"split over stages. {NO_STACK_FIX}"
    )


def _microbatched(grad_fn: Callable[..., Any], m: int, model: Any, batch: Any,
                  *args: Any) -> tuple[Any, Any]:
    """One step's gradients under a pipeline strategy: the whole batch goes through one
    forward pass, in which :func:`scan` runs the ``m`` microbatches through the stages
    (what :func:`nnx_shard.value_and_grad` calls instead of its accumulation loop).
    The loss is computed once, on the whole batch: a loss declared with
    :func:`nnx_shard.mean_over` needs no weighting here, its mean is the step's."""
    with entered(stage_microbatches=int(m)), watching() as calls:
        out = grad_fn(model, batch, *args)
    if OPTION not in calls:  # the model has no stack: nothing ran through the stages
        raise no_stack_error(m)
    return out


# --------------------------------------------------------------------------- scan


def _layer_count(layers: Any) -> int:
    leaves = jax.tree.leaves(layers)
    if not leaves or any(np.ndim(x) == 0 for x in leaves):
        raise ShardingError(
            "nnx_shard.pipeline.scan: the layers tree has no stacked layer axis (a leaf "
            f"with no leading dimension, or no leaves at all). {NO_STACK_FIX}"
        )
    counts = {int(np.shape(x)[0]) for x in leaves}
    if len(counts) > 1:
        raise ShardingError(
            "nnx_shard.pipeline.scan: the layers tree's leaves disagree on the leading "
            f"(layer) dimension: {sorted(counts)}. {NO_STACK_FIX}"
        )
    return counts.pop()


def _check(sched: Schedule, mesh: Any, n_layers: int, m: int, batch: int, data: int) -> int:
    if not isinstance(sched, Schedule):
        raise ShardingError(
            f"the pipeline option is {sched!r}, not a nnx_shard.pipeline.Schedule. Fix: "
            "Rules.with_options(pipeline=Schedule(axis='stage', repeats=1)), or use "
            "nnx_shard.strategies.get('pp')."
        )
    sizes = dict(mesh.shape)
    if sched.axis not in sizes:
        raise ShardingError(
            f"pipeline schedule over mesh axis {sched.axis!r}, but the mesh has axes "
            f"{', '.join(f'{k}={v}' for k, v in sizes.items())}. Fix: a mesh with a "
            f"{sched.axis!r} axis, e.g. ns.strategies.get('pp').make_mesh() "
            f"(make_mesh('{sched.axis}=4,data=2')), or pp(stage=...) naming your axis."
        )
    names = list(mesh.axis_names)
    if mesh.axis_types[names.index(sched.axis)] == AxisType.Explicit:
        raise ShardingError(
            f"pipeline over mesh axis {sched.axis!r}: Explicit mesh axes are not supported "
            "by the pipeline (it relies on GSPMD propagation through the stage loop). "
            "Fix: build the mesh with Auto axes, the default: make_mesh(..., "
            "axis_types='auto') or strategy.make_mesh()."
        )
    s, v = sizes[sched.axis], sched.repeats
    check_layers(n_layers, s, v, sched.axis, f"{n_layers} stacked layers do not divide into",
                  "", " with these repeats")
    if m < s:
        what = (f"pipeline: microbatches={m} is fewer than the {s} stages of mesh axis "
                f"{sched.axis!r}: at least {s - m} stage(s) would never work and the bubble "
                f"would be {bubble(s, m, v):.0%} of stage-steps.")
        if sched.allow_few_microbatches and v == 1:
            warnings.warn(what.replace("would never work and the bubble would be",
                                       "never work; the bubble is"), ShardingWarning, stacklevel=2)
        else:
            insist = (" The circular schedule needs microbatches >= stages." if v > 1 else
                      " To run anyway (GPipe), get('pp', allow_few_microbatches=True).")
            raise ShardingError(
                f"{what} Fix: microbatches >= {s} (Trainer(..., microbatches={s}) or "
                f"multistep(..., microbatches={s}); {4 * s} gives a bubble of "
                f"{bubble(s, 4 * s, v):.0%}).{insist}"
            )
    if batch % (m * data):
        raise ShardingError(
            f"pipeline: the batch of {batch} rows does not divide into microbatches={m} x "
            f"{data} data-parallel devices = {m * data}. Fix: a batch that is a multiple of "
            f"{m * data}" + (f", or a number of microbatches that divides the {batch // data} "
                             "rows of each data-parallel device" if batch % data == 0 else "")
            + "."
        )
    return s


def _spec(names: Any, shape: tuple[int, ...], mesh: Any, rules: Any) -> tuple[Any, ...]:
    """The mesh axes of each dimension of a stacked leaf, from its logical names."""
    if not names or len(names) != len(shape):
        return (_U,) * len(shape)
    return tuple(rules.spec(tuple(names), shape=shape, mesh=mesh, path="pipeline stack"))


def streamed(body: Callable[[Any, Any], tuple[Any, Any]]) -> Callable[[Any, Any], Any]:
    """``body`` for layers whose stacked leaves (some of them) are in host memory
    (``Strategy.offload="optimizer+params"``, see :mod:`nnx_shard._offload`): each
    turn moves its layer's host slices to device memory first, so the device holds
    one layer's parameters at a time.

    The body is a ``jax.checkpoint`` that saves nothing but its inputs (the carry and
    the host slices): the backward pass moves the slice in again and recomputes the
    layer from its input, rather than keeping every layer's device copy (or anything
    computed from it: a cast, a gathered shard, a LoRA delta) as a residual of the
    loop, which would hold the whole stack on the device after all. (A policy that
    saves all but the copies keeps what is computed from them; one that saves the
    matmuls overrides a model's ``remat="full"``.) So the layer's forward runs twice,
    as under ``remat="full"``, which then costs nothing more; a remat policy of the
    model's own, inside ``body``, decides what that recomputation keeps. JAX
    transposes the move: the gradient of a host slice goes back to host memory, so
    the stacked gradient comes out there.
    """
    def moved(carry: Any, layer: Any) -> Any:
        return body(carry, jax.tree.map(traced_on_device, layer))

    return jax.checkpoint(moved, policy=jax.checkpoint_policies.nothing_saveable)


def scan(
    body: Callable[[Any, Any], tuple[Any, Any]],
    carry: Any,
    layers: Any,
    *,
    microbatches: int | None = None,
) -> tuple[Any, Any]:
    """Runs ``body(carry, layer) -> (carry, y)`` over a stack of layers:
    ``jax.lax.scan(body, carry, layers)``, or the pipeline when the active rules
    carry the ``pipeline`` option (see the module docstring).

    Under the pipeline, ``carry``'s leaves are either batch-major activations
    (``[batch, ...]``, cut into microbatches) or scalars (e.g. a summed
    auxiliary loss: each microbatch starts from the given value and the result
    is the mean over microbatches, as gradient accumulation averages it for
    microbatches of as many items), and
    ``body`` must return ``y = None`` (the per-layer outputs are not collected).

    Outside a pipeline, leaves of ``layers`` in host memory (parameters offloaded
    with ``Strategy.offload="optimizer+params"``, which ``Trainer``'s steps leave
    there to stream) are moved to the device a layer per turn, and each turn is
    recomputed in the backward pass rather than kept (see :func:`streamed`).

    Args:
      body: one layer: ``(carry, layer) -> (carry, None)``; ``layer`` is one slice
        of ``layers`` (e.g. an ``nnx.State`` to ``nnx.merge``).
      carry: the activations entering the stack.
      layers: the stacked layers, every leaf ``[L, ...]`` (e.g. the state of an
        ``nnx.vmap``-built stack, from ``nnx.split``).
      microbatches: M; ``None`` takes it from :func:`nnx_shard.value_and_grad`
        (``Trainer(..., microbatches=M)``), else the number of stages.

    Raises:
      ShardingError: under a pipeline, a mesh without the stage axis or with
        Explicit axes, layers not divisible by stages (x repeats), fewer
        microbatches than stages, a batch not divisible by microbatches x data.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> import nnx_shard as ns
    >>> from nnx_shard.pipeline import scan
    >>> layers = {"w": jnp.arange(1.0, 5.0)[:, None] * jnp.ones((4, 3))}
    >>> body = lambda h, layer: (h * layer["w"], None)
    >>> rules = ns.strategies.get("pp").rules
    >>> with ns.use("stage=4,data=2", rules):
    ...     out, _ = jax.jit(lambda h, w: scan(body, h, w, microbatches=4))(
    ...         jnp.ones((8, 3)), layers)
    >>> out[0].tolist()   # 1 * 2 * 3 * 4
    [24.0, 24.0, 24.0]
    """
    if not callable(body):
        raise ShardingError(f"nnx_shard.pipeline.scan: body must be a function body(carry, "
                            f"layer) -> (carry, out), got {type(body).__name__} {body!r:.60}.")
    if microbatches is not None:
        count(microbatches, "nnx_shard.pipeline.scan: microbatches",
              fix="e.g. microbatches=8, or None to take it from the step")
    sched = option(OPTION)
    if sched is None:
        if any(map(traced_host, jax.tree.leaves(layers))):
            return jax.lax.scan(streamed(body), carry, layers)
        return jax.lax.scan(body, carry, layers)
    n_layers = _layer_count(layers)
    mesh, rules = current()  # type: ignore[misc]  # option() is None outside use()
    called(OPTION)  # the model has a stack: _microbatched checks this
    m = microbatches if microbatches is not None else context().stage_microbatches
    batch_leaves = [x for x in jax.tree.leaves(carry) if np.ndim(x) > 0]
    if not batch_leaves:
        raise ShardingError(
            "nnx_shard.pipeline.scan: the carry has no batch-major array to cut into "
            "microbatches (every leaf is a scalar). Fix: pass the activations [batch, ...]."
        )
    batch = int(np.shape(batch_leaves[0])[0])
    for x in batch_leaves:
        if np.shape(x)[0] != batch:
            raise ShardingError(
                "nnx_shard.pipeline.scan: the carry's array leaves disagree on the batch "
                f"dimension: {batch} vs {np.shape(x)[0]}. Every non-scalar leaf must be "
                "[batch, ...]."
            )
    sizes = dict(mesh.shape)
    data_axes = rules.spec(("batch",), shape=None, mesh=mesh, path="pipeline batch")[0]
    data_axes = () if data_axes is None else (data_axes,) if isinstance(data_axes, str) else data_axes
    data = math.prod(sizes[a] for a in data_axes)
    if m is None:
        m = sizes.get(getattr(sched, "axis", ""), 1)
    s = _check(sched, mesh, n_layers, int(m), batch, data)
    return _pipeline(body, carry, layers, sched, mesh, rules, s, int(m), data_axes), None


def run(layers: Any, x: Any, *args: Any, **kwargs: Any) -> Any:
    """``x`` through every block: ``for layer in layers: x = layer(x, *args, **kwargs)``.

    ``layers`` is either a list of blocks (the loop above, as written) or the module
    :func:`stack` made of them (or any ``nnx.vmap``-stacked module), which runs through
    :func:`scan`: a ``jax.lax.scan``, or under the pp presets a pipeline over stages.
    The one line a model needs in place of its loop, for both forms.

    The extra inputs the blocks take (positions, masks, segment ids) go with ``x``:
    array leaves whose leading dimension is ``x``'s batch are cut into the pipeline's
    microbatches with it, the others (e.g. a shared ``[length]`` position vector) are
    passed whole. A block returns the new ``x`` (same structure) and must not update its
    own state (batch statistics, a dropout stream held by the block): the stacked loop
    does not carry it.

    Args:
      layers: a list of blocks, or the module :func:`stack` made of them.
      x: the input of the first block.
      *args: further inputs every block takes.
      **kwargs: further keyword inputs every block takes.

    Raises:
      ShardingError: a stacked block updated its state; see :func:`scan` for the rest.

    >>> from flax import nnx
    >>> import jax.numpy as jnp
    >>> from nnx_shard.pipeline import run, stack
    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])
    ...     def __call__(self, x):
    ...         return run(self.layers, x)
    >>> net, x = Net(nnx.Rngs(0)), jnp.ones((2, 4))
    >>> y = net(x)
    >>> bool(jnp.allclose(stack(net, "layers")(x), y, atol=1e-6))
    True
    """
    if isinstance(layers, list | tuple | nnx.List):
        for layer in layers:
            x = layer(x, *args, **kwargs)
        return x
    graphdef, state = nnx.split(layers)
    lead = [np.shape(v)[0] for v in jax.tree.leaves(x) if np.ndim(v)]
    batch = lead[0] if lead else None
    extra, extra_def = jax.tree.flatten((args, kwargs))
    moves = [batch is not None and np.ndim(v) > 0 and np.shape(v)[0] == batch for v in extra]
    carried = [v for v, m in zip(extra, moves, strict=True) if m]
    fixed = [v for v, m in zip(extra, moves, strict=True) if not m]

    def body(carry: Any, layer: Any) -> tuple[Any, None]:
        h, moving = carry
        it_m, it_f = iter(moving), iter(fixed)
        a, kw = jax.tree.unflatten(extra_def, [next(it_m) if m else next(it_f) for m in moves])
        block = nnx.merge(graphdef, layer)
        # merge may reuse the Variables of `layer`: compare against the values before.
        before = [v.get_raw_value() for _, v in nnx.to_flat_state(layer)]
        out = block(h, *a, **kw)
        after = nnx.to_flat_state(nnx.state(block))
        changed = [p for (p, v), w in zip(after, before, strict=True)
                   if v.get_raw_value() is not w]
        if changed:
            where = "/".join(map(str, changed[0]))
            raise ShardingError(
                f"nnx_shard.pipeline.run: a stacked {type(block).__name__} updated its state "
                f"{where!r} (batch statistics, a dropout stream held by the block), which the "
                "stacked loop does not carry. Fix: pass dropout keys in as an input (or use "
                "nnx.Dropout(..., rngs=None) with rngs given at call time from outside the "
                "stack), or keep the blocks as a list under strategies without stages.")
        return (out, moving), None

    (x, _), _ = scan(body, (x, carried), state)
    return x


def _pipeline(body: Callable[..., Any], carry: Any, layers: Any, sched: Schedule, mesh: Any,
              rules: Any, s: int, m: int, data_axes: tuple[str, ...]) -> Any:
    v = sched.repeats
    batch_entry = data_axes if len(data_axes) != 1 else data_axes[0]
    loop = _Loop(mesh, sched.axis, s, v, m, _layer_count(layers) // (s * v), batch_entry or None)
    params = loop.stage_major(layers, rules)

    # Microbatches: [B, ...] -> [M, B/M, ...], microbatch j = rows j, j+M, ... so every
    # device keeps its own rows (as gradient accumulation splits them).
    leaves, treedef = jax.tree.flatten(carry)
    scalar = [np.ndim(x) == 0 for x in leaves]
    micro = [loop.split(x) for x in leaves]
    stage_ids = loop.put(jnp.arange(s), loop.axis)
    buf = [loop.on_stage(jnp.zeros((s, *x.shape[1:]), x.dtype),
                         *(() if sc else (loop.batch_entry,)))
           for x, sc in zip(micro, scalar, strict=True)]
    done = [loop.on_stage(jnp.zeros((s, *x.shape), x.dtype),
                          *((None,) if sc else (None, loop.batch_entry)))
            for x, sc in zip(micro, scalar, strict=True)]
    run_stages = loop.stages(body, treedef, sched.remat)

    def iteration(state: tuple[list[jax.Array], list[jax.Array]], t: jax.Array) -> Any:
        buf, done = state
        inputs = loop.enter(t, micro, buf, done, stage_ids)
        out = run_stages(params, inputs, stage_ids, t)
        # Every stage hands its result to the next; the last stage's lands on stage 0.
        rolled = [loop.on_stage(jnp.roll(o, 1, axis=0)) for o in out]
        return (rolled, loop.keep(t, rolled, done)), None

    (_, done), _ = jax.lax.scan(iteration, (buf, done), jnp.arange(m * v + s - 1))
    return jax.tree.unflatten(treedef, loop.outputs(done, scalar, leaves, stage_ids))


@dataclasses.dataclass(frozen=True)
class _Loop:
    """The pipeline loop of :func:`_pipeline`: what all its parts share (the mesh, the
    stage axis, S stages, V repeats, M microbatches, g layers per group, the batch's
    mesh axes) and its parts."""

    mesh: Any
    axis: str
    s: int
    v: int
    m: int
    g: int
    batch_entry: Any

    def put(self, x: jax.Array, *spec: Any) -> jax.Array:
        spec = spec + (_U,) * (x.ndim - len(spec))
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec(*spec)))

    def on_stage(self, x: jax.Array, *rest: Any) -> jax.Array:
        return self.put(x, self.axis, *rest)

    def stage_major(self, layers: Any, rules: Any) -> Any:
        """[L, ...] -> [S, V, g, ...]: stage s, repeat r holds layers (r*S + s)*g ... + g - 1.
        With V = 1 that is the stored contiguous split (no data moves); with V > 1 the
        constraint re-lays the stack out to the circular order."""
        s, v, g = self.s, self.v, self.g

        def relay(x: jax.Array, spec: tuple[Any, ...]) -> jax.Array:
            y = jnp.swapaxes(x.reshape(v, s, g, *x.shape[1:]), 0, 1)
            return self.put(y, self.axis, None, None, *spec[1:])

        def one(leaf: Any) -> Any:
            if isinstance(leaf, nnx.Variable):
                value = leaf.get_value()
                names = leaf.get_metadata().get("out_sharding")
                return leaf.replace(relay(value, _spec(names, tuple(value.shape), self.mesh,
                                                       rules)))
            return relay(leaf, (_U,) * np.ndim(leaf))

        return jax.tree.map(one, layers, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def split(self, x: jax.Array) -> jax.Array:
        m = self.m
        if np.ndim(x) == 0:
            return jnp.broadcast_to(x, (m,))
        y = jnp.moveaxis(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 1, 0)
        return self.put(y, None, self.batch_entry)

    def stages(self, body: Callable[..., Any], treedef: Any, remat: bool) -> Callable[..., Any]:
        """Every stage's pass over its layers at once: ``(params, inputs, stage_ids, t)
        -> outputs``, vmapped over the stage dimension."""
        m, v = self.m, self.v

        def stage_fn(stage_params: Any, inputs: list[jax.Array], stage: jax.Array,
                     t: jax.Array) -> list[jax.Array]:
            # This stage's pass over the stack: repeat r = (t - stage) // M (clipped in
            # the bubble, where the result is never used).
            item, _ = work(t, stage, m, v)
            r = jnp.clip(item // m, 0, v - 1)
            group = jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, r, 0, keepdims=False),
                                 stage_params)
            c = jax.tree.unflatten(treedef, inputs)
            c, ys = jax.lax.scan(body, c, group)
            if ys is not None and jax.tree.leaves(ys):
                raise ShardingError(
                    "nnx_shard.pipeline.scan: under a pipeline the layer body must return "
                    "(carry, None); per-layer outputs are not collected. Fix: fold them into "
                    "the carry (e.g. a summed scalar)."
                )
            return jax.tree.leaves(c)

        if remat:
            # Inside the loop XLA cannot merge the recomputation with the forward pass,
            # so CSE prevention would only cost speed (as for scanned layers).
            stage_fn = jax.checkpoint(stage_fn, prevent_cse=False)
        return jax.vmap(stage_fn, in_axes=(0, 0, 0, None), spmd_axis_name=self.axis)

    def enter(self, t: jax.Array, micro: list[jax.Array], buf: list[jax.Array],
              done: list[jax.Array], stage_ids: jax.Array) -> list[jax.Array]:
        """The stages' inputs at iteration ``t``. Stage 0's: microbatch t while there are
        new ones, then (circular) the result of the previous pass of microbatch t % M,
        which the roll left there."""
        m, s = self.m, self.s
        slot = t % m
        first = t < m
        inputs = []
        for x, b, d in zip(micro, buf, done, strict=True):
            fresh = jax.lax.dynamic_index_in_dim(x, jnp.minimum(t, m - 1), 0, keepdims=False)
            again = jax.lax.dynamic_index_in_dim(d, slot, 1, keepdims=False)
            enter = jnp.where(first, fresh[None], again)
            mask = (stage_ids == 0).reshape((s,) + (1,) * (b.ndim - 1))
            inputs.append(jnp.where(mask, enter, b))
        return inputs

    def keep(self, t: jax.Array, rolled: list[jax.Array], done: list[jax.Array]
             ) -> list[jax.Array]:
        """``done`` with what the last stage finished at iteration ``t`` stored in its
        microbatch's slot."""
        k, finished = work(t, self.s - 1, self.m, self.v)  # what the last stage just did
        kslot = jnp.maximum(k, 0) % self.m
        new_done = []
        for r, d in zip(rolled, done, strict=True):
            old = jax.lax.dynamic_index_in_dim(d, kslot, 1, keepdims=False)
            val = jnp.where(finished, r, old)
            new_done.append(jax.lax.dynamic_update_index_in_dim(d, val, kslot, 1))
        return new_done

    def outputs(self, done: list[jax.Array], scalar: list[bool], leaves: list[Any],
                stage_ids: jax.Array) -> list[jax.Array]:
        """The carry's leaves after the stack, from the finished microbatches."""
        outs = []
        for d, sc, x in zip(done, scalar, leaves, strict=True):
            mask = (stage_ids == 0).reshape((self.s,) + (1,) * (d.ndim - 1))
            # Stage 0 holds the outputs; the sum over stages hands them to every stage.
            y = jnp.sum(jnp.where(mask, d, jnp.zeros_like(d)), axis=0)
            if sc:
                outs.append(jnp.mean(y).astype(x.dtype))
            else:
                y = self.put(y, None, self.batch_entry)
                y = jnp.moveaxis(y, 0, 1).reshape(x.shape)
                outs.append(self.put(y, self.batch_entry))
        return outs


# value_and_grad hands the microbatches to the pipeline (see nnx_shard._parallel.registry).
register(ParallelOp("pipeline", OPTION, microbatched=_microbatched))
