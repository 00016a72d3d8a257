"""Rule values: placements as tables write them, their public and printed forms,
the checks of logical names, shapes and meshes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias

import numpy as np
from jax.sharding import PartitionSpec

from nnx_shard._axes import mesh_sizes, sizes_str
from nnx_shard._errors import ShardingError, short

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED
if TYPE_CHECKING:
    # The singleton's class is private to jax; checks read `is UNCONSTRAINED`.
    _Unconstrained: TypeAlias = Any
else:
    _Unconstrained = type(UNCONSTRAINED)

#: One placement: the mesh axes a dimension is sharded over (``()`` replicates), or
#: ``PartitionSpec.UNCONSTRAINED``.
Placement: TypeAlias = tuple[str, ...] | _Unconstrained
RuleValue: TypeAlias = (
    str | tuple[str, ...] | list[str | tuple[str, ...] | None] | _Unconstrained | None
)  # a list only as Fallbacks(...): a plain list is ambiguous and refused
LogicalNames: TypeAlias = Sequence[str | None]
Indivisible = Literal["error", "replicate"]

def _product(axes: tuple[Any, ...], logical: str, shown: Any, fix: str) -> tuple[str, ...]:
    """Validates a product of mesh axes (``shown`` is the value as the user wrote it)."""
    for a in axes:
        if a == "":
            raise ShardingError(
                f"rule {short(logical)} -> {short(shown)}: an empty string is not a mesh axis name. "
                f"Fix: name a mesh axis, or use None to replicate, e.g. {fix}."
            )
        if not isinstance(a, str):
            raise ShardingError(
                f"rule {short(logical)} -> {short(shown)}: a product of mesh axes must list mesh "
                f"axis names (strings), got {short(a)}. Fix: e.g. {fix}."
            )
    if len(set(axes)) != len(axes):
        raise ShardingError(
            f"rule {short(logical)} -> {short(shown)} names a mesh axis twice. "
            f"Fix: list each mesh axis once, e.g. {short(tuple(dict.fromkeys(axes)))}."
        )
    return tuple(axes)


class Fallbacks(list[Any]):
    """Ordered fallback placements of one logical name, for ``Rules({...})``: the first
    that fits the mesh and the dimension wins, the others are tried in turn.

    The same table as Flax and MaxText spell it, a repeated ``(logical, mesh)`` pair
    per candidate: ``Rules({"mlp": Fallbacks("model", None)})`` equals
    ``Rules.from_pairs([("mlp", "model"), ("mlp", None)])``. Each placement is a mesh
    axis name, a tuple of mesh axis names (their product), ``None`` (replicate) or
    ``PartitionSpec.UNCONSTRAINED``. A plain list is refused in ``Rules({...})``,
    because Flax reads a list as a product of mesh axes.

    Args:
      *placements: the candidates in order: a mesh axis, a tuple of mesh axes, ``None`` or
        ``PartitionSpec.UNCONSTRAINED``.

    >>> from nnx_shard import Fallbacks
    >>> from nnx_shard._rules import Rules
    >>> r = Rules({"mlp": Fallbacks("model", None)})
    >>> r["mlp"], r.spec(("mlp",), shape=(30,), mesh={"model": 4})
    (Fallbacks('model', None), P(None,))
    """

    def __init__(self, *placements: Any) -> None:
        super().__init__(placements)

    def __repr__(self) -> str:
        return "Fallbacks(" + ", ".join(fmt_value(c) for c in self) + ")"


def _placement(value: Any, logical: str) -> Placement:
    """One placement as ``Rules({...})`` writes it: str | tuple[str, ...] | None | UNCONSTRAINED."""
    fix = f"Rules({{{short(logical)}: None}})"
    if value is None:
        return ()
    if value is UNCONSTRAINED:
        return UNCONSTRAINED
    if isinstance(value, str):
        if not value:
            raise ShardingError(
                f"rule {short(logical)} -> '': an empty string is not a mesh axis name (it would "
                f"silently replicate). Fix: use None to replicate, e.g. {fix}."
            )
        return (value,)
    if isinstance(value, tuple):
        return _product(value, logical, value, fix)
    if isinstance(value, list):
        raise _ambiguous_list(value, logical)
    raise ShardingError(
        f"rule {short(logical)} -> {short(value)}: a rule value must be a mesh axis name, a "
        "tuple of mesh axis names (their product), None (replicate), "
        "PartitionSpec.UNCONSTRAINED or nnx_shard.Fallbacks(...) of those (ordered "
        f"candidates). Fix: e.g. Rules({{{short(logical)}: 'model'}}) or {fix}."
    )


def _ambiguous_list(value: list[Any], logical: str) -> ShardingError:
    """A list rule value: Flax and MaxText read it as a product of mesh axes, older
    tables of ours as ordered fallbacks; guessing either would shard silently wrong."""
    shown = [None if v == "" else v for v in value[:4]]
    inner = ", ".join(fmt_value(v) if v is UNCONSTRAINED else short(v, 40)
                      for v in shown) or "'model'"
    prod = tuple(v for v in shown if isinstance(v, str) and v) or ("data", "fsdp")
    return ShardingError(
        f"rule {short(logical)} -> {short(value)}: a list is ambiguous in Rules({{...}}) (Flax "
        "and MaxText read it as a product of mesh axes, it used to mean ordered fallbacks). "
        f"Fix: write a product of mesh axes as a tuple, Rules({{{short(logical)}: {short(prod)}}}), "
        f"or ordered fallbacks as Rules({{{short(logical)}: nnx_shard.Fallbacks({inner})}}) "
        "(the same as repeating the pair in Rules.from_pairs)."
    )


def placement_candidates(value: Any, logical: str) -> tuple[Placement, ...]:
    if isinstance(value, Fallbacks):
        if not value:
            raise ShardingError(
                f"rule {short(logical)} -> Fallbacks(): an empty fallback list can never fit. "
                f"Fix: use None to replicate, e.g. Rules({{{short(logical)}: None}})."
            )
        for v in value:
            if isinstance(v, list):
                raise ShardingError(
                    f"rule {short(logical)} -> {value!r}: a fallback must be one placement, got "
                    f"the list {short(v)}. Fix: a tuple for a product of mesh axes, e.g. "
                    f"Fallbacks({tuple(v)!r}, None)."
                )
        return tuple(_placement(v, logical) for v in value)
    return (_placement(value, logical),)


def pair_placement(value: Any, logical: str) -> Placement:
    """One placement as Flax / MaxText write it: a list or tuple is a product of axes."""
    if value is None or (isinstance(value, str | list | tuple) and len(value) == 0):
        return ()
    if value is UNCONSTRAINED:
        return UNCONSTRAINED
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Fallbacks):
        raise ShardingError(
            f"rule {short(logical)} -> {value!r}: in a table of [logical, mesh] pairs a "
            "fallback is a repeated pair, not Fallbacks(...). Fix: e.g. "
            f"[[{short(logical)}, 'model'], [{short(logical)}, None]]."
        )
    if isinstance(value, list | tuple):
        fix = f"[{short(logical)}, ['data', 'fsdp']] or [{short(logical)}, None]"
        return _product(tuple(value), logical, value, fix)
    raise ShardingError(
        f"rule {short(logical)} -> {short(value)}: in a table of [logical, mesh] pairs the mesh "
        "side must be a mesh axis name, a list or tuple of mesh axis names (their product), "
        f"None / [] / '' (replicate) or PartitionSpec.UNCONSTRAINED. "
        f"Fix: e.g. [{short(logical)}, 'model'] or [{short(logical)}, ['data', 'fsdp']]."
    )


def one_placement(p: Placement) -> str | tuple[str, ...] | _Unconstrained | None:
    """The public form of one placement: None, an axis name, a tuple, or UNCONSTRAINED."""
    if p is UNCONSTRAINED:
        return UNCONSTRAINED
    if not p:
        return None
    return p[0] if len(p) == 1 else p


def public_value(cands: tuple[Placement, ...]) -> RuleValue:
    if len(cands) == 1:
        return one_placement(cands[0])
    return Fallbacks(*(one_placement(c) for c in cands))


def check_logical(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ShardingError(
            f"logical axis name {short(name)} ({type(name).__name__}) in a rules table: "
            "logical names must be non-empty strings. Fix: e.g. Rules({'embed': 'fsdp'})."
        )
    return name


def mesh_axis_sizes(mesh: Any) -> dict[str, int]:
    """Axis name -> size for a jax Mesh / AbstractMesh or a plain mapping (anything else
    is the ShardingError of :func:`~nnx_shard._axes.mesh_sizes`)."""
    return mesh_sizes(mesh)


def fmt_mesh(sizes: Mapping[str, int]) -> str:
    return sizes_str(sizes, ", ", "no axes")


def fmt_value(v: Any) -> str:
    """repr() of a rule value, with UNCONSTRAINED written as code that builds it."""
    if v is UNCONSTRAINED:
        return "P.UNCONSTRAINED"
    if isinstance(v, Fallbacks):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(fmt_value(c) for c in v) + "]"
    return repr(v)


def describe(path: str, shape: Sequence[int] | None, names: Any) -> str:
    """The phrase that opens every error about one array."""
    what = f"parameter {short(path)}" if path else "array"
    parts = []
    if shape is not None:
        shown = tuple(shape) if isinstance(shape, list | tuple) else shape
        parts.append(f"shape {short(shown)}")
    parts.append(f"logical axes {short(tuple(names) if isinstance(names, list) else names)}")
    return f"{what} ({', '.join(parts)})"


def check_shape(shape: Any, path: str, names: Any) -> tuple[int, ...] | None:
    """``shape`` as a tuple of sizes; a size that is not an int >= 0 is an error (a
    negative or float size would be checked for divisibility as if it were one)."""
    if shape is None:
        return None
    if isinstance(shape, str | bytes) or not isinstance(shape, Sequence | np.ndarray):
        raise ShardingError(
            f"{describe(path, None, names)}: shape {short(shape)} is not a sequence of sizes. "
            "Fix: pass the array's shape, e.g. shape=(1024, 4096) or shape=x.shape."
        )
    for i, d in enumerate(shape):
        if isinstance(d, bool | np.bool_) or not isinstance(d, int | np.integer) or d < 0:
            raise ShardingError(
                f"{describe(path, tuple(shape), names)}: dimension {i} of shape has size {short(d)} "
                f"({type(d).__name__}); sizes are ints >= 0. Fix: pass the array's shape, e.g. "
                "shape=x.shape."
            )
    return tuple(int(d) for d in shape)


def cand_txt(c: Placement) -> str:
    if c is UNCONSTRAINED:
        return "P.UNCONSTRAINED"
    if not c:
        return "None"
    return repr(c[0]) if len(c) == 1 else repr(c)
