"""Local SGD / DiLoCo (Douillard et al., 2023) over a mesh's ``replica`` axis.

:class:`DiLoCo` holds R copies of a model's parameters (R the size of the
``replica`` axis, e.g. the ``hsdp`` preset's), each with its own
inner optimizer state, stacked along a leading dimension sharded over
``replica``; within a replica they keep the model's own layout (fsdp over
``data`` for ``hsdp``). :meth:`DiLoCo.step` is one inner step of every replica on
its own part of the batch, run under ``jax.vmap(..., spmd_axis_name="replica")``
so that nothing in it crosses replicas; every ``inner_steps`` steps it also runs
the outer step, the only communication across replicas: the replicas' parameters
averaged (one all-reduce over ``replica``), the anchor moved by the outer
optimizer along ``anchor - mean``, and every replica restarted from the new anchor.

The outer step is a ``jax.lax.cond`` on the step counter inside the step, so a
fused call (:func:`~nnx_shard.multistep`) of any K runs it wherever it falls
(a K that were required to be a multiple of H would tie the call's length to
the sync period and make resuming mid-period impossible).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._errors import UsageError, count, short
from nnx_shard._mesh import current, entered, make_mesh
from nnx_shard._rules import Rules
from nnx_shard._train import _compress

__all__ = ["DiLoCo"]


class ReplicaParam(nnx.Variable):
    """One parameter of every replica, stacked along a leading ``replica`` dimension."""


class ReplicaOptState(nnx.Variable):
    """The inner optimizer state of every replica, stacked like :class:`ReplicaParam`."""


class ReplicaResidual(nnx.Variable):
    """Every replica's compression residual (error feedback), stacked like :class:`ReplicaParam`."""


class OuterOptState(nnx.Variable):
    """The outer optimizer's state, laid out as the anchor (the model's parameters)."""


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _values(tree: Any) -> Any:
    return jax.tree.map(lambda v: v.get_value(), tree, is_leaf=_is_var)


def _assign(tree: Any, values: Any) -> None:
    for v, x in zip(jax.tree.leaves(tree, is_leaf=_is_var), jax.tree.leaves(values), strict=True):
        v.set_value(x)


def _spec(x: Any) -> PartitionSpec:
    sharding = getattr(x, "sharding", None)
    return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()


def _without(rules: Rules, axis: str) -> Rules:
    """``rules`` with ``axis`` dropped from every rule: inside the replicas' ``vmap``
    the replica dimension is ``spmd_axis_name``'s, so an activation constrained to
    ``batch -> (replica, data)`` must name only ``data`` there."""
    changed: dict[str, Any] = {}
    for name, value in rules.items():
        if value == axis:
            changed[name] = None
        elif isinstance(value, tuple) and axis in value:
            rest = tuple(a for a in value if a != axis)
            changed[name] = rest[0] if len(rest) == 1 else (rest or None)
    return rules | changed if changed else rules


