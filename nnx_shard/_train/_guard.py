"""The NaN guard of ``Trainer.fit``'s steps, and the steps that compute their gradient
norm (:mod:`nnx_shard._train._norm`).

fit runs :func:`make_fast_step`, whose call is checked once at its end
(:func:`guard_call`, the ``finish`` of the fused call): a call with a non-finite
loss, gradient norm or final state is undone on the device and replayed with
:func:`make_step`, which checks every step and finds the step and the leaf
(:func:`why_not_finite`). The gradient norm and the checks reduce small
replicated leaves as one vector (:func:`grads_norm`, :func:`all_finite`) and
sharded gradients as per-device shares (:func:`grad_sq_shares`), as the
:class:`StateLayout` the :class:`Guard` carries allows.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._errors import UsageError
from nnx_shard._mesh import apply_sharding
from nnx_shard._offload import arrive_after, moves_offloaded, traced_host
from nnx_shard._train._microbatch import value_and_grad
from nnx_shard._train._norm import grad_sq_shares, grads_norm, join_small
from nnx_shard._train._stream import (
    arrive_params,
    finite_flags,
    host_finite,
    offloaded_update,
    streams,
)
from nnx_shard._train._trees import leaf_path

__all__ = ["DEFAULT_GUARD", "GRAD_SQ", "GUARDS", "RESERVED", "Guard", "StateLayout", "all_finite",
           "aux_metrics", "check_call", "check_guard", "guard_call", "make_fast_step",
           "make_gated_step", "make_step", "not_finite_leaf", "select", "skip_update_with",
           "why_not_finite"]

#: The NaN guard's modes, ``Trainer(..., guard=...)`` (see :class:`~nnx_shard.Trainer`):
#: ``"full"`` keeps the state from before each fused call to put it back (one more
#: copy of the parameters and optimizer state per device); ``"grads"`` applies a
#: step only where its loss and gradient norm are finite, in place (no copy), and
#: checks the state each call makes; ``"off"`` applies every step and only checks.
GUARDS = ("full", "grads", "off")

#: ``Trainer``'s and ``nnx-shard plan``'s mode: it catches the realistic failures
#: (a NaN/Inf loss or gradient) before they are applied, without the copy.
DEFAULT_GUARD = "grads"


def check_guard(guard: Any) -> str:
    """``guard`` if it is one of :data:`GUARDS`, else one clear error.

    >>> check_guard("full")
    'full'
    >>> check_guard("on")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: Trainer: guard must be one of 'full', 'grads', 'off', got 'on'. Fix: ...
    """
    if not isinstance(guard, str) or guard not in GUARDS:
        raise UsageError(
            f"Trainer: guard must be one of {', '.join(map(repr, GUARDS))}, got {guard!r}. "
            "Fix: guard='grads' (the default: a step with a non-finite loss or gradient is "
            "not applied), 'full' (also undoes a step whose update makes the state "
            "non-finite; one more copy of the state per device) or 'off' (checks only).")
    return guard


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What the host knows of the model and optimizer state's layout that the traced
    types may not show (Auto mesh axes hide it), for the steps to read when traced.

    Attributes:
      replicated: the whole model and optimizer state is replicated (as under dp):
        small gradient and state leaves can then be joined into one vector for the
        norm and the NaN check (:func:`grads_norm`, :func:`all_finite`).
      grad_specs, mesh: the parameters' specs when every parameter is laid out on
        ``mesh`` (then the step hands on each device's share of the squared
        gradient norm, :func:`grad_sq_shares`); ``None`` otherwise.

    >>> import optax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> StateLayout.of(model, opt, None)   # one device: replicated, on no mesh
    StateLayout(replicated=True, grad_specs=None, mesh=None)
    >>> StateLayout.of(model, opt, jax.make_mesh((8,), ("data",))).grad_specs   # placed on it
    (P(), P())
    """

    replicated: bool = False
    grad_specs: tuple[PartitionSpec, ...] | None = None
    mesh: Mesh | None = None

    @classmethod
    def of(cls, model: Any, optimizer: Any, mesh: Mesh | None) -> StateLayout:
        """The layout of ``model`` and ``optimizer``'s arrays, read on the host, as the
        fused call on ``mesh`` lays them out: fresh eager values (uncommitted) join
        its mesh replicated there (see :func:`nnx_shard.multistep`), so a second fit
        finds the layout the first one recorded."""
        def sharding(x: Any) -> Any:
            if mesh is not None and isinstance(x, jax.Array) and not x.committed:
                return NamedSharding(mesh, PartitionSpec())
            return getattr(x, "sharding", None)

        def replicated(x: Any) -> bool:
            return bool(getattr(sharding(x), "is_fully_replicated", False))

        params = jax.tree.leaves(nnx.state(model, nnx.Param))
        # Replicated parameters with a sharded optimizer state (zero1) do not count:
        # XLA reduce-scatters the gradients to the state's shards and computes the
        # update there, so joining gradients or updated parameters into one vector
        # (for the norm, for the NaN check) would gather them back.
        everything = jax.tree.leaves(nnx.state((model, optimizer)))
        shardings = [sharding(x) for x in params]
        on_mesh = mesh is not None and all(
            isinstance(s, NamedSharding) and s.mesh == mesh for s in shardings)
        return cls(replicated=all(replicated(x) for x in everything),
                   grad_specs=tuple(s.spec for s in shardings) if on_mesh else None,
                   mesh=mesh if on_mesh else None)


