"""multistep, value_and_grad, shard_batch and Trainer on 8 simulated CPU devices.

Every fused result is compared with the plain Python loop of ``nnx.jit`` steps
it replaces. Shapes are tiny: the point is layouts and equality, not speed.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import re
import select
import subprocess
import sys
import tracemalloc
import warnings
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard._checkpoint._restore import restore_in_place
from nnx_shard._simulated import simulated_env
from nnx_shard._train import Fused, Trainer, multistep, shard_batch, value_and_grad
from nnx_shard._train import _placement as placement
from nnx_shard._train._guard import GRAD_SQ, Guard, guard_call
from nnx_shard._train._microbatch import _split_microbatches
from nnx_shard._train._progress import Progress
from tests._close import assert_close
from tests._shared import mse_train_step
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

RTOL = 1e-5
ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- helpers


def mse_step(model, opt, batch):
    def loss_fn(m):
        return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return {"loss": loss}


def seed_model():
    # The model of seed 001 (flax#4417): no annotations at all.
    return nnx.Sequential(nnx.Linear(20, 30, rngs=nnx.Rngs(0)), nnx.Linear(30, 1, rngs=nnx.Rngs(1)))


def data(k, b, d_in, d_out, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.normal(size=(k, b, d_in)).astype(np.float32),
        "y": rng.normal(size=(k, b, d_out)).astype(np.float32),
    }


def commit(tree, mesh):
    """Replicates every value that is not yet placed (fresh eager values)."""
    state = nnx.state(tree)
    rep = NamedSharding(mesh, P())
    nnx.update(tree, jax.tree.map(lambda x: x if x.committed else jax.device_put(x, rep), state))


def place(model, mesh, rules):
    state = jax.device_put(nnx.state(model), ns.shardings(model, mesh, rules))
    nnx.update(model, state)


def shardings_of(*trees):
    return [x.sharding for x in jax.tree.leaves(nnx.state(trees))]


def loop(step, model, opt, batches, *others):
    """The reference: K separate nnx.jit calls, one step each."""
    jstep = nnx.jit(step)
    k = jax.tree.leaves(batches)[0].shape[0]
    out = []
    for i in range(k):
        out.append(jstep(model, opt, jax.tree.map(lambda x, i=i: x[i], batches), *others))
        jax.block_until_ready(out[-1])  # one call in flight: see docs/architecture.md (CPU rendezvous)
    return jax.tree.map(lambda *xs: np.stack(xs), *out)


def assert_same_state(a, b, rtol=RTOL):
    # Per leaf, atol = rtol * max|expected|; counters and keys exactly equal.
    assert_close(nnx.state(a), nnx.state(b), rtol, "state")


class MLP(nnx.Module):
    """Kernels annotated ('in', 'out'); the rules decide FSDP or tensor parallel."""

    def __init__(self, sizes, *, dropout=0.0, rngs):
        init = ns.with_logical(nnx.initializers.lecun_normal(), ("in", "out"))
        binit = ns.with_logical(nnx.initializers.zeros_init(), ("out",))
        self.layers = nnx.List(
            [nnx.Linear(a, b, kernel_init=init, bias_init=binit, rngs=rngs)
             for a, b in itertools.pairwise(sizes)]
        )
        self.drop = nnx.Dropout(dropout)

    def __call__(self, x, rngs=None):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = self.drop(nnx.relu(x), rngs=rngs)
        return x


FSDP = ns.Rules({"batch": "data", "in": "data", "out": None})
TP = ns.Rules({"batch": "data", "in": None, "out": "model"})


def sharded_mlp(mesh, rules, dropout=0.0):
    model = MLP((16, 32, 8), dropout=dropout, rngs=nnx.Rngs(0))
    place(model, mesh, rules)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    commit(opt, mesh)
    return model, opt


def mse_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def ref_step(model, opt, batch):
    loss, grads = nnx.value_and_grad(mse_loss)(model, batch)
    opt.update(model, grads)
    return {"loss": loss, "grad_norm": optax.tree.norm(grads)}


REF_HOST = data(6, 8, 16, 8)
_REFS: dict = {}


def sharded_mlp_and_reference(rules, axis_types):
    """A data=4,model=2 mesh, a sharded (model, optimizer) pair to test, and the
    reference loop over ``REF_HOST`` from the same start: its metrics and the pair it
    trained. The reference is built once per layout and shared by the multistep and
    Trainer tests (only read after), so its loop compiles once."""
    mesh = ns.make_mesh("data=4,model=2", axis_types=axis_types)
    key = (id(rules), axis_types)
    if key not in _REFS:
        ref_model, ref_opt = sharded_mlp(mesh, rules)
        expected = loop(ref_step, ref_model, ref_opt, shard_batch(REF_HOST, mesh, rules, steps=True))
        _REFS[key] = (expected, ref_model, ref_opt)
    return mesh, sharded_mlp(mesh, rules), _REFS[key]


# ----------------------------------------------------------------------------- multistep


def test_seed_case_replicated_model_sharded_batch_equals_nnx_jit_loop():
    mesh = ns.make_mesh("data=8")
    rules = ns.Rules({"batch": "data"})
    batches = shard_batch(data(5, 16, 20, 1), mesh, rules, steps=True)
    assert batches["x"].sharding.spec == P(None, "data", None)

    models = []
    for _ in range(2):
        model = seed_model()
        commit(model, mesh)  # replicated on every device, as the seed asked
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        commit(opt, mesh)
        models.append((model, opt))
    (model, opt), (ref_model, ref_opt) = models
    before = shardings_of(model, opt)

    fused = multistep(mse_step)
    metrics = fused(model, opt, batches)
    expected = loop(mse_step, ref_model, ref_opt, batches)

    assert metrics["loss"].shape == (5,)
    np.testing.assert_allclose(metrics["loss"], expected["loss"], rtol=RTOL)
    assert_same_state(model, ref_model)
    assert_same_state(opt, ref_opt)
    assert int(opt.step[...]) == 5
    # The loss fell: the update really was applied (nnx.scan with in_axes=None is a no-op).
    assert metrics["loss"][-1] < metrics["loss"][0]
    assert shardings_of(model, opt) == before
    assert fused.traces == 1
    # The seed's question 3: with a replicated model and a batch-sharded loss, the
    # gradient mean across devices is an all-reduce that XLA inserts in the step.
    assert "all-reduce" in fused.lower(model, opt, batches).compile().as_text()


def test_fresh_unplaced_model_is_replicated_over_the_batch_mesh():
    mesh = ns.make_mesh("data=8")
    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batches = shard_batch(data(2, 8, 20, 1), mesh, {"batch": "data"}, steps=True)
    fused = multistep(mse_step)
    fused(model, opt, batches)
    for s in shardings_of(model, opt):
        assert isinstance(s, NamedSharding) and s.mesh == mesh and s.is_fully_replicated
    fused(model, opt, batches)
    assert fused.traces == 1  # committing once keeps the cache key stable


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
@pytest.mark.parametrize("rules", [FSDP, TP], ids=["fsdp", "tensor_parallel"])
def test_sharded_model_equals_nnx_jit_loop_and_keeps_shardings(rules, axis_types):
    mesh, (model, opt), (expected, ref_model, ref_opt) = sharded_mlp_and_reference(rules,
                                                                                   axis_types)
    kernel = model.layers[0].kernel[...].sharding.spec
    assert kernel == (P("data", None) if rules is FSDP else P(None, "model"))
    # Adam's moments follow the parameters.
    assert opt.opt_state[0].mu["layers"][0]["kernel"][...].sharding.spec == kernel
    before = shardings_of(model, opt)
    batches = shard_batch(REF_HOST, mesh, rules, steps=True)

    fused = multistep(mse_step)
    metrics = fused(model, opt, batches)

    np.testing.assert_allclose(metrics["loss"], expected["loss"], rtol=RTOL)
    assert_same_state(model, ref_model)
    assert_same_state(opt, ref_opt)
    assert shardings_of(model, opt) == before


def test_dropout_rngs_are_carried_like_the_loop():
    mesh = ns.make_mesh("data=4,model=2")

    def step(model, opt, batch, rngs):
        def loss_fn(m, rngs):  # rngs as an argument: NNX objects may not be closed over
            return jnp.mean((m(batch["x"], rngs=rngs) - batch["y"]) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model, rngs)
        opt.update(model, grads)
        return {"loss": loss}

    model, opt = sharded_mlp(mesh, TP, dropout=0.5)
    ref_model, ref_opt = sharded_mlp(mesh, TP, dropout=0.5)
    rngs, ref_rngs = nnx.Rngs(dropout=7), nnx.Rngs(dropout=7)
    batches = shard_batch(data(4, 8, 16, 8), mesh, TP, steps=True)

    metrics = multistep(step)(model, opt, batches, rngs)
    expected = loop(step, ref_model, ref_opt, batches, ref_rngs)

    np.testing.assert_allclose(metrics["loss"], expected["loss"], rtol=RTOL)
    assert_same_state(model, ref_model)
    assert_same_state(rngs, ref_rngs)
    assert int(rngs.dropout.count[...]) == 4  # one key drawn per step, carried across steps
    # Different masks at every step: a frozen key would repeat the first one.
    assert len(set(np.round(np.asarray(metrics["loss"]), 6).tolist())) == 4


def test_compiles_once_per_k_and_shape():
    mesh = ns.make_mesh("data=8")
    rules = {"batch": "data"}
    model, opt = seed_model(), None
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    fused = multistep(mse_step)
    for _ in range(3):
        fused(model, opt, shard_batch(data(3, 8, 20, 1), mesh, rules, steps=True))
    assert fused.traces == 1
    fused(model, opt, shard_batch(data(2, 8, 20, 1), mesh, rules, steps=True))  # another K
    assert fused.traces == 2
    fused(model, opt, shard_batch(data(3, 16, 20, 1), mesh, rules, steps=True))  # another B
    assert fused.traces == 3
    fused(model, opt, shard_batch(data(3, 8, 20, 1), mesh, rules, steps=True))
    assert fused.traces == 3


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
@pytest.mark.parametrize("rules", [FSDP, TP], ids=["fsdp", "tensor_parallel"])
def test_fit_grad_norm_of_sharded_parameters_equals_the_per_step_norm(rules, axis_types):
    # With sharded parameters fit sums each device's share of the squared norm once
    # per call (no collective per step); the history must still be every step's norm.
    mesh, (model, opt), (expected, ref_model, _) = sharded_mlp_and_reference(rules, axis_types)
    host = REF_HOST
    trainer = Trainer(model, opt, mse_loss, mesh=mesh, rules=rules, steps_per_call=3)
    h = trainer.fit((jax.tree.map(lambda x, i=i: x[i], host) for i in range(6)), 6,
                    progress=False)
    assert trainer._guard.layout.grad_specs is not None  # the shares path was taken
    assert h["grad_norm"].shape == (6,)
    np.testing.assert_allclose(h["grad_norm"], expected["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(h["loss"], expected["loss"], rtol=1e-5)
    assert_same_state(model, ref_model)


def test_donation_reuses_state_buffers():
    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    kernel = model.layers[0].kernel[...]
    multistep(mse_step)(model, opt, data(2, 4, 20, 1))
    assert kernel.is_deleted()
    kept = model.layers[0].kernel[...]
    multistep(mse_step, donate=False)(model, opt, data(2, 4, 20, 1))
    assert not kept.is_deleted()


def test_metrics_objects_are_carried():
    def step(model, opt, batch, avg):
        metrics = mse_step(model, opt, batch)
        avg.update(values=metrics["loss"])
        return metrics

    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    avg = nnx.metrics.Average()
    metrics = multistep(step)(model, opt, data(3, 4, 20, 1), avg)
    np.testing.assert_allclose(avg.compute(), metrics["loss"].mean(), rtol=RTOL)


def test_changes_to_the_objects_between_calls_are_seen():
    """The host reads state by a cached pytree flatten; any change must still be seen."""

    model = MLP((16, 32, 8), dropout=0.5, rngs=nnx.Rngs(0))
    model.drop.rngs = nnx.Rngs(dropout=1)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    fused = multistep(mse_step, donate=False)
    batches = data(2, 8, 16, 8)
    fused(model, opt, batches)
    fused(model, opt, batches)
    assert fused.traces == 1

    # A static attribute flips (model.eval()): retrace, and dropout is really off.
    model.eval()
    twin, twin_opt = nnx.clone(model), nnx.clone(opt)
    a = fused(model, opt, batches)
    assert fused.traces == 2
    twin.drop.rngs = nnx.Rngs(dropout=99)  # other keys: equal only if dropout is off
    b = multistep(mse_step, donate=False)(twin, twin_opt, batches)
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=RTOL)
    model.train()

    # A replaced submodule of the same structure: its new Variables are the ones updated.
    new_layer = nnx.Linear(16, 32, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))
    model.layers[0] = new_layer
    fused(model, opt, batches)
    assert model.layers[0] is new_layer
    assert not np.allclose(new_layer.kernel[...], 1.0)  # trained, not left behind

    # A value set eagerly between calls (uncommitted) neither breaks nor recompiles.
    traces = fused.traces
    model.layers[1].bias.set_value(jnp.zeros((8,)))
    fused(model, opt, batches)
    assert fused.traces == traces


def test_shared_variables_stay_shared():
    class Tied(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(4, 4, rngs=rngs)
            self.b = nnx.Linear(4, 4, rngs=rngs)
            self.b.kernel = self.a.kernel  # tied weights

        def __call__(self, x):
            return self.b(nnx.relu(self.a(x)))

    model = Tied(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    fused = multistep(mse_step)
    for _ in range(2):
        fused(model, opt, data(2, 4, 4, 4))
    assert model.a.kernel is model.b.kernel
    ref = Tied(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
    loop(mse_step, ref, ref_opt, jax.tree.map(lambda *x: np.concatenate(x),
                                              data(2, 4, 4, 4), data(2, 4, 4, 4)))
    assert_same_state(model, ref)


# ----------------------------------------------------------------------------- microbatches


def grad_step(model, opt, batch):
    mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
    loss, grads = value_and_grad(mse)(model, batch)
    opt.update(model, grads)
    return {"loss": loss}


@pytest.mark.parametrize("rules", [FSDP, TP], ids=["fsdp", "tensor_parallel"])
def test_microbatches_equal_the_full_batch(rules):
    mesh = ns.make_mesh("data=4,model=2")
    batches = shard_batch(data(3, 32, 16, 8), mesh, rules, steps=True)
    model, opt = sharded_mlp(mesh, rules)
    ref_model, ref_opt = sharded_mlp(mesh, rules)
    before = shardings_of(model, opt)

    micro = multistep(grad_step, microbatches=4)(model, opt, batches)
    full = multistep(grad_step)(ref_model, ref_opt, batches)

    np.testing.assert_allclose(micro["loss"], full["loss"], rtol=RTOL)
    assert_same_state(model, ref_model)
    assert shardings_of(model, opt) == before


def test_microbatches_match_optax_microbatch_numbers_and_layout():
    """Same rows per microbatch (j, j+M, ...) and the same mean as optax.microbatch."""
    model = seed_model()
    batch = jax.tree.map(lambda x: jnp.asarray(x[0]), data(1, 16, 20, 1))
    mse = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
    loss, grads = value_and_grad(mse, microbatches=4)(model, batch)
    graphdef, params = nnx.split(model)

    def pure(params, b):
        return jax.value_and_grad(lambda p: mse(nnx.merge(graphdef, p), b))(params)

    loss_o, grads_o = optax.microbatching.microbatch(
        pure, argnums=1, microbatch_size=4,
        accumulator=optax.microbatching.AccumulationType.MEAN)(params, batch)
    np.testing.assert_allclose(float(loss), float(loss_o), rtol=RTOL)
    for g, go in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_o), strict=True):
        assert_close(np.asarray(g), np.asarray(go), rtol=RTOL)
    rows = _split_microbatches({"i": jnp.arange(16)}, 4)["i"]
    assert rows.tolist() == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_microbatches_need_ns_value_and_grad():
    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"microbatches=2.*mse_step never called nnx_shard\.value_and_grad"):
        multistep(mse_step, microbatches=2)(model, opt, data(2, 4, 20, 1))


def test_microbatches_must_divide_the_batch():
    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"microbatches=4 .*batch\['x'\] has shape \(6, 20\)"):
        multistep(grad_step, microbatches=4)(model, opt, data(2, 6, 20, 1))


def test_value_and_grad_with_aux_and_carried_rngs():
    model = MLP((4, 8, 2), dropout=0.5, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)

    def loss_fn(m, b, rngs):
        y = m(b, rngs=rngs)
        return jnp.mean(y**2), {"mean": jnp.mean(y)}

    rngs = nnx.Rngs(dropout=3)
    # Compiled (nnx.jit carries the Rngs' count back like an eager call), rather than
    # dispatched op by op.
    micro = nnx.jit(value_and_grad(loss_fn, has_aux=True, microbatches=2))
    (_loss, aux), grads = micro(model, x, rngs)
    assert int(rngs.dropout.count[...]) == 2  # one draw per microbatch, carried back
    assert aux["mean"].shape == () and grads["layers"][0]["kernel"][...].shape == (4, 8)
    # Without dropout, 2 microbatches equal the full batch.
    model = MLP((4, 8, 2), rngs=nnx.Rngs(0))
    (l1, a1), g1 = nnx.jit(value_and_grad(loss_fn, has_aux=True))(model, x, None)
    (l2, a2), g2 = micro(model, x, None)
    assert_close(l2, l1, RTOL, "loss")
    # A mean of outputs that may nearly cancel: compared at the outputs' size.
    assert_close(a2["mean"], a1["mean"], RTOL, "aux mean", scale=float(jnp.abs(model(x)).max()))
    assert_close(g2, g1, RTOL, "grads")


# ----------------------------------------------------------------------------- bad input


def test_leaves_disagreeing_on_k_name_the_leaves():
    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = {"x": np.zeros((5, 4, 20), np.float32), "y": np.zeros((4, 4, 1), np.float32)}
    with pytest.raises(ValueError, match=r"disagree on the number of steps K") as e:
        multistep(mse_step)(model, opt, batch)
    assert "batch['x'] has shape (5, 4, 20) -> K=5" in str(e.value)
    assert "batch['y'] has shape (4, 4, 1) -> K=4" in str(e.value)


def test_scalar_data_leaf_is_rejected():
    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    batch = {"x": np.zeros((2, 4, 20), np.float32), "y": np.zeros((2, 4, 1), np.float32),
             "lr": np.float32(0.1)}
    with pytest.raises(ValueError, match=r"batch\['lr'\] has shape \(\) -> K=none"):
        multistep(mse_step)(model, opt, batch)


def test_non_array_metrics_name_the_metric():
    def step(model, opt, batch):
        return {"loss": mse_step(model, opt, batch)["loss"], "note": "hello"}

    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ns.UsageError, match=r"step returned metrics\['note'\] = 'hello' \(str\)"):
        multistep(step)(model, opt, data(2, 4, 20, 1))


def test_changing_structure_inside_the_step_is_explained():
    def step(model, opt, batch):
        metrics = mse_step(model, opt, batch)
        model.extra = nnx.Variable(jnp.zeros(()))
        return metrics

    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"changed the structure.*added 0/extra"):
        multistep(step)(model, opt, data(2, 4, 20, 1))


def test_no_nnx_argument():
    with pytest.raises(ns.UsageError, match="no NNX object"):
        multistep(lambda b: {"x": b})(np.zeros((2, 3)))


# ----------------------------------------------------------------------------- shard_batch


def test_shard_batch_layouts():
    mesh = ns.make_mesh("data=4,model=2")
    rules = ns.Rules({"batch": "data", "length": "model"})
    batch = {
        "tokens": np.arange(8 * 6).reshape(8, 6).astype(np.int32),
        "label": np.zeros((8,), np.int32),
        "image": np.zeros((8, 6, 3, 3), np.float32),
    }
    out = shard_batch(batch, mesh, rules, ("batch", "length"))
    assert out["tokens"].sharding.spec == P("data", "model")
    assert out["label"].sharding.spec == P("data")
    assert out["image"].sharding.spec == P("data", "model", None, None)  # trailing replicated
    np.testing.assert_array_equal(out["tokens"], batch["tokens"])

    per_leaf = shard_batch(batch, mesh, rules, {"tokens": ("batch",), "label": ("batch",),
                                                "image": (None, "length")})
    assert per_leaf["tokens"].sharding.spec == P("data", None)
    assert per_leaf["image"].sharding.spec == P(None, "model", None, None)

    stacked = shard_batch({"x": np.zeros((3, 8, 6))}, mesh, rules, ("batch", "length"), steps=True)
    assert stacked["x"].sharding.spec == P(None, "data", "model")


def test_shard_batch_indivisible_batch_names_the_leaf():
    rules = ns.Rules({"batch": "data"})
    with pytest.raises(ns.ShardingError, match=r"batch\['y'\].*shape \(3, 6, 1\).*not divisible by 8"):
        shard_batch({"x": np.zeros((3, 8, 2)), "y": np.zeros((3, 6, 1))}, "data=8", rules,
                    steps=True)
    with pytest.raises(ns.ShardingError, match=r"batch\['t'\] is a scalar"):
        shard_batch({"t": np.float32(1)}, "data=8", rules, steps=True)
    with pytest.raises(ns.ShardingError, match=r"'btach'.*Did you mean 'batch'"):
        shard_batch({"x": np.zeros((8, 2))}, "data=8", rules, ("btach",))


# ----------------------------------------------------------------------------- Trainer


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def host_batches(n, b=8, seed=0, nan_at=None):
    rng = np.random.default_rng(seed)
    for i in range(n):
        x = rng.normal(size=(b, 20)).astype(np.float32)
        if i == nan_at:
            x[0, 0] = np.nan
        yield {"x": x, "y": rng.normal(size=(b, 1)).astype(np.float32)}


def make_trainer(**kw):
    model = seed_model()
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    return Trainer(model, opt, loss_fn, mesh="data=8", rules={"batch": "data"}, **kw)


def test_trainer_partial_group_history_and_loop_equality():
    trainer = make_trainer(steps_per_call=3)
    h = trainer.fit(host_batches(20), num_steps=7, progress=False)
    assert h.steps == 7 and h.stop_reason is None
    assert h["step"].tolist() == list(range(1, 8))
    assert set(h.metrics) == {"step", "loss", "grad_norm"}
    assert h["loss"].shape == h["grad_norm"].shape == (7,)
    assert trainer.traces == 2  # K=3 and the final K=1
    assert int(trainer.optimizer.step[...]) == 7

    ref = seed_model()
    ref_opt = nnx.Optimizer(ref, optax.adam(1e-2), wrt=nnx.Param)
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *host_batches(7))
    expected = loop(mse_step, ref, ref_opt, stacked)
    np.testing.assert_allclose(h["loss"], expected["loss"], rtol=RTOL)
    assert_same_state(trainer.model, ref)

    h2 = trainer.fit(host_batches(6, seed=1), num_steps=6, progress=False)
    assert h2["step"].tolist() == list(range(8, 14))  # numbering continues
    assert trainer.traces == 2


def test_trainer_nan_stops_at_the_step_and_keeps_the_last_finite_state():
    trainer = make_trainer(steps_per_call=4)
    with pytest.warns(RuntimeWarning, match=r"loss is nan and grad_norm is nan at step 6;.*after step 5"
                      ) as warned:
        h = trainer.fit(host_batches(20, nan_at=5), num_steps=12, progress=False)
    assert [w.filename for w in warned] == [__file__]  # the warning points at the fit call
    assert h.steps == 5 and h["step"].tolist() == [1, 2, 3, 4, 5]
    assert "step 6" in h.stop_reason
    assert np.isfinite(h["loss"]).all()

    ref = make_trainer(steps_per_call=5)
    ref.fit(host_batches(5), num_steps=5, progress=False)
    assert_same_state(trainer.model, ref.model)
    assert_same_state(trainer.optimizer, ref.optimizer)
    assert int(trainer.optimizer.step[...]) == 5

    # The state is usable: training resumes from it.
    h2 = trainer.fit(host_batches(4, seed=3), num_steps=4, progress=False)
    assert h2.steps == 4 and np.isfinite(h2["loss"]).all()


class _NanAtState(NamedTuple):
    count: jax.Array  # float on purpose: the guard checks inexact leaves


def nan_state_at(step):
    """An optax transform passing updates through unchanged whose own state turns NaN
    at ``step`` (1-based): non-finite optimizer state, finite parameters."""

    def init(params):
        return _NanAtState(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None):
        count = state.count + 1
        return updates, _NanAtState(jnp.where(count == step, jnp.nan, count))

    return optax.GradientTransformation(init, update)


@jax.custom_vjp
def poison_grad(x, flag):
    """Identity forward; the gradient is NaN where ``flag`` is set (finite loss, NaN grads)."""
    return x


poison_grad.defvjp(
    lambda x, flag: (x, flag),
    lambda flag, g: (g * jnp.where(flag > 0, jnp.nan, 1.0), jnp.zeros_like(flag)),
)


def poisoned_loss(model, batch):
    pred = poison_grad(model(batch["x"]), batch["poison"][:, None])
    return jnp.mean((pred - batch["y"]) ** 2)


def guard_batches(route, bad, n=6):
    out = []
    for i, b in enumerate(host_batches(n)):
        b["poison"] = np.zeros((8,), np.float32)
        if i == bad - 1 and route == "loss":
            b["x"][0, 0] = np.nan
        if i == bad - 1 and route == "grad_norm":
            b["poison"][:] = 1.0
        out.append(b)
    return out


def guard_tx(route, bad):
    if route == "params":  # finite gradients, infinite learning rate at step `bad`
        return optax.sgd(lambda count: jnp.where(count == bad - 1, jnp.inf, 0.05))
    if route == "opt_state":
        return optax.chain(nan_state_at(bad), optax.sgd(0.05))
    return optax.adam(1e-2)


GUARD_MESSAGES = {
    "loss": r"loss is nan and grad_norm is nan at step {bad};",
    "grad_norm": r"grad_norm is nan at step {bad};",
    "params": r"updated parameters are not finite \(first: layers/\d/(kernel|bias); loss and "
              r"grad_norm were finite\) at step {bad};",
    "opt_state": r"updated optimizer state is not finite \(first: opt_state/0/count; loss and "
                 r"grad_norm were finite\) at step {bad};",
}


def all_finite(*trees):
    return all(
        bool(np.isfinite(np.asarray(x)).all())
        for x in jax.tree.leaves(nnx.state(trees))
        if jnp.issubdtype(x.dtype, jnp.inexact)
    )


@pytest.mark.parametrize("undo", [True, False])
def test_guard_call_turns_shares_into_norms_and_undoes_unless_told_not_to(undo):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    guard = Guard()
    before = nnx.clone((model, opt, guard))
    kept = np.asarray(model.kernel[...])
    model.kernel[...] = jnp.full((2, 2), jnp.nan)
    # Two steps' shares of the squared norm over two devices: norms 2 and 3.
    metrics = {"loss": jnp.ones(2), GRAD_SQ: jnp.array([[1.0, 3.0], [4.0, 5.0]])}
    out = guard_call(before, (model, opt, guard), metrics, undo=undo)
    assert list(out) == ["loss", "grad_norm", "applied"]
    np.testing.assert_allclose(out["grad_norm"], [2.0, 3.0], rtol=1e-6)
    assert not bool(out["applied"]) and not bool(guard.ok[...])
    if undo:  # the state before the call is back
        np.testing.assert_array_equal(model.kernel[...], kept)
    else:  # only checked: the non-finite state stays (the benchmark's variant)
        assert np.isnan(np.asarray(model.kernel[...])).all()


def guard_outcome(mode, route, bad, k=3):
    """What each guard mode does with a non-finite step ``bad`` of ``route`` (calls of
    ``k`` steps): the steps applied, whether the state kept is the last finite one,
    and the stop reason. ``"full"`` undoes any non-finite step; ``"grads"`` does not
    apply a step whose loss or gradient norm is not finite, but applies one whose
    finite gradients make the state non-finite; ``"off"`` applies every step of the
    call and stops after it."""
    end = -(-bad // k) * k  # the last step of the call holding the bad step
    if mode == "full" or (mode == "grads" and route in ("loss", "grad_norm")):
        kept = f"from after step {bad - 1}" if bad > 1 else "from before it"
        reason = (GUARD_MESSAGES[route].format(bad=bad) + " stopped without applying it, "
                  f"keeping the model and optimizer state {kept}, the last finite one$")
        return bad - 1, True, reason
    leaf = (r"the parameters are not finite \(first: layers/\d/(kernel|bias)\)"
            if route != "opt_state" else
            r"the optimizer state is not finite \(first: opt_state/0/count\)")
    if mode == "grads":  # params: the step after the bad one sees a non-finite loss
        steps = bad if route == "params" else end
        return steps, False, (leaf + f" after step {steps}; guard='grads' checks each step's "
                              r"loss and gradient norm before applying it, .* \(not saved\)\. "
                              r"Fix: Trainer\(\.\.\., guard='full'\)")
    if route == "opt_state":  # off, nothing else non-finite
        return end, False, leaf + f" after step {end}; guard='off' applies every step"
    first = bad + 1 if route == "params" else bad
    return end, False, (rf"(loss|grad_norm) is (nan|inf|-inf).* at step {first}; guard='off' "
                        f"applies every step: stopped after step {end}, " + leaf
                        + r", left as it is \(not saved\)")


@pytest.mark.slow
@pytest.mark.parametrize("bad", [1, 5], ids=["first_step", "mid_second_call"])
@pytest.mark.parametrize("route", list(GUARD_MESSAGES))
@pytest.mark.parametrize("mode", ["full", "grads", "off"])
def test_nan_guard_modes_never_save_a_non_finite_state(tmp_path, mode, route, bad):
    def build():
        model = seed_model()
        opt = nnx.Optimizer(model, guard_tx(route, bad), wrt=nnx.Param)
        return Trainer(model, opt, poisoned_loss, mesh="data=8", rules={"batch": "data"},
                       steps_per_call=3, guard=mode)

    def after(steps):  # a run of the first `steps` batches, nothing non-finite in them
        if steps == 0:
            return initial
        ref = build()
        ref.fit(guard_batches(route, bad)[:steps], num_steps=steps, progress=False)
        assert all_finite(ref.model, ref.optimizer)
        return nnx.state((ref.model, ref.optimizer))

    trainer = build()
    assert trainer.guard == mode
    initial = jax.tree.map(np.array, nnx.state((trainer.model, trainer.optimizer)))
    ckpt = ns.Checkpointer(tmp_path / "ckpt", every=3)
    steps, finite, reason = guard_outcome(mode, route, bad)
    with pytest.warns(RuntimeWarning, match=reason.rstrip("$")):
        h = trainer.fit(guard_batches(route, bad), num_steps=6, progress=False,
                        checkpointer=ckpt)
    assert re.search(reason, h.stop_reason), h.stop_reason
    # The History, the counters and the optimizer agree on the steps applied.
    assert h.steps == steps == trainer.step == int(trainer.optimizer.step[...])
    assert h["step"].tolist() == list(range(1, steps + 1))
    assert np.isfinite(h["loss"]).all() == (mode != "off" or route == "opt_state")
    assert all_finite(trainer.model, trainer.optimizer) == finite
    if finite:  # the state kept is the one after the last good step
        assert_close(nnx.state((trainer.model, trainer.optimizer)), after(bad - 1), RTOL,
                     "kept state")

    # Whatever the mode, nothing from the call with the bad step was saved: the
    # checkpoint on disk is the last one before that call (step 3), or none.
    ckpt.wait()
    if bad <= 3:
        assert ckpt.latest_step() is None
    else:
        assert ckpt.latest_step() == 3
        fresh = build()
        step, extra = restore_in_place(ckpt.directory, fresh.model, fresh.optimizer)
        assert step == 3 and extra["step"] == 3
        assert all_finite(fresh.model, fresh.optimizer)
        assert_close(nnx.state((fresh.model, fresh.optimizer)), after(3), RTOL, "saved state")


@pytest.mark.parametrize("mode", ["grads", "off"])
def test_a_call_queued_behind_a_failed_one_applies_nothing_without_undo(mode):
    """No undo and no replay under "grads" and "off": the call dispatched behind the one
    that failed (two are in flight) finds the guard down and applies no step, so the
    optimizer's step count is the trainer's."""
    trainer = make_trainer(steps_per_call=2, guard=mode)
    with pytest.warns(RuntimeWarning, match="loss is nan and grad_norm is nan at step 2;"):
        h = trainer.fit(host_batches(8, nan_at=1), num_steps=8, progress=False)
    want = 1 if mode == "grads" else 2  # "off" applies the whole failed call
    assert h.steps == trainer.step == int(trainer.optimizer.step[...]) == want
    assert trainer._careful.traces == 0  # nothing replayed
    # The guard is raised again by the next fit: a finite model trains on.
    if mode == "grads":
        h2 = trainer.fit(host_batches(4, seed=3), num_steps=4, progress=False)
        assert h2.steps == 4 and np.isfinite(h2["loss"]).all()


def test_trainer_guard_is_checked_and_defaults_to_grads():
    assert make_trainer().guard == "grads" == ns._train._guard.DEFAULT_GUARD
    with pytest.raises(ValueError, match=r"guard must be one of 'full', 'grads', 'off', got "
                                         r"'none'\. Fix: guard='grads'"):
        make_trainer(guard="none")


@jax.custom_vjp
def inf_grad(x, flag):
    """Identity forward; the gradient is +inf where ``flag`` is set (finite loss)."""
    return x


inf_grad.defvjp(
    lambda x, flag: (x, flag),
    lambda flag, g: (g + jnp.where(flag > 0, jnp.inf, 0.0), jnp.zeros_like(flag)),
)


def inf_loss(model, batch):
    # "shift" is a constant of the loss (no gradient): an infinite one gives an
    # infinite loss with finite gradients; "poison" gives infinite gradients.
    pred = inf_grad(model(batch["x"]), batch["poison"][:, None])
    return jnp.mean((pred - batch["y"]) ** 2) + batch["shift"][0]


# Each mode on each route, the bad step 2 of 4 in calls of 2 steps: (steps applied,
# the state kept is the one after step 1, the stop reason's pattern).
INF_CASES = {
    ("full", "inf_loss"): (1, True, r"^loss is inf at step 2; stopped without applying it"),
    ("grads", "inf_loss"): (1, True, r"^loss is inf at step 2; stopped without applying it"),
    # Its gradients are finite: applied, and the state it leaves is finite.
    ("off", "inf_loss"): (2, None, r"^loss is inf at step 2; guard='off' applies every step: "
                          r"stopped after step 2, the model and optimizer state are finite"),
    # The infinite gradient of the output turns into inf - inf = NaN in the layers'
    # kernel gradients: the norm is NaN (its bias gradient stays infinite).
    ("full", "inf_grads"): (1, True, r"^grad_norm is nan at step 2; stopped without applying"),
    ("grads", "inf_grads"): (1, True, r"^grad_norm is nan at step 2; stopped without applying"),
    ("off", "inf_grads"): (2, False, r"^grad_norm is nan at step 2; guard='off' applies every "
                           r"step: stopped after step 2, the parameters are not finite"),
    # optax.sgd(inf): every loss and gradient finite until the update overflows.
    ("full", "sgd_inf"): (0, True, r"^updated parameters are not finite \(first: layers/0/"),
    ("grads", "sgd_inf"): (1, False, r"^the parameters are not finite \(first: layers/0/"
                           r"(bias|kernel)\) after step 1; guard='grads' checks"),
    ("off", "sgd_inf"): (2, False, r"^(loss|grad_norm) is [-a-z]+.* at step 2; guard='off' "
                         r"applies every step: stopped after step 2, the parameters are not"),
}


@pytest.mark.slow
@pytest.mark.parametrize("mode, route", list(INF_CASES), ids=[f"{m}-{r}" for m, r in INF_CASES])
def test_each_guard_mode_on_infinite_losses_gradients_and_updates(mode, route):
    """What each mode catches: "full" every route; "grads" an infinite loss or
    gradient (the step is not applied), not a finite gradient whose update overflows
    (optax.sgd(inf): applied, the state left not finite and the stop says so); "off"
    applies every step of the call and names what it left."""
    def batches(n, bad=2):
        out = []
        for i, b in enumerate(host_batches(n)):
            b["poison"] = np.zeros((8,), np.float32)
            b["shift"] = np.zeros((8,), np.float32)
            if i == bad - 1 and route == "inf_loss":
                b["shift"][:] = np.inf
            if i == bad - 1 and route == "inf_grads":
                b["poison"][:] = 1.0
            out.append(b)
        return out

    def build():
        model = seed_model()
        tx = optax.sgd(float("inf")) if route == "sgd_inf" else optax.adam(1e-2)
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        return Trainer(model, opt, inf_loss, mesh="data=8", rules={"batch": "data"},
                       steps_per_call=2, guard=mode)

    steps, kept, reason = INF_CASES[mode, route]
    trainer = build()
    initial = jax.tree.map(np.array, nnx.state((trainer.model, trainer.optimizer)))
    with pytest.warns(RuntimeWarning):
        h = trainer.fit(batches(4), num_steps=4, progress=False)
    assert re.search(reason, h.stop_reason), h.stop_reason
    assert h.steps == steps == trainer.step == int(trainer.optimizer.step[...])
    state = nnx.state((trainer.model, trainer.optimizer))
    assert all_finite(trainer.model, trainer.optimizer) == (kept is not False)
    if kept and steps == 0:
        for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(initial), strict=True):
            np.testing.assert_array_equal(np.asarray(x), y)
    elif kept:  # the state after step 1, as a run of that step alone leaves it
        ref = build()
        ref.fit(batches(1), num_steps=1, progress=False)
        assert_close(state, nnx.state((ref.model, ref.optimizer)), RTOL, "kept state")


def test_adam_with_an_infinite_learning_rate_is_caught_at_its_first_update():
    model = seed_model()
    opt = nnx.Optimizer(model, optax.adam(float("inf")), wrt=nnx.Param)
    initial = jax.tree.map(np.array, nnx.state((model, opt)))
    trainer = Trainer(model, opt, loss_fn, mesh="data=8", rules={"batch": "data"},
                      steps_per_call=2, guard="full")
    with pytest.warns(RuntimeWarning, match=r"updated parameters are not finite \(first: "
                      r"layers/0/(bias|kernel); loss and grad_norm were finite\) at step 1;"):
        h = trainer.fit(host_batches(4), num_steps=4, progress=False)
    assert h.steps == 0 and int(opt.step[...]) == 0
    for x, y in zip(jax.tree.leaves(nnx.state((model, opt))), jax.tree.leaves(initial),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(x), y)


def test_trainer_callbacks_see_each_call_and_can_stop():
    seen = []

    def cb(step, metrics):
        seen.append((step, metrics["loss"].shape))
        return step >= 6

    trainer = make_trainer(steps_per_call=3)
    h = trainer.fit(host_batches(30), num_steps=12, progress=False, callbacks=[cb])
    assert seen == [(3, (3,)), (6, (3,))]
    assert h.steps == 6 and "callback cb asked to stop at step 6" in h.stop_reason


def test_fit_flattens_the_nnx_objects_once_per_fit_and_callbacks_see_current_values(
        monkeypatch):
    prepared = []
    real = Fused._prepare
    monkeypatch.setattr(Fused, "_prepare",
                        lambda self, args: prepared.append(1) or real(self, args))
    fast = make_trainer(steps_per_call=2)
    h = fast.fit(host_batches(12), num_steps=12, progress=False)
    # 6 fused calls, the NNX objects read once (it was once per call).
    assert h.steps == 12 and len(prepared) == 1
    leaves = jax.tree.leaves(nnx.state((fast.model, fast.optimizer)))
    assert not any(x.is_deleted() for x in leaves)  # written back, not left donated
    assert int(fast.optimizer.step[...]) == 12

    # A callback reads the model: it sees the state as of its step, every call.
    seen = []

    def cb(step, metrics):
        seen.append((step, int(watched.optimizer.step[...]),
                     float(jnp.sum(watched.model.layers[0].kernel[...]))))

    watched = make_trainer(steps_per_call=2)
    watched.fit(host_batches(12), num_steps=12, progress=False, callbacks=[cb])
    assert [(s, o) for s, o, _ in seen] == [(s, s) for s in range(2, 13, 2)]
    assert len({k for _, _, k in seen}) == 6  # the parameters moved every call
    assert_same_state(watched.model, fast.model)


def test_a_second_fit_reuses_the_placed_state_without_the_slow_path(monkeypatch):
    slow = []
    real = Fused._slow_plan
    monkeypatch.setattr(Fused, "_slow_plan",
                        lambda self, *a: slow.append(1) or real(self, *a))
    trainer = make_trainer(steps_per_call=2)
    trainer.fit(host_batches(4), num_steps=4, progress=False)
    assert len(slow) == 1  # placing fresh eager values, once
    trainer.fit(host_batches(4), num_steps=4, progress=False)
    # The guard flag is raised again where it was placed: no second placement.
    assert len(slow) == 1 and trainer.traces == 1


def test_fit_leaves_live_current_arrays_when_the_data_fails_mid_run():
    def broken():
        yield from host_batches(5)
        raise RuntimeError("disk on fire")

    trainer = make_trainer(steps_per_call=2)
    with pytest.raises(RuntimeError, match="disk on fire"):
        trainer.fit(broken(), num_steps=10, progress=False)
    state = jax.tree.leaves(nnx.state((trainer.model, trainer.optimizer)))
    assert not any(x.is_deleted() for x in state)
    # Both dispatched calls ran: the state the carry held is in the objects.
    assert int(trainer.optimizer.step[...]) == 4
    h = trainer.fit(host_batches(2), num_steps=2, progress=False)  # and training goes on
    assert h.steps == 2 and int(trainer.optimizer.step[...]) == 6


def test_fit_resolves_batch_shardings_once_per_layout(monkeypatch):
    resolved = []
    real = placement.shard_batch
    monkeypatch.setattr(placement, "shard_batch",
                        lambda *a, **k: resolved.append(1) or real(*a, **k))
    rng = np.random.default_rng(0)
    arrays = {"x": rng.normal(size=(7 * 8, 20)).astype(np.float32),
              "y": rng.normal(size=(7 * 8, 1)).astype(np.float32)}
    trainer = make_trainer(steps_per_call=3)
    h = trainer.fit(ns.Batches(arrays, 8), num_steps=7, progress=False)
    # Calls of K=3, 3, 1: two layouts, two resolutions (it was one per call).
    assert h.steps == 7 and len(resolved) == 2
    ref = make_trainer(steps_per_call=3)  # the same for per-step batches, stacked K at a time
    h_ref = ref.fit([{k: v[i * 8:(i + 1) * 8] for k, v in arrays.items()} for i in range(7)],
                    num_steps=7, progress=False)
    assert len(resolved) == 4
    np.testing.assert_allclose(h["loss"], h_ref["loss"], rtol=RTOL)
    assert_same_state(trainer.model, ref.model)


def test_fit_reads_batches_windows_in_the_calling_thread(monkeypatch):
    import threading

    threads = []
    real = ns.Batches.window
    monkeypatch.setattr(ns.Batches, "window", lambda self, *a, **k: (
        threads.append(threading.current_thread()) or real(self, *a, **k)))
    x = np.ones((6 * 8, 20), np.float32)
    h = make_trainer(steps_per_call=2).fit(ns.Batches({"x": x, "y": x[:, :1]}, 8), 6,
                                           progress=False)
    assert h.steps == 6 and len(threads) == 3
    assert set(threads) == {threading.current_thread()}


def test_trainer_data_running_out_and_errors():
    trainer = make_trainer(steps_per_call=4)
    h = trainer.fit(host_batches(6), num_steps=10, progress=False)
    assert h.steps == 6 and h.stop_reason == "data ran out after 6 of 10 steps"

    def ragged():
        yield from host_batches(2)
        yield from host_batches(1, b=16)

    with pytest.raises(ValueError, match=r"batch\['x'\] of shape \(16, 20\), but the first has \(8, 20\)"):
        make_trainer(steps_per_call=3).fit(ragged(), num_steps=3, progress=False)

    def broken():
        yield from host_batches(1)
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        make_trainer(steps_per_call=2).fit(broken(), num_steps=4, progress=False)

    with pytest.raises(ns.ShardingError, match=r"batch\['x'\].*not divisible by 8"):
        make_trainer(steps_per_call=2).fit(host_batches(2, b=6), num_steps=2, progress=False)


def test_trainer_microbatches_and_aux():
    def loss_aux(model, batch):
        err = model(batch["x"]) - batch["y"]
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}

    results = []
    for m in (1, 2):
        model = seed_model()
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        trainer = Trainer(model, opt, loss_aux, mesh="data=8", rules={"batch": "data"},
                          steps_per_call=2, microbatches=m, has_aux=True)
        results.append((trainer.fit(host_batches(4, b=16), num_steps=4, progress=False), model))
    (h1, m1), (h2, m2) = results
    assert set(h1.metrics) == {"step", "loss", "grad_norm", "mae"}
    np.testing.assert_allclose(h1["loss"], h2["loss"], rtol=RTOL)
    np.testing.assert_allclose(h1["mae"], h2["mae"], rtol=RTOL)
    assert_same_state(m1, m2)


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_tty_is_a_tqdm_bar():
    tty = FakeTTY()
    bar = Progress(10, True, tty)
    bar.update(5, 0.5, 100.0, 800.0)
    bar.update(10, 0.25, 120.0, 960.0)
    bar.close()
    out = tty.getvalue()
    # Redrawn in place, at most 10 times a second: step 5 came too soon to show.
    assert out.startswith("\r") and out.endswith("\n") and "5/10" not in out
    assert out.count("\n") == 1 and "10/10" in out.split("\r")[-1]
    assert "loss 0.25, 120.0 steps/s, 960 examples/s" in out.split("\r")[-1]


def test_progress_on_a_terminal_that_reports_no_size_still_draws():
    # A fresh pseudo-terminal is 0x0, like `docker exec` without a size.
    main, sub = os.openpty()
    try:
        with os.fdopen(sub, "w", closefd=False) as tty:
            bar = Progress(10, True, tty)
            bar.update(10, 0.25, 1.0, 2.0)
            bar.close()
        # A pty hands over what was written in pieces: read until it stays empty.
        chunks = []
        while select.select([main], [], [], 0.5)[0]:
            chunk = os.read(main, 4096)
            if not chunk:
                break
            chunks.append(chunk)
        out = b"".join(chunks).decode()
    finally:
        os.close(main)
        os.close(sub)
    assert "10/10" in out and "loss 0.25" in out, repr(out)


def test_progress_in_a_log_writes_whole_lines_at_an_interval():
    log = io.StringIO()
    bar = Progress(1000, True, log)
    for step in range(1, 1001):  # one update per call: far faster than the interval
        bar.update(step, 1.0 / step, 50.0, 400.0)
    bar.close()
    lines = log.getvalue().split("\n")
    # A line at the start and one at the end, nothing in between, no \r.
    assert "\r" not in log.getvalue() and lines[-1] == ""
    assert len(lines) == 3, lines
    assert " 0/1000" in lines[0]
    assert "1000/1000" in lines[1] and "loss 0.001, 50.0 steps/s, 400 examples/s" in lines[1]


def test_progress_disabled_or_not_process_0_writes_nothing(monkeypatch):
    for stream, enabled in ((io.StringIO(), False), (FakeTTY(), False)):
        bar = Progress(10, enabled, stream)
        bar.update(10, 0.25, 1.0, 1.0)
        bar.close()
        assert stream.getvalue() == ""
    monkeypatch.setattr(jax, "process_index", lambda *a, **k: 1)
    stream = FakeTTY()
    bar = Progress(10, True, stream)
    bar.update(10, 0.25, 1.0, 1.0)
    bar.close()
    assert stream.getvalue() == ""


def test_fit_progress_shows_final_step_and_loss_on_process_0_only(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr(sys, "stderr", log)
    trainer = make_trainer(steps_per_call=2)
    h = trainer.fit(host_batches(4), num_steps=4)
    # stderr is not a terminal here: whole lines, the first and the last.
    first, last = log.getvalue().strip().split("\n")
    assert "\r" not in log.getvalue() and " 0/4" in first
    assert "4/4" in last and f"loss {float(h['loss'][-1]):.4g}," in last, last
    assert "steps/s" in last and "examples/s" in last

    for progress, index in ((False, 0), (True, 1)):
        log = io.StringIO()
        monkeypatch.setattr(sys, "stderr", log)
        monkeypatch.setattr(jax, "process_index", lambda *a, _i=index, **k: _i)
        make_trainer(steps_per_call=2).fit(host_batches(2), num_steps=2, progress=progress)
        assert log.getvalue() == ""


def test_trainer_sharded_model_with_dropout_and_nan_stop():
    """FSDP on an Explicit 4x2 mesh, dropout keys inside the model: the NaN guard's
    select must keep layouts and restore the RNG state too."""
    mesh = ns.make_mesh("data=4,model=2", axis_types="explicit")

    def run(nan_at, steps):
        model, opt = sharded_mlp(mesh, FSDP, dropout=0.5)
        model.drop.rngs = nnx.Rngs(dropout=5)
        commit(model, mesh)
        before = shardings_of(model, opt)
        trainer = Trainer(model, opt, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                          mesh=mesh, rules=FSDP, steps_per_call=3)
        rng = np.random.default_rng(0)
        batches = []
        for i in range(12):
            x = rng.normal(size=(8, 16)).astype(np.float32)
            if i == nan_at:
                x[:] = np.inf
            batches.append({"x": x, "y": rng.normal(size=(8, 8)).astype(np.float32)})
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            h = trainer.fit(batches, num_steps=steps, progress=False)
        assert shardings_of(model, opt) == before
        return h, model, opt, w

    h, model, opt, w = run(nan_at=4, steps=9)
    assert h.steps == 4 and "at step 5" in h.stop_reason and len(w) == 1
    _, ref, ref_opt, _ = run(nan_at=None, steps=4)
    assert_same_state(model, ref)  # params, dropout key count and all
    assert_same_state(opt, ref_opt)


def test_trainer_activates_mesh_and_rules_for_constrain():
    class Constrained(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(20, 1, rngs=rngs)

        def __call__(self, x):
            return self.lin(ns.constrain(x, ("batch", "hidden")))

    def fit(rules):
        model = Constrained(nnx.Rngs(0))
        opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
        trainer = Trainer(model, opt, loss_fn, mesh="data=8", rules=rules, steps_per_call=2)
        return trainer.fit(host_batches(2), num_steps=2, progress=False)

    assert fit({"batch": "data", "hidden": None}).steps == 2
    # Without a rule for 'hidden' the constraint fails: proof that it was applied.
    with pytest.raises(ns.ShardingError, match="'hidden'"):
        fit({"batch": "data"})


def test_fused_call_retraces_under_other_rules():
    def step(model, opt, batch):
        def loss(m):
            x = ns.constrain(batch["x"], ("batch", None))
            return jnp.mean((m(x) - batch["y"]) ** 2)

        value, grads = nnx.value_and_grad(loss)(model)
        opt.update(model, grads)
        return value

    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    fused = multistep(step)
    batches = data(2, 8, 20, 1)
    fused(model, opt, batches)  # outside ns.use: constrain is a no-op
    with ns.use("data=8", {"batch": "data"}):
        fused(model, opt, batches)
        fused(model, opt, batches)
    with ns.use("data=8", {"batch": None}):
        fused(model, opt, batches)
    assert fused.traces == 3


def test_with_sharded_init_and_sharded_optimizer():
    """The library path: fsdp x tensor parallel on an Auto 4x2 mesh (on Explicit axes
    a contracting dimension sharded on both sides needs out_sharding in model code)."""
    init = pytest.importorskip("nnx_shard._init")
    mesh = ns.make_mesh("data=4,model=2", axis_types="auto")
    rules = ns.Rules({"batch": "data", "in": "data", "out": "model"})

    def build():
        model = init.sharded_init(lambda: MLP((16, 32, 8), rngs=nnx.Rngs(0)), mesh, rules)
        return model, init.sharded_optimizer(model, optax.adam(1e-2), mesh, rules)

    (model, opt), (ref, ref_opt) = build(), build()
    assert model.layers[0].kernel[...].sharding.spec == P("data", "model")
    before = shardings_of(model, opt)
    batches = shard_batch(data(3, 8, 16, 8), mesh, rules, steps=True)
    metrics = multistep(mse_step)(model, opt, batches)
    expected = loop(mse_step, ref, ref_opt, batches)
    np.testing.assert_allclose(metrics["loss"], expected["loss"], rtol=RTOL)
    assert_same_state(model, ref)
    assert shardings_of(model, opt) == before


@needs_devices(8)
def test_trainer_keeps_zero1_layouts_on_an_explicit_mesh():
    # Replicated parameter + data-sharded Adam update is data-sharded under Explicit
    # typing; the step must put parameters back in their own (replicated) layout.
    mesh = ns.make_mesh("data=8", axis_types="explicit")
    rules = {"batch": "data", "in": None, "out": None}
    opt_rules = {"batch": "data", "in": "data", "out": None}
    model = ns.sharded_init(lambda: MLP((16, 32, 8), rngs=nnx.Rngs(0)), mesh, rules)
    opt = ns.sharded_optimizer(model, optax.adam(1e-2), mesh, rules, opt_rules=opt_rules)
    stacked = data(4, 16, 16, 8)
    batches = [{k: v[i] for k, v in stacked.items()} for i in range(4)]
    trainer = Trainer(model, opt, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                      mesh=mesh, rules=rules, steps_per_call=2)
    history = trainer.fit(batches, 4, progress=False)
    assert len(history) == 4 and history["loss"][-1] < history["loss"][0]
    assert model.layers[0].kernel.get_value().sharding.spec == P(None, None)
    assert opt.opt_state[0].mu["layers"][0]["kernel"].get_value().sharding.spec == P("data", None)


# ----------------------------------------------------------------------------- clear errors


def test_shard_batch_rejects_bad_names_and_python_leaves():
    rules = ns.Rules({"batch": "data", "length": None})
    batch = {"tokens": np.zeros((8, 4), np.int32), "label": np.zeros((8,), np.int32)}
    with pytest.raises(ns.ShardingError, match=r"shard_batch: names = 5 \(int\) is not a tuple of "
                       r"logical names\. Fix: names are .*\('batch', 'length'\)"):
        shard_batch(batch, "data=8", rules, names=5)
    with pytest.raises(ns.ShardingError, match=r"names\['tokens'\] = 'batch' \(str\)"):
        shard_batch(batch, "data=8", rules, names={"tokens": "batch", "label": ("batch",)})
    with pytest.raises(ValueError, match=r"names is a pytree prefix that does not match the "
                       r"batch: .*'tokens'.*'label'.*Fix:"):
        shard_batch(batch, "data=8", rules, names={"inputs": ("batch",), "label": ("batch",)})
    # The prefix form still works.
    out = shard_batch(batch, "data=8", rules, names={"tokens": ("batch", "length"), "label": None})
    assert out["tokens"].sharding.spec == P("data", None)
    assert out["label"].sharding.is_fully_replicated
    # A list of floats is not 8 replicated scalars.
    with pytest.raises(ns.UsageError, match=r"shard_batch: batch\['x'\]\[0\] is a Python float "
                       r"\(0\.5\) \(an item of a Python list or tuple\): batches must be arrays "
                       r".*with a leading batch axis"):
        shard_batch({"x": [0.5] * 8}, "data=8", rules)
    with pytest.raises(ns.UsageError, match=r"batch is a Python int \(3\)"):
        shard_batch(3, "data=8", rules)


def test_trainer_rejects_what_is_not_a_model_an_optimizer_or_a_loss():
    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    kw = {"mesh": "data=8", "rules": {"batch": "data"}}
    with pytest.raises(ns.UsageError, match=r"Trainer: optimizer must be an nnx.Optimizer .*got "
                       r"NoneType \(None\)\. Fix: ns.sharded_optimizer\("):
        Trainer(model, None, loss_fn, **kw)
    with pytest.raises(ns.UsageError, match=r"got an optax transformation\. Fix: .*nnx.Optimizer\("
                       r"model, tx, wrt=nnx.Param\)"):
        Trainer(model, optax.adam(1e-3), loss_fn, **kw)
    with pytest.raises(ns.UsageError, match=r"Trainer: model must be an nnx.Module, got dict"):
        Trainer({"w": np.zeros(3)}, opt, loss_fn, **kw)
    with pytest.raises(ns.UsageError, match=r"Trainer: loss_fn must be callable"):
        Trainer(model, opt, "mse", **kw)


@pytest.mark.parametrize(
    ("batches", "message"),
    [
        ([[0.5, 1.0, 2.0]] * 2, r"Trainer.fit: batch\[0\] is a Python float \(0\.5\) \(an item "
                                r"of a Python list or tuple\): batches must be arrays"),
        ([1.0, 2.0], r"Trainer.fit: batch is a Python float \(1\.0\)"),
        ([{"x": np.float32(1.0)}] * 2, r"Trainer.fit: batch\['x'\] is a scalar \(shape \(\)\): "
                                        r"every leaf of a batch needs a leading batch axis"),
        ([{}] * 2, r"Trainer.fit: a batch from data is \{\}, which holds no arrays"),
    ],
    ids=["list_of_floats", "scalars", "zero_d_array", "empty"],
)
def test_trainer_fit_rejects_python_list_and_scalar_batches(batches, message):
    with pytest.raises(ns.UsageError, match=message):
        make_trainer(steps_per_call=2).fit(batches, num_steps=2, progress=False)


def test_a_tuple_loss_without_has_aux_names_the_fix():
    def loss_with_aux(model, batch):
        err = model(batch["x"]) - batch["y"]
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}

    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    trainer = Trainer(model, opt, loss_with_aux, mesh="data=8", rules={"batch": "data"})
    with pytest.raises(ns.UsageError, match=r"loss_with_aux returned a tuple of 2 values, not one "
                       r"scalar loss\. Fix: .*pass has_aux=True"):
        trainer.fit(host_batches(2), num_steps=2, progress=False)
    trainer = Trainer(model, opt, loss_fn, mesh="data=8", rules={"batch": "data"}, has_aux=True)
    with pytest.raises(ns.UsageError, match=r"loss_fn returned an array of shape \(\), but has_aux=True "
                       r"expects a pair \(loss, aux\)"):
        trainer.fit(host_batches(2), num_steps=2, progress=False)
    with pytest.raises(ns.UsageError, match=r"returned a loss of shape \(8, 1\), not a scalar"):
        value_and_grad(lambda m, b: m(b))(model, jnp.ones((8, 20)))


def test_microbatches_that_split_one_device_rows_are_explained():
    """One row per device (global batch 8 over data=8): 4 microbatches cannot be made
    without moving rows between devices; JAX's raw ShardingTypeError becomes a fix."""
    from nnx_shard.models import Decoder, get_config, lm_loss

    # One layer: the rows check is about the batch, not the depth.
    cfg = dataclasses.replace(get_config("tiny"), layers=1)
    mesh = ns.make_mesh("data=8")
    strategy = ns.strategies.get("dp")
    model = ns.sharded_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, strategy)
    opt = ns.sharded_optimizer(model, optax.adam(1e-3), mesh, strategy)
    trainer = Trainer(model, opt, lm_loss, mesh=mesh, rules=strategy.rules, microbatches=4,
                      steps_per_call=1)
    tokens = np.zeros((8, cfg.length), np.int32)
    with pytest.raises(ValueError, match=(
            r"microbatches=4 must divide each device's rows of the batch: batch\['inputs'\] "
            r"has 8 rows \(shape \(8, 16\)\) sharded over mesh axes data \(8 devices\), so 1 "
            r"row per device, which does not divide by 4\. Fix: a global batch that is a "
            r"multiple of 4 x 8 = 32, or a number of microbatches that divides 1\.")):
        trainer.fit([{"inputs": tokens, "targets": tokens}] * 2, num_steps=1, progress=False)


