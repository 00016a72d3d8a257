"""The one sparse mixture-of-experts MLP of every MoE model (Mixtral, Qwen3-MoE, the
reference model's): :class:`DecoderMoE`, and the router statistics the model sums over
its MoE layers into transformers' load-balancing loss (:func:`aux_loss`). With a
config's ``capacity_factor`` (the reference model's, 2.0 by default) the layer
dispatches GShard-style instead (:meth:`DecoderMoE.capacity_route`): a fixed number of
slots per sequence and expert, tokens over it dropped.

Every routed token is computed, none dropped (as transformers does): the
``tokens x top_k`` slots are sorted by expert and the experts' gated MLPs run as
grouped matmuls over the sorted slots, one group per expert
(:func:`~nnx_shard.models._grouped.grouped_matmul`, as the config's ``expert_matmul``
says), so the cost is that of the active parameters, not of every expert.
Under rules that split the experts over mesh axes that also split the tokens (the
``ep`` preset) the slots travel to their experts' devices and back with all-to-all
(:mod:`nnx_shard.models._expert_parallel`); otherwise the layer gathers tokens and
expert weights.

>>> from flax import nnx
>>> from nnx_shard.models._decoder_config import DecoderConfig
>>> cfg = DecoderConfig.for_model("mixtral", experts=4, top_k=2)
>>> moe = DecoderMoE(cfg, rngs=nnx.Rngs(0))
>>> y, stats = moe(jnp.ones((2, 8, cfg.embed)))
>>> y.shape, moe.gate.get_metadata("out_sharding"), stats.counts.shape
((2, 8, 32), ('expert', 'embed', 'mlp'), (4,))
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnx_shard.models._expert_parallel import Routing, dispatch_combine, expert_plan
from nnx_shard.models._grouped import grouped_matmul
from nnx_shard.models._layers import ACTIVATION_FNS, dense_init, new_param
from nnx_shard.models._layout import GATHERED, RESIDUAL
from nnx_shard.models._ops import constrain, einsum, whole

__all__ = ["DecoderMoE", "RouterStats", "add_stats", "aux_loss", "no_stats"]


class RouterStats(NamedTuple):
    """The router's sums over the real tokens of the MoE layers so far: top-k
    assignments per expert (``counts [experts]``), softmax probabilities per expert
    (``probs [experts]``) and the tokens counted (``rows``), as transformers'
    ``load_balancing_loss_func`` accumulates them."""

    counts: jax.Array
    probs: jax.Array
    rows: jax.Array


def no_stats(cfg: Any) -> RouterStats | jax.Array | None:
    """Zero statistics for a model with experts; ``None`` for a dense one. With
    GShard's dispatch (``capacity_factor``) each layer reports its own load-balancing
    loss and the model sums them: a scalar, which a pipeline averages over its
    microbatches as gradient accumulation does."""
    if not any(cfg.moe_layers()):
        return None
    if cfg.capacity_factor is not None:
        return jnp.zeros((), jnp.float32)
    zeros = jnp.zeros((cfg.experts,), jnp.float32)
    return RouterStats(zeros, zeros, jnp.zeros((), jnp.float32))


def add_stats(out: Any, stats: Any) -> tuple[jax.Array, Any]:
    """``(x, stats)`` after a block: a MoE block's ``(x, its stats)`` added in; a dense
    block's ``x`` leaves them as they are."""
    if not isinstance(out, tuple):
        return out, stats
    x, mine = out
    if stats is None:
        return x, None
    if not isinstance(stats, RouterStats):  # summed per-layer losses
        return x, stats + mine
    return x, RouterStats(*(a + b for a, b in zip(stats, mine, strict=True)))


def aux_loss(cfg: Any, stats: Any) -> jax.Array:
    """Transformers' load-balancing loss of the summed ``stats`` (0 without experts):
    ``experts * sum_e(fraction of assignments to e * mean probability of e)``, the
    fractions over every MoE layer's real tokens together."""
    if stats is None:
        return jnp.zeros((), jnp.float32)
    if not isinstance(stats, RouterStats):  # GShard's layers: their summed losses
        return stats
    rows = jnp.maximum(stats.rows, 1.0)
    return cfg.experts * jnp.sum((stats.counts / rows) * (stats.probs / rows))


