"""Device meshes: ``parse_axes``, the one reader of mesh text such as ``"data=4,model=2"``,
``make_mesh`` from such text, a dict or a Mesh (hybrid: one axis laid across processes or
slices with ``across=``), ``granules``, the process/slice groups such a mesh spans, and
``mesh_str``, their text form."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from nnx_shard._axes import sizes_str
from nnx_shard._errors import ShardingError, UsageError, short

__all__ = ["granules", "hybrid_devices", "make_mesh", "mesh_str", "parse_axes"]

_AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def mesh_str(mesh: Any) -> str:
    """``"data=4,model=2"``: a mesh (or a mapping of axis sizes) as :func:`make_mesh` reads it.

    >>> mesh_str({"data": 4, "model": 2})
    'data=4,model=2'
    """
    return sizes_str(mesh)


_FIX = "write axis=size pairs separated by commas, e.g. 'data=4,model=2' or {'data': 4, 'model': 2}"


def _pairs(spec: Any) -> list[tuple[Any, Any]]:
    """The ``(name, size)`` pairs of a mapping or of ``"axis=size,..."`` text, as given
    (sizes still text); what is not a pair, or a mapping's size that is not an int,
    is the UsageError."""
    if isinstance(spec, Mapping):
        items: list[tuple[Any, Any]] = list(spec.items())
        for name, size in items:
            # bool is an int and 8.5 truncates: both would give a mesh nobody asked for.
            if isinstance(size, bool) or not isinstance(size, int | np.integer):
                raise UsageError(
                    f"mesh spec {short(dict(spec))}: size {short(size)} of axis {short(name)} "
                    f"is a {type(size).__name__}, not an int. Fix: give whole device counts; "
                    f"{_FIX}."
                )
        return items
    if not isinstance(spec, str):
        hint = f"make_mesh('data={spec}')" if isinstance(spec, int) and not isinstance(
            spec, bool) else "e.g. make_mesh('data=4,model=2') or make_mesh({'data': 4, 'model': 2})"
        raise UsageError(
            f"make_mesh: spec must be a string 'axis=size,...', a dict {{axis: size}} or a "
            f"jax.sharding.Mesh, got {type(spec).__name__} {short(spec, 60)}. Fix: {hint}."
        )
    items = []
    for part in spec.replace(" ", "").split(","):
        if not part:
            continue
        name, eq, size_txt = part.partition("=")
        if not eq or not name:
            raise UsageError(f"mesh spec {short(spec)}: {short(part)} is not 'axis=size'. "
                             f"Fix: {_FIX}.")
        items.append((name, size_txt))
    return items


def parse_axes(spec: str | Mapping[str, int], *, rest: bool = True) -> dict[str, int]:
    """Mesh axis sizes from ``"data=4,model=2"`` or a mapping, checked: the one reader of
    mesh text in nnx_shard (:func:`make_mesh`, ``Strategy.check``, the planner's
    ``sizes`` and every ``--mesh`` flag of the ``nnx-shard`` command call it, so a bad
    string gives the same message wherever it is written).

    The grammar: ``axis=size`` pairs separated by commas, as in
    ``"data=4,model=2"`` (spaces and empty pairs are ignored). The order is kept: it
    is the order of the mesh's axes, the first varying slowest. Each axis is named once;
    a size is a whole number >= 1, or ``-1`` on at most one axis: all the devices the
    other axes leave (``make_mesh`` fills it in; where there are no devices to count,
    ``rest=False``, every axis needs its size). A mapping ``{"data": 4, "model": 2}``
    follows the same rules, its sizes ints. Anything else is a
    :class:`~nnx_shard.UsageError` that names the spec, the part at fault and a fix.

    >>> parse_axes("data=4,model=2")
    {'data': 4, 'model': 2}
    >>> parse_axes("model=2, data=-1")        # order kept; -1: the rest
    {'model': 2, 'data': -1}
    >>> parse_axes("data=4,model")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: mesh spec 'data=4,model': 'model' is not 'axis=size'. Fix: ...
    >>> parse_axes("data=-1,model=-1")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: mesh spec 'data=-1,model=-1': only one axis may have size -1 ...
    >>> parse_axes("data=-1", rest=False)
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: mesh spec 'data=-1': every axis needs a size here ...
    """
    items = _pairs(spec)
    axes: dict[str, int] = {}
    shown = short(spec)
    for name, size in items:
        try:
            size_i = int(size)
        except (TypeError, ValueError, OverflowError):
            raise UsageError(f"mesh spec {shown}: size {short(size)} of axis {short(name)} is "
                             f"not an integer. Fix: {_FIX}.") from None
        if not isinstance(name, str) or not name:
            raise UsageError(f"mesh spec {shown}: axis names must be non-empty strings, got "
                             f"{short(name)}. Fix: {_FIX}.")
        if name in axes:
            raise UsageError(f"mesh spec {shown}: axis {short(name)} appears twice. Fix: "
                             "name each axis once.")
        if size_i == 0 or size_i < -1:
            raise UsageError(f"mesh spec {shown}: axis {short(name)} has size {size_i}; sizes "
                             f"are positive (or -1 for 'all remaining devices'). Fix: {_FIX}.")
        axes[name] = size_i
    if not axes:
        raise UsageError(f"mesh spec {shown} names no axes. Fix: {_FIX}.")
    unknown = [k for k, v in axes.items() if v == -1]
    if len(unknown) > 1:
        raise UsageError(f"mesh spec {shown}: only one axis may have size -1 (all remaining "
                         "devices). Fix: give the other axes their sizes.")
    if unknown and not rest:
        raise UsageError(f"mesh spec {shown}: every axis needs a size here (-1, all remaining "
                         "devices, needs real devices to count). Fix: give "
                         f"{short(unknown[0])} its size, e.g. '{unknown[0]}=8'.")
    return axes


def make_mesh(
    spec: str | Mapping[str, int] | Mesh,
    *,
    axis_types: str | Sequence[AxisType] | None = "auto",
    devices: Sequence[Any] | None = None,
    across: str | None = None,
) -> Mesh:
    """Builds a device mesh from ``"data=4,model=2"``, a dict, or returns a Mesh as is.

    One axis may have size ``-1``: it takes all remaining devices. The text is read
    by :func:`parse_axes`, which states its grammar.

    Args:
      spec: axis sizes in order, e.g. ``"data=4,model=2"`` or ``{"data": 4, "model": 2}``.
      axis_types: ``"auto"`` (the default; ``None`` means the same), ``"explicit"``,
        or a tuple of ``jax.sharding.AxisType`` per axis. Auto axes let XLA
        propagate layouts, so any Flax model trains as written; Explicit axes
        (``jax.make_mesh``'s default) put shardings in the array types and
        reject at trace time any operation whose output sharding is ambiguous,
        which stock layers such as ``nnx.Embed`` do not spell out.
      devices: the devices to use (default: all of ``jax.devices()``), each once.
      across: the axis to lay across the slow links, as hybrid sharded data
        parallelism's ``replica`` (``strategies.get("hsdp")``, whose
        ``Strategy.make_mesh`` passes it): where the devices fall into several
        :func:`granules` (processes of a ``jax.distributed`` job, or slices where
        the devices name them), that axis spans the groups and every other axis
        stays within one. Its size must be a multiple of the number of groups
        ``g``; each group holds ``size/g`` of its places and the whole of the
        other axes (``jax.experimental.mesh_utils.create_hybrid_device_mesh``
        orders the devices). On one process (e.g. simulated devices) the mesh is
        the ordinary one.

    Raises:
      UsageError: ``spec`` is not a string, dict or Mesh (e.g. ``8`` or ``None``), or does
        not follow :func:`parse_axes`'s grammar (``"data"``, ``"data=x"``, a size that is
        not a positive int such as ``8.5`` or ``True``, two ``-1`` axes).
      ShardingError: sizes that do not multiply to the number of devices (the fix names
        ``devices=...[:n]`` when the mesh is smaller), a ``-1`` axis the devices do not
        divide into; ``devices`` not a list of jax devices, empty or repeating; an
        ``across`` axis that is not one of the mesh's, whose size the groups do not
        divide, or groups of unequal sizes; devices of several slices without ``across``.

    >>> from nnx_shard import make_mesh
    >>> mesh = make_mesh("data=4,model=2")
    >>> dict(mesh.shape)
    {'data': 4, 'model': 2}
    >>> dict(make_mesh({"data": -1}).shape)
    {'data': 8}
    >>> make_mesh("data=8").axis_types, make_mesh("data=8", axis_types="explicit").axis_types
    ((Auto,), (Explicit,))
    >>> dict(make_mesh("replica=2,data=4", across="replica").shape)  # one process: ordinary
    {'replica': 2, 'data': 4}
    """
    if isinstance(spec, Mesh):
        return spec
    axes = parse_axes(spec)
    devs = _check_devices(devices) if devices is not None else jax.devices()
    n = len(devs)
    unknown = [k for k, v in axes.items() if v == -1]
    known = math.prod(v for v in axes.values() if v != -1)
    if unknown:
        if n % known:
            raise ShardingError(
                f"mesh spec {short(spec)}: {n} devices do not divide by {known}, so "
                f"{unknown[0]!r}=-1 has no integer size. Fix: axis sizes whose product "
                f"divides {n}."
            )
        axes[unknown[0]] = n // known
    total = math.prod(axes.values())
    if total != n:
        fix = f"Fix: make the axis sizes multiply to {n}, or use -1 for one axis (e.g. 'data=-1')"
        if total < n:
            subset = "devices" if devices is not None else "jax.devices()"
            fix += f", or use {total} of them: devices={subset}[:{total}]"
        raise ShardingError(
            f"mesh {mesh_str(axes)} needs {total} devices but {n} are "
            f"{'given' if devices is not None else 'available'}. {fix}."
        )
    types: tuple[AxisType, ...] | None
    if axis_types is None:
        axis_types = "auto"
    if isinstance(axis_types, str):
        if axis_types.lower() not in _AXIS_TYPES:
            raise ShardingError(f"make_mesh: axis_types={short(axis_types)}: expected 'explicit' "
                                "or 'auto'. Fix: e.g. make_mesh('data=8', axis_types='auto').")
        types = (_AXIS_TYPES[axis_types.lower()],) * len(axes)
    else:
        if not isinstance(axis_types, Sequence) or not all(
                isinstance(t, AxisType) for t in axis_types) or len(axis_types) != len(axes):
            raise ShardingError(
                f"make_mesh: axis_types={short(axis_types)}: expected 'auto', 'explicit' or one "
                f"jax.sharding.AxisType per axis ({len(axes)} here). Fix: e.g. "
                "axis_types='auto', or (AxisType.Auto,) * number of axes."
            )
        types = tuple(axis_types)  # type: ignore[arg-type]  # checked above: AxisTypes
    if across is not None and (not isinstance(across, str) or across not in axes):
        raise UsageError(
            f"make_mesh: across={short(across)} is not an axis of mesh {mesh_str(axes)}. Fix: "
            f"name the axis to lay across processes or slices, e.g. across={next(iter(axes))!r}.")
    groups = granules(devs)
    if len(groups) > 1 and across is not None:
        return Mesh(hybrid_devices(axes, across, devs), tuple(axes), axis_types=types)
    if len(groups) > 1 and _granule_attr(devs) == "slice_index":
        # jax.make_mesh refuses these with a ValueError naming a function of its own.
        raise ShardingError(
            f"make_mesh: the {n} devices span {len(groups)} slices; mesh {mesh_str(axes)} needs "
            "an axis laid across them (the slow links). Fix: "
            f"make_mesh({mesh_str(axes)!r}, across={next(iter(axes))!r}).")
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=types, devices=devs)


def _granule_attr(devices: Sequence[Any]) -> str:
    """``"slice_index"`` where the devices name several slices, else ``"process_index"``."""
    return ("slice_index" if len({getattr(d, "slice_index", 0) for d in devices}) > 1
            else "process_index")


def granules(devices: Sequence[Any] | None = None) -> list[list[Any]]:
    """The groups of ``devices`` (default: all of ``jax.devices()``) the slow links join:
    one per slice where the devices name several (``slice_index``: multi-slice TPU, multi-node
    GPU), else one per process; in index order, each group's devices in the given order.
    :func:`make_mesh`'s ``across`` axis spans them.

    >>> [len(g) for g in granules()]    # one process of 8 simulated devices
    [8]
    """
    devs = list(jax.devices() if devices is None else devices)
    attr = _granule_attr(devs)
    groups: dict[int, list[Any]] = {}
    for d in devs:
        groups.setdefault(getattr(d, attr), []).append(d)
    return [groups[k] for k in sorted(groups)]


def hybrid_devices(axes: Mapping[str, int], across: str, devices: Sequence[Any]) -> np.ndarray:
    """The device array of a hybrid mesh of ``axes`` sizes (which multiply to
    ``len(devices)``): the ``across`` axis spans the :func:`granules` of ``devices``,
    every other axis stays within one (what :func:`make_mesh` builds with ``across``).

    Raises:
      ShardingError: ``axes[across]`` is not a multiple of the number of groups, or the
        groups hold different numbers of devices.

    >>> import jax
    >>> hybrid_devices({"replica": 2, "data": 4}, "replica", jax.devices()).shape
    (2, 4)
    """
    attr = _granule_attr(devices)
    unit = "slices" if attr == "slice_index" else "processes"
    groups = granules(devices)
    g, size = len(groups), axes[across]
    if size % g:
        raise ShardingError(
            f"mesh {mesh_str(axes)}: axis {across!r} is laid across the devices' {g} {unit}, "
            f"so its size ({size}) must be a multiple of {g}. Fix: e.g. {across}={g} with the "
            f"other axes over the {len(devices) // g} devices of each.")
    counts = sorted({len(x) for x in groups})
    if len(counts) > 1:
        raise ShardingError(
            f"make_mesh(..., across={across!r}): the devices fall into {g} {unit} holding "
            f"{counts} devices; a hybrid mesh needs the same number in each. Fix: pass "
            f"devices= with as many from each of the {unit}.")
    inner = [s // g if a == across else s for a, s in axes.items()]
    outer = [g if a == across else 1 for a in axes]
    return mesh_utils.create_hybrid_device_mesh(
        inner, outer, devices, process_is_granule=attr == "process_index")


def _check_devices(devices: Any) -> list[Any]:
    if isinstance(devices, str) or not isinstance(devices, Sequence | np.ndarray):
        raise ShardingError(
            f"make_mesh: devices must be a list of jax devices, got {type(devices).__name__} "
            f"{devices!r:.60}. Fix: e.g. devices=jax.devices()[:4]."
        )
    devs = list(np.ravel(np.asarray(devices, dtype=object)))
    if not devs:
        raise ShardingError(
            "make_mesh: devices=[] is empty; a mesh needs at least one device. Fix: leave "
            "devices out (all of jax.devices()), or pass some, e.g. devices=jax.devices()[:4]."
        )
    bad = [d for d in devs if not isinstance(d, jax.Device)]
    if bad:
        raise ShardingError(
            f"make_mesh: devices must be jax devices, got {type(bad[0]).__name__} {bad[0]!r:.40}. "
            "Fix: e.g. devices=jax.devices()[:4]."
        )
    seen: set[int] = set()
    twice = []
    for d in devs:
        if d.id in seen:
            twice.append(d)
        seen.add(d.id)
    if twice:
        raise ShardingError(
            f"make_mesh: devices lists {twice[0]} more than once ({len(devs)} entries, "
            f"{len(seen)} distinct devices); each device can hold one place of the mesh. Fix: "
            "pass distinct devices, e.g. devices=jax.devices()[:4]."
        )
    return devs
