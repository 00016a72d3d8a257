"""Context parallelism: the attention op with the sequence split over devices.

:func:`nnx_shard._attention.attention` comes here when the execution option
``attention`` (:mod:`nnx_shard._attention._modes`) asks for one of two modes and
the rules map logical axis ``length`` to mesh axes of size > 1 (``context`` in
the ``cp`` presets):

* ``"ring"``: ring attention over the mesh axes ``length`` is mapped to
  (``context``), in a ``jax.shard_map`` that is manual over those axes and
  over the axes the batch and heads are split over (attention is per row and
  per head, so those need no communication). Each device keeps its query
  block; key/value blocks travel around the ring with ``jax.lax.ppermute``
  (each sent on before it is used, so the transfer can overlap the compute)
  while an online (log-sum-exp) softmax accumulates the output. No device
  holds the full-length keys and values, or more than one tile of scores
  (its queries x one key/value block) at a time. The backward pass runs the
  ring again (a ``jax.custom_vjp``): the key/value blocks go round once more,
  each followed by the gradient accumulated for it, which ends at its owner;
  scores are recomputed per tile instead of being stored. Each ring step is
  one call of the kernel's block math: one tile (``"dense"``), or query x
  key/value blocks (``"blockwise"``, the default: a device then never holds
  its whole local tile of scores either). cuDNN's kernel returns no per-block
  statistics, so ``"auto"`` and ``"cudnn"`` run blockwise here.
* ``"allgather"``: each device all-gathers the full-length keys and values over
  the context axes and attends with its local queries through the kernel
  (simpler, more memory: the comparison point).

Grouped-query attention keeps ``kv_heads`` on the ring (K/V are never
repeated). Masks: segment ids and a key padding mask (``[batch, 1, 1,
length]``) travel with the key/value blocks (they are per key); any other mask
is held per query row at full key length and cut to each block's columns.

Load balancing (causal, ring mode): the sequence is cut into ``2 x C`` chunks
(``C`` = the context axis size) and device ``i`` works on chunks ``i`` and
``2C - 1 - i`` (zig-zag, as in MaxText and torchtitan), so at every ring step
each device computes exactly half a block: queries of both its chunks against
the earlier key chunk, or its later query chunk against both key chunks.

The zig-zag order lives inside this op only. Activations everywhere else are
split over ``context`` in the user's token order (device ``i`` holds the
``i``-th contiguous slice); the op moves half-slices to the zig-zag layout with
two collective-permutes on entry and moves the output back with two on exit.
So the logits and the loss come out in the original order and the model keeps
plain learned positions. The alternative, permuting the tokens and targets
once at the input (free for a mean loss), would leave the logits in zig-zag
order (undoing that permutes a vocabulary-wide tensor) and would need the
position embeddings permuted alike: a model change, which this op avoids at
the price of four permutes of the local q/k/v/output slice per layer (small
next to the ``C - 1`` key/value block permutes of the ring itself).

Each step runs the per-device block math of :mod:`nnx_shard._attention._blocks`.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_shard._attention import _kernels as kernels
from nnx_shard._attention._blocks import Masks, delta, finish, grads, group_mask, merge, stats
from nnx_shard._axes import entry_axes
from nnx_shard._errors import ShardingError

__all__ = ["context_axes", "split_attention"]


def context_axes(mesh: Any, rules: Any, mode: str) -> tuple[str, ...]:
    """The mesh axes (size > 1) that the rules map ``length`` to, which ``mode`` (for
    the error message) splits the sequence over.

    >>> import nnx_shard as ns
    >>> s = ns.strategies.get("cp")
    >>> context_axes(ns.make_mesh("data=4,context=2"), s.rules, "ring")
    ('context',)
    """
    try:
        cands = rules.candidates("length")
    except KeyError:
        raise ShardingError(
            f"attention={mode!r} splits the sequence over the mesh axes of logical axis "
            f"'length', but the rules have no 'length' entry (their logical axes: "
            f"{', '.join(rules) or 'none'}). Fix: add one, "
            "e.g. rules | {'length': 'context'} (what nnx_shard.strategies.get('cp') does)."
        ) from None
    sizes = dict(mesh.shape)
    for cand in cands:
        if isinstance(cand, tuple) and cand and all(a in sizes for a in cand):
            return tuple(a for a in cand if sizes[a] > 1)
    return ()


def _check_length(q: jax.Array, axes: tuple[str, ...], c: int, mode: str, causal: bool) -> None:
    length = q.shape[1]
    chunks = 2 * c if (mode == "ring" and causal) else c
    if length % chunks == 0:
        return
    axis = axes[0] if len(axes) == 1 else axes
    what = (f"2 x {c} = {chunks} zig-zag chunks (device i takes chunks i and {chunks - 1} - i)"
            if chunks != c else f"{c} slices")
    good = [n for n in range(chunks, 8 * chunks + 1, chunks)]
    near = min(good, key=lambda n: abs(n - length))
    raise ShardingError(
        f"attention={mode!r}: sequence length {length} (q {tuple(q.shape)}, logical axes "
        f"('batch', 'length', 'heads', 'kv')) does not split into {what} over mesh axis "
        f"{axis!r} of size {c}. Fix: use a sequence length that divides by {chunks} (e.g. "
        f"{near}), or a mesh whose context size C has "
        + ("2 x C" if chunks != c else "C") + f" dividing {length}."
    )


def split_attention(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, *, mode: str,
                    axes: tuple[str, ...], mesh: Any, rules: Any, causal: bool,
                    block: int | None, softcap: float | None = None) -> jax.Array:
    """Attention of ``q``, ``k``, ``v`` (self-attention, split over ``axes``, the
    :func:`context_axes` of ``rules``) in ``mode`` ``"ring"`` or ``"allgather"``, in a
    ``jax.shard_map`` over ``mesh``; ``masks`` as the op checked them, ``block`` the
    blockwise kernel's block (``None``: one dense tile per step).

    >>> import nnx_shard as ns
    >>> q = jnp.ones((2, 8, 2, 4))
    >>> rules = ns.strategies.get("cp").rules
    >>> with ns.use("data=4,context=2", rules) as mesh:
    ...     out = jax.jit(lambda q: split_attention(
    ...         q, q, q, Masks(), mode="ring", axes=("context",), mesh=mesh,
    ...         rules=rules, causal=True, block=None))(q)
    >>> out.shape
    (2, 8, 2, 4)
    """
    c = math.prod(dict(mesh.shape)[a] for a in axes)
    if q.shape[1] != k.shape[1]:
        raise ShardingError(
            f"attention={mode!r}: q {tuple(q.shape)} and k {tuple(k.shape)} differ in length; "
            "context parallelism splits one sequence for queries and keys (self-attention). "
            "Fix: run cross-attention outside the context-parallel rules, or pad both to one "
            "length."
        )
    _check_length(q, axes, c, mode, causal)
    spec, manual = _manual_spec(q, mesh, rules, axes)
    _check_kv_heads(k, spec, mesh)
    arrays = {n: x for n, x in masks._asdict().items() if x is not None}
    specs = {n: _mask_spec(n, x, spec) for n, x in arrays.items()}
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        q, k, v = (_retype(a, spec) for a in (q, k, v))
        arrays = {n: _retype(x, specs[n]) for n, x in arrays.items()}
    body = functools.partial(_ring_local if mode == "ring" else _allgather_local,
                             axes=axes, c=c, causal=causal, block=block, softcap=softcap)
    run = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, specs), out_specs=spec,
                        axis_names=manual, check_vma=False)
    return run(q, k, v, arrays)


def _check_kv_heads(k: jax.Array, spec: P, mesh: Any) -> None:
    heads = spec[2]
    names = (heads,) if isinstance(heads, str) else tuple(heads or ())
    split = math.prod(dict(mesh.shape)[a] for a in names)
    if k.shape[2] % split:
        raise ShardingError(
            f"attention: k/v {tuple(k.shape)} have {k.shape[2]} kv heads, but the query heads "
            f"are split over mesh axes {names} ({split} ways, logical axis 'heads') and each "
            "device needs whole groups of query heads with their key/value head. Fix: use a "
            f"number of kv heads divisible by {split}, or rules that do not split 'heads'."
        )


def _mask_spec(name: str, x: jax.Array, spec: P) -> P:
    """The shard_map spec of a mask field, from the q/k/v ``spec``: batch and heads
    dimensions as q's (where not broadcast), query rows over the context axes, key
    columns over them too for the key-side fields (they travel with K/V) and whole for
    a full mask."""
    batch = spec[0] if x.shape[0] > 1 else None
    if name == "mask":
        return P(batch, spec[2] if x.shape[1] > 1 else None,
                 spec[1] if x.shape[2] > 1 else None, None)
    return P(batch, spec[1])


def _manual_spec(x: jax.Array, mesh: Any, rules: Any, axes: tuple[str, ...]
                 ) -> tuple[P, set[str]]:
    """The shard_map spec of q/k/v and its manual axes: the context ``axes`` on the
    length dimension; on the batch and heads dimensions the Explicit mesh axes the
    array's type has there, and the Auto ones the rules give ``batch`` and ``heads``.

    The op is manual over every mesh axis it shards over, not over the context axes
    alone: with other axes left to the partitioner, jax 0.10 gathers the whole batch
    onto every device on entry (Explicit axes; Auto ones in all-gather mode).
    Attention is per batch row and per head, so the body is the same either way.
    """
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    typed = tuple(jax.typeof(x).sharding.spec)
    typed += (None,) * (x.ndim - len(typed))
    names = tuple(n if n is not None and n in rules else None
                  for n in ("batch", None, "heads", None))
    try:
        ruled = tuple(rules.spec(names, shape=x.shape, mesh=mesh, path="attention q/k/v"))
    except ShardingError:
        ruled = ()
    ruled += (None,) * (x.ndim - len(ruled))

    out: list[Any] = []
    for dim in range(x.ndim):
        if dim == 1:
            out.append(axes)
            continue
        kept = tuple(a for a in entry_axes(typed[dim]) if types[a] == AxisType.Explicit)
        if not kept:
            kept = tuple(a for a in entry_axes(ruled[dim]) if types[a] != AxisType.Explicit)
        out.append(tuple(a for a in kept if a not in axes) or None)
    return P(*out), {a for entry in out if entry for a in entry}


def _retype(x: jax.Array, spec: P) -> jax.Array:
    typed = tuple(jax.typeof(x).sharding.spec)
    typed += (None,) * (x.ndim - len(typed))
    norm = tuple(None if not e else entry_axes(e) for e in typed)
    want = tuple(None if not e else tuple(e) for e in spec)
    return x if norm == want else jax.sharding.reshard(x, spec)


# --------------------------------------------------------------------------- all-gather


def _allgather_local(q: jax.Array, k: jax.Array, v: jax.Array, arrays: dict[str, jax.Array], *,
                     axes: tuple[str, ...], c: int, causal: bool, block: int | None,
                     softcap: float | None = None) -> jax.Array:
    """Local queries (contiguous slice ``i``) against the gathered full-length K/V (and
    key-side masks); a full mask already holds this slice's rows at full key length."""
    n = q.shape[1]
    k_all = jax.lax.all_gather(k, axes, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, axes, axis=1, tiled=True)
    masks = Masks(**arrays)
    masks = masks._replace(
        kv_seg=None if masks.kv_seg is None
        else jax.lax.all_gather(masks.kv_seg, axes, axis=1, tiled=True),
        kv_valid=None if masks.kv_valid is None
        else jax.lax.all_gather(masks.kv_valid, axes, axis=1, tiled=True),
        mask=group_mask(masks.mask, k.shape[2]))
    offset = jax.lax.axis_index(axes) * n
    return kernels.attention_local(q, k_all, v_all, masks, causal=causal,
                                     kernel="dense" if block is None else "blockwise",
                                     block=block or 0, q_offset=offset, softcap=softcap)


