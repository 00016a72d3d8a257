"""Gradient accumulation with masked targets: M microbatches give the step of M = 1.

Ground truth is transformers' own accumulation (tests/fixtures/hf_llama/accumulation.npz,
written by tests/fixtures/make_hf_accumulation.py from the Llama fixture): every
microbatch's summed cross-entropy divided by the kept targets of the whole step
(``num_items_in_batch``), back-propagated and summed, then one SGD step. Two batches of
4 rows: ``uneven`` keeps 2, 16, 16 and 16 targets per row, ``gap`` keeps 0, 5, 0 and
16 (with M = 2 or 4 a microbatch keeps nothing).
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import nnx_shard as ns
from nnx_shard import hf
from nnx_shard._errors import UsageError
from nnx_shard.models import Decoder, DecoderConfig, lm_loss
from tests._close import assert_close

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "hf_llama"
LR = 1.0  # the fixture's SGD step
RTOL = 1e-5
# Against transformers: the same sums in torch's order. The updates are compared as
# deltas (new - old weights), scaled to each delta's largest element.
RTOL_HF = 1e-4
WEIGHTS = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
           "model.norm.weight")


@functools.cache
def _expected() -> dict[str, np.ndarray]:
    return dict(np.load(FIXTURE / "accumulation.npz"))


def _batch(name: str) -> dict[str, np.ndarray]:
    """The fixture's batch as this library's: targets are the next token's label."""
    e = _expected()
    labels = e[f"{name}_labels"]
    targets = np.concatenate([labels[:, 1:], np.full((len(labels), 1), -100, np.int32)], 1)
    return {"inputs": e[f"{name}_tokens"], "targets": targets.astype(np.int32)}


def _one_device() -> jax.sharding.Mesh:
    return ns.make_mesh("data=1", devices=jax.devices()[:1])


def _model(mesh: jax.sharding.Mesh, rules: object = None, **overrides: object) -> Decoder:
    cfg = DecoderConfig.from_hf(FIXTURE, **overrides)
    rules = rules if rules is not None else ns.strategies.get("dp")
    return hf.load_safetensors(FIXTURE, ns.abstract_init(lambda: Decoder(cfg, rngs=nnx.Rngs(0)),
                                                         mesh, rules))


def _hf_weights(model: Decoder) -> dict[str, np.ndarray]:
    """The fixture's weights of ``model`` in transformers' layout."""
    q = np.asarray(model.blocks[0].attn.q.get_value())           # [embed, heads, head_dim]
    return {WEIGHTS[0]: q.reshape(q.shape[0], -1).T,
            WEIGHTS[1]: np.asarray(model.blocks[1].mlp.down.get_value()).T,   # [in, out]
            WEIGHTS[2]: np.asarray(model.final_norm.scale.get_value())}


@functools.cache
def _initial() -> dict[str, np.ndarray]:
    return _hf_weights(_model(_one_device()))


def _lm_step(model, opt, batch):
    loss, grads = ns.value_and_grad(lm_loss)(model, batch)
    opt.update(model, grads)
    return {"loss": loss}


def _train(route: str, name: str, m: int) -> tuple[float, dict[str, np.ndarray]]:
    """One SGD step of ``lm_loss`` on the fixture's batch ``name`` with ``m`` microbatches,
    through ``Trainer`` or ``multistep``, on one device: the loss and the weights after."""
    mesh = _one_device()
    model = _model(mesh)
    opt = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
    batch = _batch(name)
    if route == "trainer":
        trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=ns.strategies.get("dp").rules,
                             microbatches=m, steps_per_call=1)
        history = trainer.fit([batch], num_steps=1, progress=False)
        assert history.stop_reason is None or "nan" not in history.stop_reason
        loss = float(history["loss"][0])
    else:
        loss = float(_fused(m)(model, opt, {k: v[None] for k, v in batch.items()})["loss"][0])
    return loss, _hf_weights(model)


@functools.cache
def _fused(m: int) -> Any:
    """One fused step per microbatch count: both batches have one shape, so the second
    reuses the first's trace and compilation."""
    return ns.multistep(_lm_step, microbatches=m)


