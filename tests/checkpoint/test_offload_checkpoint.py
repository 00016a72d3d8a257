"""Checkpoints of offloaded state (``Strategy.offload``): saved from host memory, restored
bitwise onto another mesh, into host memory where the target's layout offloads and into
device memory where it does not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from tests._shared import MLP
from tests.conftest import needs_devices

pytestmark = needs_devices(8)

TX = optax.adamw(1e-2)


def factory():
    return MLP(nnx.Rngs(params=0, dropout=1), dropout=0.0)


def values(obj):
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(obj, nnx.Not(nnx.RngState)))]


def kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(nnx.state(tree))}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """fsdp with parameters and optimizer state offloaded on 8 devices, trained 2 steps
    (so the saved moments are not zeros), saved from host memory."""
    strategy = ns.strategies.get("fsdp", offload="optimizer+params")
    mesh = strategy.make_mesh()
    model = ns.sharded_init(factory, mesh, strategy)
    opt = ns.sharded_optimizer(model, TX, mesh, strategy)
    rng = np.random.default_rng(0)
    data = [{"x": rng.normal(size=(16, 16)).astype(np.float32),
             "y": rng.normal(size=(16, 16)).astype(np.float32)} for _ in range(2)]
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)  # noqa: E731
    ns.Trainer(model, opt, loss, mesh=mesh, rules=strategy, steps_per_call=2).fit(
        data, 2, progress=False)
    assert kinds(opt) == kinds(nnx.state(model, nnx.Param)) == {"pinned_host"}
    d = tmp_path_factory.mktemp("offload_ckpt")
    ns.save(d, 2, model=model, optimizer=opt)
    return d, values(model), values(opt)


@pytest.mark.parametrize("offload", ["optimizer", None])
def test_restore_offloaded_state_onto_another_mesh(saved, offload):
    d, model_values, opt_values = saved
    strategy = ns.strategies.get("fsdp_tp", offload=offload)
    mesh = strategy.make_mesh(4)
    target_model = ns.abstract_init(factory, mesh, strategy)
    target_opt = ns.sharded_optimizer(target_model, TX, mesh, strategy)
    model, opt, _ = ns.restore(d, model=target_model, optimizer=target_opt)
    for got, want in ((values(model), model_values), (values(opt), opt_values)):
        assert all(g.tobytes() == w.tobytes() for g, w in zip(got, want, strict=True))
    # Each array where its target says: the optimizer state in host memory exactly when
    # the target strategy offloads it, the parameters on the devices (no params offload).
    for got, target in ((opt, target_opt), (model, target_model)):
        for x, t in zip(jax.tree.leaves(nnx.state(got)), jax.tree.leaves(nnx.state(target)),
                        strict=True):
            assert x.sharding == t.sharding, (x.sharding, t.sharding)
    assert kinds(opt) == {"pinned_host" if offload else "device"}
    assert kinds(nnx.state(model, nnx.Param)) == {"device"}
