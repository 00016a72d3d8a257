"""Training has one way, ``Trainer.fit``, built on the building blocks of a loop of one's
own, ``ns.multistep`` (K steps per compiled call) around ``ns.value_and_grad``: the same
steps give the same numbers through each, and the options both take are refused by the
same checks, word for word but for the name of the call."""

from __future__ import annotations

import re

import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from tests._shared import mse as loss_fn
from tests._shared import mse_train_step as train_step

RULES = {"batch": "data"}
K, STEPS = 2, 4


def build():
    model = nnx.Linear(6, 2, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


def data():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(8, 6)).astype(np.float32) for _ in range(STEPS)]
    return [{"x": x, "y": x[:, :2] / 2} for x in xs]  # learnable: the loss falls


def by_fit():
    model, opt = build()
    trainer = ns.Trainer(model, opt, loss_fn, mesh="data=8", rules=RULES, steps_per_call=K,
                         guard="off")
    history = trainer.fit(iter(data()), num_steps=STEPS, progress=False)
    return history["loss"], model


def by_multistep():
    model, opt = build()
    fused = ns.multistep(train_step)
    mesh = ns.make_mesh("data=8")
    batches = data()
    losses = []
    for i in range(0, STEPS, K):
        group = {k: np.stack([b[k] for b in batches[i:i + K]]) for k in batches[0]}
        losses += list(np.asarray(fused(model, opt, ns.shard_batch(group, mesh, RULES,
                                                                    steps=True))["loss"]))
    return np.asarray(losses), model


def by_own_loop():
    model, opt = build()
    mesh = ns.make_mesh("data=8")
    step = nnx.jit(train_step)
    losses = [float(step(model, opt, ns.shard_batch(b, mesh, RULES))["loss"]) for b in data()]
    return np.asarray(losses), model


def test_fit_multistep_and_an_own_loop_train_alike():
    loss_fit, m_fit = by_fit()
    loss_ms, m_ms = by_multistep()
    loss_own, m_own = by_own_loop()
    assert loss_fit.shape == (STEPS,) and loss_fit[-1] < loss_fit[0]
    # fit runs multistep's compiled call: the same bits
    np.testing.assert_array_equal(loss_fit, loss_ms)
    np.testing.assert_array_equal(m_fit.kernel[...], m_ms.kernel[...])
    # a step per call compiles apart: the same numbers up to rounding
    np.testing.assert_allclose(loss_fit, loss_own, rtol=1e-5)
    np.testing.assert_allclose(m_fit.kernel[...], m_own.kernel[...], rtol=1e-5, atol=1e-6)


def _raised(call):
    with pytest.raises(ns.NnxShardError) as e:
        call()
    return type(e.value), re.sub(r"^(Trainer|multistep): ", "", str(e.value))


@pytest.mark.parametrize("kw", [
    {"microbatches": 0}, {"microbatches": True}, {"microbatches": 1.5},
    {"unroll": 0}, {"unroll": "2"},
    {"donate": 1}, {"donate": "yes"},
    {"precision": "bf16"},
])
def test_trainer_and_multistep_refuse_an_option_alike(kw):
    model, opt = build()
    via_trainer = _raised(lambda: ns.Trainer(model, opt, loss_fn, mesh="data=8", rules=RULES,
                                             **kw))
    via_multistep = _raised(lambda: ns.multistep(train_step, **kw))
    assert via_trainer == via_multistep
    name = next(iter(kw))
    assert via_trainer[1].startswith(f"{name} must be"), via_trainer
    assert f"Fix: {name}=" in via_trainer[1] or "Fix: e.g." in via_trainer[1]
