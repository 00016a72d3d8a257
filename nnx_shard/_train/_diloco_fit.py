"""``ns.Trainer`` over a :class:`~nnx_shard.DiLoCo` (``Trainer(model, diloco, loss_fn,
...)``): the steps, the NaN guard's end-of-call check and the host side of the
metrics for the replicas.

Every step of every replica stays free of collectives over the replicas' axis (the
point of DiLoCo is to cross it only at the sync): each replica's loss and gradient
norm come back per replica (``[K, R]``), averaged on the host; under
``guard="grads"`` and ``"off"`` the guard's flag is one per replica, laid out over
the axis, and the end-of-call check reduces the state within each replica only.
``guard="full"`` keeps :func:`~nnx_shard._train._guard.guard_call`: one reduction
over the axis per call (its rollback is of the whole state, all replicas together).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._errors import UsageError
from nnx_shard._train._diloco import DiLoCo, ReplicaOptState, ReplicaParam, ReplicaResidual
from nnx_shard._train._guard import Guard, guard_call, select
from nnx_shard._train._stream import finite_flags

__all__ = ["check_diloco", "make_diloco_steps", "replica_guard", "replica_metrics"]

_STACKED = (ReplicaParam, ReplicaOptState, ReplicaResidual)


def check_diloco(model: Any, diloco: DiLoCo, *, microbatches: int, precision: Any,
                 has_aux: bool) -> None:
    """The Trainer's options a DiLoCo cannot honour, refused by name."""
    if diloco.model is not model:
        raise UsageError(
            "Trainer: the DiLoCo given as the optimizer trains another model (its .model is "
            "not the model passed). Fix: Trainer(diloco.model, diloco, loss_fn, ...), or build "
            "the DiLoCo on this model: ns.DiLoCo(model, optax.adamw(1e-3), inner_steps=H).")
    for name, given, why in (
            ("microbatches", microbatches != 1, f"microbatches={microbatches}"),
            ("precision", precision is not None, f"precision={precision!r}"),
            ("has_aux", has_aux, "has_aux=True")):
        if given:
            raise UsageError(
                f"Trainer: {why} does not apply to a DiLoCo: its replicas take their "
                "gradients with jax.value_and_grad of a scalar loss, on each replica's whole "
                f"rows of the batch. Fix: drop {name}= (Trainer(model, diloco, loss_fn, "
                "mesh=..., rules=...)).")


def replica_guard(diloco: DiLoCo) -> Guard:
    """The guard of ``guard="grads"`` and ``"off"``: one flag per replica, laid out over
    the replicas' axis, so that gating a replica's step on it crosses nothing."""
    guard = Guard()
    guard.ok.set_value(jax.device_put(
        np.ones(diloco.replicas_n, bool), NamedSharding(diloco.mesh, PartitionSpec(diloco.axis))))
    return guard


def _per_replica_finite(diloco: DiLoCo) -> jax.Array:
    """``[R]``: every float leaf of replica r (its parameters, inner optimizer state and
    residual) and of the shared state (anchor, outer state) is finite. The stacked
    leaves reduce within each replica (no collective over the axis); the anchor and
    outer state are replicated over it."""
    r = diloco.replicas_n
    ok = jnp.ones((r,), bool)
    for x in jax.tree.leaves(nnx.state(diloco, _STACKED)):
        if jnp.issubdtype(x.dtype, jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(x.reshape(r, -1)), axis=1)
    shared = [x for x in jax.tree.leaves(nnx.state(diloco, nnx.Not(nnx.Any(*_STACKED))))
              if jnp.issubdtype(x.dtype, jnp.inexact)]
    for x in shared:
        ok = ok & jnp.all(jnp.isfinite(x))
    return ok


def _check_replicas(before: Any, after: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    """:func:`~nnx_shard._train._guard.check_call` per replica: replica r's flag drops
    if any of its steps' loss or gradient norm, or its final state, is not finite;
    ``state_finite`` is ``[R]`` (the host reduces it)."""
    _, diloco, guard = after
    state_ok = _per_replica_finite(diloco)
    steps_ok = jnp.all(jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]),
                       axis=0)
    guard.ok[...] = guard.ok[...] & steps_ok & state_ok
    return {**metrics, "state_finite": state_ok}


