"""Attention that context parallelism can split: dense, ring, or all-gather-KV.

:func:`attention` is the softmax-attention core of a model (``q, k, v ->
out``, all ``[batch, length, heads, head_dim]``). How it runs is the active
strategy's choice (the execution option ``attention`` of the rules under
:func:`nnx_shard.use`, see :meth:`nnx_shard.Rules.with_options`), never a
model edit:

* no option (every preset but ``cp``/``fsdp_cp``), or outside ``use``: the
  dense masked softmax, ``softmax(q k^T / sqrt(d)) v``;
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
  scores are recomputed per tile instead of being stored.
* ``"allgather"``: each device all-gathers the full-length keys and values over
  the context axes and attends with its local queries (simpler, more memory:
  the comparison point).

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

from nnx_shard._frames import Frames
from nnx_shard.errors import ShardingError
from nnx_shard.mesh import current, option
from nnx_shard.parallel.registry import ParallelOp, register

__all__ = ["MODES", "OPTION", "attention", "expect_attention"]

#: The execution option (``Rules.with_options(attention=...)``) this module reads.
OPTION = "attention"

#: The values of the ``attention`` execution option (``"dense"``: as if unset).
MODES = ("dense", "ring", "allgather")

_NEG = float(jnp.finfo(jnp.float32).min)


@dataclasses.dataclass
class _Watch:
    """One :func:`expect_attention` block: whether :func:`attention` ran inside it."""

    called: bool = False


_watches: Frames[_Watch] = Frames()


def _dense(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    # The reference transformer's original core, kept operation for operation so
    # that strategies without context parallelism compute the same numbers.
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    if causal:
        length = q.shape[1]
        mask = jnp.tril(jnp.ones((length, k.shape[1]), dtype=bool))
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v)


def _check_qkv(q: Any, k: Any, v: Any) -> None:
    for name, a in (("q", q), ("k", k), ("v", v)):
        if getattr(a, "ndim", None) != 4:
            raise ValueError(
                f"attention: {name} must be [batch, length, heads, head_dim] (rank 4), got "
                f"{type(a).__name__} of shape {getattr(a, 'shape', None)}. Fix: reshape the "
                "projections to [batch, length, heads, head_dim], e.g. "
                "jnp.einsum('ble,ehk->blhk', x, w)."
            )
    if q.shape != k.shape or k.shape != v.shape:
        raise ValueError(
            f"attention: q, k and v must have the same shape [batch, length, heads, head_dim] "
            f"(self-attention), got q {q.shape}, k {k.shape}, v {v.shape}. Fix: project all "
            "three from the same input with the same number of heads."
        )


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


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True) -> jax.Array:
    """Softmax attention ``softmax(q k^T / sqrt(head_dim) [+ causal mask]) v`` of
    ``q, k, v: [batch, length, heads, head_dim]``, run the way the active strategy
    asks (see the module docs): dense, ``"ring"`` or ``"allgather"`` over the mesh
    axes of ``length`` (``context`` in the ``cp`` presets).

    Raises:
      ValueError: q, k, v not rank 4 or not of one shape; an unknown ``attention``
        option.
      ShardingError: in ring/allgather mode, a sequence length that does not split
        into ``2 x context`` zig-zag chunks (``context`` slices for all-gather), or
        rules without a ``length`` entry.

    >>> import jax.numpy as jnp
    >>> q = jax.random.normal(jax.random.key(0), (2, 8, 2, 4))
    >>> out = attention(q, q, q)
    >>> out.shape, bool(jnp.allclose(out[:, 0], q[:, 0]))   # token 0 sees only itself
    ((2, 8, 2, 4), True)
    """
    _check_qkv(q, k, v)
    for watch in _watches:
        watch.called = True
    mode = option(OPTION, "dense")
    if mode not in MODES:
        raise ValueError(
            f"attention: execution option attention={mode!r} is not one of {MODES}. Fix: "
            "rules.with_options(attention='ring') or 'allgather', or leave it unset (dense)."
        )
    active = current()
    if mode == "dense" or active is None:
        return _dense(q, k, v, causal)
    mesh, rules = active
    axes = _context_axes(mesh, rules, mode)
    c = math.prod(dict(mesh.shape)[a] for a in axes)
    if c == 1:
        return _dense(q, k, v, causal)
    _check_length(q, axes, c, mode, causal)
    spec, manual = _manual_spec(q, mesh, rules, axes)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        q, k, v = (_retype(a, spec) for a in (q, k, v))
    body = functools.partial(_ring_local if mode == "ring" else _allgather_local,
                             axes=axes, c=c, causal=causal)
    run = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                        axis_names=manual, check_vma=False)
    return run(q, k, v)


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

    def named(entry: Any) -> tuple[str, ...]:
        return (entry,) if isinstance(entry, str) else tuple(entry or ())

    out: list[Any] = []
    for dim in range(x.ndim):
        if dim == 1:
            out.append(axes)
            continue
        kept = tuple(a for a in named(typed[dim]) if types[a] == AxisType.Explicit)
        if not kept:
            kept = tuple(a for a in named(ruled[dim]) if types[a] != AxisType.Explicit)
        out.append(tuple(a for a in kept if a not in axes) or None)
    return P(*out), {a for entry in out if entry for a in entry}


def _retype(x: jax.Array, spec: P) -> jax.Array:
    typed = tuple(jax.typeof(x).sharding.spec)
    typed += (None,) * (x.ndim - len(typed))
    norm = tuple(None if not e else (e,) if isinstance(e, str) else tuple(e) for e in typed)
    want = tuple(None if not e else tuple(e) for e in spec)
    return x if norm == want else jax.sharding.reshard(x, spec)


# --------------------------------------------------------------------------- all-gather


def _allgather_local(q: jax.Array, k: jax.Array, v: jax.Array, *, axes: tuple[str, ...],
                     c: int, causal: bool) -> jax.Array:
    """Local queries (contiguous slice ``i``) against the gathered full-length K/V."""
    n = q.shape[1]
    k_all = jax.lax.all_gather(k, axes, axis=1, tiled=True)
    v_all = jax.lax.all_gather(v, axes, axis=1, tiled=True)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k_all,
                        preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    if causal:
        qpos = jax.lax.axis_index(axes) * n + jnp.arange(n)
        mask = qpos[:, None] >= jnp.arange(k_all.shape[1])[None, :]
        scores = jnp.where(mask, scores, _NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bhqs,bshk->bqhk", probs, v_all)


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


def _ring_local(q: jax.Array, k: jax.Array, v: jax.Array, *, axes: tuple[str, ...], c: int,
                causal: bool) -> jax.Array:
    if not causal:
        return _ring(q, k, v, axes, c, False)
    zq, zk, zv = _to_zigzag(jnp.stack([q, k, v]), axes, c, axis=2)
    return _from_zigzag(_ring(zq, zk, zv, axes, c, True), axes, c, axis=1)


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    return s / math.sqrt(q.shape[-1])


def _block_fwd(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None
               ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Unnormalised output, row sums and row maxima of one query/key block."""
    s = _scores(q, k)
    if mask is not None:
        s = jnp.where(mask, s, _NEG)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32))
    return o, jnp.sum(p, axis=-1), m


