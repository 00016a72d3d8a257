"""Where every piece of optimizer state lives: one rule, used by
:func:`nnx_shard.sharded_optimizer` to build the state and by
:func:`nnx_shard.explain` to report it, so the two can never disagree.

optax mirrors the parameters' tree in its state, and Flax NNX copies each
parameter's metadata (its logical names) onto the state derived from it, so a
state leaf belongs to the parameter whose path ends its own
(``opt_state/0/mu/up/kernel`` -> ``up/kernel``). Its layout:

* shaped like its parameter (Adam's ``mu``/``nu``, momentum, Lion): the
  parameter's logical names, resolved by the rules;
* a reduction of its parameter (Adafactor's factored ``v_row``/``v_col``: a
  dimension removed): the names of the dimensions it kept, when the sizes say
  unambiguously which ones they are (optax itself derives these leaves by
  reducing the parameter, so under Explicit axes they come out laid out this
  way); replicated when ambiguous (a square matrix) or when the kept names do
  not fit the smaller shape. Such leaves are at most a row of their parameter,
  so replicating them costs little;
* anything else (step counts, Adafactor's ``(1,)`` placeholders, state of an
  unannotated parameter): replicated.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from nnx_shard._annotate import SOURCE_KEY, logical_names, path_str
from nnx_shard._errors import ShardingError, UsageError, raise_collected
from nnx_shard._rules import Rules

__all__ = ["StateLeafSpec", "check_transformation", "leaf_specs", "owner_shapes"]

Owners = Mapping[tuple[str, ...], tuple[int, ...]]


class StateLeafSpec(NamedTuple):
    """The decision for one optimizer-state leaf: its spec, the logical names it came
    from and how it was decided."""

    names: tuple[Any, ...] | None  # logical names used (None: replicated, unannotated)
    spec: PartitionSpec
    source: str  # how it was decided, as shown by explain


_REPLICATED = StateLeafSpec(None, PartitionSpec(), "default (replicated)")


def check_transformation(tx: Any, caller: str, arg: str = "tx") -> None:
    """Raises a UsageError unless ``tx`` is an optax transformation (``init`` and ``update``)."""
    if not (callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))):
        raise UsageError(
            f"{caller}: {arg} must be an optax.GradientTransformation, got "
            f"{type(tx).__name__} {tx!r:.60}. Fix: pass the transformation itself, e.g. "
            f"{arg}=optax.adam(1e-3) (not its name, not None)."
        )


def owner_shapes(params: Any) -> dict[tuple[str, ...], tuple[int, ...]]:
    """``{path parts: shape}`` of the parameters the optimizer state derives from."""
    out = {}
    for p, v in nnx.to_flat_state(params):
        value = v.get_value() if isinstance(v, nnx.Variable) else v
        if hasattr(value, "shape"):
            out[tuple(path_str(p).split("/"))] = tuple(value.shape)
    return out


def _owner(parts: tuple[str, ...], owners: Owners) -> tuple[int, ...] | None:
    for start in range(len(parts)):
        if parts[start:] in owners:
            return owners[parts[start:]]
    return None


def kept_names(
    shape: Sequence[int], param_shape: Sequence[int], names: Sequence[Any]
) -> tuple[Any, ...] | None:
    """The names of the parameter dimensions a reduced leaf kept, or ``None`` when
    no choice of kept dimensions matches the sizes, or several give different names.

    >>> kept_names((32,), (32, 64), ("embed", "mlp"))
    ('embed',)
    >>> print(kept_names((64,), (64, 64), ("embed", "mlp")))   # ambiguous
    None
    """
    shape, param_shape = tuple(shape), tuple(param_shape)
    if len(shape) >= len(param_shape) or len(names) != len(param_shape):
        return None
    found = {
        tuple(names[i] for i in dims)
        for dims in itertools.combinations(range(len(param_shape)), len(shape))
        if tuple(param_shape[i] for i in dims) == shape
    }
    return found.pop() if len(found) == 1 else None


def _decide(path: str, leaf: Any, owners: Owners, mesh: Any, rules: Rules) -> StateLeafSpec:
    if not isinstance(leaf, nnx.Variable):
        return _REPLICATED
    value = leaf.get_value()
    if not hasattr(value, "shape"):
        return _REPLICATED  # e.g. multi_transform's MaskedNode: nothing stored
    names = logical_names(leaf, path)
    shape = tuple(value.shape)
    if names is None:
        return _REPLICATED
    param_shape = _owner(tuple(path.split("/")), owners)
    if param_shape is None and len(names) == len(shape):
        param_shape = shape  # owner unknown (e.g. explain on a bare State): as is
    if param_shape == shape:
        source = leaf.get_metadata().get(SOURCE_KEY, "annotation")
        spec = rules.spec(names, shape=shape, mesh=mesh, path=path, allow_unconstrained=False)
        return StateLeafSpec(names, spec, source)
    kept = None if param_shape is None else kept_names(shape, param_shape, names)
    if kept is None:
        return _REPLICATED
    try:
        spec = rules.spec(kept, shape=shape, mesh=mesh, path=path, allow_unconstrained=False)
    except ShardingError:
        return _REPLICATED  # the parameter itself fits; its reduced statistics need not
    return StateLeafSpec(kept, spec, "parameter's kept dims")


def leaf_specs(
    opt_state: Any, owners: Owners, mesh: Any, rules: Rules, prefix: str = "",
    make: Callable[[str, Any, StateLeafSpec], Any] | None = None,
) -> Any:
    """The tree of ``opt_state`` with each leaf replaced by ``make(path, leaf, spec)``
    (default: the :class:`StateLeafSpec`). ``Variable`` leaves are leaves. Every state leaf
    that cannot be laid out is named in one ShardingError.

    >>> import optax
    >>> from nnx_shard._annotate import with_logical
    >>> init = with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> params = nnx.state(nnx.Linear(32, 64, kernel_init=init, rngs=nnx.Rngs(0)), nnx.Param)
    >>> state = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=8).init, params)
    >>> out = leaf_specs(state, owner_shapes(params), {"data": 4, "model": 2},
    ...               Rules({"embed": "data", "mlp": "model"}))
    >>> out[0].v_row["kernel"].spec, out[0].v_col["kernel"].spec, out[0].v_row["bias"].spec
    (P('data',), P('model',), P())
    """
    errors: list[str] = []

    def one(p: Any, leaf: Any) -> Any:
        path = prefix + path_str(p)
        try:
            spec = _decide(path, leaf, owners, mesh, rules)
        except ShardingError as e:
            errors.append(str(e))  # keep going: one run names every piece that needs a fix
            spec = _REPLICATED
        return spec if make is None else make(path, leaf, spec)

    out = jax.tree_util.tree_map_with_path(
        one, opt_state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
    raise_collected(errors, "optimizer-state variables")
    return out
