"""The resolution engine behind :meth:`Rules.spec <nnx_shard._rules.Rules.spec>`: the
walk of a rules table in order, as Flax linen's ``logical_to_mesh_axes`` and MaxText do,
with our checks (mesh axes exist, divide the dimension) and errors that explain."""

from __future__ import annotations

import difflib
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import PartitionSpec

from nnx_shard._errors import ShardingError, ShardingWarning, short
from nnx_shard._rules._values import (
    UNCONSTRAINED,
    LogicalNames,
    Placement,
    cand_txt,
    check_shape,
    describe,
    fmt_mesh,
    fmt_value,
    mesh_axis_sizes,
    one_placement,
    public_value,
)

_UNASSIGNED: Any = object()


def resolve(
    entries: tuple[tuple[str, Placement], ...],
    table: dict[str, tuple[Placement, ...]],
    indivisible: str,
    names: LogicalNames,
    shape: Sequence[int] | None,
    mesh: Any,
    *,
    path: str,
    allow_unconstrained: bool,
) -> PartitionSpec:
    """The validated ``PartitionSpec`` of ``names`` under the table ``entries`` (in order;
    ``table`` groups them by name), as :meth:`Rules.spec <nnx_shard._rules.Rules.spec>`
    documents."""
    shape = check_shape(shape, path, names)
    names_t = _check_names(names, shape, path)
    sizes = mesh_axis_sizes(mesh)
    has_mesh = mesh is not None
    head = describe(path, shape, names_t)

    def size(dim: int) -> int | None:
        return None if shape is None else int(shape[dim])

    out: list[Any] = [_UNASSIGNED] * len(names_t)
    taken: dict[str, int] = {}

    def claim(dim: int, placement: Placement) -> None:
        if placement is not UNCONSTRAINED:
            # Only a reused size-1 axis can be taken here: it shards nothing, drop it.
            placement = tuple(a for a in placement if a not in taken)
            for axis in placement:
                taken[axis] = dim
        out[dim] = placement

    dims_of = _place_fixed(names_t, size, sizes, has_mesh, taken, head, out, claim)

    tried: dict[tuple[int, int], str] = {}
    for index, (logical, placement) in enumerate(entries):
        for dim in dims_of.get(logical, ()):
            if out[dim] is not _UNASSIGNED:
                continue
            why = _why_not(placement, size(dim), sizes, has_mesh, taken, lenient=False)
            if why is None:
                claim(dim, placement)
                break
            tried[index, dim] = why

    for dim, name in enumerate(names_t):
        if out[dim] is _UNASSIGNED:
            claim(dim, _leftover(entries, table, indivisible, name, dim, size(dim), head, sizes,
                                 has_mesh, taken, tried))

    if not allow_unconstrained:
        _require_definite(out, names_t, head)
    return PartitionSpec(*(one_placement(p) for p in out))


def _require_definite(out: list[Any], names_t: tuple[Any, ...], head: str) -> None:
    """Raises when a dimension of a stored array resolved to UNCONSTRAINED."""
    if any(p is UNCONSTRAINED for p in out):
        dim = next(d for d, p in enumerate(out) if p is UNCONSTRAINED)
        name = names_t[dim]
        raise ShardingError(
            f"{head}: dimension {dim} ({name!r}) resolves to PartitionSpec.UNCONSTRAINED, "
            "which only an activation constraint can use: a stored array needs a definite "
            f"layout. Fix: give {name!r} a mesh axis or None for this array (e.g. rules | "
            f"{{{name!r}: None}}), and keep UNCONSTRAINED for a logical name only "
            "activations use, e.g. 'activation_embed'."
        )


def _place_fixed(
    names_t: tuple[Any, ...],
    size: Callable[[int], int | None],
    sizes: dict[str, int],
    has_mesh: bool,
    taken: dict[str, int],
    head: str,
    out: list[Any],
    claim: Callable[[int, Placement], None],
) -> dict[str, list[int]]:
    """Places the dimensions the names themselves fix (None, UNCONSTRAINED, mesh axes
    given directly) and returns the other dimensions by logical name, for the walk."""
    dims_of: dict[str, list[int]] = {}
    for dim, name in enumerate(names_t):
        if name is None:
            out[dim] = ()
        elif name is UNCONSTRAINED:
            out[dim] = UNCONSTRAINED
        elif isinstance(name, tuple):
            # Mesh axes given directly (Flax style) are fixed before any rule applies.
            why = _why_not(name, size(dim), sizes, has_mesh, taken, lenient=True)
            if why is not None:
                raise _error(name, f"{name!r} (mesh axes given directly)", dim, head, sizes,
                             [(name, why)])
            claim(dim, name)
        else:
            dims_of.setdefault(name, []).append(dim)
    return dims_of