class DecoderMoE(nnx.Module):
    """The sparse MoE MLP: ``router [embed, experts]`` logits, softmax, top-k, the
    top-k weights renormalised (Mixtral; Qwen3-MoE with ``norm_topk_prob``), and
    ``experts`` gated MLPs stacked as ``gate``, ``up [experts, embed, moe_mlp]`` and
    ``down [experts, moe_mlp, embed]``, the logical ``expert`` axis first (the
    ``ep`` preset shards it; ``fsdp`` and ``tp`` shard ``embed`` / ``mlp`` as in the
    dense MLP). Transformers' ``MixtralSparseMoeBlock`` / ``Qwen3MoeSparseMoeBlock``.
    Returns the output and this layer's :class:`RouterStats`."""

    def __init__(self, cfg: Any, *, rngs: nnx.Rngs) -> None:
        e, m, n, dt = cfg.embed, cfg.expert_mlp, cfg.experts, cfg.param_dtype
        self.router = new_param(rngs, dense_init(e), (e, n), ("embed", None), dt)
        self.gate: nnx.Param | None = nnx.data(
            new_param(rngs, dense_init(e), (n, e, m), ("expert", "embed", "mlp"), dt)
            if cfg.family.gated_mlp else None)
        self.up = new_param(rngs, dense_init(e), (n, e, m), ("expert", "embed", "mlp"), dt)
        self.down = new_param(rngs, dense_init(m), (n, m, e), ("expert", "mlp", "embed"), dt)
        self.experts, self.top_k, self.renormalise = n, cfg.top_k, cfg.norm_topk_prob
        self.activation = ACTIVATION_FNS[cfg.activation]
        self.dtype, self.matmul = cfg.dtype, cfg.expert_matmul
        self.capacity_factor = cfg.capacity_factor

    def _act(self, g: jax.Array | None, u: jax.Array) -> jax.Array:
        return self.activation(u) if g is None else self.activation(g) * u

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(logits [T, experts], weights [T, top_k], experts [T, top_k])`` of the
        tokens ``x [T, embed]``: the softmax in float32, as transformers."""
        logits = jnp.dot(x, whole(self.router[...]).astype(x.dtype))
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, chosen = jax.lax.top_k(probs, self.top_k)
        if self.renormalise:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return logits, weights, chosen

    def __call__(self, x: jax.Array, deterministic: bool | None = None,
                 valid: jax.Array | None = None) -> tuple[jax.Array, Any]:
        """``x [batch, length, embed]`` -> ``(y, stats)``; ``valid [batch, length]``
        (``None``: every token) marks the real tokens the statistics count.
        ``deterministic``: the dense MLP's argument; the experts take no adapters."""
        del deterministic
        dt = self.dtype
        b, length, e = x.shape
        if self.capacity_factor is not None:
            return self._with_capacity(x, valid)
        plan = expert_plan(self.experts, self.up.shape[-1], x)
        if plan is not None:
            y, sums = dispatch_combine(
                plan, x, jnp.ones((b, length), jnp.float32) if valid is None else valid,
                self.router[...], None if self.gate is None else self.gate[...],
                self.up[...], self.down[...],
                Routing(self.top_k, self.renormalise, self.activation, dt, self.matmul))
            return constrain(y, RESIDUAL), RouterStats(*sums)
        # The tokens whole on every device: the sort and the grouped matmuls have no
        # partitioned form here (the expert weights are gathered as under fsdp).
        flat = whole(x).reshape(b * length, e)
        logits, weights, chosen = self.route(flat)
        k = self.top_k
        slots = chosen.reshape(-1)
        order = jnp.argsort(slots, stable=True)
        sizes = jnp.bincount(slots, length=self.experts).astype(jnp.int32)
        rows = flat[order // k]

        def grouped(h: jax.Array, w: nnx.Param) -> jax.Array:
            return grouped_matmul(h, whole(w[...]).astype(dt), sizes, self.matmul)

        g = None if self.gate is None else grouped(rows, self.gate)
        out = grouped(self._act(g, grouped(rows, self.up)), self.down)
        unsorted = jnp.zeros_like(out).at[order].set(out).reshape(b * length, k, e)
        y = jnp.einsum("tke,tk->te", unsorted, weights.astype(dt)).reshape(b, length, e)
        mask = (jnp.ones((b * length,), jnp.float32) if valid is None
                else whole(valid).reshape(-1).astype(jnp.float32))
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        counts = jnp.zeros((self.experts,), jnp.float32).at[slots].add(jnp.repeat(mask, k))
        stats = RouterStats(counts, jnp.sum(probs * mask[:, None], axis=0), jnp.sum(mask))
        return constrain(y, RESIDUAL), stats

    def capacity_route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """GShard's routing of ``x [batch, length, embed]`` with a fixed capacity per
        sequence and expert, ``ceil(top_k * length * capacity_factor / experts)``
        slots: ``(dispatch, combine, probs, chosen)``. ``dispatch [batch, length,
        experts, capacity]`` is 1 where a token takes a slot of an expert's buffer (each
        slot holds at most one token, each token at most ``top_k`` slots; first choices
        of every token are served before second choices, in sequence order);
        ``combine`` holds the token's top-k weight there instead; ``probs`` the router's
        softmax and ``chosen [batch, length, top_k, experts]`` its one-hot choices.

        >>> from nnx_shard.models import ReferenceConfig
        >>> cfg = ReferenceConfig(experts=4, top_k=2, capacity_factor=0.5)
        >>> moe = DecoderMoE(cfg, rngs=nnx.Rngs(0))
        >>> dispatch, combine, probs, chosen = moe.capacity_route(jnp.ones((2, 16, cfg.embed)))
        >>> dispatch.shape, float(dispatch.sum(axis=1).max())   # capacity 4, never over
        ((2, 16, 4, 4), 1.0)
        """
        dt = self.dtype
        b, length, _ = x.shape
        n_exp, k = self.experts, self.top_k
        logits = einsum("ble,ex->blx", x, self.router[...].astype(dt), GATHERED)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        gates, idx = jax.lax.top_k(probs, k)  # [b, l, k]
        if self.renormalise:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        capacity = max(1, math.ceil(k * length * self.capacity_factor / n_exp))
        chosen = jax.nn.one_hot(idx, n_exp, dtype=jnp.int32)  # [b, l, k, x]
        order = jnp.swapaxes(chosen, 1, 2).reshape(b, k * length, n_exp)
        slot = jnp.cumsum(order, axis=1) * order - 1
        slot = jnp.swapaxes(slot.reshape(b, k, length, n_exp), 1, 2)  # [b, l, k, x]
        keep = (slot >= 0) & (slot < capacity)
        onehot_slot = jax.nn.one_hot(jnp.where(keep, slot, -1), capacity, dtype=jnp.float32)
        dispatch = jnp.sum(onehot_slot, axis=2)  # [b, l, x, c]
        combine = jnp.sum(onehot_slot * gates[..., None, None], axis=2)
        dispatch = constrain(dispatch.astype(dt), ("batch", None, None, None))
        combine = constrain(combine.astype(dt), ("batch", None, None, None))
        return dispatch, combine, probs, chosen

    def _with_capacity(self, x: jax.Array, valid: jax.Array | None
                       ) -> tuple[jax.Array, jax.Array]:
        """The layer with :meth:`capacity_route`'s dispatch: tokens over an expert's
        capacity skip it (the residual carries them), and the experts run as batched
        matmuls over their buffers, ``("expert", "batch", None, None)``: expert
        parallelism turns the dispatch into collectives over the expert axis."""
        dt = self.dtype
        dispatch, combine, probs, chosen = self.capacity_route(x)
        expert_in = einsum("blxc,ble->xbce", dispatch, x, ("expert", "batch", None, None))

        def hidden(w: nnx.Param) -> jax.Array:
            return einsum("xbce,xem->xbcm", expert_in, w[...].astype(dt),
                          ("expert", "batch", None, "mlp"))

        h = self._act(None if self.gate is None else hidden(self.gate), hidden(self.up))
        expert_out = einsum("xbcm,xme->xbce", h, self.down[...].astype(dt),
                            ("expert", "batch", None, None))
        out = einsum("xbce,blxc->ble", expert_out, combine, RESIDUAL)
        # GShard's load-balancing loss of this layer: experts * sum_e(fraction of the
        # top-k choices routed to e * mean probability of e), over every token.
        del valid
        routed = jnp.mean(jnp.sum(chosen, axis=2).astype(jnp.float32), axis=(0, 1)) / self.top_k
        return out, self.experts * jnp.sum(routed * jnp.mean(probs, axis=(0, 1)))
