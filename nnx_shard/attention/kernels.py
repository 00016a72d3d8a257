"""The per-device attention kernels of :func:`nnx_shard.attention.attention`.

Three kernels compute ``softmax(q k^T / sqrt(head_dim) [masked]) v`` on one
device (or on each device's share under context parallelism, see
:mod:`nnx_shard.attention.context_parallel`). "Dense" in nnx_shard names the
first of them and nothing else:

* ``"dense"``: the plain masked softmax. It keeps the float32 scores and
  probabilities ``[batch, heads, q_len, kv_len]`` for the backward pass:
  memory grows with the square of the sequence.
* ``"blockwise"``: queries in blocks of ``block`` rows against key/value blocks
  of ``block`` columns, accumulated with an online (log-sum-exp) softmax; a
  ``jax.custom_vjp`` whose backward pass recomputes each tile's scores from
  ``q, k, v`` and the per-row log-sum-exp instead of storing any. It keeps
  ``q, k, v``, the output and the log-sum-exp (``[batch, heads, q_len]``)
  and, while it runs, a few ``[batch, heads, block, block]`` tiles: memory
  grows linearly with the sequence. Under a causal mask a query block visits
  only the key blocks at or before its last row (and in the backward pass a
  key block only the query blocks at or after its first column): fully masked
  tiles are never computed, about half the work of the unmasked problem.
  Sequences that are not a multiple of ``block`` are padded to one and the
  padded keys masked.
* ``"cudnn"``: ``jax.nn.dot_product_attention(implementation="cudnn")``, the
  fused flash-attention kernel of NVIDIA GPUs (float16/bfloat16, head_dim a
  multiple of 8 up to 128, or 256 on Hopper). Masks reach it as a dense bias,
  so ``"auto"`` picks it only without masks or segment ids.

``"auto"`` is ``"cudnn"`` where it applies (a GPU backend, no context
parallelism, half precision, a supported head size, no mask or segment ids,
as many queries as keys) and ``"blockwise"`` everywhere else (CPU, TPU, the
ring and all-gather modes).

Grouped-query attention (fewer key/value heads than query heads) is computed
without repeating K/V: query heads are grouped per key/value head, ``q [b, l,
kv_heads, group, d]`` against ``k, v [b, l, kv_heads, d]`` (query head ``n``
uses key/value head ``n // group``, as ``jax.nn.dot_product_attention`` and
transformers' ``repeat_kv`` do), and the key/value gradients sum over the group.

A query row that sees no key at all (every key masked) gets a zero output and
zero gradients in every kernel but ``"cudnn"`` (flax's and jax's own masked
softmax return the mean of all values there instead).

The block math here (:func:`stats` and :func:`grads`: unnormalised output, row
sums and maxima of a query/key block, merged with :func:`merge`) is also what
the ring mode of :mod:`nnx_shard.attention.context_parallel` runs at each ring step.

>>> import jax.numpy as jnp
>>> q = jax.random.normal(jax.random.key(0), (1, 40, 4, 8))
>>> kv = jax.random.normal(jax.random.key(1), (1, 40, 2, 8))   # 2 kv heads for 4 query heads
>>> out = attention_local(q, kv, kv, Masks(), causal=True, kernel="blockwise", block=16)
>>> ref = attention_local(q, kv, kv, Masks(), causal=True, kernel="dense", block=16)
>>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
((1, 40, 4, 8), True)
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, overload

import jax
import jax.numpy as jnp

from nnx_shard.mesh import current

__all__ = ["BLOCK", "KERNELS", "Masks", "attention_local", "finish", "grads", "merge",
           "resolve", "stats"]

#: The per-device kernels :func:`nnx_shard.attention.attention` accepts (its ``implementation``).
KERNELS = ("auto", "blockwise", "dense", "cudnn")

#: Default query and key/value block size of the blockwise kernel.
BLOCK = 512

_NEG = float(jnp.finfo(jnp.float32).min)
_F32 = jnp.float32


class Masks(NamedTuple):
    """Which keys a query may see, besides causality (each field optional).

    ``q_seg [b, q_len]`` and ``kv_seg [b, kv_len]``: segment ids (packed
    sequences); a query sees a key only if their ids are equal. ``kv_valid
    [b|1, kv_len]``: key padding, ``False`` keys are unseen. ``mask [b|1,
    kv_heads|1, group|1, q_len|1, kv_len|1]``: any boolean mask (``True``:
    seen), in the grouped head layout of the kernels.

    >>> Masks().present
    False
    """

    q_seg: jax.Array | None = None
    kv_seg: jax.Array | None = None
    kv_valid: jax.Array | None = None
    mask: jax.Array | None = None

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


def _tile_mask(masks: Masks, causal: bool, q_offset: Any, q0: Any, nq: int, k0: Any, nk: int,
               kv_len: int | None) -> jax.Array | None:
    """What query rows ``q0 : q0 + nq`` see of key columns ``k0 : k0 + nk`` (``masks``
    already cut to them), broadcastable to the scores ``[b, kv_heads, group, nq, nk]``;
    ``None`` if they see everything. Query row ``i`` sits at position ``q_offset + i``
    of the key sequence (causal masking); keys from ``kv_len`` on are padding."""
    out: jax.Array | None = None

    def both(m: jax.Array) -> None:
        nonlocal out
        out = m if out is None else out & m

    if causal or kv_len is not None:
        kpos = k0 + jnp.arange(nk)
        if causal:
            qpos = q_offset + q0 + jnp.arange(nq)
            both(qpos[:, None] >= kpos[None, :])
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
    return _capped(s / math.sqrt(q.shape[-1]), softcap)


def _capped(s: jax.Array, softcap: float | None) -> jax.Array:
    """Gemma 2's attention logit soft-capping, ``cap * tanh(s / cap)``, on the scaled
    scores (before the mask); ``None``: the scores unchanged."""
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
        s = jnp.where(mask, s, _NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v.astype(_F32))
    rowsum = jnp.sum(p, axis=-1)
    if mask is not None:
        # A row that sees no key of this block contributes nothing (not exp(0) = 1
        # per masked key), so that a row that sees no key at all ends at zero.
        seen = m > _NEG
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
                 _pad(_pad(masks.mask, -2, lq, False), -1, lk, False))


def _kv_end(i: Any, bq: int, bk: int, nk: int, causal: bool, q_offset: Any) -> Any:
    """One past the last key block that query block ``i`` sees."""
    if not causal:
        return nk
    last = q_offset + (i + 1) * bq - 1   # position of the block's last query row
    return jnp.clip(last // bk + 1, 0, nk)


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
        return _block_fwd(q, k, v, _tile_mask(masks, causal, q_offset, 0, lq, 0, lk, None),
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
            mask = _tile_mask(qmasks.keys(j * bk, bk), causal, q_offset, i * bq, bq, j * bk, bk,
                              kv_len)
            return merge(tile, _block_fwd(qi, kj, vj, mask, softcap))

        empty = (jnp.zeros((b, bq, hk, g, dv), _F32), jnp.zeros((b, hk, g, bq), _F32),
                 jnp.full((b, hk, g, bq), _NEG, _F32))
        # Causal: the loop ends at the last key block this query block sees.
        oi, li, mi = jax.lax.fori_loop(0, _kv_end(i, bq, bk, nk, causal, q_offset), kv_block,
                                       empty)
        o, rowsum, m = acc
        return (jax.lax.dynamic_update_slice_in_dim(o, oi, i * bq, 1),
                jax.lax.dynamic_update_slice_in_dim(rowsum, li, i * bq, 3),
                jax.lax.dynamic_update_slice_in_dim(m, mi, i * bq, 3))

    init = (jnp.zeros((b, nq * bq, hk, g, dv), _F32), jnp.zeros((b, hk, g, nq * bq), _F32),
            jnp.full((b, hk, g, nq * bq), _NEG, _F32))
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
                          _tile_mask(masks, causal, q_offset, 0, lq, 0, lk, None), softcap)
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
            mask = _tile_mask(kmasks.queries(i * bq, bq), causal, q_offset, i * bq, bq, j * bk,
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


# --------------------------------------------------------------------------- kernels


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def blockwise(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, q_offset: Any,
              causal: bool, block: int, softcap: float | None = None) -> jax.Array:
    """The blockwise kernel on grouped queries ``[b, q_len, kv_heads, group, d]``; query
    row ``i`` sits at key position ``q_offset + i`` for the causal mask."""
    return _blockwise_fwd(q, k, v, masks, q_offset, causal, block, softcap)[0]


def _blockwise_fwd(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, q_offset: Any,
                   causal: bool, block: int, softcap: float | None = None
                   ) -> tuple[jax.Array, Any]:
    out, lse = finish(stats(q, k, v, masks, causal=causal, q_offset=q_offset, block=block,
                            softcap=softcap), q.dtype)
    return out, (q, k, v, masks, q_offset, out, lse)


def _blockwise_bwd(causal: bool, block: int, softcap: float | None, res: Any, g: jax.Array
                   ) -> tuple[Any, ...]:
    q, k, v, masks, q_offset, out, lse = res
    do = g.astype(_F32)
    dq, dk, dv = grads(q, k, v, do, lse, delta(do, out), masks, causal=causal,
                       q_offset=q_offset, block=block, softcap=softcap)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def dense(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, causal: bool,
          q_offset: Any = 0, softcap: float | None = None) -> jax.Array:
    """The masked softmax on ``q [b, q_len, heads, d]``, ``k, v [b, kv_len, kv_heads, d]``
    (``masks`` in the grouped layout), differentiated by JAX: it keeps the scores and
    probabilities ``[b, heads, q_len, kv_len]``."""
    hk = k.shape[2]
    g = q.shape[2] // hk
    mask = _tile_mask(masks, causal, q_offset, 0, q.shape[1], 0, k.shape[1], None)
    if g == 1:
        # Multi-head attention: the reference transformer's original core, operation
        # for operation, so that its numbers do not change.
        scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=_F32)
        mask = None if mask is None else mask[:, :, 0] if mask.ndim == 5 else mask
    else:
        qg = q.reshape(*q.shape[:2], hk, g, q.shape[3])
        scores = jnp.einsum("bqhgk,bshk->bhgqs", qg, k, preferred_element_type=_F32)
    scores = _capped(scores / math.sqrt(q.shape[-1]), softcap)
    if mask is not None:
        scores = jnp.where(mask, scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1)
    if mask is not None and masks.present:
        probs = jnp.where(jnp.any(mask, axis=-1, keepdims=True), probs, 0.0)
    probs = probs.astype(q.dtype)
    if g == 1:
        return jnp.einsum("bhqs,bshk->bqhk", probs, v)
    out = jnp.einsum("bhgqs,bshk->bqhgk", probs, v)
    return out.reshape(*q.shape[:3], v.shape[-1])


def _cudnn(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, causal: bool) -> jax.Array:
    mask = _tile_mask(masks, False, 0, 0, q.shape[1], 0, k.shape[1], None)
    if mask is not None:  # grouped [b, kv_heads|1, group|1, q, k] -> [b, heads|1, q, k]
        mask = jnp.broadcast_to(mask, (*mask.shape[:3], q.shape[1], k.shape[1]))
        mask = mask.reshape(mask.shape[0], -1, *mask.shape[3:])
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                        implementation="cudnn")


def _platform() -> str:
    """The platform the active mesh's devices are on (the default backend without one)."""
    active = current()
    if active is not None and hasattr(active[0], "devices"):
        return str(active[0].devices.flat[0].platform)
    return jax.default_backend()


