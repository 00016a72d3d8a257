"""ns.Batches and the input pipelines Trainer.fit takes: whole arrays, memmaps, grain.

Every fit here is compared with the same run fed per-step batches from a plain
iterable (the path every other loader takes).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard._train import Trainer
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

RTOL = 1e-5
B = 8  # global batch: one row per simulated device


def model_and_opt():
    model = nnx.Sequential(nnx.Linear(5, 7, rngs=nnx.Rngs(0)), nnx.Linear(7, 2, rngs=nnx.Rngs(1)))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def mse(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def trainer(k=3, **kw):
    model, opt = model_and_opt()
    # Placed on the mesh, as ns.sharded_init would (a checkpoint restores onto it).
    rep = jax.sharding.NamedSharding(ns.make_mesh("data=8"), jax.sharding.PartitionSpec())
    nnx.update((model, opt), jax.device_put(nnx.state((model, opt)), rep))
    return Trainer(model, opt, mse, mesh="data=8", rules={"batch": "data"}, steps_per_call=k,
                   **kw)


def arrays(n, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 5)).astype(np.float32),
            "y": rng.normal(size=(n, 2)).astype(np.float32)}


def per_step(a, steps):
    rows = len(a["x"]) // B
    return [{key: v[(i % rows) * B:(i % rows + 1) * B] for key, v in a.items()}
            for i in range(steps)]


def assert_same(t1, t2):
    for x, y in zip(jax.tree.leaves(nnx.state((t1.model, t1.optimizer))),
                    jax.tree.leaves(nnx.state((t2.model, t2.optimizer))), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=RTOL * float(np.max(np.abs(y), initial=0)))


# ----------------------------------------------------------------------------- Batches


def test_batches_windows_and_iteration():
    a = {"x": np.arange(30).reshape(15, 2), "y": (np.arange(15), np.arange(15) * 2)}
    data = ns.Batches(a, batch_size=4, epochs=None)
    assert len(data) == 3 and data.total is None
    w = data.window(2, 3)  # batch 2, then batches 0 and 1 of the next epoch
    assert w["x"].shape == (3, 4, 2) and isinstance(w["y"], tuple)
    assert w["y"][0].tolist() == [[8, 9, 10, 11], [0, 1, 2, 3], [4, 5, 6, 7]]
    assert w["y"][1].tolist() == [[16, 18, 20, 22], [0, 2, 4, 6], [8, 10, 12, 14]]
    one = ns.Batches(a, batch_size=4)
    assert one.window(1, 5)["x"].shape == (2, 4, 2)  # the end of the data cuts it
    assert one.window(3, 1) is None
    # Within an epoch a window of a contiguous array is a view: nothing is copied.
    assert np.shares_memory(one.window(0, 3)["x"], a["x"])
    assert [b["y"][0].tolist() for b in one] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_batches_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"batch_size must be a positive int, got 0"):
        ns.Batches({"x": np.zeros((4, 1))}, 0)
    with pytest.raises(ValueError, match=r"epochs must be a positive int or None.*got 0"):
        ns.Batches({"x": np.zeros((4, 1))}, 2, epochs=0)
    with pytest.raises(ValueError, match=r"disagree on the number of examples.*"
                       r"arrays\['x'\] has 4, arrays\['y'\] has 5"):
        ns.Batches({"x": np.zeros((4, 1)), "y": np.zeros((5, 1))}, 2)
    with pytest.raises(ns.UsageError, match=r"arrays\['x'\]\[0\] is float, not an array.*Fix: pass NumPy arrays"):
        ns.Batches({"x": [1.0, 2.0]}, 1)
    with pytest.raises(ValueError, match=r"3 examples make no batch of batch_size=4"):
        ns.Batches({"x": np.zeros((3, 1))}, 4)


def test_fit_on_batches_equals_fit_on_per_step_batches_across_epochs():
    a = arrays(5 * B)  # 5 batches per epoch; 7 steps run into the second epoch
    t1, t2 = trainer(), trainer()
    h1 = t1.fit(ns.Batches(a, B, epochs=2), 7, progress=False)
    h2 = t2.fit(per_step(a, 7), 7, progress=False)
    assert h1.steps == h2.steps == 7 and h1.stop_reason is None
    np.testing.assert_allclose(h1["loss"], h2["loss"], rtol=RTOL)
    assert_same(t1, t2)
    assert t1.traces == 2  # K=3 and the last call's K=1, as for any data

    # Running out: 10 batches in all, 12 asked.
    h = trainer().fit(ns.Batches(a, B, epochs=2), 12, progress=False)
    assert h.steps == 10 and h.stop_reason == "data ran out after 10 of 12 steps"


def test_fit_reads_a_memmap_window_by_window(tmp_path):
    a = arrays(6 * B, seed=1)
    maps = {}
    for key, v in a.items():
        m = np.lib.format.open_memmap(tmp_path / f"{key}.npy", mode="w+", dtype=v.dtype,
                                      shape=v.shape)
        m[:] = v
        m.flush()
        maps[key] = np.load(tmp_path / f"{key}.npy", mmap_mode="r")
    t1, t2 = trainer(), trainer()
    h1 = t1.fit(ns.Batches(maps, B), 6, progress=False)
    h2 = t2.fit(per_step(a, 6), 6, progress=False)
    np.testing.assert_allclose(h1["loss"], h2["loss"], rtol=RTOL)
    assert_same(t1, t2)
    # A memmap also works as a plain iterable of per-step slices.
    t3 = trainer()
    t3.fit(per_step(maps, 6), 6, progress=False)
    assert_same(t3, t2)


def test_resume_on_batches_seeks_to_the_data_position(tmp_path):
    a = arrays(8 * B, seed=2)
    straight = trainer(k=2)
    straight.fit(ns.Batches(a, B), 8, progress=False)

    ckpt = ns.Checkpointer(tmp_path / "ckpt", every=3)
    first = trainer(k=2)
    first.fit(ns.Batches(a, B), 3, progress=False, checkpointer=ckpt)
    resumed = trainer(k=2)
    seen = []

    class Spy(ns.Batches):
        def window(self, start, k, **kw):
            seen.append(start)
            return super().window(start, k, **kw)

    h = resumed.fit(Spy(a, B), 8, progress=False, checkpointer=ns.Checkpointer(
        tmp_path / "ckpt", every=3), resume=True)
    assert seen[0] == 3  # no batch read and dropped
    assert h["step"].tolist() == [4, 5, 6, 7, 8]
    assert_same(resumed, straight)


def test_fit_rejects_a_window_of_strings_with_the_fix():
    data = ns.Batches({"x": np.array(["a"] * 16)}, B)
    with pytest.raises(ns.UsageError, match=r"Trainer.fit: batch\['x'\] has dtype <U1.*numbers"):
        trainer().fit(data, 2, progress=False)


def test_one_device_mesh_compiles_once_across_fits():
    model, opt = model_and_opt()
    mesh = ns.make_mesh({"data": 1}, devices=jax.devices()[:1])
    t = Trainer(model, opt, mse, mesh=mesh, rules={"batch": "data"}, steps_per_call=2)
    a = arrays(4 * B)
    t.fit(ns.Batches(a, B), 4, progress=False)
    t.fit(ns.Batches(a, B), 4, progress=False)
    assert t.traces == 1  # fresh state is committed once, so the second call reuses it


# ----------------------------------------------------------------------------- NaN guard


def test_guard_checks_each_call_once_and_compiles_the_per_step_guard_only_on_failure():
    t = trainer(guard="full")
    t.fit(ns.Batches(arrays(6 * B), B), 6, progress=False)
    assert t.traces == 1 and t._careful.traces == 0

    bad = arrays(6 * B)
    bad["x"][4 * B, 0] = np.nan  # step 5
    t2 = trainer(guard="full")
    with pytest.warns(RuntimeWarning, match=r"loss is nan and grad_norm is nan at step 5;"):
        h = t2.fit(ns.Batches(bad, B), 6, progress=False)
    assert h.steps == 4 and t2._careful.traces == 1


def test_a_call_the_per_step_guard_accepts_is_kept_with_the_calls_queued_behind_it(monkeypatch):
    """If a fused call fails the once-per-call check but its replay with the per-step
    guard finds every step finite, training goes on from the replayed state, and
    the call queued behind the failed one (undone in the compiled call) is replayed
    too, so no batch is lost."""
    from nnx_shard._train import _trainer as trainer_module
    from nnx_shard._train._guard import guard_call, select

    def fail_first_call(before, after, metrics):
        metrics = guard_call(before, after, metrics)
        # Pretend the first call (optimizer step 0 before it) was not finite.
        first = before[1].step[...] == 0
        after[2].ok[...] = after[2].ok[...] & ~first
        nnx.update((after[0], after[1]), select(
            ~first, nnx.state((after[0], after[1])), nnx.state((before[0], before[1]))))
        k = metrics["loss"].shape[0]
        return {**metrics, "applied": jnp.broadcast_to(after[2].ok[...], (k,))}

    a = arrays(9 * B)
    with monkeypatch.context() as patched:  # the end of this trainer's fused call
        patched.setattr(trainer_module, "guard_call", fail_first_call)
        t = trainer(guard="full")
    h = t.fit(ns.Batches(a, B), 9, progress=False)
    ref = trainer(guard="full")
    href = ref.fit(ns.Batches(a, B), 9, progress=False)
    assert h.steps == 9 and h.stop_reason is None
    assert h["step"].tolist() == list(range(1, 10))
    np.testing.assert_allclose(h["loss"], href["loss"], rtol=RTOL)
    assert_same(t, ref)
    assert t._careful.traces == 1


# ----------------------------------------------------------------------------- grain


def test_grain_map_dataset_and_data_loader_feed_fit():
    grain = pytest.importorskip("grain")
    a = arrays(6 * B, seed=3)
    records = [{"x": a["x"][i], "y": a["y"][i]} for i in range(len(a["x"]))]
    ref = trainer()
    ref.fit(per_step(a, 6), 6, progress=False)

    # A MapDataset of dicts, batched: an iterable of batch dicts.
    ds = grain.MapDataset.source(records).batch(B, drop_remainder=True)
    t1 = trainer()
    h1 = t1.fit(iter(ds), 6, progress=False)
    assert h1.steps == 6
    assert_same(t1, ref)

    # A DataLoader over a sequence of records (in order, one pass).
    loader = grain.DataLoader(
        data_source=records,
        sampler=grain.samplers.IndexSampler(len(records), shuffle=False, num_epochs=1),
        operations=[grain.transforms.Batch(B, drop_remainder=True)],
        worker_count=0,
    )
    t2 = trainer()
    h2 = t2.fit(loader, 6, progress=False)
    assert h2.steps == 6
    assert_same(t2, ref)


# ----------------------------------------------------------------------------- grad norm


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_grad_norm_equals_optax_with_sharded_and_replicated_leaves(axis_types):
    from nnx_shard._train._norm import grads_norm

    mesh = ns.make_mesh("data=4,model=2", axis_types=axis_types)
    rng = np.random.default_rng(0)
    put = lambda x, *spec: jax.device_put(  # noqa: E731
        jnp.asarray(x, jnp.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))
    grads = {"w": put(rng.normal(size=(8, 6)), "data", "model"), "b": put(rng.normal(size=(6,))),
             "s": put(rng.normal(size=(3,)))}
    with jax.set_mesh(mesh):
        want = float(jax.jit(optax.tree.norm)(grads))
        for replicated in (False, True):
            got = jax.jit(lambda g, r=replicated: grads_norm(g, r))(grads)
            np.testing.assert_allclose(float(got), want, rtol=1e-6)


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_grad_sq_shares_sum_to_the_norm_with_no_collective(axis_types):
    from nnx_shard._train._norm import grad_sq_shares

    mesh = ns.make_mesh("data=4,model=2", axis_types=axis_types)
    rng = np.random.default_rng(0)
    P = jax.sharding.PartitionSpec

    def put(shape, spec, dtype=jnp.float32):
        x = jnp.asarray(rng.normal(size=shape), dtype)
        return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))

    # Sharded both ways, over one axis only (held twice), replicated, and bf16.
    grads = {"a": put((8, 6), P("data", "model")), "b": put((8, 3), P("data", None)),
             "c": put((5, 4), P(None, "model")), "d": put((7,), P()),
             "e": put((4, 2), P("data", None), jnp.bfloat16)}
    specs = [x.sharding.spec for x in jax.tree.leaves(grads)]
    with jax.set_mesh(mesh):
        want = float(jax.jit(optax.tree.norm)(grads))
        fn = jax.jit(lambda g: grad_sq_shares(g, specs, mesh))
        shares = fn(grads)
        hlo = fn.lower(grads).compile().as_text()
    assert shares.shape == (8,)
    assert shares.sharding.spec == P(("data", "model"))
    np.testing.assert_allclose(float(np.sqrt(np.sum(np.asarray(shares)))), want, rtol=1e-5)
    # Each device's share is its own blocks': nothing crosses devices until the caller sums.
    assert not [c for c in COLLECTIVES if f" {c}(" in hlo or f" {c}-start(" in hlo], hlo
    # Where nothing is sharded, or the layout is unknown, grads_norm is used instead.
    replicated = {k: jax.device_put(v, jax.sharding.NamedSharding(mesh, P())) for k, v in grads.items()}
    assert grad_sq_shares(replicated, [P()] * 5, mesh) is None
    assert grad_sq_shares(grads, None, mesh) is None
    assert grad_sq_shares(grads, specs[:2], mesh) is None


def test_window_refuses_negative_starts_and_bool_counts():
    b = ns.Batches(np.ones((8, 2), np.float32), 2)
    with pytest.raises(ns.NnxShardError, match=r"window: start must be a non-negative int"):
        b.window(-1, 2)
    with pytest.raises(ns.NnxShardError, match=r"window: k must be a positive int, got True"):
        b.window(0, True)
    with pytest.raises(ns.NnxShardError, match=r"window: k must be a positive int, got 0"):
        b.window(0, 0)
    assert b.window(3, 2).shape == (1, 2, 2)  # the end of the data: fewer than k
