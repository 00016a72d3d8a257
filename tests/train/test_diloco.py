"""DiLoCo / local SGD over ``hsdp``'s ``replica`` axis (``ns.DiLoCo``), on 8 simulated
devices (``replica=2, data=4``), with the 1-layer tiny Decoder:

* (slow) H=1 with plain SGD inside and outer SGD at learning rate 1 is ``hsdp`` with the
  same SGD: the same loss and parameters after a few fused steps;
* the inner step's compiled program has no collective over ``replica``; the sync's
  has one, an all-reduce of each device's 1/data slice of the parameters;
* (slow) with H=2 the fused call holds that one all-reduce (in the sync's branch), the
  model trains, the replicas part between syncs and are the anchor
  right after one, and the whole state (anchor, replicas, both optimizers) round trips
  through ns.save / ns.restore onto another mesh and trains on there;
* the option errors.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard.models import Decoder, get_config, lm_loss
from nnx_shard.planner import compiled_collectives
from tests._close import assert_close
from tests._lm import lm_batches, lm_step
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

CFG = dataclasses.replace(get_config("tiny"), layers=1)
HSDP = ns.strategies.get("hsdp")
RTOL = 1e-5  # x max|expected| per tensor (tests/_close.py)


def _model(mesh: Any) -> Decoder:
    return ns.sharded_init(lambda: Decoder(CFG, rngs=nnx.Rngs(0)), mesh, HSDP)


def _batches(steps: int, mesh: Any) -> Any:
    return ns.shard_batch(lm_batches(steps, 8, CFG.length, CFG.vocab), mesh, HSDP.rules,
                          ("batch", "length"), steps=True)


def _params(model: Any) -> Any:
    return jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _fused(name: str) -> Any:
    return ns.multistep(lambda d, b: {"loss": getattr(d, name)(lm_loss, b)})


@pytest.mark.slow
def test_one_inner_step_with_outer_sgd_at_one_is_hsdp() -> None:
    mesh = HSDP.make_mesh()
    k = 3
    ref = _model(mesh)
    opt = ns.sharded_optimizer(ref, optax.sgd(0.1), mesh, HSDP)
    model = _model(mesh)
    diloco = ns.DiLoCo(model, optax.sgd(0.1), inner_steps=1, outer=optax.sgd(1.0))
    with ns.use(mesh, HSDP.rules):
        batches = _batches(k, mesh)
        want = jax.device_get(ns.multistep(lm_step)(ref, opt, batches))["loss"]
        got = jax.device_get(_fused("step")(diloco, batches))["loss"]
    # Each replica's loss is the mean over its half of the batch: their mean is hsdp's.
    assert got.shape == (k, 2)
    assert_close(got.mean(axis=1), want, RTOL, "loss")
    assert_close(_params(model), _params(ref), RTOL, f"params after {k} steps")
    assert int(diloco.count[...]) == k


def test_only_the_sync_crosses_replicas() -> None:
    mesh = HSDP.make_mesh()
    model = _model(mesh)
    diloco = ns.DiLoCo(model, optax.adam(1e-3), inner_steps=4)
    with ns.use(mesh, HSDP.rules):
        batches = _batches(2, mesh)
        inner = _fused("inner_step").lower(diloco, batches).compile().as_text()
        sync = nnx.jit(ns.DiLoCo.sync).lower(diloco).compile().as_text()
    found = compiled_collectives(inner, mesh)
    assert found and {c.axes for c in found} == {("data",)}
    crossing = [c for c in compiled_collectives(sync, mesh) if "replica" in (c.axes or ())]
    params = _params(model)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    # Measured: one all-reduce over replica alone, of each device's 1/data slice of every
    # parameter (hsdp lays all of them along embed over data=4): 16992 of 67968 bytes.
    assert [(c.kind, c.axes) for c in crossing] == [("all-reduce", ("replica",))]
    assert crossing[0].bytes == total // 4 == 16992


@pytest.mark.slow
def test_replicas_part_between_syncs_and_checkpoint(tmp_path: Any) -> None:
    mesh = HSDP.make_mesh()
    model = _model(mesh)
    diloco = ns.DiLoCo(model, optax.adam(3e-3), inner_steps=2)
    fused = _fused("step")
    rng = np.random.default_rng(1)
    losses, spread = [], []
    with ns.use(mesh, HSDP.rules):
        for i in range(8):
            toks = rng.integers(0, CFG.vocab, (1, 8, CFG.length + 1)).astype(np.int32) % 16
            batch = ns.shard_batch({"inputs": toks[..., :-1], "targets": toks[..., 1:]}, mesh,
                                   HSDP.rules, ("batch", "length"), steps=True)
            if i == 0:  # the K-step program holds the sync (its lax.cond's branch): once
                hlo = fused.lower(diloco, batch).compile().as_text()
                crossing = [(c.kind, c.axes, c.bytes) for c in compiled_collectives(hlo, mesh)
                            if "replica" in (c.axes or ())]
                assert crossing == [("all-reduce", ("replica",), 16992)]
            losses.append(jax.device_get(fused(diloco, batch))["loss"][0])
            reps = jax.device_get(nnx.to_pure_dict(nnx.state(diloco.replicas)))
            gap = max(float(np.max(np.abs(x[0] - x[1]))) for x in jax.tree.leaves(reps))
            spread.append(gap)
            if i % 2 == 1:  # right after a sync: every replica is the anchor
                for x, a in zip(jax.tree.leaves(reps), jax.tree.leaves(_params(model)),
                                strict=True):
                    np.testing.assert_array_equal(x[0], a)
                    np.testing.assert_array_equal(x[1], a)
    assert fused.traces == 1
    assert spread[0::2] and min(spread[0::2]) > 0 and max(spread[1::2]) == 0
    assert np.mean(losses[-2:]) < np.mean(losses[:2])
    assert int(diloco.count[...]) == 8
    # The whole state (anchor, replicas, both optimizers' states, the count) round trips,
    # onto another mesh (the other 4 devices, replica=2 x data=2), and trains on from there.
    ns.save(tmp_path, 8, model=diloco)
    small = ns.make_mesh("replica=2,data=2", devices=jax.devices()[4:])
    other = ns.restore(tmp_path, model=ns.DiLoCo(_model(small), optax.adam(3e-3), inner_steps=2))
    assert_close(jax.device_get(nnx.state(other)), jax.device_get(nnx.state(diloco)), 0,
                 "restored state")
    assert {x.sharding.mesh for x in jax.tree.leaves(nnx.state(other))} == {small}
    assert int(other.count[...]) == 8
    with ns.use(mesh, HSDP.rules):
        want = jax.device_get(fused(diloco, batch))["loss"]
    with ns.use(small, HSDP.rules):
        batch = ns.shard_batch({"inputs": toks[..., :-1], "targets": toks[..., 1:]}, small,
                               HSDP.rules, ("batch", "length"), steps=True)
        got = jax.device_get(fused(other, batch))["loss"]
    assert_close(got, want, RTOL, "loss after restoring")


def test_option_errors() -> None:
    mesh = HSDP.make_mesh()
    model = ns.sharded_init(lambda: nnx.Linear(4, 2, rngs=nnx.Rngs(0)), mesh, HSDP)
    with pytest.raises(ns.UsageError, match=r"DiLoCo: inner_steps must be a positive int, "
                       r"got 0.*Fix: e\.g\. inner_steps=50"):
        ns.DiLoCo(model, optax.sgd(0.1), inner_steps=0)
    with pytest.raises(ns.UsageError, match=r"DiLoCo: axis 'replica' is not an axis of the "
                       r"mesh \(data=8\)\. Fix: a mesh with a replica axis"):
        ns.DiLoCo(model, optax.sgd(0.1), mesh="data=8", inner_steps=2)
    with pytest.raises(ns.UsageError, match=r"DiLoCo: outer must be an optax transformation, "
                       r"got float 0\.7\. Fix: e\.g\. outer=optax\.sgd\(0\.7, momentum=0\.9"):
        ns.DiLoCo(model, optax.sgd(0.1), inner_steps=2, outer=0.7)
    with pytest.raises(ns.UsageError, match=r"DiLoCo: inner must be an optax transformation, "
                       r"got an nnx\.Optimizer \(DiLoCo keeps each replica's optimizer state "
                       r"itself\)\. Fix: e\.g\. inner=optax\.adamw\(1e-3\)"):
        ns.DiLoCo(model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), inner_steps=2)
    with pytest.raises(ns.UsageError, match=r"DiLoCo\.step: loss_fn must be callable as "
                       r"loss_fn\(model, batch\), got 'mse'"):
        ns.DiLoCo(model, optax.sgd(0.1), inner_steps=2).step("mse", {})
    with pytest.raises(ns.UsageError, match=r"DiLoCo: the model holds state besides its "
                       r"parameters \(RngCount, RngKey\)"):
        ns.DiLoCo(nnx.Dropout(0.1, rngs=nnx.Rngs(0)), optax.sgd(0.1), mesh=mesh, inner_steps=2)
    split = nnx.Linear(8, 2, rngs=nnx.Rngs(0))
    split.kernel.set_value(jax.device_put(split.kernel[...], NamedSharding(mesh, P("replica"))))
    with pytest.raises(ns.UsageError, match=r"DiLoCo: parameter kernel is sharded over "
                       r"'replica' \(spec \('replica',\)\); each replica needs a whole "
                       r"copy\. Fix: .* e\.g\. 'hsdp'"):
        ns.DiLoCo(split, optax.sgd(0.1), inner_steps=2)
