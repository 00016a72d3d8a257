"""Logical axis annotations, stored as Flax's own ``out_sharding`` Variable metadata.

Three ways in: wrap an initializer (:func:`with_logical`), decorate a module
class (:func:`logical_axes`), or match parameter paths of a model that carries
no annotations (:func:`annotate`). All three write the logical names to
``out_sharding`` so ``nnx.get_partition_spec`` and models annotated with
``nnx.with_partitioning`` keep working.

They also set ``eager_sharding=False`` on the Variable: logical names are not
mesh axes, and Flax would otherwise try to shard the value with them the moment
the Variable (or an optimizer state copied from it) is created, failing outside
a mesh. Resolution to mesh axes happens only through :class:`nnx_shard.Rules`.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnx_shard._errors import ShardingError, UsageError, short

__all__ = ["annotate", "get_logical_axes", "logical_axes", "logical_names", "with_logical"]

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)

#: Metadata key recording how a Variable got its logical names (shown by ``explain``).
SOURCE_KEY = "logical_source"

# Metadata keys Flax itself (or nnx_shard) uses; anything else close to
# 'out_sharding' is almost certainly a typo that Flax would silently ignore.
_KNOWN_KEYS = frozenset(
    {
        "out_sharding",
        "optimizer_sharding",
        "sharding_rules",
        "eager_sharding",
        "mesh",
        "hijax",
        "ref",
        "on_get_value",
        "on_set_value",
        "on_create_value",
        "on_add_axis",
        "on_remove_axis",
        SOURCE_KEY,
    }
)
_LOOKALIKES = ("out_sharding", "sharding", "sharding_names", "logical_axes", "partition")


def path_str(path: Sequence[Any]) -> str:
    """'layers/0/kernel' from a key path of jax keys or plain strings/ints."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                k = getattr(k, attr)
                break
        parts.append(str(k))
    return "/".join(parts)


def _check_names(names: Any, where: str) -> tuple[str | None, ...]:
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ShardingError(
            f"{where}: logical axes must be a tuple with one name (or None) per dimension, "
            f"got {names!r}. Fix: e.g. ('embed', 'mlp')."
        )
    for i, n in enumerate(names):
        if not (n is None or (isinstance(n, str) and n)):
            raise ShardingError(
                f"{where}: logical axes {tuple(names)!r}: entry {i} is {n!r} "
                f"({type(n).__name__}); names must be non-empty strings or None. "
                "Fix: e.g. ('embed', None)."
            )
    return tuple(names)


def _check_metadata_keys(metadata: Mapping[str, Any], where: str) -> None:
    for key in metadata:
        if key in _KNOWN_KEYS:
            continue
        if difflib.get_close_matches(key, _LOOKALIKES, n=1, cutoff=0.75):
            raise ShardingError(
                f"{where}: metadata key {key!r} looks like a misspelling of 'out_sharding'; "
                "Flax ignores unknown keys, so this annotation would have no effect. "
                f"Fix: rename {key!r} to 'out_sharding' (or use nnx_shard.with_logical)."
            )


def with_logical(initializer: F, names: Sequence[str | None], **metadata: Any) -> F:
    """Wraps an initializer so the Variable it creates carries logical axis names.

    Args:
      initializer: any ``jax.nn.initializers``-style callable.
      names: one logical name (or ``None``) per dimension of the value.
      **metadata: extra Variable metadata passed through to Flax.

    >>> from flax import nnx
    >>> from nnx_shard import with_logical
    >>> init = with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> layer = nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))
    >>> layer.kernel.get_metadata("out_sharding")
    ('embed', 'mlp')
    """
    names_t = _check_names(names, "with_logical")
    _check_metadata_keys(metadata, "with_logical")
    if not callable(initializer):
        raise UsageError(f"with_logical: initializer must be callable, got {short(initializer, 80)}. "
                         "Fix: e.g. with_logical(nnx.initializers.lecun_normal(), ('embed', 'mlp'))")
    return nnx.with_metadata(
        initializer, out_sharding=names_t, eager_sharding=False, **metadata
    )


def _relabel(var: nnx.Variable, names: tuple[str | None, ...], source: str) -> nnx.Variable:
    """A copy of ``var`` whose metadata holds ``names`` (Flax forbids flipping
    ``eager_sharding`` in place, so the Variable is rebuilt)."""
    md = dict(var.get_metadata())
    md.update(out_sharding=names, eager_sharding=False)
    md[SOURCE_KEY] = source
    return type(var)(var.get_value(), **md)


