"""The block math of the attention kernels: one query block against one key/value block.

:func:`stats` gives the unnormalised output, row sums and row maxima of queries
against keys/values (one tile, or query blocks x the key blocks each sees, causal
tiles that see nothing skipped); :func:`merge` combines two of them (the online
softmax step), :func:`finish` normalises; :func:`grads` is the backward pass,
recomputing each tile's scores from the log-sum-exp. The blockwise kernel of
:mod:`nnx_shard._attention._kernels` is these over one device's sequence; the ring
of :mod:`nnx_shard._attention._context_parallel` runs them at every ring step.

Grouped-query attention (fewer key/value heads than query heads) is computed
without repeating K/V: query heads are grouped per key/value head, ``q [b, l,
kv_heads, group, d]`` against ``k, v [b, l, kv_heads, d]`` (query head ``n``
uses key/value head ``n // group``, as ``jax.nn.dot_product_attention`` and
transformers' ``repeat_kv`` do), and the key/value gradients sum over the group.

A query row that sees no key at all (every key masked) gets a zero output and
zero gradients in every kernel but ``"cudnn"`` (flax's and jax's own masked
softmax return the mean of all values there instead).

>>> q = jnp.ones((1, 6, 1, 1, 2)); kv = jnp.ones((1, 6, 1, 2))
>>> out, lse = finish(stats(q, kv, kv, Masks(), causal=True, block=4), jnp.float32)
>>> out.shape, lse.shape                       # grouped layout [b, q, kv_heads, group, d]
((1, 6, 1, 1, 2), (1, 1, 1, 6))
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, overload

import jax
import jax.numpy as jnp

__all__ = ["MASKED", "Masks", "capped", "delta", "finish", "grads", "group_mask", "merge",
           "stats", "tile_mask"]

#: The score a masked key gets (the float32 minimum: exp of it minus a row maximum is 0).
MASKED = float(jnp.finfo(jnp.float32).min)
_F32 = jnp.float32


class Masks(NamedTuple):
    """Which keys a query may see, besides causality (each field optional).

    ``q_seg [b, q_len]`` and ``kv_seg [b, kv_len]``: segment ids (packed
    sequences); a query sees a key only if their ids are equal. ``kv_valid
    [b|1, kv_len]``: key padding, ``False`` keys are unseen. ``mask [b|1,
    kv_heads|1, group|1, q_len|1, kv_len|1]``: any boolean mask (``True``:
    seen), in the grouped head layout of the kernels. ``window`` (an int32 scalar,
    possibly traced): a sliding window on the causal positions, the query at key
    position ``p`` sees keys at positions ``> p - window`` only (a prefill against a
    key/value cache: the band costs no ``[q_len, kv_len]`` mask, and key blocks wholly
    before it are skipped).

    >>> Masks().present
    False
    """

    q_seg: jax.Array | None = None
    kv_seg: jax.Array | None = None
    kv_valid: jax.Array | None = None
    mask: jax.Array | None = None
    window: jax.Array | None = None

    @property
    def present(self) -> bool:
        return any(x is not None for x in self)

    def queries(self, start: Any, size: int) -> Masks:
        """The masks of query rows ``start : start + size``."""
        return self._replace(q_seg=_cut(self.q_seg, start, size, 1),
                             mask=_cut(self.mask, start, size, -2))

    def keys(self, start: Any, size: int) -> Masks:
        """The masks of key columns ``start : start + size``."""
        return self._replace(kv_seg=_cut(self.kv_seg, start, size, 1),
                             kv_valid=_cut(self.kv_valid, start, size, -1),
                             mask=_cut(self.mask, start, size, -1))


def _cut(x: jax.Array | None, start: Any, size: int, axis: int) -> jax.Array | None:
    # A dimension of size 1 is broadcast: every row (column) shares it.
    if x is None or x.shape[axis] == 1:
        return x
    if isinstance(start, int) and start == 0 and size == x.shape[axis]:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis % x.ndim)


def group_mask(mask: jax.Array | None, kv_heads: int) -> jax.Array | None:
    """A ``[b, heads|1, q, k]`` mask in the kernels' grouped layout ``[b, kv_heads|1,
    group|1, q, k]``.

    >>> group_mask(jnp.ones((2, 4, 3, 3), bool), 2).shape, group_mask(jnp.ones((2, 1, 3, 3), bool), 2).shape
    ((2, 2, 2, 3, 3), (2, 1, 1, 3, 3))
    """
    if mask is None:
        return None
    b, h, lq, lk = mask.shape
    if h == 1:
        return mask[:, :, None]
    return mask.reshape(b, kv_heads, h // kv_heads, lq, lk)


def tile_mask(masks: Masks, causal: bool, q_offset: Any, q0: Any, nq: int, k0: Any, nk: int,
               kv_len: int | None) -> jax.Array | None:
    """What query rows ``q0 : q0 + nq`` see of key columns ``k0 : k0 + nk`` (``masks``
    already cut to them), broadcastable to the scores ``[b, kv_heads, group, nq, nk]``;
    ``None`` if they see everything. Query row ``i`` sits at position ``q_offset + i``
    of the key sequence (causal masking); keys from ``kv_len`` on are padding.

    >>> tile_mask(Masks(), True, 0, 0, 3, 0, 3, None).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    >>> tile_mask(Masks(), False, 0, 0, 2, 0, 2, None) is None
    True
    """
    out: jax.Array | None = None

    def both(m: jax.Array) -> None:
        nonlocal out
        out = m if out is None else out & m

    if causal or kv_len is not None or masks.window is not None:
        kpos = k0 + jnp.arange(nk)
        qpos = q_offset + q0 + jnp.arange(nq)
        if causal:
            both(qpos[:, None] >= kpos[None, :])
        if masks.window is not None:
            both(kpos[None, :] > qpos[:, None] - masks.window)
        if kv_len is not None:
            both(jnp.broadcast_to(kpos < kv_len, (nq, nk)))
    if masks.q_seg is not None and masks.kv_seg is not None:
        both((masks.q_seg[:, :, None] == masks.kv_seg[:, None, :])[:, None, None])
    if masks.kv_valid is not None:
        both(masks.kv_valid[:, None, None, None, :])
    if masks.mask is not None:
        both(masks.mask)
    return out


# --------------------------------------------------------------------------- block math


def _scores(q: jax.Array, k: jax.Array, softcap: float | None = None) -> jax.Array:
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=_F32)
    return capped(s / math.sqrt(q.shape[-1]), softcap)


def capped(s: jax.Array, softcap: float | None) -> jax.Array:
    """Gemma 2's attention logit soft-capping, ``cap * tanh(s / cap)``, on the scaled
    scores (before the mask); ``None``: the scores unchanged.

    >>> capped(jnp.array([0.0, 100.0]), 5.0).round(3).tolist()
    [0.0, 5.0]
    """
    return s if softcap is None else softcap * jnp.tanh(s / softcap)


def _rows(w: jax.Array) -> jax.Array:
    """Per-row statistics ``[b, kv_heads, group, q]`` broadcast against outputs
    ``[b, q, kv_heads, group, d]``."""
    return jnp.moveaxis(w, 3, 1)[..., None]


def _block_fwd(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
               softcap: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised output, row sums and row maxima of one query/key block."""
    s = _scores(q, k, softcap)
    if mask is not None:
        s = jnp.where(mask, s, MASKED)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(_F32))
    rowsum = jnp.sum(p, axis=-1)
    if mask is not None:
        # A row that sees no key of this block contributes nothing (not exp(0) = 1
        # per masked key), so that a row that sees no key at all ends at zero.
        seen = m > MASKED
        rowsum = jnp.where(seen, rowsum, 0.0)
        o = o * _rows(seen.astype(_F32))
    return o, rowsum, m


