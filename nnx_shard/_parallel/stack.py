"""A model's Python list of identical blocks as one stacked module, and back.

Most models keep their layers as a list (``self.layers = nnx.List([Block(...) for
_ in range(n)])``). :func:`stack` replaces that list by one module of the block's
class whose every Variable carries a leading layer axis named ``layers`` (what
``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME: "layers"})`` builds), so
that :func:`nnx_shard.pipeline.run` can run it through
:func:`nnx_shard.pipeline.scan`: a ``jax.lax.scan``, or a pipeline over ``stage``
under the pp presets. :func:`unstack` is the inverse. Parameter paths differ
only by the list index (``layers/3/attn/q/kernel`` is row 3 of
``layers/attn/q/kernel``), so a checkpoint of either form is read into that form
and converted.

>>> from flax import nnx
>>> class Net(nnx.Module):
...     def __init__(self, rngs):
...         self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(3)])
>>> net = stack(Net(nnx.Rngs(0)), "layers")
>>> net.layers.kernel.shape, net.layers.kernel.get_metadata()["out_sharding"]
((3, 4, 4), ('layers', None, None))
>>> [layer.kernel.shape for layer in unstack(net, "layers").layers]
[(4, 4), (4, 4), (4, 4)]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnx_shard._errors import ShardingError
from nnx_shard._mesh import shardings

__all__ = ["stack", "unstack"]

M = TypeVar("M")

#: The logical name of the stacked layer axis (the pp presets shard it over ``stage``).
LAYERS = "layers"


def _names(var: nnx.Variable) -> tuple[Any, ...] | None:
    names = var.get_metadata().get("out_sharding")
    return tuple(names) if names else None


def _layout(model: Any, mesh: Any, rules: Any) -> None:
    """Puts the model's arrays where ``rules`` say on ``mesh`` (concrete models)."""
    if mesh is None:
        return
    if rules is None:
        raise ShardingError("stack/unstack: mesh= needs rules= too. Fix: pass the rules the "
                            "model trains with, e.g. rules=strategy.rules.")
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, shardings(state, mesh, rules)))


def stack(model: M, attr: str, *, mesh: Any = None, rules: Any = None) -> M:
    """Replaces the list of identical blocks ``model.<attr>`` (a list, tuple or
    ``nnx.List`` of modules) by one module of the block's class whose Variables are
    the blocks' stacked along a new leading axis, named ``layers`` in their sharding
    metadata; returns ``model``. Use it in the factory (``lambda:
    ns.pipeline.stack(MyModel(cfg, rngs=nnx.Rngs(0)), "layers")``) and run the
    blocks with :func:`nnx_shard.pipeline.run`. The stacked values are exactly the
    blocks' (one compiled init gives the same bits either way).

    With ``mesh`` and ``rules`` (a concrete model, e.g. restored from a checkpoint
    of the list form) the result is laid out by the rules.

    Args:
      model: the model holding the blocks.
      attr: the attribute holding the list of blocks.
      mesh: with ``rules``: lay the stacked Variables out on this mesh.
      rules: the logical-to-mesh table.

    Raises:
      ShardingError: ``model.<attr>`` is not a non-empty list of modules, or the
        blocks differ in structure, static attributes, shapes or dtypes.

    >>> from flax import nnx
    >>> from nnx_shard.pipeline import stack
    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.blocks = nnx.List([nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 3, rngs=rngs)])
    >>> stack(Net(nnx.Rngs(0)), "blocks")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.ShardingError: stack(model, 'blocks'): block 1 differs from block 0 ...
    """
    blocks = getattr(model, attr, None)
    if not isinstance(blocks, list | tuple | nnx.List) or not len(blocks) or not all(
            isinstance(b, nnx.Module) for b in blocks):
        raise ShardingError(
            f"stack(model, {attr!r}): {type(model).__name__}.{attr} is "
            f"{type(blocks).__name__}, not a non-empty list of nnx.Modules. Fix: name the "
            "attribute holding the blocks, e.g. self.layers = nnx.List([Block(...) for _ in "
            "range(n)]) -> stack(model, 'layers').")
    parts = [nnx.split(b) for b in blocks]
    graphdef, first = parts[0]
    flat0 = nnx.to_flat_state(first)
    columns: list[list[Any]] = [[] for _ in flat0]
    for i, (g, state) in enumerate(parts):
        flat = nnx.to_flat_state(state)
        same = g == graphdef and [p for p, _ in flat] == [p for p, _ in flat0] and all(
            np.shape(v.get_value()) == np.shape(v0.get_value())
            and v.get_value().dtype == v0.get_value().dtype
            for (_, v), (_, v0) in zip(flat, flat0, strict=True))
        if not same:
            raise ShardingError(
                f"stack(model, {attr!r}): block {i} differs from block 0 (its structure, "
                "static attributes, shapes or dtypes), so the blocks cannot share one "
                "stacked definition. Fix: stack only identical blocks (keep per-layer "
                "differences as arrays, not Python attributes), or keep the list and a "
                "strategy without pipeline stages.")
        for col, (_, v) in zip(columns, flat, strict=True):
            col.append(v.get_value())
    rows = []
    for (path, v0), col in zip(flat0, columns, strict=True):
        value = jnp.stack(col)
        names = _names(v0)
        names = (LAYERS, *(names or (None,) * (value.ndim - 1)))
        rows.append((path, v0.replace(value, out_sharding=names)))
    setattr(model, attr, nnx.merge(graphdef, nnx.from_flat_state(rows)))
    _layout(model, mesh, rules)
    return model