def _check_rank(var: nnx.Variable, names: tuple[Any, ...], where: str) -> None:
    shape = getattr(var.get_value(), "shape", None)
    if shape is not None and len(shape) != len(names):
        raise ShardingError(
            f"{where} (shape {tuple(shape)}, logical axes {names!r}): {len(names)} names for "
            f"an array of rank {len(shape)}. Fix: give one logical name (or None) per dimension."
        )


def logical_axes(**names: Sequence[str | None]) -> Callable[[C], C]:
    """Class decorator: every instance gets logical names on the named Variables.

    Each keyword is an attribute holding a Variable after ``__init__``; attributes
    that are ``None`` (e.g. ``bias`` with ``use_bias=False``) are skipped.

    Args:
      **names: attribute name -> the logical names of its Variable's dimensions.

    >>> from flax import nnx
    >>> from nnx_shard import logical_axes
    >>> @logical_axes(kernel=("embed", "mlp"), bias=("mlp",))
    ... class Up(nnx.Linear):
    ...     pass
    >>> Up(4, 8, rngs=nnx.Rngs(0)).kernel.get_metadata("out_sharding")
    ('embed', 'mlp')
    """
    checked = {attr: _check_names(n, f"logical_axes({attr}=...)") for attr, n in names.items()}

    def decorate(cls: C) -> C:
        if not isinstance(cls, type):
            raise UsageError(f"logical_axes decorates a class, got {short(cls, 80)}. Fix: put "
                             "@ns.logical_axes(...) above a class statement")
        original_init = cls.__init__  # type: ignore[misc]  # the class's own, read once

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            for attr, attr_names in checked.items():
                where = f"{type(self).__name__}.{attr}"
                if not hasattr(self, attr):
                    known = [k for k, v in vars(self).items() if isinstance(v, nnx.Variable)]
                    close = difflib.get_close_matches(attr, known, n=1)
                    hint = f" Did you mean {close[0]!r}?" if close else ""
                    raise ShardingError(
                        f"logical_axes({attr}=...) on {cls.__name__}: the instance has no "
                        f"attribute {attr!r}.{hint} Variables it has: {', '.join(known) or 'none'}."
                    )
                var = getattr(self, attr)
                if var is None:
                    continue
                if not isinstance(var, nnx.Variable):
                    raise ShardingError(
                        f"logical_axes({attr}=...) on {cls.__name__}: {where} is a "
                        f"{type(var).__name__}, not an nnx.Variable. Fix: name a parameter "
                        "attribute such as 'kernel'."
                    )
                _check_rank(var, attr_names, where)
                setattr(self, attr, _relabel(var, attr_names, "annotation"))

        __init__.__wrapped__ = original_init  # type: ignore[attr-defined]
        __init__.__doc__ = original_init.__doc__
        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return decorate


def _flat_variables(tree: Any) -> list[tuple[str, nnx.Variable]]:
    state = tree if isinstance(tree, nnx.State) else nnx.state(tree)
    leaves = jax.tree_util.tree_flatten_with_path(
        state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )[0]
    return [(path_str(p), v) for p, v in leaves if isinstance(v, nnx.Variable)]


