"""Grouped matmuls for the experts: ``x [rows, k] @ w[group] [k, n]`` for rows
sorted by group, with the semantics of ``jax.lax.ragged_dot`` (rows past the last
group give zeros) and two ways to compute them (:data:`EXPERT_MATMULS`):

* ``"ragged_dot"``: ``jax.lax.ragged_dot`` itself. XLA compiles it as a grouped
  matmul on TPU; XLA's CPU and GPU backends (jax 0.10-0.11, measured) rewrite it
  into a product of every row with every group's matrix, masked: ``groups`` times
  the FLOPs of the grouped product.
* ``"tiles"``: the rows in tiles of :func:`tile_rows` rows, and a loop
  (``jax.lax.scan``) over *visits*: each visit multiplies one tile by one group's
  matrix, keeping the tile's rows of that group. A tile that straddles a group
  boundary is visited once per group it holds, so at most ``tiles + groups - 1``
  visits cover every row: the FLOPs of the grouped product plus at most
  ``(groups - 1) x tile`` rows, and no copy of the weights (the same schedule as
  the grouped-matmul kernels of TPU MoE libraries, in plain JAX). Visits past the
  last group's rows are skipped at run time (``jax.lax.cond``), so a buffer that is
  mostly empty (expert parallelism's receive buffer) costs what it holds.

``"auto"`` is ``"ragged_dot"`` on TPU and ``"tiles"`` elsewhere.

XLA's ``cost_analysis()`` counts a loop's body once, whatever its trip count
(measured: a 10-step scan of a matmul counts one matmul), so a program with the
tile loop under-reports its FLOPs; inside :func:`unrolled` the loop is compiled
unrolled, the same visits, for counting them.

>>> x = jnp.arange(12.0).reshape(6, 2)
>>> w = jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])
>>> sizes = jnp.array([2, 3], jnp.int32)              # rows 0-1 group 0, 2-4 group 1
>>> grouped_matmul(x, w, sizes, "tiles")[:, 0]
Array([ 0.,  2.,  8., 12., 16.,  0.], dtype=float32)
>>> bool(jnp.array_equal(grouped_matmul(x, w, sizes, "tiles"),
...                      jax.lax.ragged_dot(x, w, sizes)))
True
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from nnx_shard._errors import UsageError, short

__all__ = ["EXPERT_MATMULS", "check_kind", "check_shapes", "grouped_matmul", "resolve",
           "tile_rows", "unrolled"]

#: The values of ``DecoderConfig.expert_matmul``.
EXPERT_MATMULS = ("auto", "tiles", "ragged_dot")

_UNROLL: contextvars.ContextVar[bool] = contextvars.ContextVar("nnx_shard_unroll_tiles",
                                                               default=False)


@contextlib.contextmanager
def unrolled() -> Iterator[None]:
    """Within it, the ``"tiles"`` loop traces unrolled (one matmul per visit in the
    program), so that XLA's ``cost_analysis()`` counts every visit: for measuring,
    not for running (more compile time and memory). It acts when a function is
    traced: wrap one that jax has traced already anew (jax reuses a trace).

    >>> with unrolled():
    ...     y = jax.jit(lambda x: grouped_matmul(x, jnp.ones((2, 3, 4)),
    ...                 jnp.array([5, 3], jnp.int32), "tiles")).lower(jnp.ones((8, 3)))
    >>> "while" in y.as_text()
    False
    """
    token = _UNROLL.set(True)
    try:
        yield
    finally:
        _UNROLL.reset(token)


def check_kind(kind: object, where: str = "") -> None:
    """Refuses a value that is not one of :data:`EXPERT_MATMULS` (``where`` prefixes the
    name, e.g. ``"DecoderConfig."``).

    >>> check_kind("dense", "DecoderConfig.")
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: DecoderConfig.expert_matmul='dense'; valid: 'auto', 'tiles', 'ragged_dot'. Fix: e.g. expert_matmul='auto'.
    """
    if kind not in EXPERT_MATMULS:
        raise UsageError(f"{where}expert_matmul={short(kind, 40)}; valid: "
                         + ", ".join(repr(k) for k in EXPERT_MATMULS)
                         + ". Fix: e.g. expert_matmul='auto'.")


def resolve(kind: str) -> str:
    """``"tiles"`` or ``"ragged_dot"`` for an :data:`EXPERT_MATMULS` value on the
    default backend (``"auto"``: ``ragged_dot`` on TPU, where XLA has a grouped kernel
    for it).

    >>> resolve("tiles"), resolve("auto") == ("ragged_dot" if jax.default_backend() == "tpu"
    ...                                       else "tiles")
    ('tiles', True)
    """
    check_kind(kind)
    if kind == "auto":
        return "ragged_dot" if jax.default_backend() == "tpu" else "tiles"
    return kind


def tile_rows(rows: int, groups: int) -> int:
    """The tile height for about ``rows`` rows over ``groups`` groups: the largest
    power of two with ``(groups - 1) x tile <= rows / 8`` (the straddling visits add
    at most 1/8 to the FLOPs), between 8 and 512, and no taller than the rows need.

    >>> tile_rows(4096, 8), tile_rows(32768, 128), tile_rows(32, 4), tile_rows(100, 1)
    (64, 32, 8, 128)
    """
    need = 1 << max(rows - 1, 0).bit_length()
    if groups <= 1:
        return max(8, min(512, need))
    budget = rows // (8 * (groups - 1))
    tile = 1 << max(budget.bit_length() - 1, 0) if budget else 1
    return max(8, min(512, tile, need))


def grouped_matmul(x: jax.Array, w: jax.Array, sizes: jax.Array, kind: str = "auto", *,
                   tile: int | None = None) -> jax.Array:
    """``jax.lax.ragged_dot(x, w, sizes)``: ``x [rows, k]`` sorted by group, ``w
    [groups, k, n]``, ``sizes [groups]`` (int32, summing to at most ``rows``; later rows
    give zeros), computed as ``kind`` says (:data:`EXPERT_MATMULS`); ``tile``: the
    tile height of ``"tiles"`` (default :func:`tile_rows`). Differentiable in ``x`` and
    ``w``.

    >>> x, w = jnp.ones((5, 3)), jnp.ones((2, 3, 4))
    >>> grouped_matmul(x, w, jnp.array([2, 2], jnp.int32), "tiles", tile=2)[:, 0]
    Array([3., 3., 3., 3., 0.], dtype=float32)
    """
    kind = resolve(kind)
    check_shapes(x, w, sizes)
    if kind == "ragged_dot":
        return jax.lax.ragged_dot(x, w, sizes)
    rows, groups = x.shape[0], w.shape[0]
    if rows == 0:  # no tile to visit: ragged_dot's empty product
        return jnp.zeros((0, w.shape[2]), jnp.result_type(x.dtype, w.dtype))
    tile = tile or tile_rows(rows, groups)
    tiles = -(-rows // tile)
    schedule = _schedule(sizes.astype(jnp.int32), tile, tiles, tiles + groups - 1)
    out = _tiles(_padded(x, tiles, tile), w, schedule, tile)
    return out.reshape(tiles * tile, -1)[:rows]


def check_shapes(x: jax.Array, w: jax.Array, sizes: jax.Array) -> None:
    """Refuses the shapes ``jax.lax.ragged_dot`` refuses (``x [rows, k]``, ``w [groups,
    k, n]``, ``sizes [groups]`` of integers), whichever way the product is computed:
    the tile loop would read a ``sizes`` of another length without an error.

    >>> check_shapes(jnp.ones((6, 2)), jnp.ones((3, 2, 4)), jnp.ones((2,), jnp.int32))
    Traceback (most recent call last):
    ...
    nnx_shard._errors.UsageError: grouped_matmul: sizes (ragged_dot's group_sizes) has 2 entries but w has 3 groups (w [groups, k, n] of shape (3, 2, 4)): one size per group. Fix: sizes of shape (3,), e.g. jnp.bincount(group_ids, length=3).
    """
    xs, ws, ss = (tuple(getattr(a, "shape", ())) for a in (x, w, sizes))
    if len(xs) != 2 or len(ws) != 3 or xs[1] != ws[1]:
        raise UsageError(f"grouped_matmul: x of shape {xs} and w of shape {ws} are not x "
                         "[rows, k] and w [groups, k, n] with the same k. Fix: rows sorted "
                         "by group as x [rows, k], one matrix per group as w [groups, k, n].")
    dtype = getattr(sizes, "dtype", None)
    if len(ss) != 1 or ss[0] != ws[0]:
        count = f"{ss[0]} entries" if len(ss) == 1 else f"shape {ss}"
        raise UsageError(f"grouped_matmul: sizes (ragged_dot's group_sizes) has {count} but "
                         f"w has {ws[0]} groups (w [groups, k, n] of shape {ws}): one size per "
                         f"group. Fix: sizes of shape ({ws[0]},), e.g. "
                         f"jnp.bincount(group_ids, length={ws[0]}).")
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise UsageError(f"grouped_matmul: sizes (ragged_dot's group_sizes) must hold integers "
                         f"(rows per group), got {dtype}. Fix: sizes.astype(jnp.int32).")


# The visits' schedule and the padded rows are computed once per call and kept for the
# backward pass, which walks the same visits.
@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiles(xp: jax.Array, w: jax.Array, schedule: tuple[jax.Array, ...], tile: int
           ) -> jax.Array:
    return _products(xp, w, schedule, tile)


def _tiles_fwd(xp: jax.Array, w: jax.Array, schedule: tuple[jax.Array, ...], tile: int
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]]:
    return _products(xp, w, schedule, tile), (xp, w, schedule)


def _tiles_bwd(tile: int, res: tuple[jax.Array, jax.Array, tuple[jax.Array, ...]],
               dy: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    # Written out rather than differentiated through the loop: autodiff of the loop
    # would add each visit's weight gradient into a zero array of every group's
    # weights (groups x k x n per visit); here it goes into its own group's slice.
    xp, w, schedule = res  # dy is padded like xp: the rows past x's are zero
    dx = _products(dy, w, schedule, tile, transposed=True).astype(xp.dtype)
    # The weight-gradient loop starts from zeros computed from dx, so it runs after the
    # dx loop, the last read of w. XLA orders a step's in-place update of a donated w
    # (``w - lr * dw``) after w's reads only through data: without this it copies w
    # first (two of the expert stacks in docs/benchmarks.md's MoE step).
    return dx, _weight_grads(xp, dy, schedule, tile, w.shape[0], w.dtype, dx), None


_tiles.defvjp(_tiles_fwd, _tiles_bwd)


def _masked_tile(a: jax.Array, tile: int, t: jax.Array, lo: jax.Array, hi: jax.Array
                 ) -> jax.Array:
    """Tile ``t`` of the padded ``a [tiles, tile, ...]``, zero outside rows ``lo..hi``."""
    r = t * tile + jnp.arange(tile)
    at = jax.lax.dynamic_index_in_dim(a, t, 0, keepdims=False)
    return jnp.where(((r >= lo) & (r < hi))[:, None], at, jnp.zeros((), at.dtype))


def _padded(a: jax.Array, tiles: int, tile: int) -> jax.Array:
    return jnp.pad(a, ((0, tiles * tile - a.shape[0]), (0, 0))).reshape(tiles, tile, -1)


def _unroll(schedule: tuple[jax.Array, ...]) -> int:
    return schedule[0].shape[0] if _UNROLL.get() else 1


def _products(xp: jax.Array, w: jax.Array, schedule: tuple[jax.Array, ...], tile: int,
              transposed: bool = False) -> jax.Array:
    """The forward loop over the padded rows ``xp [tiles, tile, k]``: each visit's tile
    times its group's matrix (``w [groups, k, n]``, or with ``transposed`` ``[groups,
    n, k]`` used as its transpose), each row from its own group's visit: ``[tiles,
    tile, n]``."""
    n = w.shape[1] if transposed else w.shape[2]
    out_dtype = jnp.result_type(xp.dtype, w.dtype)

    # Each visit writes its rows of its tile into the output, carried through the loop
    # and updated in place: no [visits, tile, n] stack of products summed after the
    # loop (XLA's CPU backend sums bfloat16 in float32: a float32 copy of the stack).
    # The carry holds the values' bits (unsigned integers of their width): XLA's CPU
    # backend computes a bfloat16 select or update through float32, and would convert
    # the whole carry there and back at every visit.
    bits = _bits(out_dtype)

    def step(out: jax.Array, v: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        t, g, on, lo, hi = v

        def product() -> jax.Array:
            wg = jax.lax.dynamic_index_in_dim(w, g, 0, keepdims=False)
            xt = jax.lax.dynamic_index_in_dim(xp, t, 0, keepdims=False)
            y = jax.lax.dot_general(xt, wg, (((1,), (1 if transposed else 0,)), ((), ())))
            return jax.lax.bitcast_convert_type(y.astype(out_dtype), bits)

        part = jax.lax.cond(on, product, lambda: jnp.zeros((tile, n), bits))
        # A row takes the product of its own group's visit alone.
        r = t * tile + jnp.arange(tile)
        keep = (on & (r >= lo) & (r < hi))[:, None]
        old = jax.lax.dynamic_index_in_dim(out, t, 0, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(out, jnp.where(keep, part, old), t, 0), None

    out, _ = jax.lax.scan(step, _zeros_after((xp.shape[0], tile, n), bits, xp), schedule,
                          unroll=_unroll(schedule))
    return jax.lax.bitcast_convert_type(out, out_dtype)


def _zeros_after(shape: tuple[int, ...], dtype: Any, after: jax.Array) -> jax.Array:
    """Zeros computed from ``after``'s first element: a loop's first carry, which XLA
    then builds once ``after`` exists, for that loop alone.

    XLA builds a constant zero array once, at the program's start, and copies it into
    the carry of each loop that starts from it: every copy lives from there to its loop
    (in docs/benchmarks.md's MoE step, the weight gradients' carries through the whole
    forward pass). ``min(unsigned, 0)`` is zero for any value, and XLA's simplifier
    leaves it (it folds ``a ^ a`` and ``a - a``: measured on jax 0.10.2)."""
    if not after.size:
        return jnp.zeros(shape, dtype)
    a = jax.lax.bitcast_convert_type(after.reshape(-1)[0], _bits(after.dtype))
    return jnp.broadcast_to(jnp.minimum(a, jnp.zeros((), a.dtype)).astype(dtype), shape)


def _bits(dtype: jnp.dtype) -> jnp.dtype:
    """The unsigned integer type of ``dtype``'s width."""
    return jnp.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def _weight_grads(xp: jax.Array, dyp: jax.Array, schedule: tuple[jax.Array, ...],
                  tile: int, groups: int, dtype: jnp.dtype, after: jax.Array) -> jax.Array:
    """``dw [groups, k, n]`` in ``dtype`` from the padded rows and output gradients,
    computed once ``after`` exists (:func:`_zeros_after`).

    A group's visits are consecutive, so its gradient is summed in one float32
    ``[k, n]`` carry (reset where the group changes) and written once, at the group's
    last visit, into its slice of ``dw`` in ``dtype`` (writing it at every visit, the
    slice's last write holding the sum, converts the carry at each: more CPU). No
    float32 ``[groups, k, n]`` accumulator (and its zero start) is live; a bfloat16 one
    would be smaller still but slower on CPU, where bfloat16 adds are emulated, and
    rounded at every visit (the MoE section of docs/benchmarks.md). A group with no
    rows keeps ``dw``'s zeros; the spare visits past the last group's are in the last
    group and add zeros (or, that group empty, write them)."""
    k, n = xp.shape[2], dyp.shape[2]

    def step(carry: tuple[jax.Array, jax.Array, jax.Array], v: tuple[jax.Array, ...]
             ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], None]:
        dw, acc, prev = carry
        t, g, on, lo, hi, last = v

        def product() -> jax.Array:
            return jnp.dot(_masked_tile(xp, tile, t, lo, hi).T,
                           jax.lax.dynamic_index_in_dim(dyp, t, 0, keepdims=False),
                           preferred_element_type=jnp.float32)

        part = jax.lax.cond(on, product, lambda: jnp.zeros((k, n), jnp.float32))
        acc = jnp.where(g == prev, acc, jnp.zeros((), jnp.float32)) + part

        def write() -> jax.Array:
            sums = jax.lax.bitcast_convert_type(acc.astype(dtype), bits)
            return jax.lax.dynamic_update_index_in_dim(dw, sums, g, 0)

        dw = jax.lax.cond(last, write, lambda: dw)
        return (dw, acc, g), None

    # dw holds its values' bits, as _products' carry does (and for the same reason).
    bits = _bits(dtype)
    init = (_zeros_after((groups, k, n), bits, after),
            _zeros_after((k, n), jnp.float32, after), jnp.int32(-1))
    group = schedule[1]
    last = group != jnp.append(group[1:], -1)
    (dw, _, _), _ = jax.lax.scan(step, init, (*schedule, last), unroll=_unroll(schedule))
    return jax.lax.bitcast_convert_type(dw, dtype)


def _schedule(sizes: jax.Array, tile: int, tiles: int, visits: int
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The visits, in group order: each one's tile, group, whether it is live, and the
    group's first and past-last rows. Group ``g`` spans tiles ``first[g]..last[g]``; the
    spare visits repeat the last tile and are not live."""
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile
    last = (jnp.maximum(ends, 1) - 1) // tile
    per_group = jnp.where(sizes > 0, last - first + 1, 0)
    through = jnp.cumsum(per_group)
    v = jnp.arange(visits, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(through, v, side="right", method="compare_all"),
                        sizes.shape[0] - 1)
    live = v < through[-1]
    which = jnp.where(live, first[group] + v - (through - per_group)[group], tiles - 1)
    which = jnp.clip(which, 0, tiles - 1).astype(jnp.int32)
    return which, group.astype(jnp.int32), live, starts[group], ends[group]