_train_cached = functools.cache(_train)


# --------------------------------------------------------------------------- ground truth


# Both routes at M = 2; M = 4 through multistep only: the Trainer builds the same
# accumulating value_and_grad, so its M = 4 cases proved the M = 2 cases' routing again.
@pytest.mark.parametrize("m,route", [(2, "trainer"), (2, "multistep"), (4, "multistep")])
@pytest.mark.parametrize("name", ["uneven", "gap"])
def test_microbatches_give_the_step_of_one(route: str, name: str, m: int) -> None:
    """M = 2 and 4 give M = 1's loss and weights, and transformers' (which divides by the
    step's kept targets): a microbatch keeping 2 targets weighs 2, one keeping none
    nothing, and the loss stays finite."""
    e = _expected()
    loss, weights = _train_cached(route, name, m)
    loss1, weights1 = _train_cached(route, name, 1)
    assert np.isfinite(loss)
    assert_close(loss, loss1, RTOL, f"{route} {name} M={m} loss vs M=1")
    assert_close(weights, weights1, RTOL, f"{route} {name} M={m} weights vs M=1")
    for k in (1, m):
        assert_close(loss, e[f"{name}_loss_m{k}"], RTOL, f"{route} {name} loss vs transformers")
        for w in WEIGHTS:
            want = e[f"{name}_m{k}__{w}"] - _initial()[w]
            assert np.abs(want).max() > 1e-3  # the step moved it
            assert_close(weights[w] - _initial()[w], want, RTOL_HF,
                         f"{route} {name} M={m} update of {w} vs transformers M={k}")


def test_one_microbatch_matches_transformers() -> None:
    e = _expected()
    for name in ("uneven", "gap"):
        loss, weights = _train_cached("multistep", name, 1)
        assert_close(loss, e[f"{name}_loss_m1"], RTOL, f"{name} loss")
        for w in WEIGHTS:
            assert_close(weights[w] - _initial()[w], e[f"{name}_m1__{w}"] - _initial()[w],
                         RTOL_HF, f"{name} update of {w}")


@pytest.mark.slow
def test_averaging_microbatch_means_would_differ() -> None:
    """The fixture can tell the two rules apart: averaging each microbatch's mean (what
    a loss without ns.mean_over gets) gives another loss than the step's mean."""
    model = _model(_one_device())
    batch = {k: jnp.asarray(v) for k, v in _batch("uneven").items()}
    plain = ns.value_and_grad(lambda m, b: lm_loss(m, b), microbatches=4)
    weighted = ns.value_and_grad(lm_loss, microbatches=4)
    l_plain, l_weighted = float(plain(model, batch)[0]), float(weighted(model, batch)[0])
    assert_close(l_weighted, _expected()["uneven_loss_m1"], RTOL, "weighted")
    means = [float(lm_loss(model, {k: v[j::4] for k, v in batch.items()})) for j in range(4)]
    assert_close(l_plain, np.mean(means), RTOL, "microbatch means averaged")
    assert abs(l_plain - l_weighted) > 20 * RTOL * abs(l_weighted), (l_plain, l_weighted)


# --------------------------------------------------------------------------- no kept target


def test_a_step_with_no_kept_target_is_nan_and_skipped() -> None:
    """As with M = 1: the loss is NaN (no mean), the gradients zero, and the Trainer's
    guard stops without applying the step."""
    mesh = _one_device()
    batch = _batch("uneven")
    batch["targets"] = np.full_like(batch["targets"], -100)
    for m in (1, 2):
        model = _model(mesh)
        opt = nnx.Optimizer(model, optax.sgd(LR), wrt=nnx.Param)
        trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh,
                             rules=ns.strategies.get("dp").rules, microbatches=m,
                             steps_per_call=1)
        with pytest.warns(RuntimeWarning, match=r"loss is nan at step 1"):
            history = trainer.fit([batch], num_steps=1, progress=False)
        assert len(history) == 0 and trainer.step == 0
        assert_close(_hf_weights(model), _initial(), 0, f"M={m} weights untouched")


