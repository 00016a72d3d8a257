"""The attention op every model calls: :func:`attention`.

:func:`attention` is the softmax-attention core of a model (``q, k, v ->
out``; ``q [batch, length, heads, head_dim]``, ``k, v [batch, length,
kv_heads, head_dim]``, optional masks and segment ids). Two independent
choices decide how it runs:

* the **kernel**, the model's choice (the op's ``implementation``,
  ``ReferenceConfig.attention``): how one device computes attention on the
  queries and keys it holds, ``"dense"`` (the plain masked softmax),
  ``"blockwise"`` (memory-efficient, online softmax over blocks, recomputed in
  the backward pass), ``"cudnn"``, or ``"auto"`` (see
  :mod:`nnx_shard._attention._kernels`);
* the **context-parallel mode**, the strategy's choice (the execution option
  ``attention`` of the rules under :func:`nnx_shard.use`, see
  :mod:`nnx_shard._attention._modes`), never a model edit: ``"local"`` (or no
  option) runs the kernel on each device's whole sequence, ``"ring"`` and
  ``"allgather"`` split the sequence over the mesh axes of ``length`` (see
  :mod:`nnx_shard._attention._context_parallel`).

Grouped-query attention keeps ``kv_heads`` everywhere: query heads are grouped
per key/value head inside the op, K/V are never repeated (outside context
parallelism, query heads that Explicit mesh axes split more ways than there are
kv heads get each kv head repeated to ``lcm(kv_heads, split)`` heads laid out like
theirs: one per device, the one it reads).

>>> import jax.numpy as jnp
>>> q = jnp.ones((1, 4, 2, 8))
>>> attention(q, q, q).shape
(1, 4, 2, 8)
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_shard._attention import _context_parallel as context_parallel
from nnx_shard._attention import _kernels as kernels
from nnx_shard._attention._blocks import Masks, group_mask
from nnx_shard._attention._kernels import BLOCK
from nnx_shard._attention._modes import LOCAL, OPTION, context_mode
from nnx_shard._axes import entry_axes
from nnx_shard._errors import ShardingError, UsageError
from nnx_shard._mesh import called, current, watching
from nnx_shard._parallel.registry import ParallelOp, register

__all__ = ["attention", "expect_attention"]


def _check_qkv(q: Any, k: Any, v: Any) -> None:
    for name, a in (("q", q), ("k", k), ("v", v)):
        if getattr(a, "ndim", None) != 4:
            raise UsageError(
                f"attention: {name} must be [batch, length, heads, head_dim] (rank 4), got "
                f"{type(a).__name__} of shape {getattr(a, 'shape', None)}. Fix: reshape the "
                "projections to [batch, length, heads, head_dim], e.g. "
                "jnp.einsum('ble,ehk->blhk', x, w)."
            )
    (b, _, h, d), (bk, _, hk, dk) = q.shape, k.shape
    if k.shape[:3] != v.shape[:3] or b != bk or d != dk or h % hk:
        raise UsageError(
            f"attention: got q {q.shape}, k {k.shape}, v {v.shape}; need q [batch, q_len, heads, "
            "head_dim], k and v [batch, kv_len, kv_heads, head_dim] with the same batch, k and "
            "v of one length and number of heads, q and k of one head_dim, and heads a "
            "multiple of kv_heads (grouped-query attention: query head n uses key/value head "
            "n // (heads // kv_heads)). Fix: project k and v with the same number of heads, "
            "and q with a multiple of it."
        )


def _check_masks(q: jax.Array, k: jax.Array, mask: Any, segment_ids: Any) -> Masks:
    """The op's ``mask`` and ``segment_ids`` as :class:`~nnx_shard._attention._blocks.Masks`, the
    mask still in the ``[b|1, heads|1, q_len|1, kv_len|1]`` layout of the arguments (a
    mask of keys alone, ``[b|1, 1, 1, kv_len]``, becomes ``kv_valid``)."""
    b, lq, h, _ = q.shape
    lk = k.shape[1]
    q_seg = kv_seg = kv_valid = None
    if segment_ids is not None:
        pair = segment_ids if isinstance(segment_ids, tuple | list) else (segment_ids,) * 2
        if len(pair) != 2:
            raise UsageError(
                f"attention: segment_ids must be one [batch, length] array or a pair "
                f"(q_segment_ids, kv_segment_ids), got {len(pair)} arrays. Fix: pass "
                "segment_ids=ids for self-attention."
            )
        q_seg, kv_seg = (jnp.asarray(x) for x in pair)
        for name, ids, n in (("q", q_seg, lq), ("kv", kv_seg, lk)):
            if ids.shape != (b, n) or not jnp.issubdtype(ids.dtype, jnp.integer):
                raise UsageError(
                    f"attention: {name} segment ids must be integers of shape (batch, "
                    f"{'q_len' if name == 'q' else 'kv_len'}) = {(b, n)}, got {ids.dtype} of "
                    f"shape {ids.shape} (q {q.shape}, k {k.shape}). Fix: one id per token, equal "
                    "ids for tokens of one packed sequence (e.g. padding gets its own id)."
                )
    if mask is not None:
        mask = jnp.asarray(mask)
        want = (b, h, lq, lk)
        if mask.ndim != 4 or any(n not in (1, w) for n, w in zip(mask.shape, want, strict=True)):
            raise UsageError(
                f"attention: mask of shape {mask.shape} does not broadcast to [batch, heads, "
                f"q_len, kv_len] = {want} (each dimension its size or 1; the heads dimension "
                f"counts query heads). Fix: e.g. flax.nnx.make_attention_mask(q_valid, "
                "kv_valid) ([batch, 1, q_len, kv_len]), or valid[:, None, None, :] for key "
                "padding alone."
            )
        mask = mask.astype(bool)
        if mask.shape[1] == 1 and mask.shape[2] == 1 and lk > 1:
            kv_valid, mask = mask[:, 0, 0, :], None
            if kv_valid.shape[-1] == 1:
                kv_valid = jnp.broadcast_to(kv_valid, (kv_valid.shape[0], lk))
    return Masks(q_seg, kv_seg, kv_valid, mask)

@contextlib.contextmanager
def expect_attention(fn_name: str = "the step") -> Iterator[None]:
    """Raises a ``ShardingError`` at the end of the block if the active rules ask for
    context-parallel attention (option ``attention`` ``"ring"`` or ``"allgather"``)
    but the code traced inside never called :func:`attention`: its sequence would be
    gathered by the partitioner instead, silently losing what the strategy is for.

    :func:`nnx_shard.multistep` (and so the Trainer) traces each step under it.

    >>> import nnx_shard as ns
    >>> rules = ns.strategies.get("cp").rules
    >>> with ns.use("data=4,context=2", rules), expect_attention("my_step"):
    ...     pass
    Traceback (most recent call last):
    ...
    nnx_shard._errors.ShardingError: my_step ran under rules with attention='ring' ...
    """
    mode = context_mode()
    with watching() as calls:
        yield
    if mode in ("ring", "allgather") and "attention" not in calls:
        active = current()
        on = ""
        if active is not None:
            axes = context_parallel.context_axes(active[0], active[1], mode)
            on = f" (logical axis 'length' is split over mesh axes {axes})" if axes else ""
        raise ShardingError(
            f"{fn_name} ran under rules with attention={mode!r}{on}, but the model never "
            "called nnx_shard.models.attention, so its attention is not context-parallel "
            "(the partitioner would gather the whole sequence on every device). Fix: compute "
            "the attention core of the model with nnx_shard.models.attention(q, k, v, "
            "causal=True) (q, k, v: [batch, length, heads, head_dim]), as "
            "nnx_shard.models.Decoder does; or train with a strategy that does not split "
            "'length' over a context axis (e.g. 'fsdp')."
        )


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              mask: jax.Array | None = None, segment_ids: Any = None,
              implementation: str = "auto", block_size: int = BLOCK,
              softcap: float | None = None) -> jax.Array:
    """Softmax attention ``softmax(q k^T / sqrt(head_dim) [masked]) v`` of ``q [batch,
    q_len, heads, head_dim]`` and ``k, v [batch, kv_len, kv_heads, head_dim]``, run the
    way the active strategy asks (see the module docs): on each device, or ``"ring"`` or
    ``"allgather"`` over the mesh axes of ``length`` (``context`` in the ``cp`` presets).

    Args:
      causal: query ``i`` sees keys ``0 .. i`` only.
      mask: boolean, broadcastable to ``[batch, heads, q_len, kv_len]`` (``True``:
        seen), as flax's attention takes it; ``[batch, 1, 1, kv_len]`` (key padding)
        travels with the key/value blocks under context parallelism, any other
        mask is held per query row at full key length.
      segment_ids: int ``[batch, length]`` (or a pair for queries and keys): tokens
        see only tokens of their own segment (packed sequences).
      implementation: the per-device kernel, ``"auto"`` (default), ``"blockwise"``,
        ``"dense"`` or ``"cudnn"`` (see :mod:`nnx_shard._attention._kernels`);
        independent of the strategy's ``attention`` option (one of
        :data:`~nnx_shard._attention._modes.MODES`), which only says how the sequence
        is split.
      block_size: the blockwise kernel's query and key/value block.
      softcap: ``None``, or Gemma 2's attention logit soft-cap: the scaled scores
        become ``softcap * tanh(scores / softcap)`` before the mask (every kernel
        but cuDNN's, which refuses it; ``"auto"`` then picks blockwise).

    ``heads`` must be a multiple of ``kv_heads`` (grouped-query attention; K/V are
    never repeated). A query that sees no key gets zeros.

    Raises:
      UsageError: q, k, v of bad ranks or mismatched shapes; a mask or segment ids
        of the wrong shape; an unknown implementation.
      ShardingError: an ``attention`` option that is not a mode; in ring/allgather
        mode, a sequence length that does not split into ``2 x context`` zig-zag
        chunks (``context`` slices for all-gather), rules without a ``length``
        entry, or kv heads that the heads' mesh axes do not divide.

    >>> import jax
    >>> import jax.numpy as jnp
    >>> from nnx_shard.models import attention
    >>> q = jax.random.normal(jax.random.key(0), (2, 8, 2, 4))
    >>> out = attention(q, q, q)
    >>> out.shape, bool(jnp.allclose(out[:, 0], q[:, 0]))   # token 0 sees only itself
    ((2, 8, 2, 4), True)
    >>> kv = q[:, :, :1]                                     # one kv head for 2 query heads
    >>> seg = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1]] * 2)      # two packed sequences
    >>> attention(q, kv, kv, segment_ids=seg, implementation="blockwise", block_size=4).shape
    (2, 8, 2, 4)
    """
    _check_qkv(q, k, v)
    masks = _check_masks(q, k, mask, segment_ids)
    called("attention")  # for expect_attention
    mode = context_mode()
    active = current()
    axes: tuple[str, ...] = ()
    if mode != LOCAL and active is not None:
        axes = context_parallel.context_axes(active[0], active[1], mode)
    c = math.prod(dict(active[0].shape)[a] for a in axes) if active is not None else 1
    kernel = kernels.resolve(implementation, q, k, masks, context_parallel=c > 1,
                             softcap=softcap)
    if c == 1:
        k, v = _kv_per_device(q, k, v, active[0] if active is not None else None)
        return kernels.attention_local(
            q, k, v, masks._replace(mask=group_mask(masks.mask, k.shape[2])), causal=causal,
            kernel=kernel, block=block_size, softcap=softcap)
    assert active is not None
    return context_parallel.split_attention(
        q, k, v, masks, mode=mode, axes=axes, mesh=active[0], rules=active[1], causal=causal,
        block=block_size if kernel == "blockwise" else None, softcap=softcap)


def _kv_per_device(q: jax.Array, k: jax.Array, v: jax.Array, mesh: Any
                   ) -> tuple[jax.Array, jax.Array]:
    """K/V laid out for query heads that Explicit mesh axes split ``s`` ways where ``s``
    does not divide ``kv_heads`` (e.g. 2 kv heads, query heads over ``model=4``; the
    rules then replicate K/V): each key/value head repeated to ``r = lcm(kv_heads, s)``
    heads split like the query heads, so that each device holds the one (or few) it
    needs and the grouped reshape of the queries stays local. Elsewhere ``k, v`` as
    they are (Auto axes: the partitioner lays the grouped reshape out itself)."""
    h, hk = q.shape[2], k.shape[2]
    if mesh is None or h == hk:
        return k, v
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    spec = tuple(jax.typeof(q).sharding.spec) + (None,) * q.ndim
    entry = spec[2]
    names = entry_axes(entry)
    if not names or any(types[a] != AxisType.Explicit for a in names):
        return k, v
    split = math.prod(dict(mesh.shape)[a] for a in names)
    if hk % split == 0:
        return k, v
    r = math.lcm(hk, split)
    r = r if h % r == 0 else h
    out = P(*spec[:4])
    return tuple(jax.sharding.reshard(jnp.repeat(x, r // hk, axis=2), out) for x in (k, v))


# The fused step traces every step under expect_attention (see nnx_shard._parallel.registry).
register(ParallelOp("attention", OPTION, check_step=expect_attention))
