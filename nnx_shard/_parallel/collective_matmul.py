"""Collective matmuls as ``ppermute`` rings, documented where they are public:
:mod:`nnx_shard.collective_matmul`."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from nnx_shard._axes import axes_entry, entry_axes
from nnx_shard._errors import ShardingError, UsageError
from nnx_shard._mesh import called, current, option, watching

__all__ = ["OPTION", "all_gather_matmul", "check_tokens", "expect_projection",
           "matmul_reduce_scatter", "projection"]

#: The execution option (``Rules.with_options(collective_matmul=True)``) this module reads.
OPTION = "collective_matmul"


def _parse(eq: Any, x: jax.Array, w: jax.Array) -> tuple[str, str, str]:
    if not isinstance(eq, str) or eq.count("->") != 1 or eq.split("->")[0].count(",") != 1:
        raise UsageError(f"eq must be a two-operand einsum, got {eq!r}. Fix: e.g. "
                         "eq='ble,ehk->blhk'")
    ins, out = eq.replace(" ", "").split("->")
    xl, wl = ins.split(",")
    for what, letters, a in (("x", xl, x), ("w", wl, w)):
        if len(letters) != jnp.ndim(a):
            raise UsageError(
                f"eq {eq!r} gives {what} {len(letters)} dimensions ({letters!r}) but {what} has "
                f"shape {tuple(jnp.shape(a))}. Fix: write one letter per dimension of {what} in eq."
            )
    return xl, wl, out


def _letter(eq: str, letters: str, letter: Any, what: str, role: str) -> int:
    if not isinstance(letter, str) or len(letter) != 1 or letter not in letters:
        raise UsageError(
            f"{role}={letter!r} must be one letter of {what} in eq {eq!r} (one of "
            f"{list(letters)}). Fix: {role}={letters[0]!r}, or another letter of {what}."
        )
    return letters.index(letter)


def _ring_size(axis: str, mesh: Mesh | AbstractMesh) -> int:
    if axis not in mesh.shape:
        raise ShardingError(
            f"collective matmul over mesh axis {axis!r}, but the mesh has axes "
            f"{tuple(mesh.axis_names)}. Fix: pass axis= one of them, or build the mesh with "
            f"a {axis!r} axis (e.g. nnx_shard.make_mesh('data=2,{axis}=4'))."
        )
    return int(mesh.shape[axis])


def _divides(eq: str, operand: str, shape: Sequence[int], dim: int, letter: str, axis: str,
             n: int, role: str) -> None:
    size = int(shape[dim])
    if size % n:
        lo, hi = (size // n) * n, -(-size // n) * n
        near = " or ".join(str(v) for v in (lo, hi) if v > 0)
        fits = next(d for d in range(n, 0, -1) if n % d == 0 and size % d == 0)
        raise ShardingError(
            f"collective matmul {eq!r}: dimension {letter!r} of {operand} (shape "
            f"{tuple(shape)}), which the ring {role} over mesh axis {axis!r}, has size {size}, "
            f"not divisible by the {axis!r} size {n}. Fix: make it a multiple of {n} "
            f"(e.g. {near}), or use a mesh with {axis}={fits}."
        )


def _spec(letters: str, sharded: dict[str, str]) -> PartitionSpec:
    return PartitionSpec(*(sharded.get(c) for c in letters))


def _typed_axes(a: jax.Array, letters: str, drop: str) -> dict[str, tuple[str, ...]]:
    """Per letter, the mesh axes (other than ``drop``) that ``a``'s type shards it over."""
    spec = tuple(jax.typeof(a).sharding.spec) + (None,) * len(letters)
    out = {}
    for c, entry in zip(letters, spec, strict=False):
        axes = entry_axes(entry)
        out[c] = tuple(x for x in axes if x != drop)
    return out


