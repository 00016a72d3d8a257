"""Compressed outer steps for :class:`~nnx_shard.DiLoCo` (its ``compress=`` option).

What crosses replicas in a sync is each replica's outer delta, ``anchor - params_r``
plus the residual its last compression left (error feedback), compressed on every
device from that device's own slice of the parameters (within a replica the model's
layout, e.g. fsdp over ``data``), in a ``jax.shard_map`` over the whole mesh:

* ``"int8"`` / ``"int4"``: the device's slices of every leaf, flattened into one
  vector and padded to blocks of :data:`BLOCK`, are rotated by a randomized Hadamard
  transform (a random sign vector from a fixed seed, the same on every device, then
  an orthonormal Walsh-Hadamard transform per block: it spreads an outlier over its
  block, so one per-block scale fits all of it) and rounded to ``bits``-bit integers
  with a float32 scale per block (``max|y| / (2**(bits-1) - 1)``; 4-bit codes go two
  to a ``uint8``). The codes and scales are all-gathered over the replica axis (an
  all-reduce cannot add codes of different scales); every device then dequantizes,
  averages and un-rotates locally.
* ``"mask:P"``: a fraction P of the elements, picked from a seed that is the same on
  every replica and new at every sync (the step counter), gathered into a dense
  vector and averaged by one all-reduce of P of the bytes. The average is not scaled
  by 1/P: with error feedback the elements not sent stay in the residual and go in a
  later sync, so scaling would count them 1/P times over.
* ``"rank:R"``: PowerSGD (Vogels et al., 2019), one power iteration from a random
  start drawn every sync (no warm start across syncs), on each device's slice of
  every leaf as a matrix: two all-reduces, of the rank-R factors P then Q.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnx_shard._errors import UsageError, short

__all__ = ["BLOCK", "Compression", "compressed_delta", "parse", "rotate", "unrotate"]

BLOCK = 256  # elements per rotation / quantization block (a power of two)
_SEED = 0x5EED  # the rotation's signs: fixed, so the same on every replica and every sync


@dataclasses.dataclass(frozen=True)
class Compression:
    """How a sync compresses: ``kind`` ``"quantize"`` (``bits`` 8 or 4), ``"mask"``
    (``keep``, the fraction of elements sent) or ``"rank"`` (``rank``, PowerSGD's)."""

    kind: str
    bits: int = 32
    keep: float = 1.0
    rank: int = 0


def parse(compress: Any) -> Compression | None:
    """``compress=`` of :class:`~nnx_shard.DiLoCo`: ``None``, ``"int8"``, ``"int4"``,
    ``"mask:P"`` (0 < P <= 1) or ``"rank:R"`` (R >= 1).

    >>> parse("int4").bits, parse("mask:0.25").keep, parse("rank:2").rank
    (4, 0.25, 2)
    """
    if compress is None:
        return None
    if compress in ("int8", "int4"):
        return Compression("quantize", bits=int(compress[3:]))
    if isinstance(compress, str) and compress.startswith("rank:") and compress[5:].isdigit():
        if int(compress[5:]) >= 1:
            return Compression("rank", rank=int(compress[5:]))
    if isinstance(compress, str) and compress.startswith("mask:"):
        try:
            keep = float(compress[5:])
        except ValueError:
            keep = -1.0
        if 0 < keep <= 1:
            return Compression("mask", keep=keep)
    raise UsageError(
        f"DiLoCo: compress must be None, 'int8', 'int4', 'mask:P' with 0 < P <= 1 or "
        f"'rank:R' with R >= 1, got {short(compress, 60)}. Fix: e.g. compress='int8' or compress='mask:0.25'.")


def _fwht(x: jax.Array) -> jax.Array:
    """The orthonormal Walsh-Hadamard transform of every row of ``x`` (``[n, b]``, b a
    power of two), in log2(b) butterflies: its own inverse."""
    n, b = x.shape
    h = 1
    while h < b:
        y = x.reshape(n, b // (2 * h), 2, h)
        x = jnp.stack([y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]], axis=2).reshape(n, b)
        h *= 2
    return x / math.sqrt(b)


def _signs(blocks: int) -> jax.Array:
    return jax.random.rademacher(jax.random.key(_SEED), (blocks, BLOCK), jnp.float32)


def rotate(x: jax.Array) -> jax.Array:
    """``x`` (1-d) padded with zeros to whole blocks of :data:`BLOCK` and rotated:
    ``[blocks, BLOCK]``, random signs then the Walsh-Hadamard transform per block.

    >>> x = jnp.arange(300.0)
    >>> bool(jnp.allclose(unrotate(rotate(x), 300), x, atol=1e-3))
    True
    """
    blocks = -(-x.shape[0] // BLOCK)
    x = jnp.pad(x, (0, blocks * BLOCK - x.shape[0])).reshape(blocks, BLOCK)
    return _fwht(x * _signs(blocks))


def unrotate(y: jax.Array, n: int) -> jax.Array:
    """The inverse of :func:`rotate`: the first ``n`` elements of the un-rotated
    ``y``, 1-d."""
    return (_fwht(y) * _signs(y.shape[0])).reshape(-1)[:n]


def _quantize(y: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    top = 2 ** (bits - 1) - 1
    scale = jnp.max(jnp.abs(y), axis=1) / top
    scale = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(y / scale[:, None]), -top, top).astype(jnp.int8)
    if bits == 4:  # two codes, offset to 1..15, to a byte
        u = (q + 8).astype(jnp.uint8).reshape(q.shape[0], -1, 2)
        return u[..., 0] | (u[..., 1] << 4), scale
    return q, scale


def _dequantize(q: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
    if bits == 4:
        q = jnp.stack([q & 15, q >> 4], axis=-1).reshape(*q.shape[:-1], -1)
        q = q.astype(jnp.int8) - 8
    return q.astype(jnp.float32) * scale[..., None]


def compressed_delta(
    compression: Compression, anchor: Sequence[jax.Array], replicas: Sequence[jax.Array],
    residual: Sequence[jax.Array], step: jax.Array, *, specs: Sequence[PartitionSpec],
    mesh: Mesh, axis: str,
) -> tuple[list[jax.Array], list[jax.Array]]:
    """The outer gradient, ``mean_r C(anchor - params_r + residual_r)`` laid out as
    ``anchor``, and every replica's new residual, ``[R, ...]`` laid out as
    ``replicas``; C is ``compression``, computed per device and sent compressed over
    ``axis`` (the module docstring)."""
    shapes = [NamedSharding(mesh, spec).shard_shape(a.shape)
              for a, spec in zip(anchor, specs, strict=True)]
    sizes = [math.prod(s) for s in shapes]
    n = sum(sizes)

    def body(step: jax.Array, *arrays: jax.Array) -> tuple[Any, ...]:
        k = len(shapes)
        anc, reps, res = arrays[:k], arrays[k:2 * k], arrays[2 * k:]
        ds = [(a[None] - p + e).reshape(s) for a, p, e, s in zip(anc, reps, res, shapes,
                                                                    strict=True)]
        key = jax.random.fold_in(jax.random.key(_SEED), step)
        if compression.kind == "rank":
            means, sents = _low_rank(ds, compression.rank, key, axis)
        else:
            d = jnp.concatenate([x.reshape(-1) for x in ds])
            if compression.kind == "quantize":
                q, scale = _quantize(rotate(d), compression.bits)
                sent = unrotate(_dequantize(q, scale, compression.bits), n)
                q_all = jax.lax.all_gather(q, axis)
                s_all = jax.lax.all_gather(scale, axis)
                mean = unrotate(jnp.mean(_dequantize(q_all, s_all, compression.bits), axis=0),
                                n)
            else:
                keep = max(1, round(compression.keep * n))
                idx = jax.random.permutation(key, n)[:keep]
                picked = d[idx]
                sent = jnp.zeros_like(d).at[idx].set(picked)
                mean = jnp.zeros_like(d).at[idx].set(jax.lax.pmean(picked, axis))
            cut = _offsets(sizes)
            means = [x.reshape(s) for x, s in zip(jnp.split(mean, cut), shapes, strict=True)]
            sents = [x.reshape(s) for x, s in zip(jnp.split(sent, cut), shapes, strict=True)]
        # Back to each leaf's dtype: under the sync's lax.cond the state keeps its types.
        news = [(d - x)[None].astype(e.dtype) for d, x, e in zip(ds, sents, res, strict=True)]
        return (*[m.astype(a.dtype) for m, a in zip(means, anc, strict=True)], *news)

    stacked = [PartitionSpec(axis, *s) for s in specs]
    run = jax.shard_map(body, mesh=mesh,
                        in_specs=(PartitionSpec(), *specs, *stacked, *stacked),
                        out_specs=(*specs, *stacked), check_vma=False)
    out = run(step, *anchor, *replicas, *residual)
    return list(out[:len(specs)]), list(out[len(specs):])


def _low_rank(ds: Sequence[jax.Array], rank: int, key: jax.Array, axis: str
              ) -> tuple[list[jax.Array], list[jax.Array]]:
    """PowerSGD's step (Vogels et al., 2019) on every device's slice of each leaf, as a
    matrix ``M`` [first dim, the rest]: ``P = pmean(M Q)`` for a random ``Q`` drawn
    from ``key`` (the same on every replica), orthonormalized, then ``Q = pmean(M^T P)``;
    the mean is ``P Q^T``, and that is also what each replica counts as sent (the
    residual is ``M - P Q^T``, as in PowerSGD's Algorithm 1). A leaf for which the factors would not
    be smaller (a vector, a thin matrix) goes whole. All the P's and whole leaves share
    one all-reduce, all the Q's another. Returns the means and what was sent."""
    mats = [d.reshape(d.shape[0], -1) if d.ndim >= 2 else d.reshape(1, -1) for d in ds]
    low = [(m.shape[0] + m.shape[1]) * rank < m.size and min(m.shape) > rank for m in mats]
    qs = [jax.random.normal(jax.random.fold_in(key, i), (m.shape[1], rank))
          if lo else None for i, (m, lo) in enumerate(zip(mats, low, strict=True))]
    first = [m @ q if q is not None else m for m, q in zip(mats, qs, strict=True)]
    first = _pmean_all(first, axis)
    ps = [jnp.linalg.qr(p)[0] if lo else p for p, lo in zip(first, low, strict=True)]
    second = _pmean_all([m.T @ p for m, p, lo in zip(mats, ps, low, strict=True) if lo], axis)
    it = iter(second)
    means = [(p @ next(it).T if lo else p).reshape(d.shape)
             for p, lo, d in zip(ps, low, ds, strict=True)]
    # A whole leaf is sent as it is (no residual); a factored one as P Q^T.
    return means, [m if lo else d for m, lo, d in zip(means, low, ds, strict=True)]


def _pmean_all(xs: Sequence[jax.Array], axis: str) -> list[jax.Array]:
    """Every array in ``xs`` averaged over ``axis`` by one all-reduce."""
    if not xs:
        return []
    flat = jax.lax.pmean(jnp.concatenate([x.reshape(-1) for x in xs]), axis)
    return [x.reshape(y.shape) for x, y in zip(jnp.split(flat, _offsets([x.size for x in xs])),
                                               xs, strict=True)]


def _offsets(sizes: Sequence[int]) -> list[int]:
    """Where ``jnp.split`` cuts a vector of the ``sizes`` joined."""
    return [int(c) for c in np.cumsum(sizes)[:-1]]