def resolve(kernel: str, q: Any, k: Any, masks: Masks, *, context_parallel: bool,
            softcap: float | None = None) -> str:
    """The kernel ``kernel`` names for these inputs: ``"auto"`` becomes ``"cudnn"`` where
    the fused kernel applies (see the module docs), else ``"blockwise"``; ``"cudnn"``
    under context parallelism (which needs per-block statistics) becomes ``"blockwise"``,
    and elsewhere off a GPU is a ``ValueError`` (cuDNN is an NVIDIA library).

    >>> resolve("auto", jnp.ones((1, 8, 2, 8)), jnp.ones((1, 8, 2, 8)), Masks(),
    ...         context_parallel=False)   # on CPU
    'blockwise'
    >>> resolve("flash", None, None, Masks(), context_parallel=False)
    Traceback (most recent call last):
    ...
    ValueError: attention: implementation='flash' is not one of ('auto', 'blockwise', 'dense', 'cudnn'). Fix: pass one of them (TransformerConfig(attention=...) for the reference model); 'auto' picks cudnn on GPUs and blockwise elsewhere.
    """
    if kernel not in KERNELS:
        raise ValueError(
            f"attention: implementation={kernel!r} is not one of {KERNELS}. Fix: pass one of "
            "them (TransformerConfig(attention=...) for the reference model); 'auto' picks "
            "cudnn on GPUs and blockwise elsewhere."
        )
    if kernel == "cudnn" and softcap is not None:
        raise ValueError(
            f"attention: implementation='cudnn' cannot soft-cap the attention logits "
            f"(softcap={softcap}): jax.nn.dot_product_attention's fused kernel has no "
            "soft-capping. Fix: implementation='blockwise' or 'dense' (LlamaConfig(attention="
            "...)), or 'auto', which picks blockwise for soft-capped models."
        )
    if kernel == "cudnn" and context_parallel:
        return "blockwise"
    if kernel == "cudnn" and _platform() != "gpu":
        raise ValueError(
            f"attention: implementation='cudnn' is cuDNN's fused kernel, for NVIDIA GPUs; "
            f"this runs on {_platform()}. Fix: implementation='auto' (cuDNN on GPUs, "
            "blockwise elsewhere) or 'blockwise' (TransformerConfig(attention=...) for the "
            "reference models)."
        )
    if kernel != "auto":
        return kernel
    if context_parallel or masks.present or softcap is not None or _platform() != "gpu":
        return "blockwise"
    d = q.shape[-1]
    fits = (q.dtype in (jnp.bfloat16, jnp.float16) and d % 8 == 0 and d <= 128
            and q.shape[1] == k.shape[1])
    return "cudnn" if fits else "blockwise"


def attention_local(q: jax.Array, k: jax.Array, v: jax.Array, masks: Masks, *, causal: bool,
                    kernel: str, block: int = BLOCK, q_offset: Any = 0,
                    softcap: float | None = None) -> jax.Array:
    """Attention of ``q [b, q_len, heads, d]`` and ``k, v [b, kv_len, kv_heads, d]`` on one
    device with a resolved ``kernel`` (``masks`` in the grouped layout)."""
    if kernel == "dense":
        return dense(q, k, v, masks, causal, q_offset, softcap)
    if kernel == "cudnn":
        return _cudnn(q, k, v, masks, causal)
    hk = k.shape[2]
    qg = q.reshape(*q.shape[:2], hk, q.shape[2] // hk, q.shape[3])
    out = blockwise(qg, k, v, masks, jnp.asarray(q_offset, jnp.int32), causal, block, softcap)
    return out.reshape(*q.shape[:3], v.shape[-1])