def make_diloco_steps(
    loss_fn: Callable[..., Any], mode: str,
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], list[tuple[str, str]]]:
    """``(step, finish, careful_step, checked)`` for the Trainer's fused call over a
    DiLoCo, as :func:`~nnx_shard._train._guard.make_gated_step` /
    :func:`~nnx_shard._train._guard.make_fast_step`, :func:`check_call` /
    :func:`guard_call` and :func:`~nnx_shard._train._guard.make_step` are for an
    ``nnx.Optimizer``. Each step returns per-replica ``loss`` and ``grad_norm``."""
    checked: list[tuple[str, str]] = []

    def step(model: Any, diloco: DiLoCo, batch: Any, guard: Guard) -> dict[str, Any]:
        if mode == "full":
            losses, norms, _ = diloco._step(loss_fn, batch, norms=True)
            return {"loss": losses, "grad_norm": norms}
        # "grads" also checks each replica's loss and gradient norm; "off" only the flag.
        losses, norms, applied = diloco._step(loss_fn, batch, guard.ok[...], norms=True,
                                              check=mode == "grads")
        guard.ok[...] = applied
        return {"loss": losses, "grad_norm": norms, "applied": applied}

    def careful_step(model: Any, diloco: DiLoCo, batch: Any, guard: Guard) -> dict[str, Any]:
        # guard="full"'s replay of a failed call: every step checked over all replicas
        # together (a reduction over the axis per step, only in this replay).
        before = jax.tree.map(lambda x: x, nnx.state(diloco))
        losses, norms, _ = diloco._step(loss_fn, batch, norms=True)
        assert norms is not None
        state = nnx.state(diloco)
        model_paths, model_flags = finite_flags(state["model"])
        rest_paths, rest_flags = finite_flags({k: v for k, v in state.items() if k != "model"})
        checked[:] = ([("model", p) for p in model_paths]
                      + [("optimizer", p) for p in rest_paths])
        flags_v = jnp.stack([*model_flags, *rest_flags, jnp.array(True)])
        state_ok = jnp.all(flags_v)
        nonfinite = jnp.where(state_ok, -1, jnp.argmin(flags_v)).astype(jnp.int32)
        ok = (guard.ok[...] & jnp.all(jnp.isfinite(losses)) & jnp.all(jnp.isfinite(norms))
              & state_ok)
        nnx.update(diloco, select(ok, nnx.state(diloco), before))
        guard.ok[...] = ok
        return {"loss": losses, "grad_norm": norms, "applied": ok, "nonfinite": nonfinite}

    finish = guard_call if mode == "full" else _check_replicas
    return step, finish, careful_step, checked


def replica_metrics(mode: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """The host side of the replicas' metrics, one call's (``[K, R]``) or several
    calls' (``[calls, K, R]``): ``loss`` and ``grad_norm`` become the means over the
    replicas (computed here, on the host: on the device the mean would cross the
    replicas every step), the per-replica values stay as ``replica_loss`` and
    ``replica_grad_norm``; the per-replica flags of ``"grads"`` and ``"off"`` (a step
    counts as applied where every replica applied it) are reduced the same way.

    >>> f = replica_metrics("grads")
    >>> out = f({"loss": np.array([[1.0, 3.0]]), "grad_norm": np.array([[0.5, 0.5]]),
    ...          "applied": np.array([[True, False]]), "state_finite": np.array([True, True])})
    >>> out["loss"].tolist(), out["replica_loss"].tolist(), out["applied"].tolist()
    ([2.0], [[1.0, 3.0]], [False])
    >>> bool(out["state_finite"])
    True
    """
    def host(metrics: dict[str, Any]) -> dict[str, Any]:
        out = dict(metrics)
        for key in ("loss", "grad_norm"):
            per = np.asarray(out.pop(key))
            out[key] = per.mean(axis=-1)
            out[f"replica_{key}"] = per
        if mode != "full":
            for key in ("applied", "state_finite"):
                if key in out:
                    out[key] = np.asarray(out[key]).all(axis=-1)
        return out

    return host
