"""What a compiled program does, read from its HLO text: its collectives by mesh
axis (:func:`compiled_collectives`), and the per-device FLOPs, communication and
memory traffic the planner's cost model weighs (:func:`hlo_costs`).

Both read ``jax.jit(f).lower(...).compile().as_text()`` with one parser of
instruction lines. Tests and benchmarks use :func:`compiled_collectives` to check
that a strategy communicates what it promises (``nnx_shard.strategies``
re-exports it, and :func:`partitioned_hlo`: the program as XLA's partitioner wrote
it, before a backend's own rewrites).
"""
from __future__ import annotations

import dataclasses
import glob
import itertools
import math
import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
from jax.sharding import AbstractMesh, Mesh

from nnx_shard._errors import UsageError

__all__ = ["HOST_SPACE", "KINDS", "Collective", "MemorySplit", "compiled_collectives", "hlo_costs",
           "memory_split", "partitioned_hlo"]


#: The collective operations :func:`compiled_collectives` reads.
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# One instruction: name = type op(operands...), the type an array or a tuple (nested once).
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*"
                    r"(\((?:[^()]|\([^()]*\))*\)|[a-z][a-z0-9]*\[[0-9,]*\])\S*\s+"
                    r"([a-z][\w-]*)\((.*)$")
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

    >>> from nnx_shard.planner import Collective
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


def _axis_ref(text: str) -> tuple[str, int | None, int]:
    """One axis of a collective's ``mesh[...] {...}`` groups: ``'data'`` (the whole axis)
    or a sub-axis ``'expert':(2)2`` (pre-size 2, size 2), as ``(name, pre, size)``.

    >>> _axis_ref("'data'"), _axis_ref("'expert':(2)2")
    (('data', None, 0), ('expert', 2, 2))
    """
    name, _, sub = text.strip().partition(":")
    if not sub:
        return name.strip("'\""), None, 0
    pre, _, size = sub.strip().lstrip("(").partition(")")
    return name.strip("'\""), int(pre), int(size)


