"""Placing arrays on a mesh by rules: one sharding applied to a value, the
``NamedSharding`` of every Variable of a model (:func:`shardings`), and the bytes
per device that placement gives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._annotate import logical_names, path_str
from nnx_shard._axes import entry_axes, mesh_sizes
from nnx_shard._errors import ShardingError, UsageError, raise_collected
from nnx_shard._mesh._build import make_mesh
from nnx_shard._rules import Rules, as_rules

__all__ = ["apply_sharding", "as_state", "bytes_per_device", "nbytes", "shardings",
           "variable_spec"]


def apply_sharding(x: Any, sharding: NamedSharding) -> Any:
    """Lays ``x`` (traced) out by ``sharding``: a ``reshard`` on Explicit meshes (the
    sharding is part of the type there), a sharding constraint on Auto ones."""
    mesh = sharding.mesh
    if mesh.are_all_axes_explicit:
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def as_state(tree: Any, caller: str, arg: str = "tree") -> nnx.State:
    """``nnx.state(tree)`` of a Module, Optimizer or abstract model; an ``nnx.State`` as is.
    Anything else is a UsageError that says what to pass."""
    if isinstance(tree, nnx.State):
        return tree
    if isinstance(tree, nnx.Module | nnx.Optimizer) or nnx.graphlib.is_graph_node(tree):
        return nnx.state(tree)
    raise UsageError(
        f"{caller}: {arg} must be an nnx.Module, an nnx.Optimizer, an nnx.State or an abstract "
        f"model, got {type(tree).__name__} {tree!r:.60}. Fix: pass the model, e.g. "
        f"{caller}(model, mesh, rules), or nnx.eval_shape(lambda: MyModel(cfg, rngs=nnx.Rngs(0))) "
        "to plan without allocating."
    )


def variable_spec(var: Any, mesh: Any, rules: Rules, path: str = "") -> PartitionSpec:
    """The validated ``PartitionSpec`` of one Variable (``P()`` when unannotated)."""
    names = logical_names(var, path)
    if names is None:
        return PartitionSpec()
    shape = getattr(var.get_value(), "shape", None)
    return rules.spec(names, shape=shape, mesh=mesh, path=path, allow_unconstrained=False)


def shardings(tree: Any, mesh: Mesh, rules: Rules | Mapping[str, Any]) -> Any:
    """A ``NamedSharding`` for every Variable, validated against mesh and shapes.

    ``tree`` is a Module, an ``nnx.State`` or an abstract model (from
    ``nnx.eval_shape``). The result has the structure of ``nnx.state(tree)``:
    each Variable holds its ``NamedSharding`` (as ``nnx.get_named_sharding``
    does), so it can be passed as ``out_shardings`` to ``jax.jit`` for that state.
    Unannotated Variables are replicated.

    Args:
      tree: a Module, an ``nnx.State`` or an abstract model.
      mesh: the mesh the shardings are on.
      rules: the logical-to-mesh table.

    >>> from flax import nnx
    >>> from nnx_shard import Rules, make_mesh, shardings
    >>> from nnx_shard._annotate import with_logical
    >>> init = with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> model = nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0))
    >>> s = shardings(model, make_mesh("data=4,model=2"), Rules({"embed": "data", "mlp": "model"}))
    >>> s["kernel"].get_value().spec, s["bias"].get_value().spec
    (P('data', 'model'), P())
    """
    state = as_state(tree, "shardings")
    mesh = make_mesh(mesh)
    rules = as_rules(rules)

    errors: list[str] = []

    def one(path: Any, leaf: Any) -> Any:
        if isinstance(leaf, nnx.Variable):
            try:
                spec = variable_spec(leaf, mesh, rules, path_str(path))
            except ShardingError as e:
                # Keep going: one run should show every parameter that needs a fix.
                errors.append(str(e))
                spec = PartitionSpec()
            return leaf.replace(NamedSharding(mesh, spec))
        return NamedSharding(mesh, PartitionSpec())

    out = jax.tree_util.tree_map_with_path(
        one, state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    raise_collected(errors)
    return out


_SUB_BYTE = {"int4": 4, "uint4": 4, "int2": 2, "uint2": 2, "float4_e2m1fn": 4}


def nbytes(shape: Sequence[int], dtype: Any) -> int:
    """Bytes of an unsharded array; PRNG key dtypes (``key<fry>``) included."""
    # jax key dtypes are not NumPy dtypes but carry their own itemsize.
    itemsize = dtype.itemsize if hasattr(dtype, "itemsize") else np.dtype(dtype).itemsize
    n = int(np.prod(shape, dtype=np.int64))
    bits = _SUB_BYTE.get(str(dtype))
    if bits is not None:  # int4 and the like are stored packed, two (or more) to a byte
        return -(-n * bits // 8)
    return n * int(itemsize)


def bytes_per_device(shape: Sequence[int], dtype: Any, spec: PartitionSpec, mesh: Any) -> int:
    """Bytes one device holds of an array laid out by ``spec`` on ``mesh``."""
    sizes = mesh_sizes(mesh)
    n = nbytes(shape, dtype)
    div = 1
    for entry in spec:
        for axis in entry_axes(entry):
            div *= sizes[axis]
    return n // div
