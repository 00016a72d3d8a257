"""multistep, value_and_grad, shard_batch and Trainer on 8 simulated CPU devices.

Every fused result is compared with the plain Python loop of ``nnx.jit`` steps
it replaces. Shapes are tiny: the point is layouts and equality, not speed.
"""

from __future__ import annotations

import io
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import nnx_shard as ns
from nnx_shard.train import Trainer, _Progress, multistep, shard_batch, value_and_grad
from tests._close import assert_close
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

RTOL = 1e-5


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
        jax.block_until_ready(out[-1])  # one call in flight: see DESIGN.md (CPU rendezvous)
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


@pytest.mark.parametrize("rules", [FSDP, TP], ids=["fsdp", "tensor_parallel"])
def test_sharded_model_equals_nnx_jit_loop_and_keeps_shardings(rules):
    mesh = ns.make_mesh("data=4,model=2")
    model, opt = sharded_mlp(mesh, rules)
    ref_model, ref_opt = sharded_mlp(mesh, rules)
    kernel = model.layers[0].kernel[...].sharding.spec
    assert kernel == (P("data", None) if rules is FSDP else P(None, "model"))
    # Adam's moments follow the parameters.
    assert opt.opt_state[0].mu["layers"][0]["kernel"][...].sharding.spec == kernel
    before = shardings_of(model, opt)
    batches = shard_batch(data(4, 8, 16, 8), mesh, rules, steps=True)

    fused = multistep(mse_step)
    metrics = fused(model, opt, batches)
    expected = loop(mse_step, ref_model, ref_opt, batches)

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

    def step(model, opt, batch):
        def loss_fn(m):
            return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        opt.update(model, grads)
        return {"loss": loss}

    model = MLP((16, 32, 8), dropout=0.5, rngs=nnx.Rngs(0))
    model.drop.rngs = nnx.Rngs(dropout=1)
    opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    fused = multistep(step, donate=False)
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
    b = multistep(step, donate=False)(twin, twin_opt, batches)
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
    (_loss, aux), grads = value_and_grad(loss_fn, has_aux=True, microbatches=2)(model, x, rngs)
    assert int(rngs.dropout.count[...]) == 2  # one draw per microbatch, carried back
    assert aux["mean"].shape == () and grads["layers"][0]["kernel"][...].shape == (4, 8)
    # Without dropout, 2 microbatches equal the full batch.
    model = MLP((4, 8, 2), rngs=nnx.Rngs(0))
    (l1, a1), g1 = value_and_grad(loss_fn, has_aux=True)(model, x, None)
    (l2, a2), g2 = value_and_grad(loss_fn, has_aux=True, microbatches=2)(model, x, None)
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
    with pytest.raises(TypeError, match=r"step returned metrics\['note'\] = 'hello' \(str\)"):
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
    with pytest.raises(TypeError, match="no NNX object"):
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
    with pytest.warns(RuntimeWarning, match=r"loss is nan and grad_norm is nan at step 6;.*after step 5"):
        h = trainer.fit(host_batches(20, nan_at=5), num_steps=12, progress=False)
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


def test_trainer_callbacks_see_each_call_and_can_stop():
    seen = []

    def cb(step, metrics):
        seen.append((step, metrics["loss"].shape))
        return step >= 6

    trainer = make_trainer(steps_per_call=3)
    h = trainer.fit(host_batches(30), num_steps=12, progress=False, callbacks=[cb])
    assert seen == [(3, (3,)), (6, (3,))]
    assert h.steps == 6 and "callback cb asked to stop at step 6" in h.stop_reason


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


def test_progress_bar_only_on_a_tty():
    tty = FakeTTY()
    bar = _Progress(10, True, tty)
    bar.update(5, 0.5, 100.0, 800.0, final=False)
    bar.update(10, 0.25, 120.0, 960.0, final=True)
    bar.close()
    out = tty.getvalue()
    assert out.startswith("\rstep 5/10 | loss 0.5 | 100.0 steps/s | 800 examples/s")
    assert "\rstep 10/10 | loss 0.25 | 120.0 steps/s | 960 examples/s" in out
    assert out.endswith("\n")

    for stream, enabled in ((io.StringIO(), True), (FakeTTY(), False)):
        bar = _Progress(10, enabled, stream)
        bar.update(10, 0.25, 1.0, 1.0, final=True)
        bar.close()
        assert stream.getvalue() == ""


def test_trainer_runs_quietly_when_not_a_tty(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_trainer(steps_per_call=2).fit(host_batches(2), num_steps=2)
    assert capsys.readouterr().err == ""


def test_trainer_sharded_model_with_dropout_and_nan_stop():
    """FSDP on an Explicit 4x2 mesh, dropout keys inside the model: the NaN guard's
    select must keep layouts and restore the RNG state too."""
    mesh = ns.make_mesh("data=4,model=2")

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
    init = pytest.importorskip("nnx_shard.init")
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
    mesh = ns.make_mesh("data=8")
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