def _groups(line: str) -> tuple[list[frozenset[int]], bool] | None:
    """The device groups of one collective (positions in the mesh's device list),
    and whether they are the source/target pairs of a permutation."""
    if m := _MESH.search(line):
        parts = [p.split("=") for p in m.group(1).split(",") if "=" in p]
        names = [n.strip().strip("'") for n, _ in parts]
        sizes = [int(v) for _, v in parts]
        ids = (_iota(_ints(m.group(2)), _ints(m.group(3)) or None).reshape(-1) if m.group(2)
               else np.arange(math.prod(sizes)))
        refs = [_axis_ref(a) for a in m.group(4).split(",") if a.strip()]
        # A sub-axis ('expert':(2)2, newer JAX: size 2 after a major part of 2) splits its
        # axis into factors, major to minor; the groups vary over the referenced factors.
        cuts = [{1, n} for n in sizes]
        for name, pre, size in refs:
            if pre is not None:
                cuts[names.index(name)] |= {pre, pre * size}
        factors: list[int] = []
        where: list[dict[int, int]] = []
        for c in cuts:
            bounds = sorted(c)
            where.append({b: len(factors) + j for j, b in enumerate(bounds[:-1])})
            factors += [hi // lo for lo, hi in itertools.pairwise(bounds)]
        over = []
        for name, pre, size in refs:
            i = names.index(name)
            lo, hi = (1, sizes[i]) if pre is None else (pre, pre * size)
            over += [k for b, k in where[i].items() if lo <= b < hi]
        ids = ids.reshape(factors)
        rest = [i for i in range(len(factors)) if i not in over]
        flat = ids.transpose(rest + over).reshape(-1, math.prod(factors[i] for i in over))
        return [frozenset(g.tolist()) for g in flat], False
    if m := _IOTA.search(line):
        shape = _ints(m.group(1))
        rows = _iota(_ints(m.group(2)), _ints(m.group(3)) or None).reshape(shape[0], -1)
        return [frozenset(g.tolist()) for g in rows], False
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

    Args:
      hlo_text: the compiled program's text (``.compile().as_text()``) or :func:`partitioned_hlo`'s.
      mesh: the mesh the program runs on.

    >>> from nnx_shard.planner import compiled_collectives
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from nnx_shard import make_mesh
    >>> mesh = make_mesh("data=2,model=4")
    >>> x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data", "model")))
    >>> text = jax.jit(lambda x: x.sum(axis=1)).lower(x).compile().as_text()
    >>> [(c.kind, c.axes, c.bytes, c.shapes) for c in compiled_collectives(text, mesh)]
    [('all-reduce', ('model',), 16, ((4,),))]
    """
    if not isinstance(hlo_text, str):
        raise UsageError(f"compiled_collectives: hlo_text must be the text of a compiled program "
                         f"(str), got {type(hlo_text).__name__}. Fix: "
                         "jax.jit(f).lower(...).compile().as_text()")
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise UsageError(f"compiled_collectives: mesh must be a jax Mesh, got "
                         f"{type(mesh).__name__} {mesh!r:.60}. Fix: ns.make_mesh('data=8')")
    out = []
    for line in hlo_text.splitlines():
        m = _INSTR.match(line)
        if m is not None and (c := _collective(line, m.group(2), m.group(3), mesh)):
            out.append(c)
    return out


def partitioned_hlo(lowered: Any) -> tuple[Any, str]:
    """Compiles ``lowered`` (``jax.jit(f).lower(...)``) and returns the executable and
    the HLO text of the program right after XLA's SPMD partitioner: the collectives
    with the dtypes the partitioner chose, before the backend's own passes.

    The difference matters for low-precision collectives: XLA's CPU backend has no
    bfloat16 kernels, so its float normalization widens a bfloat16 all-gather to a
    float32 one (with converts around it) in the final program, while GPUs and TPUs
    run it in bfloat16. Read both with :func:`compiled_collectives`.

    Args:
      lowered: a lowered program, ``jax.jit(f).lower(...)`` (or ``Trainer.lower``).

    >>> from nnx_shard.planner import compiled_collectives, partitioned_hlo
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from nnx_shard import make_mesh
    >>> mesh = make_mesh("data=8")
    >>> w = jax.device_put(jnp.ones((64, 32)), NamedSharding(mesh, P("data")))   # fsdp
    >>> x = jax.device_put(jnp.ones((16, 64), jnp.bfloat16), NamedSharding(mesh, P("data")))
    >>> f = jax.jit(lambda w, x: (x @ w.astype(jnp.bfloat16)).sum())
    >>> compiled, text = partitioned_hlo(f.lower(w, x))
    >>> [c.bytes for c in compiled_collectives(text, mesh) if c.kind == "all-gather"]
    [4096]
    >>> ag = [c.bytes for c in compiled_collectives(compiled.as_text(), mesh)
    ...       if c.kind == "all-gather"]
    >>> ag == ([8192] if jax.default_backend() == "cpu" else [4096])   # CPU widens to float32
    True
    """
    with tempfile.TemporaryDirectory(prefix="nnx_shard_hlo_") as tmp:
        # JAX leaves the dump options out of its persistent cache's key, so a program
        # compiled before would be read back and no pass would run: an option that is
        # in the key (naming this call's folder; it only concerns GPU autotuning) makes
        # the key this call's own.
        compiled = lowered.compile(compiler_options={
            "xla_dump_to": tmp, "xla_dump_hlo_pass_re": "spmd-partitioning",
            "xla_gpu_dump_autotune_results_to": os.path.join(tmp, "autotune.textproto")})
        found = sorted(glob.glob(os.path.join(tmp, "*after_spmd-partitioning*.txt")))
        if not found:
            raise RuntimeError("XLA wrote no HLO after its spmd-partitioning pass (a program "
                               "on one device is not partitioned)")
        with open(found[-1]) as f:
            return compiled, f.read()


def _collective(line: str, type_txt: str, op: str, mesh: Mesh) -> Collective | None:
    """The collective of one instruction line (``None`` if it is not one)."""
    kind = op.removesuffix("-start")
    if kind not in KINDS:
        return None
    name = _OP_NAME.search(line)
    return Collective(kind=kind, axes=_axes_of(_groups(line), mesh), bytes=_nbytes(type_txt),
                      op_name=name.group(1) if name else "",
                      shapes=tuple(tuple(_ints(d)) for _, d in _SHAPE.findall(type_txt)))


# -- costs ---------------------------------------------------------------------------

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->.*\{\s*$")
_PARAM = re.compile(r"([\w.\-]+):\s*([a-z][a-z0-9]*\[[0-9,]*\])")
# Operations that move no data of their own (views, control flow, constants).
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                   "call", "conditional", "after-all", "partition-id", "replica-id",
                   "opt-barrier"})
_CALLS = re.compile(r"\b(calls|body|condition|to_apply|branch_computations|"
                    r"called_computations)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP = re.compile(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_DIMS = re.compile(r"\[([0-9,]*)\]")
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")


def _dims(type_txt: str) -> list[int]:
    m = _DIMS.search(type_txt)
    return [int(t) for t in m.group(1).split(",") if t] if m else []


def _ring_bytes(kind: str, size: int, n: int) -> float:
    if n <= 1:
        return 0.0
    return {"all-reduce": 2 * (n - 1) / n * size, "all-gather": (n - 1) / n * size,
            "all-to-all": (n - 1) / n * size, "reduce-scatter": (n - 1) * size,
            "collective-permute": float(size)}.get(kind, float(size))


@dataclasses.dataclass
class _Computation:
    """One HLO computation's own figures, before the loops around it weigh them."""

    shapes: dict[str, str]
    flops: int = 0
    coll: float = 0.0
    ops: int = 0
    mem: int = 0
    kinds: dict[str, float] = dataclasses.field(default_factory=dict)
    # (callee, trip count, whether the loop's count is unknown, whether it runs fused)
    calls: list[tuple[str, int, bool, bool]] = dataclasses.field(default_factory=list)
    ds: bool = False   # holds a dynamic-slice
    dus: bool = False  # holds a dynamic-update-slice


def _traffic(op: str, rest: str, type_txt: str, operands: list[str],
             comps: Mapping[str, _Computation]) -> int:
    """Bytes one instruction reads and writes in memory, as XLA's cost analysis counts
    them: a slice of a stacked buffer (scanned layers) moves the slice, an in-place
    update moves the update, not the whole buffer."""
    out = _nbytes(type_txt)
    sizes = [_nbytes(t) for t in operands]
    callee = re.search(r"calls=%?([\w.\-]+)", rest) if op == "fusion" else None
    fused = comps.get(callee.group(1)) if callee else None
    if op == "dynamic-update-slice" or (fused is not None and fused.dus):
        # The buffer updated in place (same type as the result) is neither read nor
        # written whole; the update is read and written.
        rest_in = [b for t, b in zip(operands, sizes, strict=True) if t != type_txt]
        return 2 * sum(rest_in)
    if op == "dynamic-slice" or (fused is not None and fused.ds):
        return out + sum(min(b, out) for b in sizes)
    return out + sum(sizes)


def _dot_flops(comp: _Computation, type_txt: str, rest: str) -> int:
    lhs = rest.split(",", 1)[0].strip().lstrip("%").split()[-1].lstrip("%")
    lhs_dims = _dims(comp.shapes.get(lhs, ""))
    contract = _CONTRACTING.search(rest)
    k = (math.prod(lhs_dims[int(i)] for i in contract.group(1).split(",") if i)
         if contract and lhs_dims else 1)
    return 2 * math.prod(_dims(type_txt)) * k


def _instruction(comp: _Computation, line: str, m: re.Match[str],
                 comps: Mapping[str, _Computation], sizes: Mapping[str, int],
                 mesh: Mesh) -> None:
    """Adds one instruction's memory traffic, FLOPs and communication to ``comp``."""
    name, type_txt, op, rest = m.groups()
    comp.shapes[name] = type_txt
    base = op.removesuffix("-start").removesuffix("-done")
    comp.ds = comp.ds or op == "dynamic-slice"
    comp.dus = comp.dus or op == "dynamic-update-slice"
    if op not in _FREE and base not in KINDS and not op.endswith("-done"):
        operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
        comp.mem += _traffic(op, rest, type_txt, [comp.shapes.get(o, "") for o in operands],
                             comps)
    if op == "dot":
        comp.flops += _dot_flops(comp, type_txt, rest)
    if "replica_groups" in line or "source_target_pairs" in line:
        coll = _collective(line, type_txt, op, mesh)
        if coll is not None:
            n = math.prod(sizes[a] for a in coll.axes) if coll.axes else max(sizes.values())
            sent = _ring_bytes(coll.kind, coll.bytes, n)
            comp.coll += sent
            comp.ops += 1
            comp.kinds[coll.kind] = comp.kinds.get(coll.kind, 0.0) + sent


def _calls(comp: _Computation, line: str, op: str) -> None:
    """Records the computations ``line`` calls, with the trip count of a loop."""
    for kind, names in _CALLS.findall(line):
        trip = _TRIP.search(line)
        factor = int(trip.group(1)) if trip and kind in ("body", "condition") else 1
        unknown = kind == "body" and not trip
        # Inside a fusion (or a reduction's scalar computation) data stays in registers
        # or cache: its memory traffic is the fusion's operands and result.
        fused = (kind == "calls" and op != "call") or (kind == "to_apply" and op != "call")
        for callee in names.strip("{}").split(","):
            callee = callee.strip().lstrip("%")
            if callee:
                comp.calls.append((callee, factor, unknown, fused))


def _computations(hlo_text: str, mesh: Mesh) -> tuple[dict[str, _Computation], str | None]:
    """Every computation of the program by name, and the entry computation's name."""
    sizes = dict(mesh.shape)
    comps: dict[str, _Computation] = {}
    entry = None
    cur: _Computation | None = None
    for line in hlo_text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m:
                cur = comps[m.group(1)] = _Computation(dict(_PARAM.findall(m.group(2))))
                if line.startswith("ENTRY"):
                    entry = m.group(1)
            continue
        if line.startswith("}"):
            cur = None
            continue
        m = _INSTR.match(line)
        if m:
            _instruction(cur, line, m, comps, sizes, mesh)
        _calls(cur, line, m.group(3) if m else "")
    return comps, entry


def _weights(comps: Mapping[str, _Computation],
             entry: str | None) -> tuple[dict[str, int], dict[str, int], int]:
    """How many times each computation runs per call (all of them, and those not
    inside a fusion), and the loops without a known trip count (counted once)."""
    weights: dict[str, int] = {}
    unfused: dict[str, int] = {}
    unknown_loops = 0

    def visit(name: str, w: int, fused: bool, depth: int = 0) -> None:
        nonlocal unknown_loops
        if name not in comps or depth > 64:
            return
        weights[name] = weights.get(name, 0) + w
        if not fused:
            unfused[name] = unfused.get(name, 0) + w
        for callee, factor, unknown, into_fusion in comps[name].calls:
            unknown_loops += unknown
            visit(callee, w * factor, fused or into_fusion, depth + 1)

    if entry is not None:
        visit(entry, 1, False)
    return weights, unfused, unknown_loops


def hlo_costs(hlo_text: str, mesh: Any) -> dict[str, Any]:
    """Per-device matmul FLOPs and collective traffic of a compiled program's
    text, each operation weighted by the trip counts of the loops around it.

    Returns ``flops``, ``collective_bytes`` (ring-algorithm bytes each device
    sends), ``collectives`` (operations executed per call), ``memory_bytes``
    (what operations outside fusions read and write), ``by_kind`` (kind -> bytes
    sent) and ``unknown_loops`` (loops without a known trip count, counted once).

    >>> import jax, jax.numpy as jnp
    >>> from nnx_shard._mesh import make_mesh
    >>> mesh = make_mesh("d=2", devices=jax.devices()[:2])
    >>> def f(x):
    ...     return jax.lax.fori_loop(0, 3, lambda i, y: y @ x, x).sum()
    >>> c = hlo_costs(jax.jit(f).lower(jnp.ones((4, 4))).compile().as_text(), mesh)
    >>> c["flops"]   # 3 matmuls of 4x4 by 4x4
    384
    """
    comps, entry = _computations(hlo_text, mesh)
    weights, unfused, unknown_loops = _weights(comps, entry)
    kinds: dict[str, float] = {}
    for name, w in weights.items():
        for kind, b in comps[name].kinds.items():
            kinds[kind] = kinds.get(kind, 0.0) + w * b
    return {
        "flops": sum(w * comps[n].flops for n, w in weights.items()),
        "collective_bytes": sum(w * comps[n].coll for n, w in weights.items()),
        "collectives": sum(w * comps[n].ops for n, w in weights.items()),
        "memory_bytes": sum(w * comps[n].mem for n, w in unfused.items()),
        "by_kind": kinds,
        "unknown_loops": unknown_loops,
    }


# --------------------------------------------------------------------------- memory spaces

# One array of a layout: its type, then its layout, whose `S(n)` names a memory space.
_LAYOUT_ARRAY = re.compile(r"(?:pred|bf16|[sufc][0-9]+|f8e[0-9a-z]+)\[[0-9,]*\](?:\{[^}]*\})?")
_ALIAS = re.compile(r"\{([0-9,]*)\}:\s*\(([0-9]+),")
#: The memory space XLA numbers host memory with (``S(5)`` in a layout).
HOST_SPACE = 5


@dataclasses.dataclass(frozen=True)
class MemorySplit:
    """A compiled program's bytes per device, in device memory and in host memory
    (see :func:`memory_split`).

    Attributes:
      device, host: ``{"argument", "output", "temp", "alias"}`` bytes in each memory;
        ``alias`` is output bytes that reuse an argument's buffer (donation).
      derived: ``True`` where the host figures were read from the program's entry
        layout (XLA's CPU backend reports none), ``False`` where they are the
        backend's own (``memory_analysis``).
    """

    device: dict[str, int]
    host: dict[str, int]
    derived: bool

    @property
    def device_bytes(self) -> int:
        """Device memory the call holds: arguments, outputs and temporaries, less aliased."""
        d = self.device
        return d["argument"] + d["output"] + d["temp"] - d["alias"]

    @property
    def host_bytes(self) -> int:
        """Host memory the call's arguments, outputs and temporaries take, less aliased."""
        h = self.host
        return h["argument"] + h["output"] + h["temp"] - h["alias"]


def _entry_layout(hlo_text: str) -> tuple[list[str], list[str]]:
    """The parameters' and the results' array types (with layouts) of the entry
    computation, in order, from the module header's ``entry_computation_layout``."""
    start = hlo_text.find("entry_computation_layout={")
    if start < 0:
        return [], []
    i = start + len("entry_computation_layout={")
    depth = 1
    end = i
    while end < len(hlo_text) and depth:
        depth += {"{": 1, "}": -1}.get(hlo_text[end], 0)
        end += 1
    params, _, results = hlo_text[i:end - 1].partition(")->")
    return _LAYOUT_ARRAY.findall(params), _LAYOUT_ARRAY.findall(results)


def _on_host(array_txt: str) -> bool:
    return f"S({HOST_SPACE})" in array_txt


def memory_split(compiled: Any) -> MemorySplit:
    """A compiled program's per-device bytes split into device and host memory.

    Where the backend reports host memory (``memory_analysis()``'s ``host_*``
    fields, filled on GPU and TPU), its figures are used as they are. XLA's CPU
    backend leaves them 0 and counts host arguments and outputs in
    ``argument_size_in_bytes`` and ``output_size_in_bytes``; the split is then
    derived from the entry computation's layout (``entry_computation_layout``
    in ``compiled.as_text()``): a parameter or result whose layout names memory
    space 5 (``S(5)``, XLA's host memory space) lives in host memory, its bytes
    (its per-device shape times its element size) are host argument or output
    bytes and are taken off the device's; an ``input_output_alias`` pair whose
    result is in host memory is host alias. Temporaries stay device bytes (on
    CPU there is no separate host temporary space to report).

    Args:
      compiled: ``jax.jit(f).lower(...).compile()`` (e.g. ``Trainer.lower(...).compile()``).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from nnx_shard import make_mesh
    >>> from nnx_shard.planner import memory_split
    >>> mesh = make_mesh("data=8")
    >>> dev = NamedSharding(mesh, P("data"))
    >>> host = dev.with_memory_kind("pinned_host")
    >>> x = jax.device_put(jnp.ones((1024, 256)), host)       # 128 KiB per device, on host
    >>> def f(x, g):
    ...     return jax.device_put(jax.device_put(x, dev) * 0.9 + g, host)
    >>> c = jax.jit(f, out_shardings=host).lower(x, jnp.ones((1024, 256), device=dev)).compile()
    >>> s = memory_split(c)
    >>> s.host["argument"], s.host["output"], s.device["argument"]
    (131072, 131072, 131072)
    """
    if not hasattr(compiled, "memory_analysis") or not hasattr(compiled, "as_text"):
        raise UsageError(f"memory_split: expected a compiled program, got "
                         f"{type(compiled).__name__}. Fix: jax.jit(f).lower(...).compile()")
    m = compiled.memory_analysis()
    fields = ("argument", "output", "temp", "alias")
    host = {k: int(getattr(m, f"host_{k}_size_in_bytes", 0) or 0) for k in fields}
    total = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in fields}
    if any(host.values()):
        return MemorySplit(total, host, derived=False)
    text = compiled.as_text()
    params, results = _entry_layout(text)
    host["argument"] = sum(_nbytes(p) for p in params if _on_host(p))
    host["output"] = sum(_nbytes(r) for r in results if _on_host(r))
    header = text[:text.find("\n")]
    aliases = header[header.find("input_output_alias={"):] if "input_output_alias" in header else ""
    for out_index, _param in _ALIAS.findall(aliases.partition("entry_computation_layout")[0]):
        index = int(out_index.split(",")[0]) if out_index else 0
        if index < len(results) and _on_host(results[index]):
            host["alias"] += _nbytes(results[index])
    device = {k: total[k] - host[k] for k in fields}
    return MemorySplit(device, host, derived=True)
