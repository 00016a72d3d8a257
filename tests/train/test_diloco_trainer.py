"""``ns.Trainer(model, diloco, loss_fn, ...)``: DiLoCo as an option of the fused trainer,
on 8 simulated devices (hsdp, ``replica=2, data=4``), with an ``nnx.Linear`` (what is
proved here does not depend on depth):

* fit's losses (the mean over the replicas, computed on the host; the per-replica ones
  as ``replica_loss``) and the whole DiLoCo state equal the plain ``ns.multistep`` loop's
  over the same batches, with K=3 and H=2 (syncs inside the fused calls), an int8
  compressed sync (its residual is part of the state); the checkpoint fit saves holds
  the whole state, and a Trainer resumed from it continues with the loop's losses;
* the Trainer's compiled call (default guard) crosses replicas only inside the sync's
  branch: its all-reduce, and the 1-byte reduction of the replicas' guard flags;
* the NaN guard with a NaN in one replica's rows: ``"grads"`` skips that replica's
  update and stops (state finite, not saved), ``"full"`` puts back the state after
  the last finite step, ``"off"`` applies it and says so;
* the options a DiLoCo cannot honour, and a DiLoCo of another model, are refused.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard.planner import compiled_collectives
from tests._close import assert_close
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

HSDP = ns.strategies.get("hsdp")
RTOL = 1e-5  # x max|expected| per tensor (tests/_close.py)
K, H, STEPS = 3, 2, 6


def _mse(m: Any, b: Any) -> jax.Array:
    return jnp.mean((m(b["x"]) - b["y"]) ** 2)


def _diloco(mesh: Any, compress: str | None = "int8") -> ns.DiLoCo:
    model = ns.sharded_init(lambda: nnx.Linear(4, 2, rngs=nnx.Rngs(0)), mesh, HSDP)
    return ns.DiLoCo(model, optax.adam(0.05), inner_steps=H, compress=compress)


def _data(nan_at: int | None = None) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = [{"x": rng.normal(size=(8, 4)).astype(np.float32),
            "y": rng.normal(size=(8, 2)).astype(np.float32)} for _ in range(STEPS)]
    if nan_at is not None:
        out[nan_at - 1]["x"][4:] = np.nan  # rows 4..7: replica 1's half of the batch
    return out


def _trainer(d: ns.DiLoCo, mesh: Any, guard: str = "grads") -> ns.Trainer:
    return ns.Trainer(d.model, d, _mse, mesh=mesh, rules=HSDP, steps_per_call=K, guard=guard)


@pytest.fixture(scope="module")
def run(tmp_path_factory: Any) -> dict[str, Any]:
    """The multistep loop over 6 steps; a Trainer fit over the first 3 (saving step 3)
    and another resumed from that checkpoint over the last 3."""
    mesh = HSDP.make_mesh()
    data = _data()
    ref = _diloco(mesh)
    fused = ns.multistep(lambda d, b: {"loss": d.step(_mse, b)})
    with ns.use(mesh, HSDP.rules):
        want = np.concatenate([jax.device_get(fused(ref, ns.shard_batch(
            jax.tree.map(lambda *x: np.stack(x), *data[i:i + K]), mesh, HSDP.rules,
            steps=True)))["loss"] for i in range(0, STEPS, K)])
    directory = tmp_path_factory.mktemp("diloco_ckpt")
    first = _trainer(_diloco(mesh), mesh)
    h1 = first.fit(lambda pos: data[pos:], K, progress=False,
                   checkpointer=ns.Checkpointer(directory, every=K))
    resumed = _trainer(_diloco(mesh), mesh)
    h2 = resumed.fit(lambda pos: data[pos:], STEPS, progress=False, resume=True,
                     checkpointer=ns.Checkpointer(directory, every=K))
    return {"mesh": mesh, "want": want, "ref": ref, "first": first, "h1": h1,
            "resumed": resumed, "h2": h2, "dir": directory}


def test_fit_is_the_multistep_loop_and_resumes(run: dict[str, Any]) -> None:
    want, h1, h2 = run["want"], run["h1"], run["h2"]
    assert h1.stop_reason is None and h2.stop_reason is None
    assert h1["step"].tolist() == [1, 2, 3] and h2["step"].tolist() == [4, 5, 6]
    # The resumed trainer read step 3 and its data position, then ran steps 4..6.
    assert run["resumed"].step == STEPS and run["resumed"].data_position == STEPS
    got = np.concatenate([h1["replica_loss"], h2["replica_loss"]])
    assert got.shape == (STEPS, 2) and want.shape == (STEPS, 2)
    assert_close(got, want, RTOL, "per-replica losses")
    assert_close(np.concatenate([h1["loss"], h2["loss"]]), want.mean(axis=1), RTOL,
                 "loss: the mean over the replicas")
    assert h1["replica_grad_norm"].shape == (K, 2) and np.all(h1["grad_norm"] > 0)
    # The whole state: anchor, replicas, both optimizers' states, count and residual.
    ref, resumed = run["ref"], run["resumed"].optimizer
    assert {"replicas", "inner_state", "outer_state", "count", "residual", "model"} <= set(
        nnx.state(ref).keys())
    assert_close(jax.device_get(nnx.state(resumed)), jax.device_get(nnx.state(ref)), RTOL,
                 "DiLoCo state after 6 steps")
    assert int(resumed.count[...]) == STEPS
    # The checkpoint of step 3 is the first trainer's whole state then, exactly.
    mesh = run["mesh"]
    saved = ns.restore(run["dir"], model=_diloco(mesh), step=K)
    first = run["first"].optimizer
    assert_close(jax.device_get(nnx.state(saved)), jax.device_get(nnx.state(first)), 0,
                 "checkpoint of step 3")


def test_only_the_sync_crosses_replicas(run: dict[str, Any]) -> None:
    trainer, mesh = run["first"], run["mesh"]
    spec = {"x": jax.ShapeDtypeStruct((K, 8, 4), jnp.float32),
            "y": jax.ShapeDtypeStruct((K, 8, 2), jnp.float32)}
    hlo = trainer.lower(spec).compile().as_text()
    crossing = [c for c in compiled_collectives(hlo, mesh) if "replica" in (c.axes or ())]
    # Every one inside the sync's branch of the step's lax.cond (the metrics leave the
    # call per replica: packing them into one vector would gather them every call).
    assert crossing and all("/cond/branch_1_fun/" in c.op_name for c in crossing), [
        (c.kind, c.bytes, c.op_name) for c in crossing]
    # Measured: the int8 sync's all-gathers of scales and codes (its residual and the
    # replicas stay within their replica), and the AND of the replicas' guard flags.
    assert sorted((c.kind, c.bytes) for c in crossing) == [
        ("all-gather", 8), ("all-gather", 512), ("all-reduce", 1)]


def _nan_fit(guard: str, applied: int = 2, checkpointer: Any = None
             ) -> tuple[ns.DiLoCo, Any, list[Any]]:
    mesh = HSDP.make_mesh()
    d = _diloco(mesh, compress=None)
    trainer = _trainer(d, mesh, guard)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        h = trainer.fit(_data(nan_at=3), STEPS, progress=False, checkpointer=checkpointer)
    assert trainer.step == applied and h["step"].tolist() == list(range(1, applied + 1))
    assert [str(w.message) for w in caught] == [f"Trainer.fit: {h.stop_reason}."]
    return d, h, jax.tree.leaves(jax.device_get(nnx.state(d)))


def test_grads_guard_skips_the_replica(tmp_path: Any) -> None:
    ckpt = ns.Checkpointer(tmp_path, every=K)
    d, h, leaves = _nan_fit("grads", checkpointer=ckpt)
    assert ckpt.latest_step() is None  # step 3, due to be saved, was not applied
    assert h.stop_reason.startswith("loss is nan and grad_norm is nan at step 3 (replica 1); "
                                    "stopped without applying it: the replica stopped there")
    assert "not the one after step 2 (not saved)" in h.stop_reason
    assert all(np.isfinite(x).all() for x in leaves if np.issubdtype(x.dtype, np.inexact))
    # Step 2 synced (every replica the anchor); replica 1 skipped step 3 and stayed so,
    # replica 0 ran on, and no sync moved the anchor since.
    anchor = jax.device_get(nnx.to_pure_dict(nnx.state(d.model, nnx.Param)))
    reps = jax.device_get(nnx.to_pure_dict(nnx.state(d.replicas)))
    for a, r in zip(jax.tree.leaves(anchor), jax.tree.leaves(reps), strict=True):
        np.testing.assert_array_equal(r[1], a)
        assert np.any(r[0] != a)


def test_full_guard_puts_back_the_last_finite_state() -> None:
    d, h, _ = _nan_fit("full")
    assert h.stop_reason.startswith("loss is nan and grad_norm is nan at step 3; stopped "
                                    "without applying it, keeping the model and optimizer "
                                    "state from after step 2")
    assert int(d.count[...]) == 2
    anchor = jax.device_get(nnx.to_pure_dict(nnx.state(d.model, nnx.Param)))
    reps = jax.device_get(nnx.to_pure_dict(nnx.state(d.replicas)))
    for a, r in zip(jax.tree.leaves(anchor), jax.tree.leaves(reps), strict=True):
        np.testing.assert_array_equal(r, np.stack([a, a]))  # as the sync at step 2 left it


def test_off_guard_applies_and_says_so() -> None:
    d, h, _ = _nan_fit("off", applied=3)  # a call's steps all count under "off"
    assert h.stop_reason.startswith("loss is nan and grad_norm is nan at step 3; "
                                    "guard='off' applies every step")
    reps = jax.device_get(nnx.to_pure_dict(nnx.state(d.replicas)))
    assert all(np.isnan(r[1]).all() and np.isfinite(r[0]).all() for r in jax.tree.leaves(reps))


def test_refused_options() -> None:
    mesh = HSDP.make_mesh()
    d = _diloco(mesh, compress=None)
    other = ns.sharded_init(lambda: nnx.Linear(4, 2, rngs=nnx.Rngs(1)), mesh, HSDP)
    with pytest.raises(ns.UsageError, match=r"Trainer: the DiLoCo given as the optimizer "
                       r"trains another model .*Fix: Trainer\(diloco\.model, diloco, loss_fn"):
        ns.Trainer(other, d, _mse, mesh=mesh, rules=HSDP)
    for kw, said in (({"microbatches": 2}, "microbatches=2"),
                     ({"precision": ns.Precision(compute=jnp.bfloat16)}, "precision=Precision"),
                     ({"has_aux": True}, "has_aux=True")):
        with pytest.raises(ns.UsageError, match=rf"Trainer: {said}.* does not apply to a "
                           rf"DiLoCo.*Fix: drop {next(iter(kw))}="):
            ns.Trainer(d.model, d, _mse, mesh=mesh, rules=HSDP, **kw)
