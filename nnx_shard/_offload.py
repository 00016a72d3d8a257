"""Host offload: arrays kept in host memory (``pinned_host``) between steps.

A strategy's :attr:`~nnx_shard.strategies.Strategy.offload` names what lives there:
``"optimizer"`` (the optimizer state) or ``"optimizer+params"`` (the parameters
too). :func:`nnx_shard.sharded_optimizer` and :func:`nnx_shard.sharded_init` place
those arrays with their usual ``NamedSharding`` in ``memory_kind="pinned_host"``;
the fused call (:func:`nnx_shard.multistep`, ``Trainer``) reads the memory kind
from the arrays and keeps them in host memory in its K-step loop's carry: each
step moves them to device memory (a ``jax.device_put`` under ``jit``) where it
uses them and back at its end, so its outputs keep the host shardings and the
next call is given them the same way.

When each array arrives: a step of :func:`nnx_shard.multistep` moves the whole
offloaded state in at its start (unless fused with ``stream_offload=True``: it then
moves as ``Trainer``'s, its update made by :func:`nnx_shard.apply_gradients`).
``Trainer``'s steps move offloaded parameters in
at step start (the forward pass reads them) and the optimizer state only once the
gradients exist (:func:`arrive_after`: an ``optimization_barrier`` ties the host
arrays to the gradients, so XLA cannot schedule their host-to-device copy before
the backward pass ends). The device then holds the optimizer state during the
update only, never during the forward and backward passes; with scanned layers and
an element-wise optimizer not even all of it then: the update streams the stacked
state a layer at a time (``nnx_shard._train._stream``).

With ``"optimizer+params"`` and such a streaming update, the stacked parameters stream
too (``streams_params`` in ``nnx_shard._train._stream``): the step moves in only the
parameters that are not stacked, ``nnx_shard.pipeline.scan`` moves one layer's slice
in per turn of its loop (a ``jax.checkpoint`` that keeps nothing but its inputs, so
the backward pass moves it in again rather than keeping every layer's copy), the
stacked gradients come back in host memory and the gradient norm, the NaN guard's
check and the update read them a layer at a time. Not with more than one microbatch,
a pipeline, a ``gradients`` layout option (zero2) or an update that does not stream:
the parameters then move in whole at step start, as they do for a
:func:`nnx_shard.multistep` step not fused with ``stream_offload=True``. The NaN guard's
per-step replay moves them as the call does, and its checks read host state where it
lives (a stacked leaf a layer at a time).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding

from nnx_shard._errors import UsageError

__all__ = ["DEVICE", "HOST", "arrive", "arrive_after", "check_host_memory", "host_rows",
           "host_sharding", "host_where", "is_host", "moves_offloaded", "offloads", "on_device",
           "owns_moves", "to_host", "traced_host", "traced_on_device"]

#: The memory kind offloaded arrays live in between steps.
HOST = "pinned_host"
#: The memory kind they are moved to inside the compiled step.
DEVICE = "device"


def offloads(strategy: Any) -> tuple[bool, bool]:
    """``(optimizer state offloaded, parameters offloaded)`` for a strategy (anything
    with an ``offload`` attribute; ``None`` or a plain rules table offloads nothing).

    >>> from nnx_shard.strategies import get
    >>> offloads(get("fsdp")), offloads(get("fsdp", offload="optimizer+params"))
    ((False, False), (True, True))
    """
    what = getattr(strategy, "offload", None)
    return what in ("optimizer", "optimizer+params"), what == "optimizer+params"


def check_host_memory(caller: str, offload: str | None) -> None:
    """Raises a UsageError if this backend's devices have no ``pinned_host`` memory
    to offload to (JAX's CPU, GPU and TPU backends have it).

    >>> check_host_memory("sharded_optimizer", "optimizer")
    """
    kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    if HOST not in kinds:
        raise UsageError(
            f"{caller}: the strategy offloads {offload!r} to host memory ({HOST!r}), which "
            f"{jax.devices()[0].platform} devices do not have (their memories: "
            f"{', '.join(sorted(kinds))}). Fix: the strategy without offload, "
            "strategy.with_offload(None).")


def is_host(sharding: Any) -> bool:
    """Whether ``sharding`` places its array in host memory.

    >>> from jax.sharding import PartitionSpec as P
    >>> s = NamedSharding(jax.make_mesh((8,), ("data",)), P("data"))
    >>> is_host(s), is_host(host_sharding(s)), is_host(None)
    (False, True, False)
    """
    return getattr(sharding, "memory_kind", None) == HOST


def host_sharding(sharding: NamedSharding) -> NamedSharding:
    """``sharding`` with its array in host memory (``pinned_host``)."""
    return sharding.with_memory_kind(HOST)


def on_device(sharding: Any) -> Any:
    """``sharding`` in device memory if it is a host sharding, else itself."""
    return sharding.with_memory_kind(DEVICE) if is_host(sharding) else sharding


def to_host(values: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """Inside ``jit``: every value whose sharding is a host one moved into it (memory
    kind and layout); the others as they are."""
    return [jax.device_put(x, s) if is_host(s) else x
            for x, s in zip(values, shardings, strict=True)]


def traced_host(x: Any) -> bool:
    """Inside ``jit``: whether the traced value ``x``'s type says host memory."""
    return isinstance(x, jax.Array) and (
        getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host)


def traced_on_device(x: jax.Array) -> jax.Array:
    """Inside ``jit``: ``x`` in device memory if its type says host memory (read from
    the traced value itself, for code that is not given the shardings), else ``x``."""
    if traced_host(x):
        return jax.device_put(x, jax.memory.Space.Device)
    return x


def host_rows(x: jax.Array, fn: Any) -> jax.Array:
    """Inside ``jit``: ``fn`` of each slice of the leading (layer) axis of ``x``, an
    array in host memory, computed on the device with one slice moved in per turn of
    a ``jax.lax.scan`` (so the device never holds ``x`` whole); the results stacked.

    >>> import jax.numpy as jnp
    >>> host_rows(jnp.arange(6.0).reshape(3, 2), jnp.sum).tolist()
    [1.0, 5.0, 9.0]
    """
    def turn(_: None, row: jax.Array) -> tuple[None, jax.Array]:
        return None, fn(traced_on_device(row))

    _, out = jax.lax.scan(turn, None, x)
    return out


def arrive(node: Any) -> None:
    """Inside ``jit``: moves ``node``'s Variables whose values are in host memory to
    device memory, in place (on the traced copy the step was given)."""
    state = nnx.state(node)
    leaves, treedef = jax.tree.flatten(state)
    if any(map(traced_host, leaves)):
        nnx.update(node, jax.tree.unflatten(treedef, [traced_on_device(x) for x in leaves]))


def arrive_after(node: Any, ready: Any) -> Any:
    """Inside ``jit``: :func:`arrive` for ``node`` (an optimizer), scheduled after
    ``ready`` (the gradients) exists; returns ``ready``.

    The host arrays and ``ready`` go through one ``jax.lax.optimization_barrier``
    and the device copies are made of the barrier's outputs: a copy cannot start
    before its operand exists, and the barrier's outputs exist only once all its
    operands do, so no host-to-device copy of the state can be scheduled before the
    backward pass that computes ``ready`` ends. (Moving first and tying the device
    copies to ``ready`` would not: XLA may still run the copy early and keep its
    result.) Nothing in host memory: ``node`` and ``ready`` are left as they are.
    """
    state = nnx.state(node)
    leaves, treedef = jax.tree.flatten(state)
    where = [i for i, x in enumerate(leaves) if traced_host(x)]
    if not where:
        return ready
    tied, ready = jax.lax.optimization_barrier(([leaves[i] for i in where], ready))
    for i, x in zip(where, tied, strict=True):
        leaves[i] = jax.device_put(x, jax.memory.Space.Device)
    nnx.update(node, jax.tree.unflatten(treedef, leaves))
    return ready


#: The attribute a step function carries when it moves offloaded state in itself
#: (:func:`arrive`, :func:`arrive_after`): the fused call then only moves it back.
_OWN_MOVES = "_nnx_shard_moves_offloaded"


def moves_offloaded(step: Any) -> Any:
    """Marks ``step`` as moving the offloaded state to the devices itself; returns it."""
    setattr(step, _OWN_MOVES, True)
    return step


def owns_moves(step: Any) -> bool:
    """Whether ``step`` was marked by :func:`moves_offloaded`."""
    return bool(getattr(step, _OWN_MOVES, False))


def host_where(tree: Any, keep: Any) -> Any:
    """``tree`` (a state of ``NamedSharding`` leaves, as ``nnx_shard.shardings`` gives)
    with the leaves of the Variables ``keep(variable)`` accepts moved to host memory."""

    def one(var: Any) -> Any:
        if isinstance(var, nnx.Variable):
            value = var.get_value()
            if isinstance(value, NamedSharding) and keep(var):
                return var.replace(host_sharding(value))
            return var
        return host_sharding(var) if isinstance(var, NamedSharding) and keep(var) else var

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
