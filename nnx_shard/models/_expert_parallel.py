"""Expert parallelism for the MoE MLP: each token's top-k slots travel to the devices
that hold their experts with one all-to-all, are computed there with grouped
matmuls, and travel back with a second one (GShard's dispatch and combine).

This path runs when the active rules shard the logical ``expert`` axis over mesh
axes that also split the tokens (the ``ep`` preset: ``batch`` over
``("data", "expert")``, ``expert`` over ``expert``), so every device routes only
its own tokens and holds only its own experts. Nothing is dropped: each device's
send buffer has room for ``tokens x min(top_k, local experts)`` slots towards every
peer (the dropless worst case: a token's top_k experts are distinct), and the
receiver computes only the rows it was sent (grouped matmuls,
:func:`~nnx_shard.models._grouped.grouped_matmul`; the rest of the buffer is outside
every group, and its tiles are skipped). Its buffers still have room for every peer's
slots: ``min(p x top_k, experts)`` rows per local token, what ``nnx-shard plan``'s
activation formula counts for the experts' hidden tensors under expert parallelism.
Where the tokens are not split over the expert axes, or no rules are active, the
layer gathers instead (:class:`nnx_shard.models._moe.DecoderMoE`).

>>> import nnx_shard as ns
>>> from flax import nnx
>>> from nnx_shard.models import DecoderConfig
>>> from nnx_shard.models._moe import DecoderMoE
>>> cfg = DecoderConfig.for_model("mixtral", experts=4, top_k=2)
>>> moe = DecoderMoE(cfg, rngs=nnx.Rngs(0))
>>> with ns.use("data=2,expert=4", ns.strategies.get("ep").rules):
...     plan = expert_plan(moe.experts, cfg.expert_mlp, jnp.ones((8, 4, cfg.embed)))
>>> plan.ep, plan.tokens
(('expert',), (('data', 'expert'), None))
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from nnx_shard._axes import axes_entry, entry_axes
from nnx_shard._errors import ShardingError
from nnx_shard._mesh import current
from nnx_shard.models._grouped import grouped_matmul, tile_rows

__all__ = ["ExpertPlan", "Routing", "dispatch_combine", "expert_plan"]


class ExpertPlan(NamedTuple):
    """Where the expert-parallel layer runs: the ``mesh``, the mesh axes of the
    ``expert`` dimension (``ep``, ``p`` devices along them), the axes of the tokens'
    batch and length dimensions (``tokens``) and of the experts' ``mlp`` dimension
    (``mlp``, reduced after the down projection)."""

    mesh: Any
    ep: tuple[str, ...]
    p: int
    tokens: tuple[Any, Any]
    mlp: tuple[str, ...]


class Routing(NamedTuple):
    """How the layer routes and computes: top-``k`` experts per token, their weights
    renormalised or not, the gated MLP's ``activation`` and compute ``dtype``, and
    the grouped matmuls' ``matmul`` (``DecoderConfig.expert_matmul``)."""

    top_k: int
    renormalise: bool
    activation: Any
    dtype: Any
    matmul: str = "auto"


def _axes(rules: Any, mesh: Any, names: tuple[str | None, ...], shape: tuple[int, ...]
          ) -> tuple[tuple[str, ...], ...]:
    try:
        spec = tuple(rules.spec(names, shape=shape, mesh=mesh, path="moe"))
    except ShardingError:
        return tuple(() for _ in names)
    spec += (None,) * (len(names) - len(spec))
    return tuple(entry_axes(e) for e in spec)


def expert_plan(experts: int, width: int, x: jax.Array) -> ExpertPlan | None:
    """The :class:`ExpertPlan` for tokens ``x [batch, length, embed]`` and experts of
    ``width`` mlp columns under the active
    rules, or ``None`` when the gathering path applies (no rules, ``expert`` not
    sharded, or the tokens not split over the expert axes)."""
    active = current()
    if active is None:
        return None
    mesh, rules = active
    (ep,) = _axes(rules, mesh, ("expert",), (experts,))
    if not ep:
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    typed = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    ruled = _axes(rules, mesh, ("batch", "length"), tuple(x.shape[:2]))
    tokens = []
    for dim in range(2):
        # An Explicit axis follows the array's type, an Auto one the rules (as the
        # context-parallel attention decides its manual axes).
        kept = tuple(a for a in entry_axes(typed[dim]) if types[a] == AxisType.Explicit)
        tokens.append(kept or tuple(a for a in ruled[dim] if types[a] != AxisType.Explicit))
    split = {a for axes in tokens for a in axes}
    if not set(ep) <= split:
        return None
    (mlp,) = _axes(rules, mesh, ("mlp",), (width,))
    # An mlp axis that also splits the tokens would give each device other tokens and
    # other columns: the experts' mlp dimension is gathered then.
    mlp = tuple(a for a in mlp if a not in split and a not in ep)
    p = math.prod(dict(mesh.shape)[a] for a in ep)
    if experts % p:
        return None
    return ExpertPlan(mesh, ep, p, (axes_entry(tokens[0]), axes_entry(tokens[1])), mlp)