# --------------------------------------------------------------------------- zig-zag


def _zigzag_pairs(c: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Where each device's first (chunk 2i) and second (chunk 2i+1) half-slice goes:
    chunk j lives on device j if j < C, else on device 2C - 1 - j."""
    def home(j: int) -> int:
        return j if j < c else 2 * c - 1 - j

    return ([(i, home(2 * i)) for i in range(c)], [(i, home(2 * i + 1)) for i in range(c)])


def _to_zigzag(x: jax.Array, axes: tuple[str, ...], c: int, axis: int) -> jax.Array:
    """Contiguous layout (device i: chunks 2i, 2i+1) -> zig-zag (chunks i, 2C-1-i),
    along ``axis`` of the local block."""
    first, second = jnp.split(x, 2, axis=axis)
    even_pairs, odd_pairs = _zigzag_pairs(c)
    even = jax.lax.ppermute(first, axes, even_pairs)
    odd = jax.lax.ppermute(second, axes, odd_pairs)
    # Of chunks d and 2C-1-d exactly one is even: chunk d is, on even devices.
    d_even = jax.lax.axis_index(axes) % 2 == 0
    return jnp.where(d_even, jnp.concatenate([even, odd], axis),
                     jnp.concatenate([odd, even], axis))


def _from_zigzag(x: jax.Array, axes: tuple[str, ...], c: int, axis: int) -> jax.Array:
    """Inverse of :func:`_to_zigzag`."""
    first, second = jnp.split(x, 2, axis=axis)
    d_even = jax.lax.axis_index(axes) % 2 == 0
    even = jnp.where(d_even, first, second)
    odd = jnp.where(d_even, second, first)
    even_pairs, odd_pairs = _zigzag_pairs(c)
    even = jax.lax.ppermute(even, axes, [(t, s) for s, t in even_pairs])
    odd = jax.lax.ppermute(odd, axes, [(t, s) for s, t in odd_pairs])
    return jnp.concatenate([even, odd], axis)


# --------------------------------------------------------------------------- ring


def _ring_local(q: jax.Array, k: jax.Array, v: jax.Array, arrays: dict[str, jax.Array], *,
                axes: tuple[str, ...], c: int, causal: bool, block: int | None,
                softcap: float | None = None) -> jax.Array:
    masks = Masks(**arrays)
    if causal:
        q = _to_zigzag(q, axes, c, axis=1)
        if k.shape == v.shape:
            k, v = _to_zigzag(jnp.stack([k, v]), axes, c, axis=2)
        else:
            k, v = _to_zigzag(k, axes, c, axis=1), _to_zigzag(v, axes, c, axis=1)
        masks = masks._replace(**{
            name: None if x is None else x if x.shape[ax] == 1
            else _to_zigzag(x, axes, c, axis=ax)
            for name, ax in (("q_seg", 1), ("kv_seg", 1), ("kv_valid", -1), ("mask", 2))
            for x in (getattr(masks, name),)})
    hk = k.shape[2]
    qg = q.reshape(*q.shape[:2], hk, q.shape[2] // hk, q.shape[3])
    out = _ring(qg, k, v, masks._replace(mask=group_mask(masks.mask, hk)), axes, c, causal,
                block, softcap)
    out = out.reshape(*q.shape[:3], v.shape[-1])
    return _from_zigzag(out, axes, c, axis=1) if causal else out


def _columns(mask: jax.Array | None, src: Any, n2: int, c: int, causal: bool
             ) -> jax.Array | None:
    """The key columns of a full mask (rows local, all ``C x n2`` columns) that belong to
    the K/V block of device ``src``: its contiguous slice, or its two zig-zag chunks."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    if not causal:
        return jax.lax.dynamic_slice_in_dim(mask, src * n2, n2, mask.ndim - 1)
    n = n2 // 2
    return jnp.concatenate(
        [jax.lax.dynamic_slice_in_dim(mask, src * n, n, mask.ndim - 1),
         jax.lax.dynamic_slice_in_dim(mask, (2 * c - 1 - src) * n, n, mask.ndim - 1)], -1)


def _step_masks(masks: Masks, kv: tuple[Any, ...], s: Any, axes: tuple[str, ...], c: int,
                causal: bool, n2: int) -> Masks:
    """The masks of this device's queries against the K/V block held at ring step ``s``:
    the key-side ones travel with it (``kv[2:]``), a full mask's columns are cut."""
    src = (jax.lax.axis_index(axes) - s) % c
    return Masks(masks.q_seg, kv[2], kv[3], _columns(masks.mask, src, n2, c, causal))


def _shift(x: Any, axes: tuple[str, ...], c: int) -> Any:
    perm = [(i, (i + 1) % c) for i in range(c)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axes, perm), x)