def test_value_and_grad_with_no_kept_target() -> None:
    model = _model(_one_device())
    batch = {k: jnp.asarray(v) for k, v in _batch("gap").items()}
    batch["targets"] = jnp.full_like(batch["targets"], -100)
    # Compiled: op by op, the eager accumulation dispatches every layer's ops one at a time.
    loss, grads = nnx.jit(ns.value_and_grad(lm_loss, microbatches=2))(model, batch)
    assert np.isnan(float(loss))
    assert all(float(jnp.abs(g).max()) == 0 for g in jax.tree.leaves(grads))


# --------------------------------------------------------------------------- mean_over


def _masked_mse(model, batch):
    err = (model(batch["x"])[:, 0] - batch["y"]) ** 2
    return jnp.sum(err * batch["mask"]) / jnp.sum(batch["mask"])


def _mse_batch() -> dict[str, jax.Array]:
    mask = jnp.array([1.0, 0, 0, 0, 1, 0, 0, 1])  # microbatches of 4: rows 1,5 and 2,6 empty
    return {"x": jnp.arange(24.0).reshape(8, 3) / 10, "y": jnp.ones(8), "mask": mask}


def test_mean_over_a_user_loss_and_its_aux() -> None:
    items = lambda b: jnp.sum(b["mask"])  # noqa: E731
    loss_fn = ns.mean_over(items)(_masked_mse)

    def with_aux(model, batch):
        loss = loss_fn(model, batch)
        return loss, {"twice": 2 * loss}

    aux_fn = ns.mean_over(items)(with_aux)
    model, batch = nnx.Linear(3, 1, rngs=nnx.Rngs(0)), _mse_batch()
    l1, g1 = ns.value_and_grad(loss_fn)(model, batch)
    for m in (2, 4):
        lm, gm = ns.value_and_grad(loss_fn, microbatches=m)(model, batch)
        assert_close((lm, nnx.to_pure_dict(gm)), (l1, nnx.to_pure_dict(g1)), RTOL, f"M={m}")
        (la, aux), ga = ns.value_and_grad(aux_fn, has_aux=True, microbatches=m)(model, batch)
        assert_close((la, aux["twice"], nnx.to_pure_dict(ga)),
                     (l1, 2 * l1, nnx.to_pure_dict(g1)), RTOL, f"M={m} aux")
    # Undeclared, the microbatch means are averaged: another loss (NaN here, two
    # microbatches keeping nothing).
    plain, _ = ns.value_and_grad(_masked_mse, microbatches=4)(model, batch)
    assert np.isnan(float(plain))
    # The function itself is left unmarked; the declared one keeps its name and signature.
    assert not hasattr(_masked_mse, "__nnx_shard_mean_over__")
    assert loss_fn.__name__ == "_masked_mse" and float(loss_fn(model, batch)) == float(l1)


def test_mean_over_keeps_bfloat16_gradients() -> None:
    model = nnx.Linear(3, 1, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    loss_fn = ns.mean_over(lambda b: jnp.sum(b["mask"]))(_masked_mse)
    _, g = ns.value_and_grad(loss_fn, microbatches=4)(model, _mse_batch())
    assert g["kernel"][...].dtype == jnp.bfloat16


def test_mean_over_refuses_what_is_no_count() -> None:
    with pytest.raises(UsageError, match="mean_over: items must be a function"):
        ns.mean_over(3)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="decorates a loss function"):
        ns.mean_over(len)("loss")  # type: ignore[arg-type]
    bad = ns.mean_over(lambda b: b["mask"])(_masked_mse)     # per row, not one count
    model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
    with pytest.raises(UsageError, match=r"item count of _masked_mse .* shape \(8,\)"):
        ns.value_and_grad(bad, microbatches=2)(model, _mse_batch())