class Guard(nnx.Module):
    """What the fused steps of ``Trainer.fit`` are given besides the model, optimizer
    and batch: a device flag carried across fused calls (False once a step was not
    finite) and the state's :class:`StateLayout`, a static attribute, so the compiled
    call is traced again whenever it changes.

    >>> guard = Guard()
    >>> bool(guard.ok[...]), guard.layout.replicated
    (True, False)
    """

    def __init__(self, layout: StateLayout | None = None) -> None:
        self.ok = nnx.Variable(jnp.array(True))
        self.layout = layout if layout is not None else StateLayout()

    def raise_(self) -> None:
        """Sets the flag up again, keeping its placement: a fresh (uncommitted) value
        would make the next fused call take its slow path to place it (~1 ms)."""
        old = self.ok.get_raw_value()
        if isinstance(old, jax.Array) and old.committed:
            # (a DiLoCo's guard holds one flag per replica)
            self.ok.set_raw_value(jax.device_put(np.ones(old.shape, bool), old.sharding))
        else:
            self.ok.set_value(jnp.array(True))


def _keep_layout(a: jax.Array, want: Any, host: bool = False) -> jax.Array:
    """``a`` in the sharding type ``want`` of the value it replaces, and back in host
    memory if that value was there (``host``).

    On Explicit meshes an update can change an array's sharding type (ZeRO-1: a
    replicated parameter plus a data-sharded update is data-sharded); the state
    keeps the layout it had before the step (the all-gather ZeRO-1 implies)."""
    if (
        isinstance(want, NamedSharding)
        and not want.mesh.empty
        and jax.typeof(a).sharding.spec != want.spec
    ):
        a = apply_sharding(a, want)
    if host and not traced_host(a):
        a = jax.device_put(a, jax.memory.Space.Host)
    return a