def _earlier(step: jax.Array, axes: tuple[str, ...], c: int) -> jax.Array:
    """At ring step ``step`` the K/V block held came from device ``(d - step) mod C``;
    with zig-zag chunks it is wholly earlier than this device's first chunk iff that
    device index is below ``d``."""
    d = jax.lax.axis_index(axes)
    return (d - step) % c < d


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8))
def _ring(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, axes: tuple[str, ...], c: int,
          causal: bool, block: int | None, softcap: float | None = None) -> jax.Array:
    return _ring_fwd(q, k, v, masks, axes, c, causal, block, softcap)[0]


def _ring_fwd(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, axes: tuple[str, ...],
              c: int, causal: bool, block: int | None, softcap: float | None = None
              ) -> tuple[jax.Array, Any]:
    # q: [b, n2, kv_heads, group, d] (grouped), k, v: [b, n2, kv_heads, d]. Each ring step
    # is one call of the per-device kernel's block math (nnx_shard._attention._blocks.stats): a
    # single tile, or (blockwise) query x key/value blocks of ``block``.
    n2 = q.shape[1]
    n = n2 // 2
    tile = functools.partial(stats, block=block, softcap=softcap)
    own = (k, v, masks.kv_seg, masks.kv_valid)
    # Each block is sent on before it is used, so that the transfer of step s + 1
    # can overlap the compute of step s (async collective-permutes on accelerators).
    moving = _shift(own, axes, c)
    # Step 0 pairs the device's own chunks (i, 2C-1-i) with themselves: causal on the
    # local index is exactly that (each chunk sees itself causally, the later chunk
    # all of the earlier one).
    acc = tile(q, k, v, _step_masks(masks, own, 0, axes, c, causal, n2), causal=causal)

    def full(s: Any, kv: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        return tile(q, kv[0], kv[1], _step_masks(masks, kv, s, axes, c, causal, n2),
                    causal=False)

    def low_keys(s: Any, kv: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        # Both query chunks against the earlier key chunk only.
        m = _step_masks(masks, kv, s, axes, c, causal, n2).keys(0, n)
        return tile(q, kv[0][:, :n], kv[1][:, :n], m, causal=False)

    def high_queries(s: Any, kv: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        # Only the later query chunk sees this block (all of it).
        m = _step_masks(masks, kv, s, axes, c, causal, n2).queries(n, n)
        o, l_, mx = tile(q[:, n:], kv[0], kv[1], m, causal=False)
        return (jnp.concatenate([jnp.zeros_like(o), o], 1),
                jnp.concatenate([jnp.zeros_like(l_), l_], -1),
                jnp.concatenate([jnp.full_like(mx, -jnp.inf), mx], -1))

    def block_(s: Any, kv: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        if causal:
            return jax.lax.cond(_earlier(s, axes, c), low_keys, high_queries, s, kv)
        return full(s, kv)

    def step(s: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        acc, kv = carry
        nxt = _shift(kv, axes, c)
        return merge(acc, block_(s, kv)), nxt

    # Steps 1 .. C-2 in the loop; the last one outside it, with nothing left to send.
    acc, kv = jax.lax.fori_loop(1, c - 1, step, (acc, moving))
    out, lse = finish(merge(acc, block_(c - 1, kv)), q.dtype)
    return out, (q, k, v, masks, out, lse)


def _ring_bwd(axes: tuple[str, ...], c: int, causal: bool, block: int | None,
              softcap: float | None, res: Any, g: jax.Array) -> tuple[Any, ...]:
    q, k, v, masks, out, lse = res
    n2 = q.shape[1]
    n = n2 // 2
    do = g.astype(jnp.float32)
    dlt = delta(do, out)
    tile = functools.partial(grads, block=block, softcap=softcap)
    own = (k, v, masks.kv_seg, masks.kv_valid)
    dq, dk, dv = tile(q, k, v, do, lse, dlt, _step_masks(masks, own, 0, axes, c, causal, n2),
                      causal=causal)

    def full(s: Any, kv: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        return tile(q, kv[0], kv[1], do, lse, dlt, _step_masks(masks, kv, s, axes, c, causal, n2),
                    causal=False)

    def low_keys(s: Any, kv: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        m = _step_masks(masks, kv, s, axes, c, causal, n2).keys(0, n)
        dqb, dkb, dvb = tile(q, kv[0][:, :n], kv[1][:, :n], do, lse, dlt, m, causal=False)
        return (dqb, jnp.concatenate([dkb, jnp.zeros_like(dkb)], 1),
                jnp.concatenate([dvb, jnp.zeros_like(dvb)], 1))

    def high_queries(s: Any, kv: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        m = _step_masks(masks, kv, s, axes, c, causal, n2).queries(n, n)
        dqb, dkb, dvb = tile(q[:, n:], kv[0], kv[1], do[:, n:], lse[..., n:], dlt[..., n:], m,
                             causal=False)
        return jnp.concatenate([jnp.zeros_like(dqb), dqb], 1), dkb, dvb

    def block_(s: Any, kv: tuple[Any, ...]) -> tuple[jax.Array, ...]:
        if causal:
            return jax.lax.cond(_earlier(s, axes, c), low_keys, high_queries, s, kv)
        return full(s, kv)

    def step(s: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        # kv: the block of step s (with its key-side masks), sent on ahead as in the
        # forward pass; grad: the gradient accumulated for the block of step s - 1,
        # which follows one device behind its block.
        dq, kv, grad = carry
        nxt = _shift(kv, axes, c)
        dqb, dkb, dvb = block_(s, kv)
        dk, dv = _shift(grad, axes, c)
        return dq + dqb, nxt, (dk + dkb, dv + dvb)

    carry = (dq, _shift(own, axes, c), (dk, dv))
    carry = jax.lax.fori_loop(1, c - 1, step, carry)
    dq, _, (dk, dv) = step(c - 1, carry)  # its extra K/V send is unused: XLA drops it
    # After step C - 1 each gradient block sits one device short of its owner.
    dk, dv = _shift((dk, dv), axes, c)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_ring.defvjp(_ring_fwd, _ring_bwd)