@pytest.mark.parametrize("label,items,seen", [
    ("a mean", lambda b: jnp.mean(b["mask"]), r"count \[1, 0, 0, 0.5\] and the whole step 0.375"),
    ("negative", lambda b: -jnp.sum(b["mask"]), r"count \[-2, -0, -0, -1\]"),
    ("nan", lambda b: jnp.sum(b["mask"]) * jnp.nan, r"count \[nan"),
])
def test_counts_that_are_no_counts(label, items, seen) -> None:
    """Known counts that do not add up (a mean), negative or NaN are refused; traced
    inside a compiled step, they make the loss NaN, which the guard stops at."""
    loss_fn = ns.mean_over(items)(_masked_mse)
    model, batch = nnx.Linear(3, 1, rngs=nnx.Rngs(0)), _mse_batch()
    with pytest.raises(UsageError, match=r"item counts of _masked_mse are no counts .*" + seen):
        ns.value_and_grad(loss_fn, microbatches=4)(model, batch)
    loss, _ = nnx.jit(ns.value_and_grad(loss_fn, microbatches=4))(model, batch)
    assert np.isnan(float(loss)), label


# --------------------------------------------------------------------------- presets


@pytest.mark.parametrize("preset", ["fsdp", "tp"])
def test_sharded_presets_weigh_microbatches_alike(preset: str) -> None:
    """On 8 devices the step's count is a sum over devices, each microbatch's too: M = 2
    (one row per device per microbatch) gives the one-device M = 1 step."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    s = ns.strategies.get(preset)
    mesh = s.make_mesh(8)
    model = _model(mesh, s)
    opt = ns.sharded_optimizer(model, optax.sgd(LR), mesh, s)
    # 16 rows, the uneven batch tiled: the same mean, 2 rows per device of the data axis.
    batch = {k: np.tile(v, (4, 1)) for k, v in _batch("uneven").items()}
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s.rules, microbatches=2,
                         steps_per_call=1)
    history = trainer.fit([batch], num_steps=1, progress=False)
    loss1, weights1 = _train_cached("trainer", "uneven", 1)
    assert_close(float(history["loss"][0]), loss1, RTOL, f"{preset} loss vs one device")
    got = _hf_weights(model)
    for w in WEIGHTS:
        assert_close(got[w] - _initial()[w], weights1[w] - _initial()[w], RTOL,
                     f"{preset} update of {w} vs one device")


# --------------------------------------------------------------------------- pipeline


def test_pipeline_microbatches_give_the_step_of_one_device() -> None:
    """pp with 4 microbatches: the loss sees the whole batch (the pipeline cuts it only
    inside the stacked layers), so the step is the one-device step and transformers'."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices")
    s = ns.strategies.get("pp")
    mesh = ns.make_mesh({"stage": 2, "data": 4}, axis_types="auto")
    model = _model(mesh, s, scan_layers=True)
    opt = ns.sharded_optimizer(model, optax.sgd(LR), mesh, s)
    # 16 rows: 4 microbatches x 4 data-parallel devices; the tiled batch has the same mean.
    batch = {k: np.tile(v, (4, 1)) for k, v in _batch("uneven").items()}
    trainer = ns.Trainer(model, opt, lm_loss, mesh=mesh, rules=s.rules, microbatches=4,
                         steps_per_call=1, batch_names=("batch", "length"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        history = trainer.fit([batch], num_steps=1, progress=False)
    loss1, weights1 = _train_cached("trainer", "uneven", 1)
    assert_close(float(history["loss"][0]), loss1, RTOL, "pp loss vs one device")
    stacked = model.blocks
    assert stacked.attn.q.get_value().sharding.spec[0] == "stage"   # a pipeline ran
    q = np.asarray(stacked.attn.q.get_value()[0])
    down = np.asarray(stacked.mlp.down.get_value()[1])
    got = {WEIGHTS[0]: q.reshape(q.shape[0], -1).T, WEIGHTS[1]: down.T,
           WEIGHTS[2]: np.asarray(model.final_norm.scale.get_value())}
    for w in WEIGHTS:
        assert_close(got[w] - _initial()[w], weights1[w] - _initial()[w], RTOL,
                     f"pp update of {w} vs one device")