def unstack(model: M, attr: str, *, mesh: Any = None, rules: Any = None) -> M:
    """The inverse of :func:`stack`: ``model.<attr>`` (a stacked module) becomes an
    ``nnx.List`` of blocks, row ``i`` of every Variable in block ``i``, with the
    leading ``layers`` name dropped from the sharding metadata; returns ``model``.
    With ``mesh`` and ``rules`` the result is laid out by the rules.

    Args:
      model: the model holding the stacked module.
      attr: the attribute holding it.
      mesh: with ``rules``: lay the blocks out on this mesh.
      rules: the logical-to-mesh table.

    >>> from flax import nnx
    >>> from nnx_shard.pipeline import stack, unstack
    >>> class Net(nnx.Module):
    ...     def __init__(self, rngs):
    ...         self.layers = nnx.List([nnx.Linear(2, 2, rngs=rngs) for _ in range(2)])
    >>> net = Net(nnx.Rngs(0))
    >>> k1 = net.layers[1].kernel[...]
    >>> back = unstack(stack(net, "layers"), "layers")
    >>> bool((back.layers[1].kernel[...] == k1).all())
    True
    """
    stacked = getattr(model, attr, None)
    if not isinstance(stacked, nnx.Module):
        raise ShardingError(
            f"unstack(model, {attr!r}): {type(model).__name__}.{attr} is "
            f"{type(stacked).__name__}, not a stacked module. Fix: the attribute stack() "
            "replaced.")
    graphdef, state = nnx.split(stacked)
    flat = nnx.to_flat_state(state)
    counts = {int(np.shape(v.get_value())[0]) for _, v in flat if np.ndim(v.get_value())}
    if len(counts) != 1:
        raise ShardingError(
            f"unstack(model, {attr!r}): the Variables of {attr} disagree on the leading layer "
            f"axis ({sorted(counts)}). Fix: a module built by stack() or nnx.vmap.")
    n = counts.pop()
    blocks = []
    for i in range(n):
        rows = []
        for path, v in flat:
            names = _names(v)
            if names and names[0] == LAYERS:
                names = names[1:]
            meta: Mapping[str, Any] = {"out_sharding": names if any(names or ()) else None}
            rows.append((path, v.replace(v.get_value()[i], **meta)))
        blocks.append(nnx.merge(graphdef, nnx.from_flat_state(rows)))
    setattr(model, attr, nnx.List(blocks))
    _layout(model, mesh, rules)
    return model