def annotate(
    model: Any,
    patterns: Mapping[str, Sequence[str | None]],
    *,
    strict: bool = False,
) -> Any:
    """Annotates a model that carries no logical names, by path patterns.

    Each pattern is a regular expression searched (``re.search``) in the
    slash-joined path of each Variable, e.g. ``layers/0/kernel``; anchor it with
    ``^...$`` for an exact match. The first matching pattern wins and replaces any
    existing annotation. The model is updated in place and returned.

    Args:
      model: an ``nnx.Module``, concrete or abstract (from ``nnx.eval_shape``);
        not a factory: call ``annotate`` inside it instead.
      patterns: ``{regex: logical names}``, tried in order.
      strict: raise a ``ShardingError`` listing every parameter (``nnx.Param``)
        that no pattern matched and has no annotation, and every pattern that
        matched nothing.

    >>> from flax import nnx
    >>> from nnx_shard import annotate
    >>> model = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)))
    >>> _ = annotate(model, {r"kernel$": ("embed", "mlp"), r"bias$": ("mlp",)}, strict=True)
    >>> model.layers[0].kernel.get_metadata("out_sharding")
    ('embed', 'mlp')
    """
    if not nnx.graph.is_graph_node(model):
        what = "a function" if callable(model) else type(model).__name__
        raise UsageError(
            f"annotate: model must be an nnx.Module (concrete, or abstract from "
            f"nnx.eval_shape), got {what} ({model!r:.80}). annotate relabels the Variables "
            "of a module that exists. Fix: annotate the built module inside your factory, "
            "e.g. ns.sharded_init(lambda: ns.annotate(MyModel(rngs=nnx.Rngs(0)), patterns), "
            "mesh, rules), or an abstract one: "
            "ns.annotate(nnx.eval_shape(lambda: MyModel(rngs=nnx.Rngs(0))), patterns)."
        )
    if not isinstance(patterns, Mapping):
        raise ShardingError(
            f"annotate: patterns must be a dict of {{regex: logical names}}, got "
            f"{type(patterns).__name__} ({patterns!r:.80}). Fix: e.g. "
            "{'kernel': ('embed', 'mlp'), 'bias': ('mlp',)}")
    compiled = []
    for pattern, names in patterns.items():
        try:
            rx = re.compile(pattern)
        except re.error as e:
            raise ShardingError(f"annotate: pattern {pattern!r} is not a valid regex: {e}") from e
        compiled.append((pattern, rx, _check_names(names, f"annotate pattern {pattern!r}")))
    used: set[str] = set()
    unmatched: list[str] = []
    updates: dict[tuple[str, ...], nnx.Variable] = {}
    state = nnx.state(model)
    for path, var in _flat_variables(state):
        for pattern, rx, names in compiled:
            if rx.search(path):
                used.add(pattern)
                _check_rank(var, names, f"parameter {path!r} matched by pattern {pattern!r}")
                updates[tuple(path.split("/"))] = _relabel(var, names, "pattern")
                break
        else:
            if isinstance(var, nnx.Param) and logical_names(var, path) is None:
                unmatched.append(f"{path} {tuple(getattr(var.get_value(), 'shape', ()))}")
    unused = [p for p, _, _ in compiled if p not in used]
    if strict and (unmatched or unused):
        lines = []
        if unmatched:
            lines.append("parameters no pattern matched: " + ", ".join(unmatched))
        if unused:
            lines.append("patterns that matched nothing: " + ", ".join(map(repr, unused)))
        raise ShardingError(
            "annotate(strict=True): " + "; ".join(lines) + ". Fix: add or correct patterns "
            "(they are searched in slash-joined paths such as 'layers/0/kernel')."
        )
    if updates:
        flat = nnx.to_flat_state(state)
        new_items = [
            (p, updates.get(tuple(str(k) for k in p), v)) for p, v in flat
        ]
        nnx.update(model, nnx.from_flat_state(new_items))
    return model


def logical_names(var: nnx.Variable, path: str = "") -> tuple[Any, ...] | None:
    """The logical names stored on ``var`` (``None`` when unannotated).

    Accepts what Flax accepts in ``out_sharding``: a tuple, a ``PartitionSpec``
    or a ``NamedSharding``; checks for misspelled metadata keys on the way.
    """
    md = var.get_metadata()
    shape = getattr(var.get_value(), "shape", None)
    where = f"parameter {path!r}" if path else type(var).__name__
    _check_metadata_keys(md, where if shape is None else f"{where} (shape {tuple(shape)})")
    names = md.get("out_sharding")
    if not names:
        return None
    if isinstance(names, NamedSharding):
        names = names.spec
    if isinstance(names, PartitionSpec):
        return tuple(names)
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ShardingError(
            f"parameter {path!r}: out_sharding metadata {names!r} is not a tuple of logical "
            "names. Fix: e.g. out_sharding=('embed', 'mlp')."
        )
    return tuple(names)


def get_logical_axes(tree: Any) -> nnx.State:
    """The logical names of every Variable, as an ``nnx.State`` of tuples
    (``None`` where a Variable is unannotated).

    Args:
      tree: a Module, an ``nnx.State`` or an abstract model.

    >>> from flax import nnx
    >>> from nnx_shard import get_logical_axes, with_logical
    >>> init = with_logical(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    >>> axes = get_logical_axes(nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0)))
    >>> axes["kernel"], axes["bias"]
    (('embed', 'mlp'), None)
    """
    if not isinstance(tree, nnx.State) and not nnx.graph.is_graph_node(tree):
        raise UsageError(
            f"get_logical_axes: tree must be an nnx.Module or nnx.State, got "
            f"{type(tree).__name__} ({tree!r:.80}). Fix: pass the model, or nnx.state(model)")
    state = tree if isinstance(tree, nnx.State) else nnx.state(tree)
    flat = nnx.to_flat_state(state)
    return nnx.from_flat_state(
        [(p, logical_names(v, path_str(p)) if isinstance(v, nnx.Variable) else None) for p, v in flat]
    )