def _retype(x: jax.Array, spec: P) -> jax.Array:
    mesh = jax.typeof(x).sharding.mesh
    if mesh.empty or not any(t == AxisType.Explicit for t in mesh.axis_types):
        return x
    typed = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    have = tuple(entry_axes(e) for e in typed[:x.ndim])
    want = tuple(entry_axes(e) for e in tuple(spec) + (None,) * x.ndim)[:x.ndim]
    return x if have == want else jax.sharding.reshard(x, spec)


def dispatch_combine(plan: ExpertPlan, x: jax.Array, valid: jax.Array, router: jax.Array,
                     gate: jax.Array | None, up: jax.Array, down: jax.Array, routing: Routing
                     ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """The MoE MLP of ``x [batch, length, embed]`` under ``plan``: ``(y, (counts,
    probs, rows))``, the router statistics summed over every device's real tokens
    (``valid [batch, length]``); ``gate`` ``None`` for ungated experts."""
    bt, ln = plan.tokens
    mlp = axes_entry(plan.mlp)
    ep = axes_entry(plan.ep)
    gates = () if gate is None else (gate,)
    specs = (P(bt, ln, None), P(bt, ln), P(None, None), *(P(ep, None, mlp) for _ in gates),
             P(ep, None, mlp), P(ep, mlp, None))
    args = tuple(_retype(a, s) for a, s in zip((x, valid, router, *gates, up, down), specs,
                                               strict=True))
    token_axes = tuple(entry_axes(bt)) + tuple(entry_axes(ln))

    def body(*a: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
        x, valid, router, *weights = a
        g = weights[0] if gates else None
        u, d = weights[-2:]
        return _local(x, valid, router, g, u, d, plan=plan, token_axes=token_axes,
                      routing=routing)

    manual = set(token_axes) | set(plan.ep) | set(plan.mlp)
    run = jax.shard_map(body, mesh=plan.mesh, in_specs=specs,
                        out_specs=(P(bt, ln, None), (P(), P(), P())),
                        axis_names=manual, check_vma=False)
    return run(*args)


def _local(x: jax.Array, valid: jax.Array, router: jax.Array, gate: jax.Array | None,
           up: jax.Array,
           down: jax.Array, *, plan: ExpertPlan, token_axes: tuple[str, ...],
           routing: Routing) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """One device: route the local tokens, send each slot to its expert's device,
    compute the local experts over what arrived, send the results back, combine."""
    ep, p, mlp = plan.ep, plan.p, plan.mlp
    top_k, dtype = routing.top_k, routing.dtype
    b, length, e = x.shape
    local = up.shape[0]
    experts = local * p
    flat = x.reshape(b * length, e)
    logits = jnp.dot(flat, router.astype(flat.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, chosen = jax.lax.top_k(probs, top_k)
    if routing.renormalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)

    slots = chosen.reshape(-1)
    s = slots.shape[0]
    order = jnp.argsort(slots, stable=True)
    ranked = slots[order]
    dest = ranked // local
    sent = jnp.bincount(dest, length=p)
    pos = jnp.arange(s) - (jnp.cumsum(sent) - sent)[dest]
    # A token's top_k experts are distinct, so at most min(top_k, local) of its slots
    # go to one peer: each peer's block has room for that many per token (the
    # dropless worst case), not for all top_k. Every buffer after the all-to-all, and
    # what the grouped matmuls keep for the backward pass, has p x block rows.
    block = b * length * min(top_k, local)
    # Slot i of peer q's block is the i-th slot this device sends to q; the tag is its
    # expert on q, ``local`` marking the unused rest of the block.
    send = jnp.zeros((p, block, e), flat.dtype).at[dest, pos].set(flat[order // top_k])
    tag = jnp.full((p, block), local, jnp.int32).at[dest, pos].set(ranked % local)
    rows = jax.lax.all_to_all(send, ep, 0, 0).reshape(p * block, e)
    tags = jax.lax.all_to_all(tag, ep, 0, 0).reshape(p * block)

    by_expert = jnp.argsort(tags, stable=True)
    sizes = jnp.bincount(tags, length=local + 1)[:local].astype(jnp.int32)
    h = rows[by_expert]
    # About s rows arrive on average (every device sends s slots), however large the
    # buffer that has room for the worst case.
    grouped = partial(grouped_matmul, sizes=sizes, kind=routing.matmul,
                      tile=tile_rows(s, local))
    u = grouped(h, up.astype(dtype))
    act = (routing.activation(u) if gate is None
           else routing.activation(grouped(h, gate.astype(dtype))) * u)
    out = grouped(act, down.astype(dtype))
    if mlp:
        out = jax.lax.psum(out, mlp)
    back = jnp.zeros_like(out).at[by_expert].set(out).reshape(p, block, e)
    mine = jax.lax.all_to_all(back, ep, 0, 0)[dest, pos]
    unsorted = jnp.zeros_like(mine).at[order].set(mine).reshape(b * length, top_k, e)
    y = jnp.einsum("tke,tk->te", unsorted, weights.astype(dtype)).reshape(b, length, e)

    mask = valid.reshape(-1).astype(jnp.float32)
    counts = jnp.zeros((experts,), jnp.float32).at[slots].add(jnp.repeat(mask, top_k))
    stats = (counts, jnp.sum(probs * mask[:, None], axis=0), jnp.sum(mask))
    stats = tuple(jax.lax.psum(a, token_axes) for a in stats)
    return y, stats