def _merge(acc: tuple[jax.Array, ...], blk: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    o, s, m = acc
    ob, sb, mb = blk
    mn = jnp.maximum(m, mb)
    a, bb = jnp.exp(m - mn), jnp.exp(mb - mn)
    return o * _rows(a) + ob * _rows(bb), s * a + sb * bb, mn


def _rows(w: jax.Array) -> jax.Array:
    """Per-row statistics ``[b, h, q]`` broadcast against outputs ``[b, q, h, d]``."""
    return jnp.transpose(w, (0, 2, 1))[..., None]


def _causal_block_mask(n2: int) -> jax.Array:
    # Step 0 pairs the device's own chunks (i, 2C-1-i) with themselves: each chunk
    # sees itself causally, the later chunk sees all of the earlier one.
    n = n2 // 2
    tril = jnp.tril(jnp.ones((n, n), bool))
    return jnp.block([[tril, jnp.zeros((n, n), bool)], [jnp.ones((n, n), bool), tril]])


def _shift(x: Any, axes: tuple[str, ...], c: int) -> Any:
    perm = [(i, (i + 1) % c) for i in range(c)]
    return jax.tree.map(lambda a: jax.lax.ppermute(a, axes, perm), x)


def _earlier(step: jax.Array, axes: tuple[str, ...], c: int) -> jax.Array:
    """At ring step ``step`` the K/V block held came from device ``(d - step) mod C``;
    with zig-zag chunks it is wholly earlier than this device's first chunk iff that
    device index is below ``d``."""
    d = jax.lax.axis_index(axes)
    return (d - step) % c < d


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _ring(q: jax.Array, k: jax.Array, v: jax.Array, axes: tuple[str, ...], c: int,
          causal: bool) -> jax.Array:
    return _ring_fwd(q, k, v, axes, c, causal)[0]


def _ring_fwd(q: jax.Array, k: jax.Array, v: jax.Array, axes: tuple[str, ...], c: int,
              causal: bool) -> tuple[jax.Array, Any]:
    n2 = q.shape[1]
    n = n2 // 2
    # Each block is sent on before it is used, so that the transfer of step s + 1
    # can overlap the compute of step s (async collective-permutes on accelerators).
    moving = _shift((k, v), axes, c)
    acc = _block_fwd(q, k, v, _causal_block_mask(n2) if causal else None)

    def full(kb: jax.Array, vb: jax.Array) -> tuple[jax.Array, ...]:
        return _block_fwd(q, kb, vb, None)

    def low_keys(kb: jax.Array, vb: jax.Array) -> tuple[jax.Array, ...]:
        # Both query chunks against the earlier key chunk only.
        return _block_fwd(q, kb[:, :n], vb[:, :n], None)

    def high_queries(kb: jax.Array, vb: jax.Array) -> tuple[jax.Array, ...]:
        # Only the later query chunk sees this block (all of it).
        o, l_, m = _block_fwd(q[:, n:], kb, vb, None)
        return (jnp.concatenate([jnp.zeros_like(o), o], 1),
                jnp.concatenate([jnp.zeros_like(l_), l_], 2),
                jnp.concatenate([jnp.full_like(m, -jnp.inf), m], 2))

    def block(s: Any, kv: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        if causal:
            return jax.lax.cond(_earlier(s, axes, c), low_keys, high_queries, *kv)
        return full(*kv)

    def step(s: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        acc, kv = carry
        nxt = _shift(kv, axes, c)
        return _merge(acc, block(s, kv)), nxt

    # Steps 1 .. C-2 in the loop; the last one outside it, with nothing left to send.
    acc, kv = jax.lax.fori_loop(1, c - 1, step, (acc, moving))
    o, l_, m = _merge(acc, block(c - 1, kv))
    out = (o / _rows(l_)).astype(q.dtype)
    lse = m + jnp.log(l_)
    return out, (q, k, v, out, lse)


def _block_bwd(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array,
               delta: jax.Array, mask: jax.Array | None) -> tuple[jax.Array, ...]:
    s = _scores(q, k)
    p = jnp.exp(s - lse[..., None])
    if mask is not None:
        p = jnp.where(mask, p, 0.0)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, do)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, v.astype(jnp.float32))
    ds = p * (dp - delta[..., None]) / math.sqrt(q.shape[-1])
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(jnp.float32))
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32))
    return dq, dk, dv