# ----------------------------------------------------------------------------- bounded dispatch


DISPATCH_SCRIPT = """
import sys, time
import jax, jax.numpy as jnp, numpy as np, optax
from flax import nnx
import nnx_shard as ns

mesh = ns.make_mesh("data=8")
rules = ns.Rules({"batch": "data", "in": "data", "out": None})
init = ns.with_logical(nnx.initializers.lecun_normal(), ("in", "out"))
model = ns.sharded_init(lambda: nnx.Linear(8, 8, kernel_init=init, rngs=nnx.Rngs(0)), mesh, rules)
opt = ns.sharded_optimizer(model, optax.sgd(1e-3), mesh, rules)

def step(model, opt, batch):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch) - 1.0) ** 2))(model)
    opt.update(model, grads)
    return {"loss": loss}

fused = ns.multistep(step, **eval(sys.argv[1]))
batch = ns.shard_batch(np.ones((1, 8, 8), np.float32), mesh, rules, steps=True)
start = time.perf_counter()
for _ in range(3000):
    fused(model, opt, batch)   # K=1, never blocked on by the caller
print("done", int(opt.step[...]), round(time.perf_counter() - start, 1))
"""


@pytest.mark.slow
def test_an_unblocked_loop_of_fused_calls_does_not_abort(tmp_path):
    """3,000 unblocked K=1 FSDP calls on 8 simulated devices: with unbounded dispatch
    (max_in_flight=None) XLA's CPU rendezvous aborted the process (SIGABRT) after ~75
    calls; the default keeps two calls in flight. Runs in a subprocess so an abort fails
    the test instead of killing pytest."""
    script = tmp_path / "dispatch.py"
    script.write_text(DISPATCH_SCRIPT)
    env = {**simulated_env(8), "PYTHONPATH": str(ROOT)}
    try:
        done = subprocess.run([sys.executable, str(script), "{}"], capture_output=True,
                              text=True, timeout=240, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("3,000 fused calls did not finish within 240 s")
    assert done.returncode == 0, f"rc {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.split()[:2] == ["done", "3000"]


def test_max_in_flight_is_validated_and_shown():
    assert "max_in_flight=2" in repr(multistep(mse_step))
    assert multistep(mse_step, max_in_flight=None).max_in_flight is None
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"max_in_flight must be a positive int or None"):
            multistep(mse_step, max_in_flight=bad)


