"""What a compiled program communicates: the collectives in its HLO text, by mesh axis.

:func:`compiled_collectives` reads ``jax.jit(f).lower(...).compile().as_text()``
and lists each collective operation with the mesh axes it runs over and its
result size on one device. Tests and benchmarks use it to check that a
strategy communicates what it promises (``nnx_shard.strategies`` re-exports it).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re

import numpy as np
from jax.sharding import Mesh

__all__ = ["KINDS", "Collective", "compiled_collectives"]


#: The collective operations :func:`compiled_collectives` reads.
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_OP = re.compile(
    r"=\s*(?P<type>\([^()]*\)|[a-z][a-z0-9]*\[[0-9,]*\]\S*)\s+"
    r"(?P<kind>" + "|".join(KINDS) + r")(?:-start)?\("
)
_SHAPE = re.compile(r"\b(pred|[sufc][0-9]+|bf16|f8e[0-9a-z]+)\[([0-9,]*)\]")
_EXPLICIT = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")
_MESH = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([0-9,]+)\](?:T\(([0-9,]+)\))?\))?"
    r"\s*\{([^}]*)\}"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[0-9]+,[0-9]+\},?)*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective operation of a compiled program (see :func:`compiled_collectives`).

    Attributes:
      kind: one of :data:`KINDS`.
      axes: the mesh axes it communicates over (``None`` if the device groups
        match no set of mesh axes).
      bytes: bytes of its result on one device (a tuple result summed).
      op_name: the JAX operation it came from (HLO metadata).
      shapes: the shape of its result on one device (one per element of a
        tuple result), e.g. to tell which array it moves.

    >>> Collective("all-reduce", ("data",), 1024, "transpose(jvp(...))").axes
    ('data',)
    """

    kind: str
    axes: tuple[str, ...] | None
    bytes: int
    op_name: str
    shapes: tuple[tuple[int, ...], ...] = ()


def _ints(txt: str | None) -> list[int]:
    return [int(t) for t in (txt or "").split(",") if t]


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _groups(line: str) -> tuple[list[frozenset[int]], bool] | None:
    """The device groups of one collective (positions in the mesh's device list),
    and whether they are the source/target pairs of a permutation."""
    if m := _MESH.search(line):
        parts = [p.split("=") for p in m.group(1).split(",") if "=" in p]
        names = [n.strip().strip("'") for n, _ in parts]
        sizes = [int(v) for _, v in parts]
        ids = (_iota(_ints(m.group(2)), _ints(m.group(3)) or None).reshape(-1) if m.group(2)
               else np.arange(math.prod(sizes)))
        ids = ids.reshape(sizes)
        over = [names.index(a.strip().strip("'")) for a in m.group(4).split(",") if a.strip()]
        rest = [i for i in range(len(sizes)) if i not in over]
        flat = ids.transpose(rest + over).reshape(-1, math.prod(sizes[i] for i in over))
        return [frozenset(g.tolist()) for g in flat], False
    if m := _IOTA.search(line):
        shape = _ints(m.group(1))
        ids = _iota(_ints(m.group(2)), _ints(m.group(3)) or None).reshape(shape[0], -1)
        return [frozenset(g.tolist()) for g in ids], False
    if m := _EXPLICIT.search(line):
        groups = re.findall(r"\{([0-9,]*)\}", m.group(1))
        return [frozenset(_ints(g)) for g in groups if g], False
    if m := _PAIRS.search(line):
        pairs = re.findall(r"\{([0-9]+),([0-9]+)\}", m.group(1))
        return [frozenset((int(a), int(b))) for a, b in pairs], True
    return None


def _axes_of(found: tuple[list[frozenset[int]], bool] | None, mesh: Mesh) -> tuple[str, ...] | None:
    """The fewest mesh axes whose device groups are the collective's (for a
    permutation: contain every source/target pair), size-1 axes left out."""
    if not found or not found[0]:
        return None
    groups, pairs = found
    names = tuple(mesh.axis_names)
    ids = np.arange(mesh.devices.size).reshape(mesh.devices.shape)
    wanted = set(groups)
    for r in range(1, len(names) + 1):
        for over in itertools.combinations(range(len(names)), r):
            rest = [i for i in range(len(names)) if i not in over]
            flat = ids.transpose(rest + list(over)).reshape(
                -1, math.prod(ids.shape[i] for i in over))
            mine = {frozenset(g.tolist()) for g in flat}
            hit = (all(any(p <= g for g in mine) for p in wanted) if pairs else wanted == mine)
            if hit:
                return tuple(names[i] for i in over if ids.shape[i] > 1)
    return None


_DTYPE_BYTES = {"pred": 1, "bf16": 2, "c64": 8, "c128": 16}


def _nbytes(type_txt: str) -> int:
    total = 0
    for dtype, dims in _SHAPE.findall(type_txt):
        size = _DTYPE_BYTES.get(dtype) or max(int(re.sub(r"\D.*", "", dtype[1:]) or 8) // 8, 1)
        total += math.prod(_ints(dims)) * size
    return total


def compiled_collectives(hlo_text: str, mesh: Mesh) -> list[Collective]:
    """The collectives in the text of a compiled program
    (``jax.jit(f).lower(...).compile().as_text()``), each with the ``mesh`` axes
    it communicates over and its result size on one device.

    Counts each operation once as written: one inside a loop body (e.g. the
    fused steps of :func:`nnx_shard.multistep`, or stacked layers) runs once per
    iteration.

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from nnx_shard import make_mesh
    >>> mesh = make_mesh("data=2,model=4")
    >>> x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data", "model")))
    >>> text = jax.jit(lambda x: x.sum(axis=1)).lower(x).compile().as_text()
    >>> [(c.kind, c.axes, c.bytes, c.shapes) for c in compiled_collectives(text, mesh)]
    [('all-reduce', ('model',), 16, ((4,),))]
    """
    out = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        name = _OP_NAME.search(line)
        out.append(Collective(
            kind=m.group("kind"),
            axes=_axes_of(_groups(line), mesh),
            bytes=_nbytes(m.group("type")),
            op_name=name.group(1) if name else "",
            shapes=tuple(tuple(_ints(dims)) for _, dims in _SHAPE.findall(m.group("type"))),
        ))
    return out
