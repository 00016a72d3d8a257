"""Attention that context parallelism can split: on each device, ring, or all-gather-KV.

:func:`attention` is the softmax-attention core of a model (``q, k, v ->
out``; ``q [batch, length, heads, head_dim]``, ``k, v [batch, length,
kv_heads, head_dim]``, optional masks and segment ids). Two independent
choices decide how it runs:

* the **kernel**, the model's choice (the op's ``implementation``,
  ``TransformerConfig.attention``): how one device computes attention on the
  queries and keys it holds, ``"dense"``, ``"blockwise"`` (memory-efficient,
  online softmax over blocks, recomputed in the backward pass), ``"cudnn"``, or
  ``"auto"`` (see :mod:`nnx_shard.blockwise`);
* the **distribution**, the strategy's choice (the execution option
  ``attention`` of the rules under :func:`nnx_shard.use`, see
  :meth:`nnx_shard.Rules.with_options`), never a model edit. Its ``"dense"``
  (or no option) means "no context parallelism", not the dense kernel:

* no option (every preset but ``cp``/``fsdp_cp``), or outside ``use``: the
  kernel on each device's whole sequence;
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

Grouped-query attention keeps ``kv_heads`` on the ring: query heads are grouped
per key/value head inside the op, K/V are never repeated (outside context
parallelism, query heads that Explicit mesh axes split more ways than there are
kv heads get each kv head repeated to ``lcm(kv_heads, split)`` heads laid out like
theirs: one per device, the one it reads). Masks: segment ids and
a key padding mask (``[batch, 1, 1, length]``) travel with the key/value blocks
(they are per key); any other mask is held per query row at full key length and
cut to each block's columns.

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

>>> import jax.numpy as jnp
>>> q = jnp.ones((1, 4, 2, 8))
>>> attention(q, q, q).shape
(1, 4, 2, 8)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_shard import blockwise
from nnx_shard._frames import Frames
from nnx_shard.axes import entry_axes
from nnx_shard.blockwise import BLOCK, Masks, finish, grads, group_mask, merge, stats
from nnx_shard.errors import ShardingError
from nnx_shard.mesh import current, option
from nnx_shard.parallel.registry import ParallelOp, register

__all__ = ["MODES", "OPTION", "attention", "expect_attention"]

#: The execution option (``Rules.with_options(attention=...)``) this module reads.
OPTION = "attention"

#: The values of the ``attention`` execution option (``"dense"``: as if unset).
MODES = ("dense", "ring", "allgather")

@dataclasses.dataclass
class _Watch:
    """One :func:`expect_attention` block: whether :func:`attention` ran inside it."""

    called: bool = False


_watches: Frames[_Watch] = Frames()


def _check_qkv(q: Any, k: Any, v: Any) -> None:
    for name, a in (("q", q), ("k", k), ("v", v)):
        if getattr(a, "ndim", None) != 4:
            raise ValueError(
                f"attention: {name} must be [batch, length, heads, head_dim] (rank 4), got "
                f"{type(a).__name__} of shape {getattr(a, 'shape', None)}. Fix: reshape the "
                "projections to [batch, length, heads, head_dim], e.g. "
                "jnp.einsum('ble,ehk->blhk', x, w)."
            )
    (b, _, h, d), (bk, _, hk, dk) = q.shape, k.shape
    if k.shape[:3] != v.shape[:3] or b != bk or d != dk or h % hk:
        raise ValueError(
            f"attention: got q {q.shape}, k {k.shape}, v {v.shape}; need q [batch, q_len, heads, "
            "head_dim], k and v [batch, kv_len, kv_heads, head_dim] with the same batch, k and "
            "v of one length and number of heads, q and k of one head_dim, and heads a "
            "multiple of kv_heads (grouped-query attention: query head n uses key/value head "
            "n // (heads // kv_heads)). Fix: project k and v with the same number of heads, "
            "and q with a multiple of it."
        )


def _check_masks(q: jax.Array, k: jax.Array, mask: Any, segment_ids: Any) -> Masks:
    """The op's ``mask`` and ``segment_ids`` as :class:`~nnx_shard.blockwise.Masks`, the
    mask still in the ``[b|1, heads|1, q_len|1, kv_len|1]`` layout of the arguments (a
    mask of keys alone, ``[b|1, 1, 1, kv_len]``, becomes ``kv_valid``)."""
    b, lq, h, _ = q.shape
    lk = k.shape[1]
    q_seg = kv_seg = kv_valid = None
    if segment_ids is not None:
        pair = segment_ids if isinstance(segment_ids, tuple | list) else (segment_ids,) * 2
        if len(pair) != 2:
            raise ValueError(
                f"attention: segment_ids must be one [batch, length] array or a pair "
                f"(q_segment_ids, kv_segment_ids), got {len(pair)} arrays. Fix: pass "
                "segment_ids=ids for self-attention."
            )
        q_seg, kv_seg = (jnp.asarray(x) for x in pair)
        for name, ids, n in (("q", q_seg, lq), ("kv", kv_seg, lk)):
            if ids.shape != (b, n) or not jnp.issubdtype(ids.dtype, jnp.integer):
                raise ValueError(
                    f"attention: {name} segment ids must be integers of shape (batch, "
                    f"{'q_len' if name == 'q' else 'kv_len'}) = {(b, n)}, got {ids.dtype} of "
                    f"shape {ids.shape} (q {q.shape}, k {k.shape}). Fix: one id per token, equal "
                    "ids for tokens of one packed sequence (e.g. padding gets its own id)."
                )
    if mask is not None:
        mask = jnp.asarray(mask)
        want = (b, h, lq, lk)
        if mask.ndim != 4 or any(n not in (1, w) for n, w in zip(mask.shape, want, strict=True)):
            raise ValueError(
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


def _context_axes(mesh: Any, rules: Any, mode: str) -> tuple[str, ...]:
    """The mesh axes (size > 1) that the rules map ``length`` to."""
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
    nnx_shard.errors.ShardingError: my_step ran under rules with attention='ring' ...
    """
    mode = option(OPTION, "dense")
    with _watches.push(_Watch()) as watch:
        yield
    if mode in ("ring", "allgather") and not watch.called:
        active = current()
        on = ""
        if active is not None:
            axes = _context_axes(active[0], active[1], mode)
            on = f" (logical axis 'length' is split over mesh axes {axes})" if axes else ""
        raise ShardingError(
            f"{fn_name} ran under rules with attention={mode!r}{on}, but the model never "
            "called nnx_shard.models.attention, so its attention is not context-parallel "
            "(the partitioner would gather the whole sequence on every device). Fix: compute "
            "the attention core of the model with nnx_shard.models.attention(q, k, v, "
            "causal=True) (q, k, v: [batch, length, heads, head_dim]), as "
            "nnx_shard.models.Transformer does; or train with a strategy that does not split "
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
        ``"dense"`` or ``"cudnn"`` (see :mod:`nnx_shard.blockwise`); independent of
        the strategy's ``attention`` option, which only says how the sequence is split.
      block_size: the blockwise kernel's query and key/value block.
      softcap: ``None``, or Gemma 2's attention logit soft-cap: the scaled scores
        become ``softcap * tanh(scores / softcap)`` before the mask (every kernel
        but cuDNN's, which refuses it; ``"auto"`` then picks blockwise).

    ``heads`` must be a multiple of ``kv_heads`` (grouped-query attention; K/V are
    never repeated). A query that sees no key gets zeros.

    Raises:
      ValueError: q, k, v of bad ranks or mismatched shapes; a mask or segment ids
        of the wrong shape; an unknown ``attention`` option or implementation.
      ShardingError: in ring/allgather mode, a sequence length that does not split
        into ``2 x context`` zig-zag chunks (``context`` slices for all-gather),
        rules without a ``length`` entry, or kv heads that the heads' mesh axes do
        not divide.

    >>> import jax.numpy as jnp
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
    for watch in _watches:
        watch.called = True
    mode = option(OPTION, "dense")
    if mode not in MODES:
        raise ValueError(
            f"attention: execution option attention={mode!r} is not one of {MODES}. Fix: "
            "rules.with_options(attention='ring') or 'allgather', or leave it unset (dense)."
        )
    active = current()
    axes: tuple[str, ...] = ()
    if mode != "dense" and active is not None:
        axes = _context_axes(active[0], active[1], mode)
    c = math.prod(dict(active[0].shape)[a] for a in axes) if active is not None else 1
    kernel = blockwise.resolve(implementation, q, k, masks, context_parallel=c > 1,
                               softcap=softcap)
    block = block_size if kernel == "blockwise" else None
    if c == 1:
        k, v = _kv_per_device(q, k, v, active[0] if active is not None else None)
        return blockwise.attention_local(
            q, k, v, masks._replace(mask=group_mask(masks.mask, k.shape[2])), causal=causal,
            kernel=kernel, block=block_size, softcap=softcap)
    assert active is not None
    mesh, rules = active
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
    return blockwise.attention_local(q, k_all, v_all, masks, causal=causal,
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
        masks = Masks(*(None if x is None else x if x.shape[ax] == 1
                        else _to_zigzag(x, axes, c, axis=ax)
                        for x, ax in zip(masks, (1, 1, -1, 2), strict=True)))
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
    # is one call of the per-device kernel's block math (nnx_shard.blockwise.stats): a
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
    dlt = blockwise.delta(do, out)
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


# The fused step traces every step under expect_attention (see nnx_shard.parallel.registry).
register(ParallelOp("attention", OPTION, check_step=expect_attention))