def test_unroll_runs_the_same_steps_in_an_unrolled_loop():
    def run(unroll):
        model = seed_model()
        opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
        fused = multistep(mse_step, unroll=unroll)
        batches = data(5, 4, 20, 1)  # K=5: two unrolled pairs and a remainder step
        text = fused.lower(model, opt, batches).compile().as_text()
        return fused(model, opt, batches)["loss"], nnx.state(model, nnx.Param), text

    loss1, params1, text1 = run(1)
    loss2, params2, text2 = run(2)
    assert_close(loss2, loss1, what="losses")
    assert_close(params2, params1, what="parameters")
    # Unrolled, the loop body holds the step twice (plus the remainder step).
    dots = [len(re.findall(r"\bdot\(", text)) for text in (text1, text2)]
    assert dots[1] >= 2 * dots[0] > 0, dots
    assert "unroll=2" in repr(multistep(mse_step, unroll=2))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"unroll must be a positive int"):
            multistep(mse_step, unroll=bad)


def test_trainer_unroll_gives_the_rolled_history():
    rolled = make_trainer(steps_per_call=4).fit(host_batches(20), num_steps=6, progress=False)
    trainer = make_trainer(steps_per_call=4, unroll=2)
    unrolled = trainer.fit(host_batches(20), num_steps=6, progress=False)
    assert trainer._fused.unroll == 2
    assert_close(unrolled["loss"], rolled["loss"], what="losses")
    assert unrolled["step"].tolist() == rolled["step"].tolist() == list(range(1, 7))