def _shard_map(body: Any, mesh: Mesh | AbstractMesh, axis: str, x: jax.Array, w: jax.Array, xl: str, wl: str,
               out: str, rings: tuple[str, str, str],
               layout: dict[str, tuple[str, ...]] | None) -> jax.Array:
    """``body`` over ``x``, ``w`` sharded over ``axis`` along the letters
    ``rings`` (of x, w, output).

    ``layout``: per letter of ``x``, the other mesh axes ``x`` is sharded over
    (the batch over ``data``). Unknown (``None``: Auto axes and no rules), the
    map is manual over ``axis`` alone and the partitioner keeps the other
    axes. Known, the map is manual over every axis, because manual over
    ``axis`` alone each block's dot gets its own collective over the other
    axes: an all-gather of the batch (Explicit axes) or an all-reduce of the
    weight's gradient (Auto axes). ``x`` then keeps its other axes on the
    dimensions that pass to the output (the ring's own excepted), ``w`` is
    gathered along them (FSDP's all-gather before a matmul) and the output
    takes ``x``'s.
    """
    x_ring, w_ring, out_ring = rings
    if layout is None:
        auto = jax.shard_map(body, mesh=mesh, axis_names={axis},
                             in_specs=(_spec(xl, {x_ring: axis}), _spec(wl, {w_ring: axis})),
                             out_specs=_spec(out, {out_ring: axis}))
        return _one_program(auto, x, w)
    kept = {c: (tuple(layout.get(c, ())) if c in out and c not in wl and c != x_ring else ())
            for c in xl}
    x_spec = PartitionSpec(*(axes_entry(kept[c] + ((axis,) if c == x_ring else ())) for c in xl))
    w_spec = _spec(wl, {w_ring: axis})
    o_spec = PartitionSpec(*(axes_entry(kept.get(c, ()) + ((axis,) if c == out_ring else ()))
                             for c in out))
    explicit = any(t == AxisType.Explicit for t in mesh.axis_types)
    varying = tuple(sorted({a for v in kept.values() for a in v}))

    def manual(xs: jax.Array, ws: jax.Array) -> jax.Array:
        # The weight meets data that varies over the batch axes: mark it varying
        # once here, so its gradient is reduced over them once, not at every block.
        return body(xs, jax.lax.pcast(ws, varying, to="varying") if varying else ws)

    def ring(x: jax.Array, w: jax.Array) -> jax.Array:
        if explicit:
            x = jax.sharding.reshard(x, x_spec)
            w = jax.sharding.reshard(w, w_spec)
        return jax.shard_map(manual, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=o_spec)(x, w)

    return _one_program(ring, x, w)


def _one_program(ring: Any, x: jax.Array, w: jax.Array) -> jax.Array:
    """``ring(x, w)``, compiled as one program when called on concrete arrays: run
    eagerly, a shard_map dispatches each op of its ``n`` ring steps as a program of its
    own (hundreds of compilations). Traced (a model's projection under jit), it is
    inlined as it is."""
    if isinstance(x, jax.core.Tracer) or isinstance(w, jax.core.Tracer):
        return ring(x, w)
    return jax.jit(ring)(x, w)


def _layout(mesh: Mesh | AbstractMesh, x: jax.Array, letters: str, drop: str) -> dict[str, tuple[str, ...]] | None:
    """``x``'s other mesh axes per letter, read from its type (Explicit axes), else ``None``."""
    if not any(t == AxisType.Explicit for t in mesh.axis_types):
        return None
    return _typed_axes(x, letters, drop)


def _mesh(mesh: Mesh | AbstractMesh | None) -> Mesh | AbstractMesh:
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    if abstract.empty:
        raise ShardingError(
            "mesh=None and no mesh is active. Fix: pass mesh=, or call inside "
            "nnx_shard.use(...) (or jax.set_mesh)."
        )
    return abstract


def _halves(n_block: int, n: int, bidirectional: bool | None) -> bool:
    if bidirectional is None:
        return n > 2 and n_block % 2 == 0
    if bidirectional and n_block % 2:
        raise UsageError(
            f"bidirectional=True splits each device's block of {n_block} rows in two halves "
            "that go opposite ways round the ring; it needs an even block. Fix: "
            "bidirectional=None (chooses) or False."
        )
    return bool(bidirectional) and n > 1


def _shift(axis: str, n: int, step: int) -> Any:
    perm = [(j, (j + step) % n) for j in range(n)]
    return lambda a: jax.lax.ppermute(a, axis, perm)