def select(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``ok``, else ``old`` (two states of the same structure), each leaf
    in the layout and memory of ``old``'s. Leaves in host memory are chosen by one
    ``jax.lax.cond`` (no arithmetic on host arrays), the others by ``jnp.where``."""
    news, treedef = jax.tree.flatten(new)
    olds = jax.tree.leaves(old)
    out = [a if traced_host(b) else jnp.where(ok, _keep_layout(a, jax.typeof(b).sharding), b)
           for a, b in zip(news, olds, strict=True)]
    host = [i for i, b in enumerate(olds) if traced_host(b)]
    if host:
        pairs = [_keep_layout(news[i], jax.typeof(olds[i]).sharding, True) for i in host]
        chosen = jax.lax.cond(ok, lambda: pairs, lambda: [olds[i] for i in host])
        for i, x in zip(host, chosen, strict=True):
            out[i] = x
    return jax.tree.unflatten(treedef, out)


# The key under which fit's fused step hands each device's share of the squared
# gradient norm to the end of the call (see grad_sq_shares).
GRAD_SQ = "grad_norm/shares"

#: Metric names ``Trainer.fit`` writes itself (``step`` numbers the History and the
#: rows of MetricsWriter); an aux metric may not take one of them.
RESERVED = ("loss", "grad_norm", "step", "applied", "nonfinite", GRAD_SQ)


def aux_metrics(aux: Any) -> dict[str, Any]:
    """The aux output of a loss as fit's metrics: a mapping as it is (its names may not
    be :data:`RESERVED`: fit's own values would be replaced), anything else as ``aux``.

    >>> sorted(aux_metrics({"acc": 1.0})), sorted(aux_metrics(2.0))
    (['acc'], ['aux'])
    >>> aux_metrics({"loss": 1.0})
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: Trainer(has_aux=True): the loss function's aux metric 'loss' has the name of one of fit's own metrics ...
    """
    if not isinstance(aux, Mapping):
        return {"aux": aux}
    clash = [k for k in aux if k in RESERVED]
    if clash:
        raise UsageError(
            f"Trainer(has_aux=True): the loss function's aux metric {clash[0]!r} has the name "
            f"of one of fit's own metrics ({', '.join(RESERVED[:3])}), whose value it would "
            "replace in the History and in MetricsWriter's rows. Fix: rename it in the aux "
            f"dict, e.g. {{'aux_{clash[0]}': ...}}."
        )
    return dict(aux)


def _differentiate(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """``wrt -> value_and_grad(loss_fn, wrt=wrt)``: a step differentiates only what
    its optimizer updates, so a frozen base (``wrt=nnx.LoRAParam``) gets no
    gradient buffer."""
    return lambda wrt: value_and_grad(loss_fn, has_aux=has_aux, wrt=wrt)


def make_step(
    loss_fn: Callable[..., Any], has_aux: bool
) -> tuple[Callable[..., Any], list[tuple[str, str]]]:
    """The step with the per-step guard (the replay of a call :func:`guard_call`
    failed), and the leaves it checks after the update, filled while it is traced,
    in the order of its ``nonfinite`` metric (an index into that list). Under host
    offload it moves the state as :func:`make_fast_step` does (stacked parameters and
    the update a layer at a time where they stream); the check reads host leaves a
    layer at a time and :func:`select` keeps the state from before the step where it
    lives, in host memory (this replay runs only after a call failed, when the device
    is no roomier than before)."""
    grad_fn = _differentiate(loss_fn, has_aux)
    checked: list[tuple[str, str]] = []

    @moves_offloaded
    def train_step(model: Any, optimizer: Any, batch: Any, guard: Guard) -> dict[str, Any]:
        # Copies of the Variable wrappers (the arrays are shared, nothing is copied):
        # the state to fall back to if this step is not finite.
        before = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))
        arrive_params(model, optimizer)
        out, grads = grad_fn(optimizer.wrt)(model, batch)
        loss, aux = out if has_aux else (out, {})
        offloaded_update(model, optimizer, grads)
        grad_norm = grads_norm(grads, guard.layout.replicated)
        # Finite gradients can still give non-finite parameters or optimizer state
        # (an infinite learning rate, an overflowing second moment): the updated state
        # itself is checked too, so a non-finite value is never kept, nor saved.
        model_paths, model_flags = finite_flags(nnx.state(model))
        opt_paths, opt_flags = finite_flags(nnx.state(optimizer))
        checked[:] = [("model", p) for p in model_paths] + [("optimizer", p) for p in opt_paths]
        flags = jnp.stack([*model_flags, *opt_flags, jnp.array(True)])
        state_ok = jnp.all(flags)
        nonfinite = jnp.where(state_ok, -1, jnp.argmin(flags)).astype(jnp.int32)
        ok = guard.ok[...] & jnp.all(jnp.isfinite(loss)) & jnp.isfinite(grad_norm) & state_ok
        # A non-finite step (and every later one) is not applied, inside the compiled
        # call: the state stays the last finite one without a host round trip.
        nnx.update((model, optimizer), select(ok, nnx.state((model, optimizer)), before))
        guard.ok[...] = ok
        return {"loss": loss, "grad_norm": grad_norm, **aux_metrics(aux), "applied": ok,
                "nonfinite": nonfinite}

    return train_step, checked


def make_fast_step(loss_fn: Callable[..., Any], has_aux: bool) -> Callable[..., Any]:
    """The step fit runs normally: no per-step guard, :func:`guard_call` checks the call.

    The guard of :func:`make_step` costs a pass over the whole state per step (the
    finiteness reductions and the select): on a small MLP it halved the steps/s. Here
    the check runs once per fused call; a call that fails is undone in the compiled
    call and replayed with the per-step guard (see ``Trainer.fit``), which finds the
    exact step and leaf. With sharded gradients (the guard's :class:`StateLayout` gives
    their specs and mesh) the step hands on each device's share of the squared
    gradient norm, summed across devices at the end of the call
    (:func:`grad_sq_shares`).
    """
    grad_fn = _differentiate(loss_fn, has_aux)

    @moves_offloaded
    def train_step(model: Any, optimizer: Any, batch: Any, guard: Guard) -> dict[str, Any]:
        # Offloaded parameters: the forward pass reads them (stacked ones a layer at a
        # time where they stream; their gradients then come back in host memory).
        arrive_params(model, optimizer)
        out, grads = grad_fn(optimizer.wrt)(model, batch)
        loss, aux = out if has_aux else (out, {})
        offloaded_update(model, optimizer, grads)
        aux = aux_metrics(aux)
        layout = guard.layout
        shares = (grad_sq_shares(grads, layout.grad_specs, layout.mesh)
                  if layout.grad_specs is not None else None)
        if shares is not None:
            return {"loss": loss, GRAD_SQ: shares, **aux}
        return {"loss": loss, "grad_norm": grads_norm(grads, layout.replicated), **aux}

    return train_step


# How make_gated_step skips an update: "cond" skips the optimizer step with
# jax.lax.cond; "select" computes it and keeps the old value where the step is not
# allowed (jnp.where per leaf). Neither keeps a copy of the whole state on Llama-3.1
# 8B under fsdp (9.23 GiB of temp per device both, 14.83 with guard="full"); on the
# small transformer the select kept 0.5 MiB (dp) and 1.1 MiB (fsdp, nearly its
# 1.34 MiB of state per device) more than the cond, which matched the bare step
# (benchmarks/guard_cost.py).
_GATE = "cond"


@contextlib.contextmanager
def skip_update_with(kind: str) -> Iterator[None]:
    """Steps traced inside the block skip a disallowed update with ``kind``:
    ``"cond"`` (the default, ``jax.lax.cond`` around the optimizer step) or
    ``"select"`` (the update computed, the old values kept per leaf). For comparing
    the two (benchmarks/guard_cost.py); training never needs it.

    >>> with skip_update_with("select"):
    ...     pass
    >>> with skip_update_with("where"):
    ...     pass
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: skip_update_with: kind must be 'cond' or 'select', got 'where'. Fix: ...
    """
    global _GATE
    if kind not in ("cond", "select"):
        raise UsageError(f"skip_update_with: kind must be 'cond' or 'select', got {kind!r}. "
                         "Fix: skip_update_with('cond') or skip_update_with('select')")
    saved, _GATE = _GATE, kind
    try:
        yield
    finally:
        _GATE = saved


def _apply_where(ok: jax.Array, model: Any, optimizer: Any, grads: Any, rest: Any) -> None:
    """``optimizer.update(model, grads)`` where ``ok``, and the model's other Variables
    (``rest``: RNG counts, batch statistics, as they were before the forward pass)
    put back where not: a step that is not applied leaves no trace."""
    if _GATE == "cond":
        def apply(m: Any, o: Any, g: Any) -> None:
            # Both branches return the state in the types it came in (see _keep_layout).
            # and in the memory it came in: state the update brought in from the host
            # goes back there inside the branch (the other branch leaves it there).
            types = jax.tree.map(lambda x: jax.typeof(x).sharding, nnx.state((m, o)))
            hosts = jax.tree.map(traced_host, nnx.state((m, o)))
            offloaded_update(m, o, g)
            nnx.update((m, o), jax.tree.map(_keep_layout, nnx.state((m, o)), types, hosts))

        nnx.cond(ok, apply, lambda m, o, g: None, model, optimizer, grads)
    else:
        # The select keeps the old state next to the new: both whole, on the device.
        grads = arrive_after(optimizer, grads)
        before = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))
        optimizer.update(model, grads)
        nnx.update((model, optimizer), select(ok, nnx.state((model, optimizer)), before))
    nnx.update(model, select(ok, nnx.state(model, nnx.Not(optimizer.wrt)), rest))


def make_gated_step(loss_fn: Callable[..., Any], has_aux: bool,
                    check_grads: bool) -> Callable[..., Any]:
    """The step of fit's ``guard="grads"`` (``check_grads=True``) and ``guard="off"``:
    the update is applied only where the step is allowed to, in place, so no state
    is kept from before the step or the call.

    With ``check_grads`` a step is applied only if the guard is up and its loss and
    gradient norm are finite (the norm is then summed across devices every step:
    the step needs it before its update); without, only if the guard is up (it
    drops at the end of a call that :func:`check_call` finds not finite, so calls
    queued behind that one change nothing). The ``applied`` metric says which
    steps were applied; a step that is not applied drops the guard, so no later
    step of the call is applied either.
    """
    grad_fn = _differentiate(loss_fn, has_aux)

    @moves_offloaded
    def train_step(model: Any, optimizer: Any, batch: Any, guard: Guard) -> dict[str, Any]:
        # Offloaded parameters: the forward pass reads them (see make_fast_step). The
        # "select" gate updates the whole state at once: nothing streams under it.
        arrive_params(model, optimizer, stream=_GATE == "cond")
        # What the forward pass may change besides the parameters (small: RNG counts,
        # batch statistics), to put back if the step is not applied.
        rest = jax.tree.map(lambda x: x, nnx.state(model, nnx.Not(optimizer.wrt)))
        out, grads = grad_fn(optimizer.wrt)(model, batch)
        if not streams(model, optimizer):
            grads = arrive_after(optimizer, grads)  # offloaded optimizer state: after backward
        loss, aux = out if has_aux else (out, {})
        aux = aux_metrics(aux)  # fit's own names refused, a non-mapping kept as "aux"
        layout = guard.layout
        shares = (grad_sq_shares(grads, layout.grad_specs, layout.mesh)
                  if layout.grad_specs is not None else None)
        ok = guard.ok[...]
        if check_grads:
            norm = (jnp.sqrt(jnp.sum(shares)) if shares is not None
                    else grads_norm(grads, layout.replicated))
            ok = ok & jnp.all(jnp.isfinite(loss)) & jnp.isfinite(norm)
            norms: dict[str, Any] = {"grad_norm": norm}
        else:
            norms = ({GRAD_SQ: shares} if shares is not None
                     else {"grad_norm": grads_norm(grads, layout.replicated)})
        _apply_where(ok, model, optimizer, grads, rest)
        guard.ok[...] = ok
        return {"loss": loss, **norms, **aux, "applied": ok}

    return train_step


def _norms(metrics: dict[str, Any]) -> dict[str, Any]:
    """``[K, devices]`` shares of the squared gradient norm as ``[K]`` norms: one
    reduction (across devices) per call."""
    if GRAD_SQ not in metrics:
        return metrics
    return {("grad_norm" if key == GRAD_SQ else key):
            (jnp.sqrt(jnp.sum(v, axis=-1)) if key == GRAD_SQ else v)
            for key, v in metrics.items()}


def _state_finite(state: Any, replicated: bool, also: Sequence[Any] = ()) -> jax.Array:
    """One flag: ``state`` and the arrays ``also`` are finite, its leaves in device
    memory checked by :func:`all_finite` with ``also``, those in host memory where they
    live (:func:`~nnx_shard._train._stream.host_finite`: a stacked leaf a layer at a time)."""
    leaves, host_flags = host_finite(state)
    ok = all_finite([*also, *leaves], replicated)
    return ok & jnp.all(jnp.stack(host_flags)) if host_flags else ok


@moves_offloaded
def check_call(before: Any, after: Any, metrics: dict[str, Any]) -> dict[str, Any]:
    """The end of a fused call of :func:`make_gated_step` (``guard="grads"`` or
    ``"off"``): checks every step's loss and gradient norm and the final state, and
    drops the guard if any is not finite, so that no call queued behind this one
    applies a step. Nothing is undone: the state before the call is not kept. The
    ``state_finite`` metric tells the host whether the state the call leaves is
    finite (the steps' own flags are in ``applied``).

    It reads offloaded state where it lives (:func:`host_finite`): a stacked leaf in
    host memory is checked on the device a layer at a time, as the streamed update
    (:func:`offloaded_update`) moved it, so the check holds no more of it either."""
    model, opt, guard = after
    metrics = _norms(metrics)
    state_ok = _state_finite(nnx.state((model, opt)), before[2].layout.replicated)
    steps_ok = all_finite([metrics["loss"], metrics["grad_norm"]])
    guard.ok[...] = guard.ok[...] & steps_ok & state_ok
    return {**metrics, "state_finite": state_ok}


def not_finite_leaf(model: Any, optimizer: Any) -> str | None:
    """What of the model and optimizer state holds a NaN/Inf, naming its first leaf
    (as :func:`why_not_finite` does); ``None`` where everything is finite. Run on
    the host after a call, only when its check failed.

    >>> import optax
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
    >>> not_finite_leaf(model, opt) is None
    True
    >>> opt.opt_state[0].nu["bias"][...] = jnp.array([jnp.inf])
    >>> not_finite_leaf(model, opt)
    'the optimizer state is not finite (first: opt_state/0/nu/bias)'
    """
    flags = jax.jit(lambda xs: jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))
    for owner, what in ((model, "the parameters are"), (optimizer, "the optimizer state is")):
        paths, leaves = [], []
        for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(owner))[0]:
            if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.inexact):
                paths.append(leaf_path(path))
                leaves.append(x)
        ok = np.asarray(flags(leaves)) if leaves else np.ones(0, bool)
        if not ok.all():
            return f"{what} not finite (first: {paths[int(np.argmin(ok))]})"
    return None


def all_finite(leaves: Sequence[Any], replicated: bool = False) -> jax.Array:
    """One flag: every inexact (float/complex) leaf is finite.

    As in :func:`grads_norm`, the small replicated leaves are checked as one
    concatenated vector per dtype: a check per leaf costs XLA's CPU backend a few
    kernels each (an MLP's 19 state leaves took ~60 per fused call); sharded and
    large leaves keep their own.

    >>> bool(all_finite([jnp.ones(3), jnp.array([1.0, jnp.inf]), jnp.arange(2)]))
    False
    >>> bool(all_finite([jnp.ones(3), jnp.zeros((2, 2), jnp.bfloat16), jnp.arange(2)]))
    True
    """
    inexact = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    whole, joined = join_small(inexact, replicated, lambda x: True)
    flags = [jnp.all(jnp.isfinite(x)) for x in [*whole, *joined]]
    return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


@moves_offloaded
def guard_call(
    before: Any, after: Any, metrics: dict[str, Any], undo: bool = True,
) -> dict[str, Any]:
    """The NaN guard, once per fused call of :func:`make_fast_step`: the call is kept
    only if the guard was up, every step's loss and gradient norm are finite and the
    final state is; else the state goes back to the one before the call and the guard
    drops (so calls already queued behind it change nothing either). Which leaf was
    not finite is left to the per-step replay: here one flag is enough.

    ``undo=False`` (only for ``benchmarks/fit_call_cost.py``, which prices the undo)
    checks without selecting the state back: then the state before the call need
    not be kept, and a failed call's state is not finite.

    Offloaded state is read where it lives, as :func:`check_call` reads it, and kept
    or put back there (:func:`select`): the check moves no whole state in."""
    model0, opt0, guard0 = before
    model, opt, guard = after
    metrics = _norms(metrics)
    ok = guard0.ok[...] & _state_finite(nnx.state((model, opt)), guard0.layout.replicated,
                                        [metrics["loss"], metrics["grad_norm"]])
    if undo:
        nnx.update((model, opt), select(ok, nnx.state((model, opt)), nnx.state((model0, opt0))))
    guard.ok[...] = ok
    # One flag for the call (a call is kept whole or not at all): fit reads it with
    # the metrics, and the per-step replay gives per-step flags when it is False.
    return {**metrics, "applied": ok}


def why_not_finite(host: Mapping[str, np.ndarray], i: int, checked: Sequence[tuple[str, str]]) -> str:
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
