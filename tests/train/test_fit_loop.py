"""Trainer.fit's steady state: a loop over flat state with host batches stacked once
per leaf, metrics read back in bulk, and the NNX objects exactly right wherever they
are looked at (callbacks, checkpoints, errors, the end of fit).

Every state is compared with a plain loop of ``nnx.jit`` steps on the same batches.
"""

from __future__ import annotations

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
from nnx_shard._mesh import make_mesh
from nnx_shard._rules import as_rules
from nnx_shard._train import Fused, Trainer
from nnx_shard._train import _run as run
from nnx_shard._train._feed import Stacker
from nnx_shard._train._placement import Placer
from tests._close import assert_close
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

RTOL = 1e-5


def model_and_opt():
    model = nnx.Sequential(nnx.Linear(20, 30, rngs=nnx.Rngs(0)),
                           nnx.Linear(30, 1, rngs=nnx.Rngs(1)))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def loss_fn(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batches(n, seed=0, nan_at=None):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        x = rng.normal(size=(8, 20)).astype(np.float32)
        if i == nan_at:
            x[0, 0] = np.nan
        out.append({"x": x, "y": rng.normal(size=(8, 1)).astype(np.float32)})
    return out


def trainer(**kw):
    model, opt = model_and_opt()
    return Trainer(model, opt, loss_fn, mesh="data=8", rules={"batch": "data"}, **kw)


def reference_states(data):
    """The plain loop: one ``nnx.jit`` step per batch; the state after each step
    (index i: after step i; 0: the initial state)."""
    model, opt = model_and_opt()

    @nnx.jit
    def step(model, opt, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        opt.update(model, grads)
        return loss

    states = [jax.tree.map(np.asarray, nnx.state((model, opt)))]
    for batch in data:
        jax.block_until_ready(step(model, opt, batch))
        states.append(jax.tree.map(np.asarray, nnx.state((model, opt))))
    return states


def assert_state(t, want):
    assert_close(jax.tree.map(np.asarray, nnx.state((t.model, t.optimizer))), want, RTOL,
                 "state")


def reads(monkeypatch):
    """Calls pending at each bulk read of the metrics."""
    seen = []
    real = run.FitRun.read_all

    def counted(self):
        if self.pending and self.stop_reason is None:
            seen.append(len(self.pending))
        real(self)

    monkeypatch.setattr(run.FitRun, "read_all", counted)
    return seen


def test_fit_state_and_history_equal_the_plain_loop_with_metrics_read_in_bulk(monkeypatch):
    data = batches(20)
    want = reference_states(data)
    seen = reads(monkeypatch)
    monkeypatch.setattr(run, "READ_SECONDS", 1e9)  # reads by count only
    t = trainer(steps_per_call=2)
    h = t.fit(data, num_steps=20, progress=False)
    assert seen == [10]  # 10 calls, their metrics read back once, at the end
    assert h.steps == t.step == t.data_position == int(t.optimizer.step[...]) == 20
    assert h["step"].tolist() == list(range(1, 21)) and h.stop_reason is None
    assert_state(t, want[20])

    seen.clear()
    monkeypatch.setattr(run, "READ_EVERY", 3)
    t2 = trainer(steps_per_call=2)
    t2.fit(data, num_steps=20, progress=False)
    assert seen == [3, 3, 3, 1]
    assert_state(t2, want[20])


def test_callbacks_see_the_objects_as_of_their_step():
    data = batches(12)
    want = reference_states(data)
    t = trainer(steps_per_call=3)
    steps = []

    def cb(step, metrics):
        steps.append(step)
        assert int(t.optimizer.step[...]) == t.step == step
        assert_state(t, want[step])

    h = t.fit(data, num_steps=12, progress=False, callbacks=[cb])
    assert steps == [3, 6, 9, 12] and h.steps == 12


def test_checkpoints_hold_the_state_of_their_step(tmp_path, monkeypatch):
    data = batches(12)
    want = reference_states(data)
    monkeypatch.setattr(run, "READ_SECONDS", 1e9)
    t = trainer(steps_per_call=2)
    ckpt = ns.Checkpointer(tmp_path / "ckpt", every=4, keep=5)
    t.fit(data, num_steps=12, progress=False, checkpointer=ckpt)
    assert_state(t, want[12])
    for step in (4, 8, 12):
        model, opt = model_and_opt()
        got, extra = restore_in_place(tmp_path / "ckpt", model, opt, step=step)
        assert got == step and extra == {"step": step, "data_position": step}
        assert_close(jax.tree.map(np.asarray, nnx.state((model, opt))), want[step], RTOL,
                     f"checkpoint {step}")


def test_an_error_mid_fit_leaves_the_objects_and_counters_at_the_last_dispatched_call(
        monkeypatch):
    data = batches(7)
    want = reference_states(data)
    monkeypatch.setattr(run, "READ_SECONDS", 1e9)

    def broken():
        yield from data
        raise RuntimeError("disk on fire")

    t = trainer(steps_per_call=2)
    with pytest.raises(RuntimeError, match="disk on fire"):
        t.fit(broken(), num_steps=20, progress=False)
    # Three calls of 2 ran (the fourth group never formed): their metrics were read on
    # the way out, so the counters agree with the state in the objects.
    assert t.step == t.data_position == int(t.optimizer.step[...]) == 6
    assert_state(t, want[6])
    h = t.fit(batches(2, seed=1), num_steps=2, progress=False)
    assert h["step"].tolist() == [7, 8]


@pytest.mark.parametrize("mode", ["grads", "off", "full"])
def test_the_nan_guard_stops_at_the_same_step_with_metrics_read_late(monkeypatch, mode):
    """The bad step is the 15th of 30; under "grads" and "off" the metrics are read
    only at the end, 13 calls after it: the calls behind it applied nothing."""
    data = batches(30, nan_at=14)
    want = reference_states(data[:14])
    seen = reads(monkeypatch)
    monkeypatch.setattr(run, "READ_SECONDS", 1e9)
    t = trainer(steps_per_call=2, guard=mode)
    with pytest.warns(RuntimeWarning, match="loss is nan and grad_norm is nan at step 15"):
        h = t.fit(data, num_steps=30, progress=False)
    kept = 16 if mode == "off" else 14  # "off" applies the whole failed call
    assert h.steps == t.step == t.data_position == int(t.optimizer.step[...]) == kept
    assert h["step"].tolist() == list(range(1, kept + 1)) and "step 15" in h.stop_reason
    if mode == "full":
        assert max(seen) <= 2  # a call that is undone is replayed at once
    else:
        assert seen == [15]
    if mode != "off":  # the last finite state; "off" keeps what the failed call made
        assert_state(t, want[14])


def test_the_graph_is_traversed_once_per_fit_not_per_call(monkeypatch):
    t = trainer(steps_per_call=2)
    t.fit(batches(4), num_steps=4, progress=False)  # compiles (tracing splits and merges)
    counts = {"split": 0, "merge": 0, "prepare": 0, "device_put": 0}

    def counting(name, real):
        def fn(*a, **k):
            counts[name] += 1
            return real(*a, **k)
        return fn

    monkeypatch.setattr(nnx, "split", counting("split", nnx.split))
    monkeypatch.setattr(nnx, "merge", counting("merge", nnx.merge))
    monkeypatch.setattr(Fused, "_prepare", counting("prepare", Fused._prepare))
    monkeypatch.setattr(jax, "device_put", counting("device_put", jax.device_put))
    h = t.fit(batches(40, seed=1), num_steps=40, progress=False)
    assert h.steps == 40 and t.traces == 1
    # 20 calls: the objects are flattened once, never split nor merged, and the
    # batches are copied to the devices by the compiled call (the one device_put
    # raises the guard's flag where it lives).
    assert counts == {"split": 0, "merge": 0, "prepare": 1, "device_put": 1}


def test_the_feed_stacks_each_leaf_once_with_the_batch_sharding():
    mesh = make_mesh("data=8")
    stack = Stacker(Placer(mesh, as_rules({"batch": "data"}), ("batch",)))
    host = batches(3)
    group = stack(host)
    assert group.steps == 3 and group.examples == 8
    for key in ("x", "y"):
        np.testing.assert_array_equal(group.data[key], np.stack([b[key] for b in host]))
        assert group.shardings[key] == NamedSharding(mesh, P(None, "data", None))
    # The same layout: the same shardings object (the compiled call is found by it).
    assert stack(batches(3, seed=1)).shardings is group.shardings
    one = batches(1)
    single = stack(one)
    assert single.data["x"].shape == (1, 8, 20)
    one[0]["x"][:] = 0.0  # a loader reusing its buffer does not change the group
    assert np.abs(single.data["x"]).sum() > 0
    with pytest.raises(ValueError, match=r"host batch 1 of this group has batch\['x'\] of shape"):
        stack([host[0], {"x": host[1]["x"][:4], "y": host[1]["y"]}])
    with pytest.raises(ValueError, match="every batch must have the same structure"):
        stack([host[0], {"x": host[1]["x"]}])
    with pytest.raises(ns.UsageError, match="Python float"):
        stack([{"x": 1.0, "y": host[0]["y"]}])


def test_lower_describes_the_call_fit_runs_on_host_data():
    t = trainer(steps_per_call=2)
    x = jax.ShapeDtypeStruct((2, 8, 20), jnp.float32)
    y = jax.ShapeDtypeStruct((2, 8, 1), jnp.float32)
    lowered = t.lower({"x": x, "y": y})
    assert lowered.compile().memory_analysis().temp_size_in_bytes > 0
    h = t.fit(batches(4), num_steps=4, progress=False)
    assert h.steps == 4 and t.traces == 1  # fit reused the lowered trace


def test_metrics_of_every_dtype_come_back_as_the_loss_returned_them():
    """Each call's metrics travel as one packed byte vector: floats, bfloat16, ints and
    flags come back with their dtypes and values, per step."""

    def aux_loss(model, batch):
        loss = loss_fn(model, batch)
        return loss, {"half": loss.astype(jnp.bfloat16), "count": jnp.int32(7),
                      "positive": loss > 0, "pair": jnp.stack([loss, 2 * loss])}

    model, opt = model_and_opt()
    t = Trainer(model, opt, aux_loss, mesh="data=8", rules={"batch": "data"},
                steps_per_call=3, has_aux=True)
    h = t.fit(batches(7), num_steps=7, progress=False)
    assert h.steps == 7
    assert h["loss"].dtype == np.float32 and h["grad_norm"].dtype == np.float32
    assert h["half"].dtype == jnp.bfloat16 and h["half"].shape == (7,)
    np.testing.assert_allclose(h["half"].astype(np.float32), h["loss"], rtol=1e-2)
    assert h["count"].dtype == np.int32 and h["count"].tolist() == [7] * 7
    assert h["positive"].dtype == np.bool_ and h["positive"].all()
    assert h["pair"].shape == (7, 2)
    np.testing.assert_allclose(h["pair"][:, 1], 2 * h["loss"], rtol=1e-6)
    assert np.isfinite(h["grad_norm"]).all() and (h["grad_norm"] > 0).all()


@pytest.mark.parametrize("axis_types", ["auto", "explicit"])
def test_the_step_sees_the_batch_layout_it_saw_with_placed_batches(axis_types):
    """Host batches are placed by the compiled call itself, except on Explicit axes,
    where a batch's traced type carries its sharding: there they are placed first, so
    the loss sees the same types as before."""
    seen = []

    def typed_loss(model, batch):
        seen.append(jax.typeof(batch["x"]).sharding.spec)
        return loss_fn(model, batch)

    mesh = ns.make_mesh("data=8", axis_types=axis_types)
    model, opt = model_and_opt()
    t = Trainer(model, opt, typed_loss, mesh=mesh, rules={"batch": "data"}, steps_per_call=2)
    h = t.fit(batches(4), num_steps=4, progress=False)
    assert h.steps == 4 and t.traces == 1
    assert seen[-1] == (P("data", None) if axis_types == "explicit" else P(None, None))
    assert_state(t, reference_states(batches(4))[4])
