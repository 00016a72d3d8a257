"""Host offload: arrays kept in host memory (``pinned_host``) between steps.

A strategy's :attr:`~nnx_shard.strategies.Strategy.offload` names what lives there:
``"optimizer"`` (the optimizer state) or ``"optimizer+params"`` (the parameters
too). :func:`nnx_shard.sharded_optimizer` and :func:`nnx_shard.sharded_init` place
those arrays with their usual ``NamedSharding`` in ``memory_kind="pinned_host"``;
the fused call (:func:`nnx_shard.multistep`, ``Trainer``) reads the memory kind
from the arrays, moves them to device memory inside its compiled program
(:func:`to_device`, a ``jax.device_put`` under ``jit``), runs the steps, and moves
the results back (:func:`to_host`), so its outputs keep the host shardings and
the next call is given them the same way.

The move is of the whole state at the start of the call: device memory holds the
offloaded arrays only while the call runs, and none of them between calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding

from nnx_shard._errors import UsageError

__all__ = ["DEVICE", "HOST", "check_host_memory", "host_sharding", "host_where", "is_host", "offloads", "on_device",
           "to_device", "to_host", "traced_on_device"]

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


def to_device(values: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """Inside ``jit``: every value whose sharding is a host one moved to device memory
    with the same layout; the others as they are."""
    return [jax.device_put(x, on_device(s)) if is_host(s) else x
            for x, s in zip(values, shardings, strict=True)]


def to_host(values: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
    """Inside ``jit``: the inverse of :func:`to_device`."""
    return [jax.device_put(x, s) if is_host(s) else x
            for x, s in zip(values, shardings, strict=True)]


def traced_on_device(x: jax.Array) -> jax.Array:
    """Inside ``jit``: ``x`` in device memory if its type says host memory (read from
    the traced value itself, for code that is not given the shardings), else ``x``."""
    if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Device)
    return x


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