def merge(acc: tuple[jax.Array, ...], blk: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Two ``(output, row sums, row maxima)`` of the same queries against disjoint keys,
    combined as one softmax over both (the online softmax step)."""
    o, s, m = acc
    ob, sb, mb = blk
    mn = jnp.maximum(m, mb)
    a, bb = jnp.exp(m - mn), jnp.exp(mb - mn)
    return o * _rows(a) + ob * _rows(bb), s * a + sb * bb, mn


def finish(acc: tuple[jax.Array, ...], dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(output, log-sum-exp)`` of accumulated ``(output, row sums, row maxima)``;
    rows that saw no key give 0 and ``-inf``."""
    o, rowsum, m = acc
    out = (o / _rows(jnp.where(rowsum > 0, rowsum, 1.0))).astype(dtype)
    return out, m + jnp.log(rowsum)


def delta(do: jax.Array, out: jax.Array) -> jax.Array:
    """``rowsum(dO * O)`` ``[b, kv_heads, group, q]``, the softmax backward's correction."""
    return jnp.moveaxis(jnp.sum(do * out.astype(_F32), -1), 1, 3)


def _block_bwd(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array,
               dlt: jax.Array, mask: jax.Array | None, softcap: float | None = None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    s = _scores(q, k, softcap)
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, do)
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", do, v.astype(_F32))
    ds = p * (dp - dlt[..., None])
    if softcap is not None:  # d(cap * tanh(x / cap)) / dx = 1 - tanh^2, and s = cap * tanh
        ds = ds * (1.0 - jnp.square(s / softcap))
    ds = ds / math.sqrt(q.shape[-1])
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k.astype(_F32))
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q.astype(_F32))
    return dq, dk, dv


