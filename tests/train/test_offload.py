"""Host offload (``Strategy.offload``): the optimizer state, and with ``"optimizer+params"``
the parameters, live in ``pinned_host`` memory between steps and in the fused loop's
carry; each step moves them to the devices (the Trainer's steps: the optimizer state
only once the gradients exist) and back. Training computes what it computes without
offload, the state stays on the host, and the compiled step's bytes move from device
to host memory by the offloaded state's size."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.planner import memory_split
from tests._close import assert_close
from tests._shared import MLP
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

HOST = "pinned_host"
STEPS, K = 4, 2


def factory():
    return MLP(nnx.Rngs(params=0, dropout=1), dropout=0.0)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(n=STEPS, nan_at=None):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        x = rng.normal(size=(16, 16)).astype(np.float32)
        if i == nan_at:
            x[0, 0] = np.nan
        out.append({"x": x, "y": rng.normal(size=(16, 16)).astype(np.float32)})
    return out


def build(name, offload, mesh=None):
    strategy = ns.strategies.get(name, offload=offload)
    mesh = mesh or strategy.make_mesh()
    model = ns.sharded_init(factory, mesh, strategy)
    opt = ns.sharded_optimizer(model, optax.adamw(1e-2), mesh, strategy)
    return strategy, mesh, model, opt


def kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(tree))}


@functools.cache
def trained(name, offload, nan_at=None, **options):
    """``name`` with ``offload`` trained STEPS AdamW steps by the fused K-step Trainer
    (``options``: more of its arguments)."""
    strategy, mesh, model, opt = build(name, offload)
    before = kinds(opt), kinds(nnx.state(model, nnx.Param))
    trainer = ns.Trainer(model, opt, loss_fn, mesh=mesh, rules=strategy, steps_per_call=K,
                         **options)
    history = trainer.fit(batches(nan_at=nan_at), STEPS, progress=False)
    return model, opt, history, before


def assert_same_training(name, offload, nan_at=None, **options):
    model, opt, history, _ = trained(name, offload, nan_at, **options)
    ref_model, ref_opt, ref_history, _ = trained(name, None, nan_at, **options)
    assert len(history) == len(ref_history)
    assert_close(history["loss"], ref_history["loss"], 1e-5, f"{name} {offload} loss")
    assert_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), 1e-5,
                 f"{name} {offload} params")
    assert_close(nnx.state(opt), nnx.state(ref_opt), 1e-5, f"{name} {offload} optimizer")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp", "fsdp", "fsdp_tp"])
def test_offloaded_optimizer_trains_as_without_and_stays_on_host(name):
    assert_same_training(name, "optimizer")
    model, opt, _, (opt_before, params_before) = trained(name, "optimizer")
    # Placed on the host by sharded_optimizer, and still there after fit's K-step calls,
    # with the layout the strategy gives (the reference's, in host memory).
    assert opt_before == kinds(opt) == {HOST}
    assert params_before == kinds(nnx.state(model, nnx.Param)) == {"device"}
    ref_opt = trained(name, None)[1]
    for a, b in zip(jax.tree.leaves(nnx.state(opt)), jax.tree.leaves(nnx.state(ref_opt)),
                    strict=True):
        assert a.sharding == b.sharding.with_memory_kind(HOST)


def test_offloaded_params_train_as_without_and_stay_on_host():
    assert_same_training("fsdp", "optimizer+params")
    model, opt, _, (opt_before, params_before) = trained("fsdp", "optimizer+params")
    assert opt_before == params_before == kinds(opt) == kinds(nnx.state(model, nnx.Param)) == {HOST}


def test_the_full_guard_and_microbatches_train_as_without():
    """guard="full" runs the other step (its check at the call's end selects between
    the state before and after the call, in host memory) and microbatches=2 takes the
    gradients in a loop of its own, before the optimizer state is moved in."""
    assert_same_training("fsdp", "optimizer+params", guard="full", microbatches=2)
    model, opt, history, _ = trained("fsdp", "optimizer+params", guard="full", microbatches=2)
    assert kinds(opt) == kinds(nnx.state(model, nnx.Param)) == {HOST}
    assert len(history) == STEPS and history.stop_reason is None


def test_nan_guard_skips_a_non_finite_step_with_offload():
    # Step 3 of 4 has a NaN input: not applied, fit stops there, the state is the
    # one after step 2 (as without offload), finite and still on the host.
    model, opt, history, _ = trained("fsdp", "optimizer+params", nan_at=2)
    assert history.stop_reason is not None and len(history) == 2
    assert_same_training("fsdp", "optimizer+params", nan_at=2)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(opt)))
    assert kinds(opt) == kinds(nnx.state(model, nnx.Param)) == {HOST}


def test_the_full_guard_undoes_a_non_finite_call_with_offload():
    # The call holding the NaN step is undone in host memory (the state before the call
    # chosen by a cond), replayed step by step and stopped at, as without offload.
    model, opt, history, _ = trained("fsdp", "optimizer+params", nan_at=2, guard="full")
    assert history.stop_reason is not None and len(history) == 2
    assert_same_training("fsdp", "optimizer+params", nan_at=2, guard="full")
    assert kinds(opt) == kinds(nnx.state(model, nnx.Param)) == {HOST}


def test_compiled_step_moves_the_offloaded_bytes_from_device_to_host():
    """memory_split of the Trainer's compiled call: with the optimizer offloaded the
    device's argument and output bytes drop by the optimizer state's per-device size
    and the host's rise by exactly it (derived from the S(5) entry layout on CPU)."""
    batch = {k: jax.ShapeDtypeStruct((K, *v.shape), v.dtype) for k, v in batches(1)[0].items()}
    split = {}
    for offload in (None, "optimizer"):
        strategy, mesh, model, opt = build("fsdp", offload)
        trainer = ns.Trainer(model, opt, loss_fn, mesh=mesh, rules=strategy, steps_per_call=K)
        split[offload] = memory_split(trainer.lower(batch).compile())
        state_bytes = sum(x.addressable_shards[0].data.nbytes
                          for x in jax.tree.leaves(nnx.state(opt)))
    off, ref = split["optimizer"], split[None]
    assert off.derived and ref.host == {"argument": 0, "output": 0, "temp": 0, "alias": 0}
    assert off.host["argument"] == off.host["output"] == state_bytes > 0
    assert off.device["argument"] == ref.device["argument"] - state_bytes
    assert off.device["output"] == ref.device["output"] - state_bytes
    assert off.host_bytes + off.device_bytes >= state_bytes


