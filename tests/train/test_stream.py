"""The offloaded optimizer update streamed layer by layer (``nnx_shard._train._stream``).

With the optimizer state in host memory and the decoder's layers scanned (stacked on a
``"layers"`` axis), ``Trainer``'s steps update the stacked leaves in a loop over the
layers: each turn moves one layer's slice of the state in and the new slice back, so
the device never holds more than a layer of it (plus the leaves that are not stacked).

(a) it trains as without offload (losses and weights, rtol 1e-5) under every guard and
    with the parameters offloaded too;
(b) the traced call: the update loop reads every stacked host leaf a layer at a time,
    the NaN guard's check at the call's end too, and no stacked state leaf is moved to
    the device whole;
(c) an optimizer that is not element-wise (a global-norm clip) is not streamed: the
    whole state moves in after the gradients, and it still trains as without offload.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.models import Decoder, get_config, lm_loss
from tests._close import assert_close
from tests._lm import lm_batches
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

LAYERS, STEPS, K, BATCH = 3, 4, 2, 16
CFG = dataclasses.replace(get_config("tiny"), layers=LAYERS, scan_layers=True)
CLIPPED = "clip+adamw"


def _tx(name: str) -> optax.GradientTransformation:
    if name == CLIPPED:
        return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    return optax.adamw(1e-2)


def _build(name: str, offload: str | None, tx: str, guard: str):
    s = ns.strategies.get(name, offload=offload)
    mesh = s.make_mesh(8)
    model = ns.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh, s)
    opt = ns.sharded_optimizer(model, _tx(tx), mesh, s)
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s, steps_per_call=K,
                         guard=guard, batch_names=("batch", "length"))
    return s, mesh, model, opt, trainer


@functools.cache
def _trained(name: str, offload: str | None, tx: str = "adamw", guard: str = "grads"):
    *_, model, opt, trainer = _build(name, offload, tx, guard)
    stacked = lm_batches(STEPS, BATCH, CFG.length, CFG.vocab)
    history = trainer.fit([{k: v[i] for k, v in stacked.items()} for i in range(STEPS)],
                          STEPS, progress=False)
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(opt))}
    return np.asarray(history["loss"]), jax.device_get(nnx.state(model, nnx.Param)), kinds


def _assert_trains_as_without(name, offload, tx="adamw", guard="grads"):
    losses, params, kinds = _trained(name, offload, tx, guard)
    ref_losses, ref_params, _ = _trained(name, None, tx, guard)
    assert kinds == {"pinned_host"}  # the state stays on the host between calls
    assert losses[-1] < losses[0]
    assert_close(losses, ref_losses, 1e-5, f"{name} {offload} {tx} {guard} losses")
    assert_close(params, ref_params, 1e-5, f"{name} {offload} {tx} {guard} params")


@pytest.mark.parametrize(("name", "offload", "guard"), [
    ("fsdp", "optimizer", "grads"),
    pytest.param("fsdp_tp", "optimizer+params", "full", marks=pytest.mark.slow),
    pytest.param("dp", "optimizer", "off", marks=pytest.mark.slow),
])
def test_streamed_update_trains_as_without_offload(name, offload, guard):
    _assert_trains_as_without(name, offload, guard=guard)


@pytest.mark.slow
def test_an_optimizer_that_couples_leaves_is_not_streamed_and_trains_as_without():
    _assert_trains_as_without("fsdp", "optimizer", CLIPPED)


# --------------------------------------------------------------------------- (b) the program


def _on_host(v) -> bool:
    return getattr(v.aval, "memory_space", None) == jax.memory.Space.Host


def _eqns(jaxpr, inside=()):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it, with the primitives
    of the equations that hold it (outermost first)."""
    for e in jaxpr.eqns:
        yield e, inside
        for p in e.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _eqns(sub.jaxpr, (*inside, e))
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _eqns(sub, (*inside, e))


def _traced_call(tx: str):
    """The Trainer's fused call (fsdp, optimizer offloaded) traced: on XLA CPU memory
    moves compile to nothing, so the jaxpr is where they show."""
    s, mesh, model, opt, trainer = _build("fsdp", "optimizer", tx, "grads")
    stacked = lm_batches(K, BATCH, CFG.length, CFG.vocab)
    with ns.use(mesh, s.rules):
        placed = ns.shard_batch(stacked, mesh, s.rules, ("batch", "length"), steps=True)
        plan, _, _, values, data = trainer._fused._prepare((model, opt, placed, trainer._guard))
        jaxpr = jax.make_jaxpr(plan.run)(values, data)
    # Per-device shapes of the stacked (layer-axis) optimizer-state leaves, as traced.
    stacked_state = [x.addressable_shards[0].data.shape for x in jax.tree.leaves(nnx.state(opt))
                     if x.ndim and x.shape[0] == LAYERS]
    return jaxpr, stacked_state


def _moves(jaxpr, space):
    return [(e, inside) for e, inside in _eqns(jaxpr.jaxpr) if e.primitive.name == "device_put"
            and e.params["devices"][0] == space]


def test_the_update_moves_the_stacked_state_a_layer_at_a_time():
    jaxpr, stacked_state = _traced_call("adamw")
    assert stacked_state  # the model has stacked optimizer-state leaves to stream
    ins = _moves(jaxpr, jax.memory.Space.Device)
    whole = [e for e, _ in ins if _on_host(e.invars[0]) and e.invars[0].aval.ndim
             and e.invars[0].aval.shape[0] == LAYERS]
    assert whole == []  # no stacked leaf moved in whole
    # Loops of LAYERS turns fed host leaves: the update (inside the K-step scan), whose
    # body moves each leaf's layer slice in and the new slice out, and, at the call's
    # end, the NaN guard's finiteness check of each stacked leaf (nothing back out).
    loops = [e for e, inside in _eqns(jaxpr.jaxpr) if e.primitive.name == "scan"
             and e.params["length"] == LAYERS and any(map(_on_host, e.invars))]
    (loop,) = [e for e in loops if any(map(_on_host, e.outvars))]
    checks = [e for e in loops if not any(map(_on_host, e.outvars))]
    assert len(checks) == len(stacked_state)
    # (Adam's count, a host scalar, comes in too: every turn reads it.)
    host_xs = [v for v in loop.invars if _on_host(v) and v.aval.ndim]
    assert len(host_xs) == len(stacked_state)
    assert all(v.aval.shape[0] == LAYERS for v in host_xs)
    body = loop.params["jaxpr"].jaxpr
    slices_in = [e for e, _ in _eqns(body) if e.primitive.name == "device_put"
                 and e.params["devices"][0] == jax.memory.Space.Device
                 and e.invars[0].aval.ndim > 0]
    slices_out = [e for e, _ in _eqns(body) if e.primitive.name == "device_put"
                  and e.params["devices"][0] == jax.memory.Space.Host]
    assert len(slices_in) == len(slices_out) == len(stacked_state)
    assert sorted(tuple(e.invars[0].aval.shape) for e in slices_in) == sorted(
        tuple(v.aval.shape[1:]) for v in host_xs)
    assert all(_on_host(o) for loop_out in [loop.outvars] for o in loop_out[-len(host_xs):])


@pytest.mark.slow
def test_an_optimizer_that_couples_leaves_moves_the_whole_state_in():
    jaxpr, stacked_state = _traced_call(CLIPPED)
    ins = [e for e, _ in _moves(jaxpr, jax.memory.Space.Device) if _on_host(e.invars[0])
           and e.invars[0].aval.ndim and e.invars[0].aval.shape[0] == LAYERS]
    assert len(ins) == len(stacked_state) > 0  # each stacked leaf, whole