def _gather_body(eq: str, x: jax.Array, w: jax.Array, *, axis: str, n: int, dim: int,
                 out_dim: int, both: bool) -> jax.Array:
    """Per device: ``x`` holds block ``d`` (of ``n``) along ``dim``; returns
    ``einsum(eq, gathered x, w)`` with every block in place along ``out_dim``."""
    d = jax.lax.axis_index(axis)
    block = x.shape[dim]
    parts = ([(x, 1, 0)] if not both else
             [(jax.lax.slice_in_dim(x, 0, block // 2, axis=dim), 1, 0),
              (jax.lax.slice_in_dim(x, block // 2, block, axis=dim), -1, block // 2)])
    out = None
    moving = [p for p, _, _ in parts]
    for s in range(n):
        if s:
            moving = [_shift(axis, n, step)(p) for p, (_, step, _) in zip(moving, parts,
                                                                          strict=True)]
        for p, (_, step, offset) in zip(moving, parts, strict=True):
            y = jnp.einsum(eq, p, w)
            if out is None:
                # Built from y so that it carries y's type (sharding) on Explicit meshes.
                out = jnp.concatenate([jnp.zeros_like(y)] * (n * len(parts)), axis=out_dim)
            # After s steps forward (backward) this device holds block d - s (d + s).
            owner = (d - step * s) % n
            out = jax.lax.dynamic_update_slice_in_dim(out, y, owner * block + offset, out_dim)
    assert out is not None  # n >= 1 steps ran
    return out


def _scatter_body(eq: str, x: jax.Array, w: jax.Array, *, axis: str, n: int, dim: int,
                  out_dim: int, both: bool) -> jax.Array:
    """Per device: ``x`` is whole along ``dim`` and holds this device's share of
    the contraction; returns block ``d`` along ``out_dim`` of the sum over
    devices of ``einsum(eq, x, w)``."""
    d = jax.lax.axis_index(axis)
    block = x.shape[dim] // n
    parts = [(1, 0, block)] if not both else [(1, 0, block // 2), (-1, block // 2, block // 2)]
    sums: list[jax.Array] = []
    for step, offset, size in parts:
        acc: jax.Array | None = None
        for s in range(n):
            # The running sum that ends on device d after n - 1 hops forward
            # (backward) is for block d; at hop s it collects block d - s - 1 (d + s + 1).
            owner = (d - step * (s + 1)) % n
            piece = jax.lax.dynamic_slice_in_dim(x, owner * block + offset, size, axis=dim)
            y = jnp.einsum(eq, piece, w)
            acc = y if acc is None else _shift(axis, n, step)(acc) + y
        assert acc is not None  # n >= 1 hops ran
        sums.append(acc)
    return sums[0] if len(sums) == 1 else jnp.concatenate(sums, axis=out_dim)


def _ring(body: Any, eq: str, x: jax.Array, w: jax.Array, letters: tuple[str, str, str],
          rings: tuple[str, str, str], sharded: Sequence[tuple[str, Sequence[int], int, str, str]],
          axis: str, mesh: Mesh | AbstractMesh | None, bidirectional: bool | None,
          layout: dict[str, tuple[str, ...]] | None) -> jax.Array:
    """Both collective matmuls once their letters are checked: ``body``
    (:func:`_gather_body` or :func:`_scatter_body`) run in :func:`_shard_map`
    over the ring of ``axis`` (``rings``: the sharded letters of x, w, output).
    ``sharded``: the ``(operand, shape, dim, letter, role)`` of each dimension
    the ring splits, checked to divide by the ring's size; the first is the
    dimension of ``x`` that the ring walks, which the output keeps."""
    called(OPTION)  # a user's own ring projection counts for expect_projection too
    xl, wl, out = letters
    mesh = _mesh(mesh)
    n = _ring_size(axis, mesh)
    for operand, shape, dim, letter, role in sharded:
        _divides(eq, operand, shape, dim, letter, axis, n, role)
    _, _, dim, ring, _ = sharded[0]
    both = _halves(x.shape[dim] // n, n, bidirectional)
    fn = functools.partial(body, f"{xl},{wl}->{out}", axis=axis, n=n, dim=dim,
                           out_dim=out.index(ring), both=both)
    return _shard_map(fn, mesh, axis, x, w, xl, wl, out, rings,
                      layout if layout is not None else _layout(mesh, x, xl, axis))


def all_gather_matmul(eq: str, x: jax.Array, w: jax.Array, *, gather: str, shard: str,
                      axis: str = "model", mesh: Mesh | AbstractMesh | None = None,
                      bidirectional: bool | None = None,
                      layout: dict[str, tuple[str, ...]] | None = None) -> jax.Array:
    """``jnp.einsum(eq, x, w)`` for ``x`` sharded over ``axis`` along its
    dimension ``gather`` and ``w`` along its output dimension ``shard``
    (column-parallel), with the all-gather of ``x`` done in ring steps that each
    multiply the block at hand. The result is sharded over ``axis`` along
    ``shard``.

    Args:
      eq: a two-operand einsum; ``gather`` must be a letter of ``x`` kept in
        the output, ``shard`` a letter of ``w`` kept in the output, not in ``x``.
      axis: the mesh axis of the ring (manual inside; other axes stay automatic).
      mesh: default: the active mesh (``nnx_shard.use`` / ``jax.set_mesh``).
      bidirectional: half of each block goes each way round the ring; ``None``
        chooses it where the ring has more than 2 devices and blocks split evenly.
      layout: per letter of ``x``, the other mesh axes it is sharded over (say
        ``{"b": ("data",)}``); default: read from ``x``'s type on Explicit
        axes, else left to the partitioner.

    Raises:
      ShardingError: a sharded dimension does not divide by the ``axis`` size.

    >>> import jax.numpy as jnp
    >>> import numpy as np
    >>> from nnx_shard.collective_matmul import all_gather_matmul
    >>> from nnx_shard import make_mesh
    >>> mesh = make_mesh("data=2,model=4")
    >>> x, w = jnp.ones((2, 8, 16)), jnp.ones((16, 4, 2))
    >>> y = all_gather_matmul("ble,ehk->blhk", x, w, gather="l", shard="h", mesh=mesh)
    >>> y.shape, float(y[0, 0, 0, 0]), y.sharding.spec
    ((2, 8, 4, 2), 16.0, P(None, None, 'model'))
    """
    xl, wl, out = _parse(eq, x, w)
    g = _letter(eq, xl, gather, "x", "gather")
    if gather not in out:
        raise UsageError(f"gather={gather!r} must also be an output letter of eq {eq!r}. "
                         "Fix: gather a dimension of x that the output keeps")
    h = _letter(eq, wl, shard, "w", "shard")
    if shard not in out or shard in xl:
        raise UsageError(
            f"shard={shard!r} must be a letter of w that is in the output and not in x "
            f"(column-parallel) in eq {eq!r}. Fix: shard= the letter of w's output "
            "dimension, e.g. 'k' in 'ble,ehk->blhk'"
        )
    return _ring(_gather_body, eq, x, w, (xl, wl, out), (gather, shard, shard),
                 [("x", x.shape, g, gather, "gathers"), ("w", w.shape, h, shard, "shards")],
                 axis, mesh, bidirectional, layout)


def matmul_reduce_scatter(eq: str, x: jax.Array, w: jax.Array, *, scatter: str, contract: str,
                          axis: str = "model", mesh: Mesh | AbstractMesh | None = None,
                          bidirectional: bool | None = None,
                          layout: dict[str, tuple[str, ...]] | None = None) -> jax.Array:
    """``jnp.einsum(eq, x, w)`` for ``x`` and ``w`` both sharded over ``axis``
    along the contracted dimension ``contract`` (row-parallel), with the
    reduction of the partial products done as a reduce-scatter in ring steps
    that each add one block's product. The result is sharded over ``axis``
    along ``scatter``.

    Args:
      eq: a two-operand einsum; ``contract`` must be a letter of both operands
        missing from the output, ``scatter`` a letter of ``x`` kept in the output.
      axis, mesh, bidirectional, layout: as :func:`all_gather_matmul`.

    Raises:
      ShardingError: a sharded dimension does not divide by the ``axis`` size.

    >>> import jax.numpy as jnp
    >>> from nnx_shard.collective_matmul import matmul_reduce_scatter
    >>> from nnx_shard import make_mesh
    >>> mesh = make_mesh("data=2,model=4")
    >>> x, w = jnp.ones((2, 8, 4, 2)), jnp.ones((4, 2, 16))
    >>> y = matmul_reduce_scatter("blhk,hke->ble", x, w, scatter="l", contract="h", mesh=mesh)
    >>> y.shape, float(y[0, 0, 0]), y.sharding.spec
    ((2, 8, 16), 8.0, P(None, 'model'))
    """
    xl, wl, out = _parse(eq, x, w)
    s = _letter(eq, xl, scatter, "x", "scatter")
    if scatter not in out or scatter in wl:
        raise UsageError(f"scatter={scatter!r} must be a letter of x in the output, not in w, "
                         f"in eq {eq!r}. Fix: scatter= a dimension of x that the output "
                         "keeps, e.g. 'l' in 'blf,fe->ble'")
    c = _letter(eq, xl, contract, "x", "contract")
    if contract not in wl or contract in out:
        raise UsageError(f"contract={contract!r} must be a letter of both operands that the "
                         f"output sums over, in eq {eq!r}. Fix: contract= the summed "
                         "letter, e.g. 'f' in 'blf,fe->ble'")
    return _ring(_scatter_body, eq, x, w, (xl, wl, out), (contract, contract, scatter),
                 [("x", x.shape, s, scatter, "scatters"), ("x", x.shape, c, contract, "reduces")],
                 axis, mesh, bidirectional, layout)


#: Values of the rules option ``collective_matmul`` -> ``bidirectional``.
_DIRECTIONS: dict[Any, bool | None] = {True: None, "bidirectional": True, "unidirectional": False}


def projection(eq: str, x: jax.Array, w: jax.Array, out: NamedSharding, seq: str) -> jax.Array | None:
    """A model projection ``einsum(eq, x, w)`` as a collective matmul over the
    mesh axis that ``out`` (the output layout the rules give) implies, or
    ``None`` where the layout needs no ring (the caller runs the plain einsum).

    Column-parallel (an output letter of ``w`` alone is sharded, ``seq`` is
    not): :func:`all_gather_matmul` along ``seq``. Row-parallel (``seq`` is
    sharded in the output): :func:`matmul_reduce_scatter`, contracting the
    first contracted letter of ``w`` (Megatron's row split). The result is
    constrained to ``out``. The rules option ``collective_matmul`` picks the
    ring: ``True`` (bidirectional where blocks split evenly),
    ``"bidirectional"`` or ``"unidirectional"``.

    >>> from nnx_shard import make_mesh
    >>> mesh = make_mesh("data=2,model=4")
    >>> out = NamedSharding(mesh, PartitionSpec("data", "model", None))
    >>> y = projection("blm,me->ble", jnp.ones((2, 8, 16)), jnp.ones((16, 4)), out, "l")
    >>> float(y[0, 0, 0]), y.sharding.spec
    (16.0, P('data', 'model', None))
    """
    called(OPTION)  # for expect_projection
    xl, wl, ol = _parse(eq, x, w)
    spec = tuple(out.spec) + (None,) * (len(ol) - len(out.spec))
    value = option(OPTION, True)
    if value not in _DIRECTIONS:
        raise ShardingError(
            f"rules option collective_matmul={value!r} is not a ring kind; valid: True, "
            "'bidirectional', 'unidirectional' (or False / None: plain einsums). Fix: "
            "rules.with_options(collective_matmul=True)."
        )
    both = _DIRECTIONS[value]

    def single(entry: Any) -> str | None:
        axes = entry_axes(entry)
        return axes[0] if len(axes) == 1 else None

    mesh = out.mesh
    seq_axis = single(spec[ol.index(seq)])

    def layout(axis: str) -> dict[str, tuple[str, ...]]:
        # x's other axes, as the rules lay out the output dimensions it shares.
        got = {}
        for c, entry in zip(ol, spec, strict=True):
            axes = entry_axes(entry)
            got[c] = tuple(a for a in axes if a != axis)
        return got

    if seq_axis is not None:
        contract = next((c for c in wl if c in xl and c not in ol), None)
        if contract is None or mesh.shape[seq_axis] == 1:
            return None
        y = matmul_reduce_scatter(eq, x, w, scatter=seq, contract=contract, axis=seq_axis,
                                  mesh=mesh, layout=layout(seq_axis), bidirectional=both)
    else:
        cols = [(c, single(spec[i])) for i, c in enumerate(ol) if c in wl and c not in xl]
        col = next(((c, a) for c, a in cols if a is not None), None)
        if col is None or mesh.shape[col[1]] == 1:
            return None
        y = all_gather_matmul(eq, x, w, gather=seq, shard=col[0], axis=col[1], mesh=mesh,
                              layout=layout(col[1]), bidirectional=both)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(y, out)
    return jax.lax.with_sharding_constraint(y, out)



_WHAT = {"batch": "batch size", "length": "sequence length"}


def check_tokens(shape: Sequence[int], names: Sequence[str] = ("batch", "length")) -> None:
    """Raises a ``ShardingError`` with the fix when the active rules (from
    :func:`nnx_shard.use`) cannot split tokens of ``shape`` (logical ``names``)
    over their mesh axes: under collective matmuls the sequence stays split
    over the model axis between projections, so its length must divide.

    >>> import nnx_shard as ns
    >>> s = ns.strategies.get("async_tp")
    >>> with ns.use("data=2,model=4", s.rules):
    ...     check_tokens((8, 16))
    ...     check_tokens((8, 14))
    Traceback (most recent call last):
    ...
    nnx_shard._errors.ShardingError: collective matmuls (rules option collective_matmul=True, as in strategy 'async_tp') keep the sequence length split over mesh axis 'model' (size 4) ... Fix: make the sequence length a multiple of 4 (e.g. 12 or 16), use a mesh with model=2, ...
    """
    if (isinstance(shape, str | bytes) or not isinstance(shape, Sequence)
            or not all(isinstance(d, int | np.integer) and not isinstance(d, bool) and d >= 0
                       for d in shape)):
        raise ShardingError(f"check_tokens: shape must be a tuple of sizes >= 0, got "
                            f"{shape!r:.60}. Fix: e.g. check_tokens(tokens.shape)")
    if isinstance(names, str) or len(names) != len(shape):
        raise ShardingError(f"check_tokens: names {names!r:.60} must give one logical name per "
                            f"dimension of shape {tuple(shape)}. Fix: e.g. ('batch', 'length')")
    active = current()
    if active is None:
        return
    mesh, rules = active
    for name, size in zip(names, shape, strict=True):
        try:
            rules.spec((name,), shape=(size,), mesh=mesh)
            continue
        except ShardingError:
            pass
        entry = rules.spec((name,), mesh=mesh)[0]
        axes = entry_axes(entry)
        n = math.prod(int(mesh.shape[a]) for a in axes)
        what = _WHAT.get(name, f"{name!r} dimension")
        lo, hi = (size // n) * n, -(-size // n) * n
        near = " or ".join(str(v) for v in (lo, hi) if v > 0)
        fits = next(d for d in range(n, 0, -1) if n % d == 0 and size % d == 0)
        shown = axes[0] if len(axes) == 1 else axes
        why = (f"collective matmuls (rules option collective_matmul=True, as in strategy "
               f"'async_tp') keep the {what} split over mesh axis {shown!r} (size {n}) between "
               "the projections, but" if name == "length" else
               f"rule {name!r} splits the {what} over mesh axis {shown!r} (size {n}), but")
        raise ShardingError(
            f"{why} the tokens (shape {tuple(shape)}, logical axes {tuple(names)}) have {what} "
            f"{size}, not divisible by {n} (rule {name!r} -> {shown!r}). Fix: make the {what} a "
            f"multiple of {n} (e.g. {near}), use a mesh with {'x'.join(axes)}={fits}"
            + (", or strategy 'tp' (which does not split the sequence)." if name == "length"
               else ".")
        )


@contextlib.contextmanager
def expect_projection(fn_name: str = "the step") -> Iterator[None]:
    """Raises a ``ShardingError`` at the end of the block if the active rules ask for
    collective matmuls (option ``collective_matmul``, strategy ``async_tp``) but the
    code traced inside never ran a projection through :func:`projection`: the step
    would silently run as ``sp`` (the same layouts, no overlapped rings). Context
    parallelism checks its attention the same way.

    :func:`nnx_shard.multistep` (and so the Trainer) traces each step under it.

    >>> import nnx_shard as ns
    >>> with ns.use("data=2,model=4", ns.strategies.get("async_tp").rules):
    ...     with expect_projection("my_step"):
    ...         pass
    Traceback (most recent call last):
    ...
    nnx_shard._errors.ShardingError: my_step ran under rules with collective_matmul=True ...
    """
    value = option(OPTION)
    with watching() as calls:
        yield
    if value not in (None, False) and OPTION not in calls:
        raise ShardingError(
            f"{fn_name} ran under rules with collective_matmul={value!r} (strategy "
            "'async_tp'), but the model never ran a projection as a collective matmul, so "
            "the step would run as strategy 'sp' with nothing overlapped. Only stock "
            "nnx.Linear / nnx.LinearGeneral / nnx.Einsum layers whose kernels carry logical "
            "names split over the model axis (nnx_shard.tp_layers) and the rings of "
            "nnx_shard.collective_matmul run as one. Fix: annotate the projection kernels "
            "(e.g. ('embed', 'mlp')), compute the projections with stock layers or with "
            "nnx_shard.collective_matmul.all_gather_matmul / matmul_reduce_scatter, or train "
            "with strategy 'sp' (the same layouts)."
        )