def _fused_jaxpr(offload):
    """The Trainer's fused call (fsdp, the default guard's step) traced, not compiled:
    on XLA CPU memory moves compile to nothing, so the jaxpr is where they show."""
    strategy, mesh, model, opt = build("fsdp", offload)
    trainer = ns.Trainer(model, opt, loss_fn, mesh=mesh, rules=strategy, steps_per_call=K)
    batch = {k: np.stack([v] * K) for k, v in batches(1)[0].items()}
    with ns.use(mesh, strategy.rules):
        placed = ns.shard_batch(batch, mesh, strategy.rules, ("batch",), steps=True)
        plan, _, _, values, data = trainer._fused._prepare((model, opt, placed, trainer._guard))
        jaxpr = jax.make_jaxpr(plan.run)(values, data)
    return model, opt, jaxpr


def _on_host(var):
    return getattr(var.aval, "memory_space", None) == jax.memory.Space.Host


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params"])
def test_each_step_moves_the_optimizer_state_in_after_its_gradients(offload):
    """The K-step loop carries the offloaded state in host memory; inside each step the
    optimizer state's host arrays go through one optimization_barrier with the
    gradients, and its device copies are made of that barrier's outputs, so no copy
    can start before the backward pass ends. Offloaded parameters are moved in at the
    step's start, straight from the carry; everything goes back to the host at its end."""
    model, opt, jaxpr = _fused_jaxpr(offload)
    n_opt = len(jax.tree.leaves(nnx.state(opt)))
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    n_params = len(params) if offload == "optimizer+params" else 0
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    body = scan.params["jaxpr"].jaxpr
    count = lambda vs: sum(map(_on_host, vs))  # noqa: E731
    assert count(scan.invars) == count(scan.outvars) == n_opt + n_params
    assert count(body.invars) == count(body.outvars) == n_opt + n_params
    carried = set(body.invars)

    (barrier,) = [e for e in body.eqns if e.primitive.name == "optimization_barrier"]
    state_in = [v for v in barrier.invars if _on_host(v)]
    grads = [v for v in barrier.invars if not _on_host(v)]
    assert len(state_in) == n_opt and all(v in carried for v in state_in)
    assert sorted(v.aval.shape for v in grads) == sorted(x.shape for x in params)
    assert not any(v in carried for v in grads)  # computed by the step: the gradients

    moves_in = [(i, e) for i, e in enumerate(body.eqns) if e.primitive.name == "device_put"
                and e.params["devices"] == (jax.memory.Space.Device,)]
    tied = set(barrier.outvars)
    after = [i for i, e in moves_in if e.invars[0] in tied]
    at_start = [i for i, e in moves_in if e.invars[0] in carried]
    assert len(after) == n_opt and len(at_start) == n_params == len(moves_in) - n_opt
    assert all(i < body.eqns.index(barrier) for i in at_start)
    moves_out = [e for e in body.eqns if e.primitive.name == "device_put"
                 and getattr(e.params["devices"][0], "memory_kind", None) == HOST]
    assert len(moves_out) == n_opt + n_params