def _leftover(
    entries: tuple[tuple[str, Placement], ...],
    table: dict[str, tuple[Placement, ...]],
    indivisible: str,
    name: str,
    dim: int,
    dim_size: int | None,
    head: str,
    sizes: dict[str, int],
    has_mesh: bool,
    taken: dict[str, int],
    tried: dict[tuple[int, int], str],
) -> Placement:
    """The placement of a named dimension no entry fitted in the table walk,
    or the ShardingError that explains why there is none."""
    if name in table:
        indexed = [(i, p) for i, (n, p) in enumerate(entries) if n == name]
        rule_txt = f"rule {name!r} -> {fmt_value(public_value(table[name]))}"
    elif has_mesh and name in sizes:
        indexed = [(-1, (name,))]
        rule_txt = f"{name!r} (a mesh axis, used directly)"
    else:
        close = difflib.get_close_matches(name, list(table), n=3, cutoff=0.6)
        known = short(", ".join(sorted(table)) or "none", 600).strip("'")
        mean = f" Did you mean {' or '.join(short(c) for c in close)}?" if close else ""
        # Suggest a mesh axis the mesh has (the largest), never one it lacks.
        axis = max(sizes, key=lambda a: sizes[a]) if has_mesh and sizes else "model"
        shard = f"rules | {{{short(name)}: {short(axis)}}}, or " if sizes.get(axis, 2) > 1 else ""
        raise ShardingError(
            f"logical axis {short(name)} of {head} has no rule.{mean} Known logical axes: "
            f"{known}. Fix: add a rule, e.g. {shard}"
            f"rules | {{{short(name)}: None}} to replicate it."
        )
    for _, p in indexed:
        # A size-1 mesh axis shards nothing: an entry blocked only by reusing one applies.
        if _why_not(p, dim_size, sizes, has_mesh, taken, lenient=True) is None:
            return p
    failures = [
        (p, tried.get((i, dim)) or _why_not(p, dim_size, sizes, has_mesh, taken,
                                                 lenient=True) or "")
        for i, p in indexed
    ]
    if indivisible == "replicate" and all(f.startswith("size ") for _, f in failures):
        warnings.warn(
            f"{head}: dimension {dim} (size {dim_size}) does not divide by its mesh axes "
            f"({rule_txt}); replicating it as Rules(indivisible='replicate') allows.",
            ShardingWarning,
            stacklevel=5,  # the caller of Rules.spec's caller
        )
        return ()
    raise _error(name, rule_txt, dim, head, sizes, failures)

def _error(
    key: str | tuple[str, ...],
    rule_txt: str,
    dim: int,
    head: str,
    sizes: dict[str, int],
    failures: list[tuple[Placement, str]],
) -> ShardingError:
    detail = "; ".join(f"{cand_txt(c)}: {f}" for c, f in failures)
    first = cand_txt(failures[0][0])
    if any(f.startswith("not in the mesh") for _, f in failures):
        missing = sorted({a for c, _ in failures if c is not UNCONSTRAINED
                          for a in c if a not in sizes})
        return ShardingError(
            f"{rule_txt} names a mesh axis that is not in the mesh (axes: {fmt_mesh(sizes)}) "
            f"for dimension {dim} of {head}: {detail}. Fix: build the mesh with axis "
            f"{' and '.join(repr(m) for m in missing)}, or map {key!r} to an existing axis "
            f"({fmt_mesh(sizes)}) or None: rules | {{{key!r}: None}}."
        )
    if any(f.startswith("already used") for _, f in failures):
        return ShardingError(
            f"{rule_txt} cannot shard dimension {dim} of {head}: {detail}. A mesh axis can "
            "shard only one dimension of an array, and rules claim mesh axes in table "
            f"order. Fix: map {key!r} to another axis, or add None as a last candidate, "
            f"e.g. rules | {{{key!r}: Fallbacks({first}, None)}}."
        )
    return ShardingError(
        f"{rule_txt} cannot shard dimension {dim} of {head}: {detail}. "
        f"Fix: make the dimension divisible, add None as a last candidate "
        f"(rules | {{{key!r}: Fallbacks({first}, None)}}), or pass "
        "Rules(..., indivisible='replicate') to replicate such dimensions with a warning."
    )

def _check_names(names: Any, shape: Any, path: str) -> tuple[Any, ...]:
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ShardingError(
            f"{describe(path, shape, names)}: logical axes must be a tuple with one name "
            "(or None) per dimension. Fix: e.g. ('embed', 'mlp') instead of "
            f"{short(names)}."
        )
    names_t = tuple(names)
    for i, n in enumerate(names_t):
        ok = n is None or n is UNCONSTRAINED or (isinstance(n, str) and n) or (
            isinstance(n, tuple)
            and n
            and all(isinstance(a, str) and a for a in n)
            and len(set(n)) == len(n)
        )
        if not ok:
            raise ShardingError(
                f"{describe(path, shape, names_t)}: entry {i} is {short(n)} "
                f"({type(n).__name__}); logical names must be non-empty strings, or None "
                "for a replicated dimension. Fix: e.g. ('embed', None)."
            )
    if shape is not None and len(names_t) != len(shape):
        hint = ""
        if len(names_t) == len(shape) - 1:
            hint = (
                " If the layers were stacked with nnx.vmap / nnx.scan, the stacked axis has no "
                "logical name: pass transform_metadata={nnx.PARTITION_NAME: 'layers'} to the "
                "transform (and give 'layers' a rule) so the layer axis is named."
            )
        raise ShardingError(
            f"{describe(path, shape, names_t)}: {len(names_t)} logical names for an array "
            f"of rank {len(shape)}.{hint} Fix: give exactly one logical name (or None) per "
            "dimension."
        )
    return names_t

def _why_not(
    cand: Placement,
    dim_size: int | None,
    sizes: dict[str, int],
    has_mesh: bool,
    taken: dict[str, int],
    *,
    lenient: bool,
) -> str | None:
    """Why ``cand`` cannot shard the dimension now (``None``: it fits). ``lenient``
    lets an already used mesh axis of size 1 pass."""
    if cand is UNCONSTRAINED:
        return None
    for axis in cand:
        if has_mesh and axis not in sizes:
            return f"not in the mesh (mesh axis {axis!r})"
    for axis in cand:
        if axis in taken and not (lenient and has_mesh and sizes.get(axis) == 1):
            return f"already used by dimension {taken[axis]} (mesh axis {axis!r})"
    if dim_size is not None and has_mesh:
        prod = math.prod(sizes[a] for a in cand)
        if dim_size % prod:
            return f"size {dim_size} is not divisible by {prod}"
    return None