def _ring_bwd(axes: tuple[str, ...], c: int, causal: bool, res: Any, g: jax.Array
              ) -> tuple[jax.Array, jax.Array, jax.Array]:
    q, k, v, out, lse = res
    n2 = q.shape[1]
    n = n2 // 2
    do = g.astype(jnp.float32)
    delta = jnp.transpose(jnp.sum(do * out.astype(jnp.float32), -1), (0, 2, 1))  # [b,h,q]
    dq, dk, dv = _block_bwd(q, k, v, do, lse, delta, _causal_block_mask(n2) if causal else None)

    def full(kb: jax.Array, vb: jax.Array) -> tuple[jax.Array, ...]:
        return _block_bwd(q, kb, vb, do, lse, delta, None)

    def low_keys(kb: jax.Array, vb: jax.Array) -> tuple[jax.Array, ...]:
        dqb, dkb, dvb = _block_bwd(q, kb[:, :n], vb[:, :n], do, lse, delta, None)
        z = jnp.zeros_like(dkb)
        return dqb, jnp.concatenate([dkb, z], 1), jnp.concatenate([dvb, z], 1)

    def high_queries(kb: jax.Array, vb: jax.Array) -> tuple[jax.Array, ...]:
        dqb, dkb, dvb = _block_bwd(q[:, n:], kb, vb, do[:, n:], lse[..., n:], delta[..., n:],
                                   None)
        return jnp.concatenate([jnp.zeros_like(dqb), dqb], 1), dkb, dvb

    def block(s: Any, kv: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, ...]:
        if causal:
            return jax.lax.cond(_earlier(s, axes, c), low_keys, high_queries, *kv)
        return full(*kv)

    def step(s: Any, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        # kv: the block of step s, sent on ahead as in the forward pass; grad: the
        # gradient accumulated for the block of step s - 1, which follows one device
        # behind its block.
        dq, kv, grad = carry
        nxt = _shift(kv, axes, c)
        dqb, dkb, dvb = block(s, kv)
        dk, dv = _shift(grad, axes, c)
        return dq + dqb, nxt, (dk + dkb, dv + dvb)

    carry = (dq, _shift((k, v), axes, c), (dk, dv))
    carry = jax.lax.fori_loop(1, c - 1, step, carry)
    dq, _, (dk, dv) = step(c - 1, carry)  # its extra K/V send is unused: XLA drops it
    # After step C - 1 each gradient block sits one device short of its owner.
    dk, dv = _shift((dk, dv), axes, c)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


# The fused step traces every step under expect_attention (see nnx_shard.parallel.registry).
register(ParallelOp("attention", OPTION, check_step=expect_attention))