# --------------------------------------------------------------------------- tiling


def _blocks(length: int, block: int | None) -> tuple[int, int]:
    """(block size, number of blocks) along a sequence of ``length``."""
    if block is None or length <= block:
        return length, 1
    return block, -(-length // block)


@overload
def _pad(x: jax.Array, axis: int, to: int, value: Any) -> jax.Array: ...
@overload
def _pad(x: None, axis: int, to: int, value: Any) -> None: ...
def _pad(x: jax.Array | None, axis: int, to: int, value: Any) -> jax.Array | None:
    if x is None or x.shape[axis] in (1, to):
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis % x.ndim] = (0, to - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _pad_masks(masks: Masks, lq: int, lk: int) -> Masks:
    return Masks(_pad(masks.q_seg, 1, lq, 0), _pad(masks.kv_seg, 1, lk, 0),
                 _pad(masks.kv_valid, -1, lk, False),
                 _pad(_pad(masks.mask, -2, lq, False), -1, lk, False), masks.window)


def _kv_end(i: Any, bq: int, bk: int, nk: int, causal: bool, q_offset: Any) -> Any:
    """One past the last key block that query block ``i`` sees."""
    if not causal:
        return nk
    last = q_offset + (i + 1) * bq - 1   # position of the block's last query row
    return jnp.clip(last // bk + 1, 0, nk)


def _kv_start(i: Any, bq: int, bk: int, window: Any, q_offset: Any) -> Any:
    """The first key block that query block ``i`` sees under a sliding ``window``."""
    first = q_offset + i * bq - window + 1   # the first key the block's first row sees
    return jnp.maximum(first // bk, 0)


def _q_start(j: Any, bq: int, bk: int, nq: int, causal: bool, q_offset: Any) -> Any:
    """The first query block that sees key block ``j``."""
    if not causal:
        return 0
    return jnp.clip((j * bk - q_offset) // bq, 0, nq)


def stats(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, *, causal: bool,
          q_offset: Any = 0, block: int | None = None, softcap: float | None = None
          ) -> tuple[jax.Array, ...]:
    """``(output, row sums, row maxima)`` of queries ``q [b, q_len, kv_heads, group, d]``
    against keys/values ``k, v [b, kv_len, kv_heads, d]``, the output unnormalised
    (float32), the statistics ``[b, kv_heads, group, q_len]``: one tile if ``block`` is
    ``None`` or covers both lengths, else query blocks x the key blocks each sees.

    >>> q = jnp.ones((1, 6, 1, 1, 2)); kv = jnp.ones((1, 6, 1, 2))
    >>> o, l, m = stats(q, kv, kv, Masks(), causal=True, block=4)
    >>> l[0, 0, 0].tolist()                                  # keys each row sees
    [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    """
    lq, lk = q.shape[1], k.shape[1]
    bq, nq = _blocks(lq, block)
    bk, nk = _blocks(lk, block)
    if nq == 1 and nk == 1:
        return _block_fwd(q, k, v, tile_mask(masks, causal, q_offset, 0, lq, 0, lk, None),
                          softcap)
    kv_len = lk if nk * bk != lk else None
    q = _pad(q, 1, nq * bq, 0)
    k, v = _pad(k, 1, nk * bk, 0), _pad(v, 1, nk * bk, 0)
    masks = _pad_masks(masks, nq * bq, nk * bk)
    b, _, hk, g, _ = q.shape
    dv = v.shape[-1]

    def q_block(i: Any, acc: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        qi = jax.lax.dynamic_slice_in_dim(q, i * bq, bq, 1)
        qmasks = masks.queries(i * bq, bq)

        def kv_block(j: Any, tile: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            kj = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, 1)
            vj = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, 1)
            mask = tile_mask(qmasks.keys(j * bk, bk), causal, q_offset, i * bq, bq, j * bk, bk,
                              kv_len)
            return merge(tile, _block_fwd(qi, kj, vj, mask, softcap))

        empty = (jnp.zeros((b, bq, hk, g, dv), _F32), jnp.zeros((b, hk, g, bq), _F32),
                 jnp.full((b, hk, g, bq), MASKED, _F32))
        # Causal: the loop ends at the last key block this query block sees (and, under
        # a sliding window, starts at the first).
        end = _kv_end(i, bq, bk, nk, causal, q_offset)
        start = (0 if masks.window is None
                 else jnp.minimum(_kv_start(i, bq, bk, masks.window, q_offset), end))
        oi, li, mi = jax.lax.fori_loop(start, end, kv_block, empty)
        o, rowsum, m = acc
        return (jax.lax.dynamic_update_slice_in_dim(o, oi, i * bq, 1),
                jax.lax.dynamic_update_slice_in_dim(rowsum, li, i * bq, 3),
                jax.lax.dynamic_update_slice_in_dim(m, mi, i * bq, 3))

    init = (jnp.zeros((b, nq * bq, hk, g, dv), _F32), jnp.zeros((b, hk, g, nq * bq), _F32),
            jnp.full((b, hk, g, nq * bq), MASKED, _F32))
    o, rowsum, m = jax.lax.fori_loop(0, nq, q_block, init)
    return o[:, :lq], rowsum[..., :lq], m[..., :lq]


def grads(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array,
          dlt: jax.Array, masks: Masks, *, causal: bool, q_offset: Any = 0,
          block: int | None = None, softcap: float | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Float32 ``(dq, dk, dv)`` of the attention :func:`stats` computes, from the output
    gradient ``do``, the log-sum-exp ``lse`` and :func:`delta`, recomputing each tile's
    scores: key blocks x the query blocks that see each (FlashAttention-2's order: a key
    block's gradient accumulates in the loop, the queries' in place)."""
    lq, lk = q.shape[1], k.shape[1]
    bq, nq = _blocks(lq, block)
    bk, nk = _blocks(lk, block)
    if nq == 1 and nk == 1:
        return _block_bwd(q, k, v, do, lse, dlt,
                          tile_mask(masks, causal, q_offset, 0, lq, 0, lk, None), softcap)
    kv_len = lk if nk * bk != lk else None
    q, do = _pad(q, 1, nq * bq, 0), _pad(do, 1, nq * bq, 0)
    # Padded query rows: lse = +inf makes their probabilities exp(s - inf) = 0.
    lse, dlt = _pad(lse, -1, nq * bq, jnp.inf), _pad(dlt, -1, nq * bq, 0)
    k, v = _pad(k, 1, nk * bk, 0), _pad(v, 1, nk * bk, 0)
    masks = _pad_masks(masks, nq * bq, nk * bk)

    def kv_block(j: Any, acc: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        kj = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, 1)
        vj = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, 1)
        kmasks = masks.keys(j * bk, bk)

        def q_block(i: Any, tile: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            dq, dkj, dvj = tile
            rows = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=i * bq,
                                     slice_size=bq)
            mask = tile_mask(kmasks.queries(i * bq, bq), causal, q_offset, i * bq, bq, j * bk,
                              bk, kv_len)
            dqb, dkb, dvb = _block_bwd(rows(q, axis=1), kj, vj, rows(do, axis=1),
                                       rows(lse, axis=3), rows(dlt, axis=3), mask, softcap)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, rows(dq, axis=1) + dqb, i * bq, 1)
            return dq, dkj + dkb, dvj + dvb

        dq, dk, dv = acc
        # Causal: the loop starts at the first query block that sees this key block.
        dq, dkj, dvj = jax.lax.fori_loop(
            _q_start(j, bq, bk, nq, causal, q_offset), nq, q_block,
            (dq, jnp.zeros(kj.shape, _F32), jnp.zeros(vj.shape, _F32)))
        return (dq, jax.lax.dynamic_update_slice_in_dim(dk, dkj, j * bk, 1),
                jax.lax.dynamic_update_slice_in_dim(dv, dvj, j * bk, 1))

    init = (jnp.zeros(q.shape, _F32), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32))
    dq, dk, dv = jax.lax.fori_loop(0, nk, kv_block, init)
    return dq[:, :lq], dk[:, :lk], dv[:, :lk]