def test_max_in_flight_bounds_unfinished_calls():
    model = seed_model()
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    fused = multistep(mse_step, max_in_flight=2)
    waited = []
    batches = data(1, 8, 20, 1)
    for _ in range(5):
        fused(model, opt, batches)
        waited.append(len(fused._in_flight))
    assert waited == [1, 2, 2, 2, 2]
    assert int(opt.step[...]) == 5


# ----------------------------------------------------------------------------- lazy plans


def test_fit_with_a_huge_num_steps_on_finite_data_stops_when_the_data_ends():
    trainer = make_trainer(steps_per_call=2)
    tracemalloc.start()
    try:
        h = trainer.fit(host_batches(5), num_steps=10**12, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert h.steps == 5 and h.stop_reason == "data ran out after 5 of 1000000000000 steps"
    assert h["step"].tolist() == [1, 2, 3, 4, 5]
    # Nothing sized by num_steps was built: a plan of 10**12 steps would show here.
    assert peak < 50 * 2**20, f"peak Python allocation {peak / 2**20:.0f} MiB"


def test_microbatch_rows_check_ignores_unsharded_leaves_and_runs_once_per_layout():
    """Only leaves whose batch axis is sharded are checked per device; a replicated batch
    that does not divide gets the plain batch-size message from the split itself."""

    mesh = ns.make_mesh("data=8")
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    fused = ns.multistep(mse_train_step, microbatches=2)
    rep = NamedSharding(mesh, P())
    odd = {"x": jax.device_put(np.ones((1, 3, 3), np.float32), rep),
           "y": jax.device_put(np.zeros((1, 3, 1), np.float32), rep)}
    with pytest.raises(ValueError, match=r"must divide the batch dimension \(axis 0\) of every "
                       r"batch leaf, but batch\['x'\] has shape \(3, 3\)"):
        fused(model, opt, odd)
    good = ns.shard_batch({"x": np.ones((1, 16, 3), np.float32),
                           "y": np.zeros((1, 16, 1), np.float32)},
                          mesh, {"batch": "data"}, steps=True)
    assert fused(model, opt, good)["loss"].shape == (1,)
    checked = len(fused._rows_checked)  # the replicated layout and this one
    fused(model, opt, good)
    assert len(fused._rows_checked) == checked == 2


@needs_devices(8)
@pytest.mark.parametrize("guard", ["full", "grads"])
def test_lower_is_the_call_fit_then_runs_and_keeps_a_copy_of_the_state_only_under_full(guard):
    """Trainer.lower traces what fit runs (fit then reuses that trace); under
    guard="full" its compiled temporaries hold the NaN guard's copy of the state a bare
    multistep does not keep, under "grads" (the default) they do not."""
    mesh = ns.make_mesh("data=8")
    rules = FSDP
    model, opt = sharded_mlp(mesh, rules)
    trainer = Trainer(model, opt, mse_loss, mesh=mesh, rules=rules, steps_per_call=2,
                      guard=guard)
    rows = NamedSharding(mesh, P(None, "data"))
    group = {"x": jax.ShapeDtypeStruct((2, 16, 16), jnp.float32, sharding=rows),
             "y": jax.ShapeDtypeStruct((2, 16, 8), jnp.float32, sharding=rows)}
    fit_temp = trainer.lower(group).compile().memory_analysis().temp_size_in_bytes
    assert trainer.traces == 1

    def step(model, opt, batch):
        loss, grads = value_and_grad(mse_loss)(model, batch)
        opt.update(model, grads)
        return loss

    with ns.use(mesh, rules):
        bare = multistep(step).lower(model, opt, group).compile().memory_analysis()
    state = sum(x.addressable_shards[0].data.nbytes
                for x in jax.tree.leaves(nnx.state((model, opt))))
    if guard == "full":
        assert state <= fit_temp - bare.temp_size_in_bytes <= 1.5 * state
    else:  # a few scalars: the flags and norms of the checks, and the metrics packed
        # into one byte vector (fit reads one array back per call): bytes per step
        assert 0 <= fit_temp - bare.temp_size_in_bytes <= 0.25 * state + 128 * 2

    data = [{"x": np.ones((16, 16), np.float32), "y": np.zeros((16, 8), np.float32)}] * 4
    history = trainer.fit(data, 4, progress=False)
    assert len(history) == 4 and trainer.traces == 1


# --------------------------------------------------------------------------- wrong types


def _tiny_trainer(**kw):
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    mse = lambda m, b: jnp.mean((m(b) - 1.0) ** 2)  # noqa: E731
    return Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"}, **kw)


@pytest.mark.parametrize("kw, match", [
    ({"steps_per_call": True}, r"steps_per_call must be a positive int, got True \(a bool\)"),
    ({"steps_per_call": 2.0}, r"steps_per_call must be a positive int, got 2.0 \(float\)"),
    ({"steps_per_call": None}, r"steps_per_call must be a positive int, got None"),
    ({"microbatches": True}, r"microbatches must be a positive int, got True \(a bool\)"),
    ({"microbatches": 0}, r"microbatches must be a positive int, got 0"),
    ({"batch_names": "batch"}, r"batch_names must be a tuple of logical names"),
    ({"batch_names": ()}, r"batch_names must be a tuple of logical names"),
    ({"batch_names": (5,)}, r"batch_names must be a tuple of logical names"),
    ({"has_aux": "yes"}, r"has_aux must be True or False, got 'yes' \(str\)"),
    ({"donate": 2}, r"donate must be True or False, got 2 \(int\)"),
])
def test_trainer_refuses_bools_and_wrong_types_where_counts_and_flags_go(kw, match):
    with pytest.raises(ns.NnxShardError, match=match):
        _tiny_trainer(**kw)


BATCHES = [np.ones((8, 2), np.float32)] * 4


@pytest.mark.parametrize("kw, match", [
    ({"num_steps": True}, r"num_steps must be a non-negative int, got True \(a bool\)"),
    ({"num_steps": 2.0}, r"num_steps must be a non-negative int, got 2.0"),
    ({"callbacks": [5]}, r"callbacks\[0\] is int 5, not a callable"),
    ({"callbacks": [print, None]}, r"callbacks\[1\] is NoneType None"),
    ({"callbacks": "cb"}, r"callbacks must be a list of callables"),
    ({"checkpointer": "ckpt"}, r"checkpointer must be an ns.Checkpointer or None, got str"),
    ({"progress": "yes"}, r"progress must be True or False"),
    ({"resume": "yes"}, r"resume must be True or False"),
    ({"data": None}, r"data must be an iterable of batches .* got NoneType"),
    ({"data": "abc"}, r"data must be an iterable of batches .* got str"),
])
def test_fit_refuses_bad_arguments_before_any_training_call(kw, match):
    t = _tiny_trainer(steps_per_call=2)
    args = {"data": BATCHES, "num_steps": 2, "progress": False, **kw}
    data, num_steps = args.pop("data"), args.pop("num_steps")
    with pytest.raises(ns.NnxShardError, match=match):
        t.fit(data, num_steps, **args)
    assert t.step == 0 and t.traces == 0  # refused up front: nothing compiled or run


def test_multistep_refuses_a_batch_without_its_steps_axis():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    def step(model, opt, batch):
        loss, grads = value_and_grad(lambda m, b: jnp.mean((m(b) - 1.0) ** 2))(model, batch)
        opt.update(model, grads)
        return {"loss": loss}

    one_step = shard_batch(np.ones((8, 2), np.float32), "data=8", {"batch": "data"})
    with ns.use("data=8", {"batch": "data"}):
        with pytest.raises(ns.ShardingError, match=r"multistep: batch has shape \(8, 2\) with "
                           r"its leading axis split over devices .* not the steps axis K"):
            multistep(step)(model, opt, one_step)
        assert int(opt.step[...]) == 0
        stacked = shard_batch(np.ones((3, 8, 2), np.float32), "data=8", {"batch": "data"},
                              steps=True)
        assert multistep(step)(model, opt, stacked)["loss"].shape == (3,)


@pytest.mark.parametrize("kw, match", [
    ({"microbatches": True}, r"microbatches must be a positive int, got True"),
    ({"donate": "yes"}, r"donate must be True or False"),
])
def test_multistep_refuses_bools_and_text(kw, match):
    with pytest.raises(ns.NnxShardError, match=match):
        multistep(lambda m, o, b: {}, **kw)


@pytest.mark.parametrize("kw, match", [
    ({"microbatches": True}, r"microbatches must be a positive int, got True"),
    ({"has_aux": "x"}, r"has_aux must be True or False"),
])
def test_value_and_grad_refuses_bools_and_text(kw, match):
    with pytest.raises(ns.NnxShardError, match=match):
        value_and_grad(lambda m, b: 0.0, **kw)


def test_an_integer_loss_is_named_not_a_jax_error():
    model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    with pytest.raises(ns.UsageError, match=r"returned a loss of dtype int32 .* not a float"):
        value_and_grad(lambda m, b: jnp.sum(b).astype(jnp.int32))(model, jnp.ones((8, 2)))


@pytest.mark.parametrize("kw, match", [
    ({"steps": "yes"}, r"shard_batch: steps must be True or False"),
    ({"batch": "abc"}, r"batch has dtype <U3 .* batches are numbers or bools"),
    ({"batch": np.ones(8), "steps": True}, r"batch has shape \(8,\), but steps=True expects"),
])
def test_shard_batch_refuses_text_and_a_missing_steps_axis(kw, match):
    batch = kw.pop("batch", np.ones((2, 8, 2)))
    with pytest.raises(ns.NnxShardError, match=match):
        shard_batch(batch, "data=8", {"batch": "data"}, **kw)


class _Counted(nnx.Module):
    """A linear layer and an integer nnx.Param (a count kept with the weights)."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.lin = nnx.Linear(2, 1, rngs=rngs)
        self.seen = nnx.Param(jnp.array(7, jnp.int32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.lin(x)


def _floats(path: object, v: object) -> bool:
    return isinstance(v, nnx.Variable) and jnp.issubdtype(v.get_value().dtype, jnp.floating)


@needs_devices(8)
def test_an_integer_param_is_not_differentiated_and_an_optimizer_tracking_it_is_refused():
    model = _Counted(nnx.Rngs(0))
    mse = lambda m, b: jnp.mean((m(b) - 1.0) ** 2)  # noqa: E731
    # value_and_grad differentiates the float parameters only (jax.grad takes no ints).
    _, grads = value_and_grad(mse)(model, jnp.ones((8, 2)))
    assert "lin" in grads and "seen" not in grads
    # An optimizer over every Param would update the integer one: refused, naming it.
    with pytest.raises(ns.NnxShardError, match=r"Trainer: the optimizer tracks integer "
                       r"parameter 'seen' \(int32\).*Fix: .*nnx.Variable.*wrt=nnx.All\("
                       r"nnx.Param"):
        ns.Trainer(model, nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param), mse,
                   mesh="data=8", rules={"batch": "data"})
    # The optimizer over the float parameters, as the message says: trains, the count
    # is kept as it is.
    for tx in (optax.sgd(0.1), optax.adamw(0.1)):
        model = _Counted(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.All(nnx.Param, _floats))
        trainer = ns.Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"},
                             steps_per_call=2)
        kernel = np.asarray(model.lin.kernel[...]).copy()
        trainer.fit([np.ones((8, 2), np.float32)] * 4, 4, progress=False)
        assert not np.allclose(np.asarray(model.lin.kernel[...]), kernel)
        assert int(model.seen[...]) == 7 and model.seen[...].dtype == jnp.int32