def test_multistep_carries_offloaded_state_through_its_calls():
    """ns.multistep (the fused call without the Trainer): two calls of K steps on
    offloaded state compute what they compute on device state; one trace, the state
    in host memory after each call."""

    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    data = batches()
    stacked = [{k: np.stack([b[k] for b in data[i:i + K]]) for k in data[0]}
               for i in range(0, STEPS, K)]
    runs = {}
    for offload in (None, "optimizer+params"):
        strategy, mesh, model, opt = build("fsdp", offload)
        fused = ns.multistep(step)
        with ns.use(mesh, strategy.rules):
            losses = [fused(model, opt, ns.shard_batch(b, mesh, strategy.rules, ("batch",),
                                                       steps=True)) for b in stacked]
        runs[offload] = (np.concatenate([np.asarray(x) for x in losses]), model, opt)
        assert fused.traces == 1
    (loss, model, opt), (ref_loss, ref_model, ref_opt) = runs["optimizer+params"], runs[None]
    assert kinds(opt) == kinds(nnx.state(model, nnx.Param)) == {HOST}
    assert_close(loss, ref_loss, 1e-5, "loss")
    assert_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), 1e-5, "params")
    assert_close(nnx.state(opt), nnx.state(ref_opt), 1e-5, "optimizer")


def test_offload_on_devices_without_host_memory_is_refused(monkeypatch):
    strategy = ns.strategies.get("fsdp", offload="optimizer")
    mesh = strategy.make_mesh()
    model = ns.abstract_init(factory, mesh, strategy)

    class NoHost:
        platform = "cpu"

        def addressable_memories(self):
            return [type("Memory", (), {"kind": "device"})()]

    monkeypatch.setattr(jax, "devices", lambda *a: [NoHost()])
    with pytest.raises(ns.UsageError, match=r"sharded_optimizer: the strategy offloads "
                       r"'optimizer' to host memory \('pinned_host'\), which cpu devices do not "
                       r"have \(their memories: device\)\. Fix: .*with_offload\(None\)"):
        ns.sharded_optimizer(model, optax.adamw(1e-2), mesh, strategy)