class DiLoCo(nnx.Module):
    """DiLoCo / local SGD: R replicas of ``model`` trained apart, averaged every H steps.

    R is the size of the mesh's ``axis`` (``replica``, as the ``hsdp`` preset
    lays it). Each replica keeps its own copy of the parameters and its own
    ``inner`` optimizer state (stacked along a leading dimension sharded over
    ``axis``; within a replica each keeps the model's layout) and takes
    :meth:`step` on its own rows of the batch, with no collective over ``axis``.
    Every ``inner_steps`` steps the outer step averages the replicas (the only
    all-reduce over ``axis``: the parameters' bytes, 1/data of them per device
    under ``hsdp``), applies ``outer`` to the anchor with the outer gradient
    ``anchor - mean_r(params_r)``, and restarts every replica from the new anchor.
    ``model`` is the anchor: its parameters are updated in place by the outer steps
    only. Inner optimizer states persist across outer steps, as in DiLoCo.

    Train with :func:`~nnx_shard.multistep` (the outer step is part of the compiled
    K-step call wherever it falls, a ``lax.cond`` on the step counter), or give it to
    :class:`~nnx_shard.Trainer` as the optimizer: ``ns.Trainer(model, diloco,
    loss_fn, rules=...)`` (its NaN guard, checkpoints and history, per replica). The loss
    returned is each replica's, ``[R]`` (averaging it would be one more collective
    over ``axis`` every step). ``loss_fn(model, batch)`` returns a scalar loss, the
    mean over its rows; the gradients are ``jax.value_and_grad``'s, so
    ``multistep``'s ``microbatches`` and ``precision`` do not apply to it. Checkpoints: the object is an ``nnx.Module``, so
    ``ns.save(dir, step, model=diloco)`` writes the anchor, every replica and both
    optimizers' states, and ``ns.restore`` reads them back.

    Args:
      model: the model, laid out on ``mesh`` (e.g. ``ns.sharded_init`` with ``hsdp``);
        its state must be parameters (``nnx.Param``) only.
      inner: the replicas' optax optimizer (e.g. ``optax.adamw(1e-3)``).
      mesh: the mesh; defaults to the one the model's arrays are on.
      inner_steps: H, the inner steps between outer steps.
      outer: the outer optax optimizer; by default DiLoCo's
        ``optax.sgd(0.7, momentum=0.9, nesterov=True)``.
      axis: the mesh axis the replicas are laid over.
      compress: what a sync sends across replicas in place of the float32 average:
        ``None`` (the all-reduce), ``"int8"`` or ``"int4"`` (each replica's delta
        rotated by a randomized Hadamard transform and quantized per block of 256 with a
        float32 scale; codes and scales all-gathered over ``axis``, then dequantized and
        averaged on every device), or ``"mask:P"`` (a fraction P of the elements, from a
        seed shared by the replicas and new every sync, averaged by an all-reduce of P of
        the bytes, not rescaled by 1/P), or ``"rank:R"`` (PowerSGD: rank-R factors of
        each device's slice of every matrix, by two all-reduces). Each keeps error feedback: every replica's
        compression residual (``residual``, stacked like the replicas, checkpointed with
        them) is added to its next delta.

    >>> import nnx_shard as ns, jax.numpy as jnp, numpy as np, optax
    >>> from flax import nnx
    >>> s = ns.strategies.get("hsdp")
    >>> mesh = s.make_mesh()                                      # replica=2, data=4
    >>> model = ns.sharded_init(lambda: nnx.Linear(4, 1, rngs=nnx.Rngs(0)), mesh, s)
    >>> diloco = ns.DiLoCo(model, optax.sgd(0.1), inner_steps=2)
    >>> mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
    >>> fused = ns.multistep(lambda d, b: {"loss": d.step(mse, b)})
    >>> with ns.use(mesh, s.rules):
    ...     batches = ns.shard_batch({"x": np.ones((4, 8, 4), np.float32),
    ...                               "y": np.zeros((4, 8, 1), np.float32)},
    ...                              mesh, s.rules, steps=True)       # K=4 steps
    ...     losses = fused(diloco, batches)["loss"]
    >>> losses.shape, int(diloco.count[...])                     # [K, R]
    ((4, 2), 4)
    >>> small = ns.DiLoCo(model, optax.sgd(0.1), inner_steps=2, compress="int8")
    >>> with ns.use(mesh, s.rules):
    ...     losses = fused(small, batches)["loss"]                # syncs send int8 codes
    >>> small.residual["kernel"].shape                            # [R, 4, 1]
    (2, 4, 1)
    """

    def __init__(
        self,
        model: nnx.Module,
        inner: optax.GradientTransformation,
        *,
        mesh: Mesh | str | Mapping[str, int] | None = None,
        inner_steps: int,
        outer: optax.GradientTransformation | None = None,
        axis: str = "replica",
        compress: str | None = None,
    ) -> None:
        if not isinstance(model, nnx.Module):
            raise UsageError(
                f"DiLoCo: model must be an nnx.Module, got {type(model).__name__} "
                f"{short(model, 60)}. Fix: pass the model laid out by ns.sharded_init.")
        for name, tx, example in (("inner", inner, "optax.adamw(1e-3)"),
                                  ("outer", outer, "optax.sgd(0.7, momentum=0.9, nesterov=True)")):
            if tx is not None and not isinstance(tx, optax.GradientTransformation):
                given = ("an nnx.Optimizer (DiLoCo keeps each replica's optimizer state "
                         "itself)" if isinstance(tx, nnx.Optimizer)
                         else f"{type(tx).__name__} {short(tx, 60)}")
                raise UsageError(f"DiLoCo: {name} must be an optax transformation, got "
                                 f"{given}. Fix: e.g. {name}={example}")
        self.compression = _compress.parse(compress)
        self.inner_steps = count(inner_steps, "DiLoCo: inner_steps", fix="e.g. inner_steps=50")
        params = nnx.state(model, nnx.Param)
        others = nnx.state(model, nnx.Not(nnx.Param))
        if jax.tree.leaves(others):
            kinds = sorted({type(v).__name__ for _, v in nnx.to_flat_state(others)})
            raise UsageError(
                f"DiLoCo: the model holds state besides its parameters ({', '.join(kinds)}); "
                "the replicas copy only nnx.Param. Fix: a model whose state is its "
                "parameters (e.g. no nnx.Rngs or BatchStat in it).")
        leaves = jax.tree.leaves(params)
        if mesh is None:
            found = [x.sharding.mesh for x in leaves
                     if isinstance(getattr(x, "sharding", None), NamedSharding)]
            if not found:
                raise UsageError(
                    "DiLoCo: mesh= not given and the model's arrays are not on a mesh. Fix: "
                    "pass the mesh, e.g. mesh=ns.strategies.get('hsdp').make_mesh().")
            mesh = found[0]
        mesh = make_mesh(mesh)
        if axis not in mesh.axis_names:
            raise UsageError(
                f"DiLoCo: axis {axis!r} is not an axis of the mesh "
                f"({', '.join(f'{k}={v}' for k, v in mesh.shape.items())}). Fix: a mesh with a "
                "replica axis, e.g. ns.strategies.get('hsdp').make_mesh(), or axis= one of "
                f"{list(mesh.axis_names)}.")
        specs = [_spec(x) for x in leaves]
        for (path, _), spec in zip(nnx.to_flat_state(params), specs, strict=True):
            if any(axis == a or (isinstance(a, tuple) and axis in a) for a in spec):
                raise UsageError(
                    f"DiLoCo: parameter {'/'.join(map(str, path))} is sharded over {axis!r} "
                    f"(spec {tuple(spec)}); each replica needs a whole copy. Fix: lay the model out with "
                    "a strategy that replicates parameters across it, e.g. 'hsdp'.")
        outer = outer if outer is not None else optax.sgd(0.7, momentum=0.9, nesterov=True)
        self.model = model
        self.inner = inner
        self.outer = outer
        self.axis = axis
        self.mesh = mesh
        self.replicas_n = int(mesh.shape[axis])
        self.specs = tuple(specs)
        pure = nnx.to_pure_dict(params)
        r = self.replicas_n
        stacked_sh = jax.tree.unflatten(
            jax.tree.structure(pure),
            [NamedSharding(mesh, PartitionSpec(axis, *s)) for s in specs])
        anchor_sh = jax.tree.unflatten(jax.tree.structure(pure),
                                       [NamedSharding(mesh, s) for s in specs])
        rep = NamedSharding(mesh, PartitionSpec())
        by_replica = NamedSharding(mesh, PartitionSpec(axis))
        compressed = self.compression is not None

        def build(pure: Any) -> tuple[Any, ...]:
            stacked = jax.tree.map(lambda x: jnp.broadcast_to(x[None], (r, *x.shape)), pure)
            # Only a compressed sync leaves a residual: an uncompressed DiLoCo's state
            # (and checkpoints) stay as they were.
            residual = jax.tree.map(jnp.zeros_like, stacked) if compressed else None
            return (stacked, jax.vmap(inner.init)(stacked), outer.init(pure),
                    jnp.zeros((), jnp.int32), residual)

        # One compiled program builds the whole state, laid out by out_shardings: eager
        # copies compiled a small program per leaf (~0.7 CPU-s for a 1-layer Decoder).
        shapes = jax.eval_shape(build, pure)
        out = (stacked_sh,
               optax.tree_map_params(inner, lambda _, s: s, shapes[1], stacked_sh,
                                     transform_non_params=lambda x: by_replica if x.ndim
                                     else rep),
               optax.tree_map_params(outer, lambda _, s: s, shapes[2], anchor_sh,
                                     transform_non_params=lambda x: rep),
               rep, stacked_sh if compressed else None)
        stacked, inner_state, outer_state, steps, residual = jax.jit(
            build, out_shardings=out)(pure)
        self.replicas = nnx.data(jax.tree.map(ReplicaParam, stacked))
        self.inner_state = nnx.data(jax.tree.map(ReplicaOptState, inner_state))
        self.outer_state = nnx.data(jax.tree.map(OuterOptState, outer_state))
        self.count = nnx.Variable(steps)
        self.residual = (nnx.data(jax.tree.map(ReplicaResidual, residual))
                         if compressed else None)

    def inner_step(self, loss_fn: Callable[[nnx.Module, Any], jax.Array], batch: Any
                   ) -> jax.Array:
        """One step of every replica's inner optimizer on its rows of ``batch`` (the
        leading dim of every leaf split into R equal parts, replica r taking the r-th),
        with no collective over ``axis``; counts the step. Returns each replica's loss,
        ``[R]``. Call it (or :meth:`step`) inside the function given to
        :func:`~nnx_shard.multistep` (or under ``jax.jit``)."""
        return self._inner(loss_fn, batch)[0]

    def _inner(self, loss_fn: Callable[[nnx.Module, Any], jax.Array], batch: Any,
               gate: jax.Array | None = None, norms: bool = False, check: bool = True
               ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """:meth:`inner_step`, returning ``(losses, grad_norms, applied)``, each ``[R]``:
        with ``norms`` each replica's gradient norm (a reduction within the replica);
        with ``gate`` (``[R]`` flags, laid out over ``axis``) replica r's update is
        applied only where ``gate[r]`` holds and, with ``norms``, its loss and gradient
        norm are finite (``check``) (``applied``). ``Trainer.fit``'s NaN guard runs it."""
        if not callable(loss_fn):
            raise UsageError(
                f"DiLoCo.step: loss_fn must be callable as loss_fn(model, batch), got "
                f"{short(loss_fn, 60)}. Fix: def loss_fn(model, batch): return a scalar loss.")
        mesh, axis, r = self.mesh, self.axis, self.replicas_n
        graphdef, params, rest = nnx.split(self.model, nnx.Param, ...)  # type: ignore[misc]
        layout = jax.tree.structure(params)
        active = current()
        # Outside any ns.use the model's constraints are no-ops, and stay so.
        inside = (entered(mesh=mesh, rules=_without(active[1], axis)) if active is not None
                  else contextlib.nullcontext())
        within = _without(active[1], axis).get("batch") if active is not None else None

        def split(x: jax.Array) -> jax.Array:
            if x.shape[0] % r:
                raise UsageError(
                    f"DiLoCo.step: a batch leaf of {x.shape[0]} rows does not split into "
                    f"{r} replicas. Fix: a batch size that is a multiple of {r}.")
            x = x.reshape(r, x.shape[0] // r, *x.shape[1:])
            return jax.lax.with_sharding_constraint(
                x, NamedSharding(mesh, PartitionSpec(axis, within)))

        def one(p: Any, opt: Any, b: Any, ok: Any) -> tuple[Any, Any, jax.Array, Any, Any]:
            def loss_of(p: Any) -> jax.Array:
                state = jax.tree.unflatten(layout, jax.tree.leaves(p))
                return loss_fn(nnx.merge(graphdef, state, rest), b)

            loss, grads = jax.value_and_grad(loss_of)(p)
            updates, new_opt = self.inner.update(grads, opt, p)
            new_p = optax.apply_updates(p, updates)
            # Inside the vmap: sums over this replica's gradients only.
            norm = (jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
                    if norms else None)
            if ok is not None:
                if norm is not None and check:
                    ok = ok & jnp.isfinite(loss) & jnp.isfinite(norm)
                new_p, new_opt = jax.tree.map(lambda a, b: jnp.where(ok, a, b),
                                              (new_p, new_opt), (p, opt))
            return new_p, new_opt, loss, norm, ok

        with inside:
            reps, inner_state, losses, grad_norms, applied = jax.vmap(
                one, spmd_axis_name=axis)(_values(self.replicas), _values(self.inner_state),
                                          jax.tree.map(split, batch), gate)
        for tree, new in ((self.replicas, reps), (self.inner_state, inner_state)):
            _assign(tree, new)
        self.count.set_value(self.count[...] + 1)
        return losses, grad_norms, applied

    def _gated_sync(self, ok: jax.Array) -> None:
        """:meth:`sync` where every replica's flag in ``ok`` (``[R]``) holds, else
        nothing: one replica that stopped (``Trainer.fit``'s NaN guard) keeps every
        replica and the anchor as they are. The flags are reduced here, inside the
        sync, the one place that crosses replicas."""
        owned = (nnx.state(self.model, nnx.Param), self.replicas, self.outer_state,
                 self.residual)
        before = _values(owned)
        self.sync()
        go = jnp.all(ok)
        _assign(owned, jax.tree.map(lambda a, b: jnp.where(go, a, b), _values(owned), before))

    def sync(self) -> None:
        """The outer step: the replicas averaged (one all-reduce over ``axis``; with
        ``compress``, their compressed deltas gathered or reduced instead), the
        anchor (the model's parameters) moved by ``outer`` along ``anchor - mean``, and
        every replica restarted from it. :meth:`step` runs it when due; call it
        yourself (under ``jax.jit``) to sync at another time."""
        mesh, axis, r = self.mesh, self.axis, self.replicas_n
        params = nnx.state(self.model, nnx.Param)
        anchor = nnx.to_pure_dict(params)
        pure = jax.tree.structure(anchor)
        reps = _values(self.replicas)
        if self.compression is None:
            mean = jax.tree.map(lambda x: jnp.mean(x, axis=0), reps)
            delta = jax.tree.map(jnp.subtract, anchor, mean)
        else:
            sent, residual = _compress.compressed_delta(
                self.compression, jax.tree.leaves(anchor), jax.tree.leaves(reps),
                jax.tree.leaves(_values(self.residual)), self.count[...], specs=self.specs,
                mesh=mesh, axis=axis)
            delta = jax.tree.unflatten(pure, sent)
            _assign(self.residual, jax.tree.unflatten(pure, residual))
        updates, outer_state = self.outer.update(delta, _values(self.outer_state), anchor)
        anchor = optax.apply_updates(anchor, updates)
        flat = [jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s))
                for x, s in zip(jax.tree.leaves(anchor), self.specs, strict=True)]
        reps = jax.tree.unflatten(pure, [
            jax.lax.with_sharding_constraint(jnp.broadcast_to(x[None], (r, *x.shape)),
                                             NamedSharding(mesh, PartitionSpec(axis, *s)))
            for x, s in zip(flat, self.specs, strict=True)])
        nnx.update(self.model, jax.tree.unflatten(jax.tree.structure(params), flat))
        _assign(self.replicas, reps)
        _assign(self.outer_state, outer_state)

    def step(self, loss_fn: Callable[[nnx.Module, Any], jax.Array], batch: Any) -> jax.Array:
        """:meth:`inner_step`, then :meth:`sync` when the step counter reaches a multiple
        of ``inner_steps`` (a ``jax.lax.cond``: inside a fused call the sync runs at
        whichever of its K steps it falls). Returns each replica's loss, ``[R]``."""
        return self._step(loss_fn, batch)[0]

    def _step(self, loss_fn: Callable[[nnx.Module, Any], jax.Array], batch: Any,
              gate: jax.Array | None = None, norms: bool = False, check: bool = True
              ) -> tuple[jax.Array, jax.Array | None, jax.Array | None]:
        """:meth:`step` as :meth:`_inner` takes it: with ``gate``, a sync runs only where
        every replica's update was applied (:meth:`_gated_sync`)."""
        losses, grad_norms, applied = self._inner(loss_fn, batch, gate, norms, check)
        if applied is None:
            def sync(d: DiLoCo, ok: Any) -> None:
                d.sync()
        else:
            def sync(d: DiLoCo, ok: Any) -> None:
                d._gated_sync(ok)
        if self.inner_steps == 1:
            sync(self, applied)
        else:
            nnx.cond(self.count[...] % self.inner_steps == 0, sync, lambda d, ok: None,
                     self, applied)
        return losses, grad_norms, applied
